"""The host's work of a call, without a GPU: the library's Python from the call to each launch, and a training step's.

    python profile/host_glue.py [--heads 16/32] [--seqs 1x2048] [--mode infer|train] [--compile] [--calls N]

CPU tensors take the GPU route (flash_qla.ops.forward, backward) with the kernels stubbed: each launch records the
time and does nothing, the streams and the device's profile are stand-ins (a route that splits works too).

`--mode infer` (the default) prints, in µs a call (the median over rounds of each round's mean), the time from the
call to kkt_solve's launch, to the walk's launch (the last launch) and to the return, and the launches a call makes.
What it leaves out is what only the GPU's host has: the launches themselves (TileLang's TVM-FFI calls), CUDA's
allocations (the buffers here are the CPU's: for large calls, whose buffers are too large to keep as scratch, far
slower than CUDA's caching allocator), stream queries. On the H200 a call's latency is that host work up to the
first launch, then the kernels and the sync (README, Benchmark): this is the part a change to the Python moves,
measurable on any machine.

`--mode train` times a training step instead: an op of the caller's (g scaled), the call, and
torch.autograd.grad of o w.r.t. q, k, v, g and beta; µs a step, run eagerly (the autograd Function). With
`--compile` also the step under torch.compile (backend aot_eager: the graphs' ops run eagerly, so what the
steps differ by is the graphs' and the library's host work, not generated code), both ways the library offers
(README, torch.compile): with `capture_dynamic_output_shape_ops` (the training operator pair, fullgraph; the flag
set around each block of steps, as a user sets it once) and without it (a graph break at the call, the Function run
eagerly between two graphs).

Compare two trees on the same machine, interleaved.
"""

import argparse
import contextlib
import inspect
import statistics
import time

import torch

import flash_qla
from flash_qla import api, autograd, dispatch
from flash_qla.arch import SM90
from flash_qla.ops import backward, forward
from flash_qla.reference.inputs import parse_seqs


def stub_the_gpu(stamps):
    """Route CPU tensors through the GPU forward and backward with every launch replaced by a time stamp."""

    def launch(*args):
        stamps.append(time.perf_counter_ns())

    class Stream:
        def wait_stream(self, other):
            pass

    for module in (forward, backward):
        for name in dir(module):
            if name.endswith("_kernel") and hasattr(getattr(module, name), "cache_info"):
                setattr(module, name, lambda *args, **kwargs: "kernel")  # its executable: `launch`
        module.executable = lambda kernel: launch
        module.get_profile = lambda device: SM90
        module.on_device = lambda device: contextlib.nullcontext()
        module.side_stream = lambda device: Stream()
        module.current_stream = lambda device: Stream()
    backward.multiprocessors = lambda device: SM90.num_sms
    torch.cuda.set_stream = lambda stream: None
    torch.Tensor.record_stream = lambda tensor, stream: None
    torch.cuda.is_current_stream_capturing = lambda: False
    torch._C._cuda_getCurrentRawStream = lambda index: 0  # CPU tensors: no device index to query

    def gpu_branch(core, kernels):
        """dispatch's core function's GPU branch: its arguments, by position in core's order (those not passed
        by position taken from the keywords or the defaults), handed to the GPU kernels. (Not Signature.bind:
        ~14 µs a call on this repository's CPU machine, as much as the library's own Python.)"""
        names, defaults = zip(*((p.name, p.default) for p in inspect.signature(core).parameters.values()))

        def branch(*args, **kwargs):
            n = len(args)
            return kernels(*args, *[kwargs.get(name, default) for name, default in zip(names[n:], defaults[n:])])

        return branch

    for module in (api, autograd):
        module._forward = gpu_branch(dispatch._forward, forward.forward_kernels)
        module._backward = gpu_branch(dispatch._backward, backward.backward_kernels)


