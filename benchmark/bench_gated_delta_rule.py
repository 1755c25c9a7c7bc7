"""flash_qla vs FLA Triton on the DESIGN.md §4 set: GPU kernel time and whole-call latency.

    python benchmark/bench_gated_delta_rule.py [--mode fwd|train|bwd] [--full] [--heads 16/32 ...]
                                               [--seqs 1x32768 ...] [--reps 30] [--warmup 5] [--keep-states]
                                               [--one-process]
                                               [--out benchmark/benchmark_results_H200.txt [--append]]

What one timed call is, per --mode (q, k, v, g, beta from make_inputs; do, dht random, seed 1):
  fwd    the public forward, o, final_state = fn(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True),
         inputs not requiring grad.
  train  a training step: the public forward on leaves requiring grad (made once), then
         torch.autograd.grad([o, final_state], [q, k, v, g, beta], [do, dht]); the graph is
         built afresh and freed by every call, and no .grad accumulates. Ours with the library's
         keep_states default (None: the forward keeps the states where they are small, else the
         backward recomputes them); --keep-states: keep_states=True (kept at any size).
  bwd    the low-level backward alone, from what one untimed low-level forward saved. Ours:
         chunk_gated_delta_rule_bwd(q, k, v, g_cum, beta, A, do, dht, cu_seqlens=cu) after
         g_cum, A, ... = chunk_gated_delta_rule_fwd(...). FLA: fla.ops.gated_delta_rule.chunk's
         chunk_gated_delta_rule_bwd (what its autograd backward calls, less input_guard) after
         its chunk_gated_delta_rule_fwd, chunk_indices prepared once as its autograd forward does.

Kernel time: CUDA events around one call queued behind a device sleep longer than a whole
call (1 ms + the whole-call median), so the host's launch work hides under the sleep and
the events see only the GPU work of the call (all of its kernels, gaps between them
included; a call that syncs the device inside also shows its host work after the sync);
median of --reps after warm-up. Whole call: host wall clock from a synchronised start to
the synchronised end of one call, median. FLA runs with FLA_FLASH_QLA=0 so it does not
dispatch to us and with FLA_CACHE_RESULTS=0 (below), on the same inputs in the same process, with
its defaults otherwise (its Triton kernels; on Hopper with Triton 3.4-3.7 its backward's dq / dk /
dw / dg step is FLA's TileLang kernel; its opt-in intra-card context parallelism off); the header
names the Triton version.
Each config runs in a fresh process of its own (ours and FLA's side by side in it), and with
FLA_CACHE_RESULTS=0: FLA's autotuner keys leave the sequence lengths out (e.g. ['H', 'HV', 'K', 'V',
'BT', 'STATE_V_FIRST'] for its state walk), so within a process the first pattern of a head layout
picks the configurations of every later one, and with its results cached on disk (its default) so
does the first pattern of any earlier run; here each pattern tunes its own. --one-process times every
config in this process instead (faster; FLA's later patterns of a layout then run the first one's
choices).
floor = max(FLOP / 789 TFLOP/s, bytes / 4.28 TB/s) with DESIGN.md §1's forward counts, printed in fwd
mode only: §1 counts no backward, and the backward's least work depends on what it chooses to recompute.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

os.environ["FLA_FLASH_QLA"] = "0"  # before fla is imported: FLA must not dispatch to us
os.environ["FLA_CACHE_RESULTS"] = "0"  # FLA tunes in each run, not from an earlier run's disk cache (docstring)

import torch  # noqa: E402

import flash_qla  # noqa: E402
from flash_qla.reference.inputs import make_inputs, parse_seqs  # noqa: E402

DEFAULT_HEADS = ["16/64", "8/32", "4/16", "2/8", "16/32", "16/48"]
DEFAULT_SEQS = ["1x32768", "4096x8", "1x2048"]
EXTRA = [("16/32", "1x8192"), ("16/32", "1024x8")]
FULL_HEADS = ["16/64", "8/32", "4/16", "2/8", "16/32", "16/48", "8/24", "16/16", "32/32"]
FULL_SEQS = ["1x32768", "1x8192", "1x2048", "28672+4096", "16384+16384", "8192x4", "4096x8", "1024x8"]
PEAK_FLOPS, PEAK_BYTES = 789e12, 4.28e12  # measured on our H200 (DESIGN.md §1)
SLEEP_CYCLES_PER_MS = 2_000_000  # torch.cuda._sleep spins in clock cycles; H200 SMs run at <= 1.98 GHz
HEADER = (
    "Hqk/Hv", "seqlens", "floor", "ours kern", "FLA kern", "speedup", "/floor", "ours call", "FLA call", "speedup"
)
MODES = {
    "fwd": "forward",
    "train": "training step: forward + backward through autograd",
    "bwd": "backward alone from the saved low-level forward",
}


def floor_ms(T, Hqk, Hv, K=128, V=128, C=64):
    flops = T * Hv * (2 * C * (3 * K + 2 * V) + 6 * K * V)
    nbytes = T * (2 * Hqk * K * 2 + Hv * V * 2 * 2 + Hv * (4 + 2))  # q, k, v, o in bf16; g fp32; beta
    return max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES) * 1e3


def kernel_ms(fn, reps, sleep_ms):
    """GPU time of fn's work, host launch cost hidden behind a device sleep of sleep_ms; median in ms."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(sleep_ms * SLEEP_CYCLES_PER_MS))  # the host queues fn's launches meanwhile
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


