"""Where the time goes: flash_qla's and FLA's kernels, one line per kernel, on the GPU.

    python profile/profile_gdr.py --set develop [--skip-bwd] [--skip-fla]

Runs each implementation --iters times under torch.profiler and prints, per config, every
GPU kernel with its mean time per call and share of the kernels' summed time (two streams' kernels
overlap, so a call's span can be shorter), ours then FLA's (FLA_FLASH_QLA=0: its Triton kernels, its
backward's dq / dk / dw / dg step a TileLang kernel on Hopper with Triton 3.4-3.7). Without --skip-bwd
the backward of o alone (from saved forward outputs, through autograd: FLA's gets a zero gradient for
the final state, ours none) is profiled too. The develop set is small on purpose: a few seconds per run.
"""

import argparse
import collections
import os

os.environ["FLA_FLASH_QLA"] = "0"  # before fla is imported

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import flash_qla  # noqa: E402
from flash_qla.reference.inputs import make_inputs  # noqa: E402

SETS = {
    "develop": [("16/32", [32768]), ("16/32", [4096] * 8), ("2/8", [32768]), ("16/32", [2048])],
    "single": [("16/32", [32768])],
    # README's "where the time goes" table: the bars' layouts, one and eight sequences (2/8 and 4/16
    # at 32768 tokens walk split)
    "bars": [("16/32", [32768]), ("16/32", [4096] * 8), ("4/16", [32768]), ("2/8", [32768]), ("2/8", [4096] * 8)],
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", choices=sorted(SETS), default="develop")
    parser.add_argument("--skip-bwd", action="store_true", help="profile the forward only")
    parser.add_argument(
        "--skip-fla", action="store_true", help="ours only (FLA's Triton JIT takes minutes on a new machine)"
    )
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
    except ImportError:
        fla_fn = None
    if args.skip_fla:
        fla_fn = None

    impls = {"flash_qla": flash_qla.chunk_gated_delta_rule}
    if fla_fn is not None:
        impls["fla"] = fla_fn
    for heads, seqlens in SETS[args.set]:
        Hqk, Hv = (int(x) for x in heads.split("/"))
        x = make_inputs(1, sum(seqlens), Hqk, Hv, 128, 128, device="cuda")
        cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        print(f"{heads} seqlens {len(seqlens)}x{seqlens[0]}" if len(set(seqlens)) == 1 else f"{heads} {seqlens}")
        for name, fn in impls.items():
            cu_arg = cu.long() if name == "fla" else cu

            def fwd():
                return fn(**x, cu_seqlens=cu_arg, output_final_state=True)

            report(f"{name} forward", kernel_table(fwd, args.iters), args.iters)
            if args.skip_bwd:
                continue
            leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
            o, _ = fn(**leaves, cu_seqlens=cu_arg, output_final_state=True)
            do = torch.randn_like(o)

            def bwd():
                torch.autograd.grad(o, list(leaves.values()), do, retain_graph=True)

            report(f"{name} backward", kernel_table(bwd, args.iters), args.iters)


if __name__ == "__main__":
    main()
