"""The generated CUDA source of every kernel a layout needs, without nvcc or a GPU: to see what a change did to them.

    python profile/kernel_sources.py OUT --heads 16/32 --dtype bfloat16 [--heads 4/8 --dtype float16 ...] [--jobs 2]

Lowers (TileLang's `tilelang.lower`, no nvcc: ~3 s a kernel) each kernel that `python -m flash_qla.precompile`
builds for the given layouts (forward, backward, kept states) and writes its device source to OUT/<factory>_<args>.cu.
Run it on two trees and `diff -r` the folders: a refactor that leaves every file equal leaves the kernels' device
code unchanged (session 69: the kernels taking the packed [1, T, ...] tensors, 170 of 170 equal over 16/32 bf16 and
4/8 fp16), while TileLang's cache keys, the TIR's, change with any edit to a kernel's source.
"""

import argparse
import os
from concurrent.futures import ProcessPoolExecutor

import tilelang
from tvm.target import Target

from flash_qla.arch import profile_by_name
from flash_qla.ops.backward import backward_kernel_builds
from flash_qla.ops.forward import forward_kernel_builds, kept_states_kernel_builds


def lower(func, target=None, **kwargs):
    """Stands in for tilelang.compile in the factories: the device source alone."""
    with Target(target):
        return tilelang.lower(func, target=target).kernel_source


def write_source(job):
    out, factory, args = job
    tilelang.compile = lower  # in this worker process only
    name = "_".join([factory.__name__, *(getattr(a, "name", str(a)) for a in args)])
    with open(os.path.join(out, name + ".cu"), "w") as f:
        f.write(factory.__wrapped__(*args))  # the factory itself, not its cache of compiled kernels
    return name


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--arch", default="sm90")
    parser.add_argument("--heads", action="append", required=True, help="Hqk/Hv, once per layout")
    parser.add_argument("--dtype", action="append", required=True, help="bfloat16 or float16, once per layout")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    args = parser.parse_args()
    if len(args.heads) != len(args.dtype):
        parser.error("give --dtype once per --heads")
    profile = profile_by_name(args.arch)
    jobs = {}
    for heads, dtype in zip(args.heads, args.dtype):
        Hqk, Hv = map(int, heads.split("/"))
        for builds in (forward_kernel_builds, backward_kernel_builds, kept_states_kernel_builds):
            for factory, build_args in builds(profile, Hqk, Hv, dtype):
                jobs[(factory.__name__, build_args)] = (args.out, factory, build_args)
    os.makedirs(args.out, exist_ok=True)
    with ProcessPoolExecutor(args.jobs) as pool:
        for name in pool.map(write_source, jobs.values()):
            print(name, flush=True)
    print(f"{len(jobs)} kernels' sources in {args.out}")


if __name__ == "__main__":
    main()