def triton_version():
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def load_fla():
    """FLA's public function and its low-level forward and backward (or None), and its version."""
    try:
        import fla
        import fla.ops.gated_delta_rule.chunk as chunk
        from fla.ops.utils.index import prepare_chunk_indices
    except ImportError:
        return None, "not installed"
    api = SimpleNamespace(
        call=chunk.chunk_gated_delta_rule,
        fwd=chunk.chunk_gated_delta_rule_fwd,
        bwd=chunk.chunk_gated_delta_rule_bwd,
        chunk_indices=prepare_chunk_indices,
    )
    return api, fla.__version__


def implementations(x, cu, fla_api, keep_states=None):
    """{name: (call, saved_backward)} for ours and, when installed, FLA.

    call(**inputs) -> (o, final_state) is the public, differentiable function on x's packing cu.
    saved_backward() runs the low-level forward once and returns bwd(do, dht), the low-level
    backward from what that forward saved.
    """
    q, k, v, g, beta = (x[name] for name in ("q", "k", "v", "g", "beta"))

    def ours_backward():
        g_cum, A, *_ = flash_qla.chunk_gated_delta_rule_fwd(**x, cu_seqlens=cu, output_final_state=True)
        return lambda do, dht: flash_qla.chunk_gated_delta_rule_bwd(
            q, k, v, g_cum, beta, A, do, dht, cu_seqlens=cu
        )

    def ours(**inputs):
        return flash_qla.chunk_gated_delta_rule(
            **inputs, cu_seqlens=cu, output_final_state=True, keep_states=keep_states
        )  # fmt: skip

    impls = {"ours": (ours, ours_backward)}
    if fla_api is None:
        return impls
    cu_fla, scale = cu.long(), q.shape[-1] ** -0.5

    def fla_backward():
        common = dict(q=q, k=k, v=v, beta=beta, scale=scale, initial_state=None, cu_seqlens=cu_fla)
        common["chunk_indices"] = fla_api.chunk_indices(cu_fla, 64)
        g_cum, _, A, *_ = fla_api.fwd(g=g, output_final_state=True, **common)  # g_cum is in log2 units
        return lambda do, dht: fla_api.bwd(g=g_cum, A=A, do=do, dht=dht, **common)

    def fla(**inputs):
        return fla_api.call(**inputs, cu_seqlens=cu_fla, output_final_state=True)

    impls["fla"] = (fla, fla_backward)
    return impls


def make_step(mode, call, saved_backward, x, do, dht):
    """The callable that one timed call of mode runs; its setup (leaves, the saved forward) runs here."""
    if mode == "fwd":
        return lambda: call(**x)
    if mode == "train":
        leaves = {name: t.detach().requires_grad_() for name, t in x.items()}
        return lambda: torch.autograd.grad(call(**leaves), list(leaves.values()), [do, dht])
    bwd = saved_backward()
    return lambda: bwd(do, dht)


def bench_config(args, heads, seqs, fla_api):
    """The row of one config, timed in this process: floor, and each implementation's call and kernel ms."""
    mode, reps, warmup, keep_states = args.mode, args.reps, args.warmup, args.keep_states or None
    Hqk, Hv = (int(x) for x in heads.split("/"))
    seqlens = parse_seqs(seqs)
    T, K, V = sum(seqlens), 128, 128
    x = make_inputs(1, T, Hqk, Hv, K, V, device="cuda", seed=0)
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").to(x["v"].dtype)
    dht = torch.randn(len(seqlens), Hv, K, V, generator=gen, device="cuda")
    row = {"heads": heads, "seqs": seqs, "floor": floor_ms(T, Hqk, Hv)}
    for name, (call, saved_backward) in implementations(x, cu, fla_api, keep_states).items():
        fn = make_step(mode, call, saved_backward, x, do, dht)
        for _ in range(warmup):
            fn()
        row[f"{name}_call"] = call_ms(fn, reps)
        row[f"{name}_kernel"] = kernel_ms(fn, reps, sleep_ms=1 + row[f"{name}_call"])
    return row


