"""Ahead-of-time compilation of every kernel one head layout needs, on any machine.

    python -m flash_qla.precompile --arch sm90 --heads 16/32 --dtype bfloat16 [--cache-dir DIR]
                                   [--forward-only] [--jobs N]

Every kernel training runs (the forward's, the backward's, and the forward walks that keep
checkpoints or every state), unless --forward-only (inference: the forward's).
Compiles into TileLang's kernel cache (``--cache-dir`` or ``TILELANG_CACHE_DIR``); no GPU
is needed, nvcc is (TileLang calls it). At run time the library builds the identical target
for the GPU it runs on, so a precompiled cache is hit and the first call does not stall on
compilation. Run again, it finds every kernel in the cache and finishes in seconds.
"""

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def parse_heads(text: str) -> tuple[int, int]:
    try:
        hqk, hv = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads takes Hqk/Hv such as 16/32, got {text!r}") from None
    if hqk <= 0 or hv <= 0 or hv % hqk:
        raise argparse.ArgumentTypeError(f"--heads {text}: need positive Hqk, Hv with Hv % Hqk == 0")
    return hqk, hv


def parse_jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--jobs takes a positive number of processes, got {text!r}")
    return n


def _build(job):
    factory, args = job
    factory(*args)
    return factory.__name__


def main(argv=None) -> int:
    from flash_qla.arch import BY_NAME, profile_by_name

    parser = argparse.ArgumentParser(prog="python -m flash_qla.precompile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm90", choices=sorted(BY_NAME), help="architecture profile (default sm90)")
    parser.add_argument("--heads", type=parse_heads, action="append", required=True, help="Hqk/Hv, may repeat")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), action="append", help="may repeat (default bfloat16)")
    parser.add_argument("--cache-dir", help="TileLang cache directory (default: TILELANG_CACHE_DIR or TileLang's)")
    parser.add_argument("--forward-only", action="store_true", help="only the inference forward's kernels")
    parser.add_argument("--jobs", type=parse_jobs, default=1, help="compile in this many processes")
    args = parser.parse_args(argv)
    if args.cache_dir:
        os.environ["TILELANG_CACHE_DIR"] = os.path.abspath(args.cache_dir)

    from flash_qla.ops.backward import backward_kernel_builds
    from flash_qla.ops.forward import forward_kernel_builds, kept_states_kernel_builds

    profile = profile_by_name(args.arch)
    jobs = []
    for dtype in args.dtype or ["bfloat16"]:
        for hqk, hv in args.heads:
            jobs += forward_kernel_builds(profile, hqk, hv, dtype)
            if not args.forward_only:  # training, whose keep_states=None keeps every state where they are small
                jobs += backward_kernel_builds(profile, hqk, hv, dtype)
                jobs += kept_states_kernel_builds(profile, hqk, hv, dtype)
    jobs = list(dict.fromkeys(jobs))  # a layout given twice, or a kernel that two layouts or dtypes share, once
    start = time.time()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            list(pool.map(_build, jobs))
    else:
        for job in jobs:
            _build(job)
    print(f"precompile: {len(jobs)} kernels for {args.arch} ready in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
