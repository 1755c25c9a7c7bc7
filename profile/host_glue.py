"""The host's work of an inference call, without a GPU: the library's Python from the call to each launch.

    python profile/host_glue.py [--heads 16/32] [--seqs 1x2048] [--calls 3000] [--rounds 9]

CPU tensors take the GPU route (flash_qla.ops.forward) with the kernels stubbed: each launch records the time
and does nothing, the streams and the device's profile are stand-ins (a route that splits works too). Prints, in
µs a call (the median over rounds of each round's mean), the time from the call to kkt_solve's launch, to the
walk's launch (the last launch) and to the return. What it leaves out is what only the GPU's host has: the
launches themselves (TileLang's TVM-FFI calls), CUDA's allocations (the buffers here are the CPU's: for large
calls, whose buffers are too large to keep as scratch, far slower than CUDA's caching allocator), stream queries.
On the H200 a call's latency is that host work up to the first launch, then the kernels and the sync (README,
Benchmark): this is the part a change to the Python moves, measurable on any machine. Compare two trees on the
same machine, interleaved.
"""

import argparse
import contextlib
import statistics
import time

import torch

import flash_qla
from flash_qla import api, dispatch
from flash_qla.arch import SM90
from flash_qla.ops import forward
from flash_qla.reference.inputs import parse_seqs


def stub_the_gpu(stamps):
    """Route CPU tensors through the GPU forward with every launch replaced by a time stamp."""

    def launch(*args):
        stamps.append(time.perf_counter_ns())

    class Stream:
        def wait_stream(self, other):
            pass

    for name in ("kkt_solve_kernel", "fused_fwd_opath_kernel", "fused_fwd_wide_kernel", "fused_fwd_kernel",
                 "compose_maps_kernel"):  # fmt: skip
        setattr(forward, name, lambda *args, **kwargs: "kernel")  # its executable: `launch`
    forward.executable = lambda kernel: launch
    forward.get_profile = lambda device: SM90
    forward.on_device = lambda device: contextlib.nullcontext()
    forward.side_stream = lambda device: Stream()
    forward.current_stream = lambda device: Stream()
    torch.cuda.set_stream = lambda stream: None
    torch.Tensor.record_stream = lambda tensor, stream: None
    torch.cuda.is_current_stream_capturing = lambda: False
    torch._C._cuda_getCurrentRawStream = lambda index: 0  # CPU tensors: no device index to query
    forward_kernels = dispatch._gpu_forward().forward_kernels

    def gpu_forward(*args, training=False, keep_states=False, scratch=False):  # dispatch._forward's GPU branch
        return forward_kernels(*args, training, keep_states, scratch)

    api._forward = gpu_forward


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", default="16/32", help="Hqk/Hv")
    parser.add_argument(
        "--seqs", default="1x2048", help="DESIGN.md §4 label, packed: 1x2048 one sequence, 4096x8 eight of 4096"
    )
    parser.add_argument("--calls", type=int, default=3000, help="calls a round")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
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
    with torch.no_grad():
        first, last, whole = measure(
            lambda: flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu), stamps, args.calls, args.rounds
        )
    print(f"{args.heads} {args.seqs}, inference, µs a call: to kkt_solve's launch {first:.2f}, to the last launch "
          f"{last:.2f}, to the return {whole:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