def bench_in_fresh_process(args, heads, seqs):
    """bench_config's row for one config, run in a child process of this script (module docstring)."""
    command = [sys.executable, __file__, "--child", "--mode", args.mode, "--heads", heads, "--seqs", seqs]
    command += ["--reps", str(args.reps), "--warmup", str(args.warmup)] + ["--keep-states"] * args.keep_states
    child = subprocess.run(command, capture_output=True, text=True)
    if child.returncode != 0:
        sys.stderr.write(child.stdout + child.stderr)
        raise SystemExit(f"{heads} {seqs}: the child process failed (exit status {child.returncode})")
    return json.loads(child.stdout.strip().splitlines()[-1])


def format_line(cells, with_floor):
    """heads, seqlens, floor | ours, FLA, speedup, /floor (kernel) | ours, FLA, speedup (call), as strings."""
    widths = (7, 12, 6, 9, 9, 7, 6, 9, 9, 7)
    text = [f"{c:>{w}}" for c, w in zip(cells, widths)]
    if not with_floor:
        text[2] = text[6] = None
    groups = (text[:3], text[3:7], text[7:])
    return " | ".join(" ".join(t for t in group if t is not None) for group in groups)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, default="fwd", help="what one timed call does (top of the file)")
    parser.add_argument("--full", action="store_true", help="every head layout x sequence pattern of DESIGN.md §4")
    parser.add_argument("--heads", action="append", help="Hqk/Hv, may repeat")
    parser.add_argument("--seqs", action="append", help="e.g. 1x32768, 4096x8, 28672+4096; may repeat")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", help="also write the table here (overwritten), under the command, versions, GPU, mode")
    parser.add_argument("--append", action="store_true", help="add the table at the end of --out, not overwrite it")
    parser.add_argument("--keep-states", action="store_true", help="train mode: ours with keep_states=True")
    parser.add_argument("--one-process", action="store_true", help="every config in this process (docstring)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one config, its row as JSON
    args = parser.parse_args()
    if args.child:
        print(json.dumps(bench_config(args, args.heads[0], args.seqs[0], load_fla()[0])))
        return
    if args.append and not args.out:
        parser.error("--append needs --out")
    if args.keep_states and args.mode != "train":
        parser.error("--keep-states needs --mode train")

    if args.heads or args.seqs:
        configs = [(h, s) for h in args.heads or DEFAULT_HEADS for s in args.seqs or DEFAULT_SEQS]
    elif args.full:
        configs = [(h, s) for h in FULL_HEADS for s in FULL_SEQS]
    else:
        configs = [(h, s) for h in DEFAULT_HEADS for s in DEFAULT_SEQS] + EXTRA

    fla_api, fla_version = load_fla()
    with_floor = args.mode == "fwd"
    lines = [
        "# " + " ".join(["python", *sys.argv]),
        f"# GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, flash_qla {flash_qla.__version__}, "
        f"fla {fla_version} (FLA_FLASH_QLA=0), triton {triton_version()}, bf16, K = V = 128, mode {args.mode} ({MODES[args.mode]}"
        f"{'; ours with keep_states=True' if args.keep_states else ''}), ms (median of {args.reps}"
        f"{', every config in one process' if args.one_process else ', a fresh process per config'})",
        format_line(HEADER, with_floor),
    ]
    print("\n".join(lines), flush=True)
    for heads, seqs in configs:
        r = bench_config(args, heads, seqs, fla_api) if args.one_process else bench_in_fresh_process(args, heads, seqs)
        ours_k, ours_c = r["ours_kernel"], r["ours_call"]
        fla_k, fla_c = r.get("fla_kernel", float("nan")), r.get("fla_call", float("nan"))
        line = format_line(
            (heads, seqs, f"{r['floor']:.3f}", f"{ours_k:.3f}", f"{fla_k:.3f}", f"{fla_k / ours_k:.2f}x",
             f"{ours_k / r['floor']:.1f}", f"{ours_c:.3f}", f"{fla_c:.3f}", f"{fla_c / ours_c:.2f}x"),
            with_floor,
        )
        print(line, flush=True)
        lines.append(line)
    if args.out:
        with open(args.out, "a" if args.append else "w") as f:
            f.write(("\n" if args.append else "") + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