def measure(call, stamps, calls, rounds):
    """(to the first launch, to the last, to the return), µs a call."""
    for _ in range(calls // 10):
        call()
    first, last, whole = [], [], []
    for _ in range(rounds):
        sums = [0, 0, 0]
        for _ in range(calls):
            stamps.clear()
            start = time.perf_counter_ns()
            call()
            end = time.perf_counter_ns()
            sums[0] += stamps[0] - start
            sums[1] += stamps[-1] - start
            sums[2] += end - start
        first.append(sums[0] / calls / 1e3)
        last.append(sums[1] / calls / 1e3)
        whole.append(sums[2] / calls / 1e3)
    return statistics.median(first), statistics.median(last), statistics.median(whole)


def mean_step_times(steps, n, rounds):
    """{name: µs a step} of each of `steps` ({name: (capture, step)}), the median over rounds of its mean over n
    steps, the steps interleaved by blocks of n within each round; each block runs with dynamo's
    capture_dynamic_output_shape_ops set to its capture, as a user sets it once for a whole run."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (capture, step) in steps.items():
            with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=capture):
                for _ in range(n // 10):
                    step()
                start = time.perf_counter_ns()
                for _ in range(n):
                    step()
                times[name].append((time.perf_counter_ns() - start) / n / 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def training_steps(q, k, v, g, beta, cu, compile_too):
    """{name: (capture_dynamic_output_shape_ops, a training step)}: eager, and with compile_too under torch.compile
    with the operator pair (the flag on) and with the graph break (off, the default)."""
    for x in (q, k, v, g, beta):
        x.requires_grad_()
    do = torch.randn_like(v)

    def step(q, k, v, g, beta):
        o, _ = flash_qla.chunk_gated_delta_rule(q, k, v, g * 1.01, beta, cu_seqlens=cu)
        return o

    def run(fn):
        return lambda: torch.autograd.grad(fn(q, k, v, g, beta), (q, k, v, g, beta), do)

    steps = {"eager": (False, run(step))}
    if compile_too:
        steps["compiled, operator pair"] = (True, run(torch.compile(step, fullgraph=True, backend="aot_eager")))
        steps["compiled, graph break"] = (False, run(torch.compile(step, backend="aot_eager")))
    return steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", default="16/32", help="Hqk/Hv")
    parser.add_argument(
        "--seqs", default="1x2048", help="DESIGN.md §4 label, packed: 1x2048 one sequence, 4096x8 eight of 4096"
    )
    parser.add_argument("--mode", choices=("infer", "train"), default="infer")
    parser.add_argument("--compile", action="store_true", help="--mode train: the compiled steps too")
    parser.add_argument("--calls", type=int, help="calls a round (default 3000 inference calls, 500 steps)")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if args.compile and args.mode != "train":
        parser.error("--compile times training steps: add --mode train")
    Hqk, Hv = map(int, args.heads.split("/"))
    seqlens = parse_seqs(args.seqs)
    T = sum(seqlens)
    torch.set_num_threads(1)
    stamps = []
    stub_the_gpu(stamps)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, T, Hqk, 128, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(1, T, Hv, 128, generator=gen).bfloat16()
    g, beta = -torch.rand(1, T, Hv, generator=gen), torch.rand(1, T, Hv, generator=gen).bfloat16()
    cu = None if len(seqlens) == 1 else torch.tensor([0, *seqlens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    if args.mode == "train":
        steps = training_steps(q, k, v, g, beta, cu, args.compile)
        launches = {}
        for name, (capture, step) in steps.items():  # each step's launches, counted (its compile, if any, first)
            with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=capture):
                step()
                stamps.clear()
                step()
            launches[name] = len(stamps)
        times = mean_step_times(steps, args.calls or 500, args.rounds)
        print(f"{args.heads} {args.seqs}, training step, µs a step (launches): "
              + ", ".join(f"{name} {t:.1f} ({launches[name]})" for name, t in times.items()))  # fmt: skip
        return
    with torch.no_grad():
        first, last, whole = measure(
            lambda: flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu),
            stamps,
            args.calls or 3000,
            args.rounds,
        )
    print(f"{args.heads} {args.seqs}, inference, µs a call: to kkt_solve's launch {first:.2f}, to the last launch "
          f"{last:.2f}, to the return {whole:.2f} ({len(stamps)} launches)")  # fmt: skip


if __name__ == "__main__":
    main()
