"""Where the time goes: flash_qla's and FLA's kernels, one line per kernel, on the GPU.

    python profile/profile_gdr.py --set develop|bars|misses [--skip-bwd] [--skip-fla]

Runs each implementation --iters times under torch.profiler and prints, per config, every
GPU kernel with its mean time per call and share of the kernels' summed time (two streams' kernels
overlap, so a call's span can be shorter), ours then FLA's (FLA_FLASH_QLA=0: its Triton kernels, its
backward's dq / dk / dw / dg step a TileLang kernel on Hopper with Triton 3.4-3.7). Without --skip-bwd
the backward of o and the final state is profiled too (from saved forward outputs, through autograd; both
get the same seeded gradients, as the benchmark's train mode). The develop set is small on purpose: a few
seconds per run.

Each config runs in a fresh process of its own with FLA_CACHE_RESULTS=0, as in
benchmark/bench_gated_delta_rule.py: FLA's autotuner keys leave the sequence lengths out, so in one
process (or from an earlier run's disk cache) a layout's first pattern would pick FLA's kernel
configurations for the later ones.
"""

import argparse
import collections
import os
import subprocess
import sys

os.environ["FLA_FLASH_QLA"] = "0"  # before fla is imported
os.environ["FLA_CACHE_RESULTS"] = "0"  # FLA tunes each pattern afresh (docstring)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import flash_qla  # noqa: E402
from flash_qla.reference.inputs import make_inputs  # noqa: E402

SETS = {
    "develop": [("16/32", [32768]), ("16/32", [4096] * 8), ("2/8", [32768]), ("16/32", [2048])],
    "single": [("16/32", [32768])],
    # the bars' layouts, one and eight sequences (2/8 and 4/16 at 32768 tokens walk split)
    "bars": [("16/32", [32768]), ("16/32", [4096] * 8), ("4/16", [32768]), ("2/8", [32768]), ("2/8", [4096] * 8)],
    # the forward's multi-sequence configs below its 3x bar (README, Where the bars stand)
    "misses": [("16/32", [28672, 4096]), ("16/16", [16384] * 2), ("4/16", [16384] * 2), ("2/8", [8192] * 4),
               ("2/8", [1024] * 8)],  # fmt: skip
}


def kernel_table(fn, iters):
    """{kernel name: total µs} over iters calls of fn, from the profiler's device events."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    totals = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time
    return totals


def report(title, totals, iters):
    total = sum(totals.values()) / iters
    print(f"  {title}: {total / 1e3:.3f} ms of kernels per call")
    for name, us in totals.most_common():
        print(f"    {us / iters / 1e3:8.3f} ms {100 * us / iters / total:5.1f}%  {name[:90]}")


def profile_config(heads, seqlens, skip_bwd, skip_fla, iters):
    """Print the kernel tables of one config, ours then FLA's, each forward then backward."""
    impls = {"flash_qla": flash_qla.chunk_gated_delta_rule}
    if not skip_fla:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
        except ImportError:
            fla_fn = None
        if fla_fn is not None:
            impls["fla"] = fla_fn
    Hqk, Hv = (int(x) for x in heads.split("/"))
    x = make_inputs(1, sum(seqlens), Hqk, Hv, 128, 128, device="cuda")
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").to(x["v"].dtype)
    dht = torch.randn(len(seqlens), Hv, 128, 128, generator=gen, device="cuda")
    # the benchmark's labels (parse_seqs): 1x32768, 4096x8 (length x count), 28672+4096
    if len(seqlens) == 1:
        label = f"1x{seqlens[0]}"
    elif len(set(seqlens)) == 1:
        label = f"{seqlens[0]}x{len(seqlens)}"
    else:
        label = "+".join(map(str, seqlens))
    print(f"{heads} {label}")
    for name, fn in impls.items():
        cu_arg = cu.long() if name == "fla" else cu

        def fwd():
            return fn(**x, cu_seqlens=cu_arg, output_final_state=True)

        report(f"{name} forward", kernel_table(fwd, iters), iters)
        if skip_bwd:
            continue
        leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
        o, final_state = fn(**leaves, cu_seqlens=cu_arg, output_final_state=True)

        def bwd():
            torch.autograd.grad([o, final_state], list(leaves.values()), [do, dht], retain_graph=True)

        report(f"{name} backward", kernel_table(bwd, iters), iters)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", choices=sorted(SETS), default="develop")
    parser.add_argument("--skip-bwd", action="store_true", help="profile the forward only")
    parser.add_argument(
        "--skip-fla", action="store_true", help="ours only (FLA's Triton JIT takes minutes on a new machine)"
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # profile this config of the set, here
    args = parser.parse_args()
    if args.child is not None:
        heads, seqlens = SETS[args.set][args.child]
        profile_config(heads, seqlens, args.skip_bwd, args.skip_fla, args.iters)
        return
    for index in range(len(SETS[args.set])):  # each in a fresh process (docstring)
        command = [sys.executable, __file__, "--child", str(index), "--set", args.set, "--iters", str(args.iters)]
        command += ["--skip-bwd"] * args.skip_bwd + ["--skip-fla"] * args.skip_fla
        sys.stdout.flush()
        subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
