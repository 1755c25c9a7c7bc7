"""Output buffers of the kernels: one allocation point, so tests can poison every output.

`new` allocates a buffer; `scratch` hands out buffers for intermediates that one call writes
and reads and then drops (kkt_solve's outputs in an inference forward, and a split walk's pieces'
buffers), the same ones again to the next call of the same shapes on the same device, stream and
thread: the layers of a model step share their shapes, and allocations were a third of a small
call's host time (benchmark/NOTES.md v25).
"""

import threading

import torch

# scratch keeps a call's buffers for the next call only when they take at most this many bytes: those of the calls
# whose host time shows, 16/32 at 2048 tokens (9 MiB on the O path, 17 MiB with P) and the split calls over few
# heads (2/8 at 32768 tokens: 68 MiB of kkt_solve's outputs and 34 MiB of the pieces' buffers, 4/16 at 8192: 34 and
# 20; 16/32 at 8192: 68 and 40). An H100 ran their kernels in less time than its host took to launch them: kept
# from 64 MiB to this, the call at 2/8 over 1 x 32768 tokens took 249 µs (median of six processes, 242-260) against
# 296 (288-396), its kernels 207; 2/8 1 x 8192 172 (155-197) against 274 (219-319), kernels 95 (benchmark/NOTES.md,
# session 74, with the split's plan and stream changes)
SCRATCH_MAX_BYTES = 128 * 2**20


def new(shape, dtype, like: torch.Tensor) -> torch.Tensor:
    """Allocate a buffer on like's device that the kernels write in full (tests swap this for a
    NaN-poisoned fill). like.new_empty: ~3 µs less host time than torch.empty(device=...) on the H200's host."""
    return like.new_empty(shape, dtype=dtype)


def new_like(x: torch.Tensor) -> torch.Tensor:
    """new(x.shape, x.dtype, x) for a contiguous x, by torch.empty_like: ~3 µs less host time for a
    large buffer on the H200's host."""
    return torch.empty_like(x)


_placeholders: dict = {}


def placeholder(device: torch.device, Hv: int, K: int, V: int) -> torch.Tensor:
    """A state-shaped buffer passed where a kernel flag says the tensor is neither read nor written."""
    key = (device, Hv, K, V)
    if key not in _placeholders:
        _placeholders[key] = torch.empty(1, Hv, K, V, dtype=torch.float32, device=device)
    return _placeholders[key]


def no_bounds(device: torch.device, Hv: int) -> torch.Tensor:
    """The walks' log_norms [Hv, 1] fp32 where their flags say it is not read (every walk but the
    split's map, offset and end walks, flash_qla.ops.context_parallel)."""
    key = (device, Hv)
    if key not in _placeholders:
        _placeholders[key] = torch.zeros(Hv, 1, dtype=torch.float32, device=device)
    return _placeholders[key]


def no_parts(device: torch.device, C: int, Hqk: int, K: int) -> tuple:
    """chunk_grads' first parts' dq / dk sums [1, C, Hqk, K] fp32 and counts [1, Hqk] int32 where it walks
    whole items (PARTS = 1: neither read nor written)."""
    key = ("parts", device, C, Hqk, K)
    if key not in _placeholders:
        parts = torch.empty(1, C, Hqk, K, dtype=torch.float32, device=device)
        _placeholders[key] = (parts, torch.zeros(1, Hqk, dtype=torch.int32, device=device))
    return _placeholders[key]


# (device index, raw stream) -> int32 zeros that the kernels counting in them leave zero
_counters: dict = {}


def counters(n: int, like: torch.Tensor) -> torch.Tensor:
    """n int32 zeros on like's device, for a kernel that counts in them and leaves them zero (chunk_grads'
    parts). The same ones to every call on this device and stream (stream order keeps the calls apart;
    a new stream gets its own), grown when a call needs more; during a CUDA graph capture new ones, zeroed
    by a captured fill."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=like.device)
    device = like.device.index
    key = (device, torch._C._cuda_getCurrentRawStream(device))
    kept = _counters.get(key)
    if kept is None or kept.numel() < n:
        kept = _counters[key] = torch.zeros(n, dtype=torch.int32, device=like.device)
    return kept[:n]


# (device index, raw stream, thread) -> (specs, buffers) of the last call there
_scratch: dict = {}


def scratch(specs, like: torch.Tensor) -> list:
    """Buffers of the given ((shape, dtype), ...) on like's device, for intermediates that the
    caller's kernels write and read on the current stream and that nothing uses after the call.

    The last call's buffers on this device and stream from this thread when they had the same
    specs, else new ones (kept for the next call when they take at most SCRATCH_MAX_BYTES, until a thread
    that ended is found among the keepers when new ones are kept, or release_scratch). Reuse
    is safe by stream order: the next call's kernels, queued on the same stream, run after every
    kernel of this one. Per thread, because two threads' calls on one stream may interleave their
    launches. During a CUDA graph capture the buffers are new and not kept (a replay may run beside
    later calls).
    """
    if torch.cuda.is_current_stream_capturing():
        return [new(shape, dtype, like) for shape, dtype in specs]
    device = like.device.index
    # the raw stream handle: torch.cuda.current_stream() costs ~5 µs
    key = (device, torch._C._cuda_getCurrentRawStream(device), threading.get_ident())
    kept = _scratch.get(key)
    if kept is not None and kept[0] == specs:
        return kept[1]
    buffers = [new(shape, dtype, like) for shape, dtype in specs]
    if sum(x.numel() * x.element_size() for x in buffers) <= SCRATCH_MAX_BYTES:
        _drop_ended_threads()
        _scratch[key] = (specs, buffers)
    return buffers


def _drop_ended_threads() -> None:
    """Forget the scratch of threads that have ended (a server running each request on a thread of its
    own would otherwise keep up to SCRATCH_MAX_BYTES for every thread it ever ran)."""
    alive = {thread.ident for thread in threading.enumerate()}
    for key in list(_scratch):  # a snapshot (atomic): other threads may add or drop entries meanwhile
        if key[2] not in alive:
            _scratch.pop(key, None)


def release_scratch() -> None:
    """Free the scratch buffers that inference calls keep for the next call of the same shapes (at
    most SCRATCH_MAX_BYTES per device, stream and thread that ran one); the next such call allocates
    them again. The memory goes back to PyTorch's caching allocator (torch.cuda.empty_cache() then
    returns it to the device). Safe while calls are in flight: a call holds its own references to
    its buffers, and the allocator reuses a freed block only in the order of its stream.
    """
    _scratch.clear()
