"""flash_qla vs FLA Triton on the DESIGN.md §4 set: GPU kernel time and whole-call latency.

    python benchmark/bench_gated_delta_rule.py [--full] [--heads 16/32 ...] [--seqs 1x32768 ...]
                                               [--out benchmark/benchmark_results_H200.txt]

Kernel time: CUDA events around one call queued behind a ~1 ms device sleep, so the host's
launch work hides under the sleep and the events see only the GPU work of the call (all
of its kernels, gaps between them included); median of --reps after warm-up. Whole
call: host wall clock from a synchronised start to the synchronised end of one call,
median. FLA runs with FLA_FLASH_QLA=0 so it does not dispatch to us, on the same inputs
in the same process. floor = max(FLOP / 789 TFLOP/s, bytes / 4.28 TB/s) (DESIGN.md §1).
"""

import argparse
import os
import statistics
import sys
import time

os.environ["FLA_FLASH_QLA"] = "0"  # before fla is imported: FLA must not dispatch to us

import torch  # noqa: E402

import flash_qla  # noqa: E402
from flash_qla.reference.inputs import make_inputs  # noqa: E402

DEFAULT_HEADS = ["16/64", "8/32", "4/16", "2/8", "16/32", "16/48"]
DEFAULT_SEQS = ["1x32768", "4096x8", "1x2048"]
EXTRA = [("16/32", "1x8192"), ("16/32", "1024x8")]
FULL_HEADS = ["16/64", "8/32", "4/16", "2/8", "16/32", "16/48", "8/24", "16/16", "32/32"]
FULL_SEQS = ["1x32768", "1x8192", "1x2048", "28672+4096", "16384+16384", "8192x4", "4096x8", "1024x8"]
PEAK_FLOPS, PEAK_BYTES = 789e12, 4.28e12  # measured on our H200 (DESIGN.md §1)


def parse_seqs(text):
    """DESIGN.md §4 labels: '1x32768' -> one sequence of 32768; '4096x8' -> 8 of 4096; '28672+4096'."""
    if "x" in text:
        first, second = (int(x) for x in text.split("x"))
        return [second] if first == 1 else [first] * second
    return [int(x) for x in text.split("+")]


def floor_ms(T, Hqk, Hv, K=128, V=128, C=64):
    flops = T * Hv * (2 * C * (3 * K + 2 * V) + 6 * K * V)
    nbytes = T * (2 * Hqk * K * 2 + Hv * V * 2 * 2 + Hv * (4 + 2))  # q, k, v, o in bf16; g fp32; beta
    return max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES) * 1e3


def kernel_ms(fn, reps):
    """GPU time of fn's work, host launch cost hidden behind a device sleep; median in ms."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)  # ~1 ms: the host queues fn's launches meanwhile
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def call_ms(fn, reps):
    """Whole-call latency as a user sees it (host overhead included); median in ms."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def bench_config(heads, seqs, fla_fn, reps, warmup):
    Hqk, Hv = (int(x) for x in heads.split("/"))
    seqlens = parse_seqs(seqs)
    T = sum(seqlens)
    x = make_inputs(1, T, Hqk, Hv, 128, 128, device="cuda", seed=0)
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    fns = {"ours": lambda: flash_qla.chunk_gated_delta_rule(**x, cu_seqlens=cu, output_final_state=True)}
    if fla_fn is not None:
        cu_fla = cu.long()
        fns["fla"] = lambda: fla_fn(**x, cu_seqlens=cu_fla, output_final_state=True)
    row = {"heads": heads, "seqs": seqs, "floor": floor_ms(T, Hqk, Hv)}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        row[f"{name}_kernel"] = kernel_ms(fn, reps)
        row[f"{name}_call"] = call_ms(fn, reps)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="every head layout x sequence pattern of DESIGN.md §4")
    parser.add_argument("--heads", action="append", help="Hqk/Hv, may repeat")
    parser.add_argument("--seqs", action="append", help="e.g. 1x32768, 4096x8, 28672+4096; may repeat")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", help="also write the table here, with the command, versions and GPU on top")
    args = parser.parse_args()

    if args.heads or args.seqs:
        configs = [(h, s) for h in args.heads or DEFAULT_HEADS for s in args.seqs or DEFAULT_SEQS]
    elif args.full:
        configs = [(h, s) for h in FULL_HEADS for s in FULL_SEQS]
    else:
        configs = [(h, s) for h in DEFAULT_HEADS for s in DEFAULT_SEQS] + EXTRA

    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn

        fla_version = fla.__version__
    except ImportError:
        fla_fn, fla_version = None, "not installed"

    lines = [
        "# " + " ".join(["python", *sys.argv]),
        f"# GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, flash_qla {flash_qla.__version__}, "
        f"fla {fla_version} (FLA_FLASH_QLA=0), bf16, K = V = 128, forward, ms (median of {args.reps})",
        f"{'Hqk/Hv':>7} {'seqlens':>12} {'floor':>6} | {'ours kern':>9} {'FLA kern':>9} {'speedup':>7} "
        f"{'/floor':>6} | {'ours call':>9} {'FLA call':>9} {'speedup':>7}",
    ]
    print("\n".join(lines), flush=True)
    for heads, seqs in configs:
        r = bench_config(heads, seqs, fla_fn, args.reps, args.warmup)
        fla_k, fla_c = r.get("fla_kernel", float("nan")), r.get("fla_call", float("nan"))
        line = (
            f"{heads:>7} {seqs:>12} {r['floor']:6.3f} | {r['ours_kernel']:9.3f} {fla_k:9.3f} "
            f"{fla_k / r['ours_kernel']:6.2f}x {r['ours_kernel'] / r['floor']:6.1f} | "
            f"{r['ours_call']:9.3f} {fla_c:9.3f} {fla_c / r['ours_call']:6.2f}x"
        )
        print(line, flush=True)
        lines.append(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
