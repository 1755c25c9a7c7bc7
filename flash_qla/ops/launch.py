"""Building and launching the TileLang kernels: one build per configuration, the least host work per
launch, and the next kernel's start early.

A JITKernel's `__call__` goes through TileLang's torch adapter, which rebuilds the argument
list and looks for outputs to allocate on every launch. Our kernels allocate nothing (every
output is passed in), so the adapter's work is pure overhead: calling the TVM-FFI
executable directly launches the same kernel on the current stream with the same argument
checks (dtype, shape, device, contiguity), 2-4 µs sooner per launch on the H200's host
(benchmark/NOTES.md).
"""

import contextlib
import functools
import inspect

import tilelang.language as T
import torch

_NOTHING = contextlib.nullcontext()


def on_device(device: torch.device):
    """A context that makes device current for the launches: torch.cuda.device(device), or nothing
    to enter when it is current already (the usual case; ~1.5 µs of host time less). The current device is
    read from torch._C: torch.cuda.current_device() adds three Python frames (its lazy-init check, needless
    with a CUDA tensor in hand), ~0.3 µs on the CPU machine."""
    return _NOTHING if device.index == torch._C._cuda_getDevice() else torch.cuda.device(device)


def kernel_factory(build):
    """Decorate a kernel factory build(config...) -> JITKernel: one kernel per configuration, however its
    arguments are spelled.

    functools.lru_cache keys on the call as spelled: a flag passed by position in one place and by keyword,
    or left to its default, in another would build the same kernel twice, the second time as a hit of
    TileLang's own memory cache (after tracing the kernel's source again, and with a warning in the
    caller's log). Each spelling is remembered; a new one is bound to build's signature, defaults filled
    in, and looked up by that. `cache_info()` counts the configurations built.
    """
    signature = inspect.signature(build)
    built = functools.lru_cache(maxsize=None)(build)
    spellings = {}

    @functools.wraps(build)
    def factory(*args, **kwargs):
        key = (args, *kwargs.items())
        kernel = spellings.get(key)
        if kernel is None:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            kernel = spellings[key] = built(*bound.args)
        return kernel

    factory.cache_info = built.cache_info
    return factory


_side_streams: dict = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A second stream of the device, for a walk beside another one (the backward's state recompute
    beside its walk, a split forward's map walk beside its offset walk), forked from and joined to the
    caller's stream by the orchestration that uses it."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


_current_streams: dict = {}


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """torch.cuda.current_stream(device), the Stream object kept per raw stream handle: torch's call builds it through
    Python frames, 6.9-7.8 µs of an H100 host's time, where the handle is one C call (a split inference call at 2/8
    over 8192 tokens, host-bound: 143.8 -> 139.7 µs, medians of three processes; benchmark/NOTES.md v76 steps 5-6).
    A handle names one stream for as long as the process runs (PyTorch never frees its pool's streams; an external
    stream found again at the same address is a Stream object equal to the kept one)."""
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    stream = _current_streams.get(key)
    if stream is None:
        stream = _current_streams[key] = torch.cuda.current_stream(device)
    return stream


@contextlib.contextmanager
def fork(beside: torch.cuda.Stream, main: torch.cuda.Stream):
    """Launch on `beside` (side_stream) after the work queued on `main`, the current stream (current_stream), so far;
    main is current again after. The caller joins them (main.wait_stream(beside)) before anything on main reads what
    beside wrote. main is the caller's, looked up once for the fork and the join (torch.cuda.stream(beside) would look
    the current stream and device up again)."""
    beside.wait_stream(main)
    torch.cuda.set_stream(beside)
    try:
        yield
    finally:
        torch.cuda.set_stream(main)


@functools.lru_cache(maxsize=None)
def executable(kernel):
    """The TVM-FFI callable of a compiled kernel: executable(kernel)(*args) == kernel(*args)."""
    assert not kernel.adapter.result_idx, "kernels of this library take every output as an argument"
    return kernel.adapter.get_exportable_executable()


@T.macro
def follow_previous_kernel():
    """The first statement of the kernels here (all but the narrow walks): programmatic dependent launch.

    `griddepcontrol.wait` (SM90 and later) holds every thread until the previous kernel on the stream has
    finished and its writes are visible, so nothing in a kernel reads or writes global memory before it;
    TileLang places it after the block's setup (barrier init, TMA descriptor prefetch) and launches a kernel
    that has it with the programmatic-stream-serialization attribute, so that setup and the launch itself
    overlap the previous kernel's last blocks. `griddepcontrol.launch_dependents` right after lets the next such
    kernel launch once every block of this one has started: its blocks take the SMs this one's last wave leaves
    idle and wait there. A kernel launched after anything else (a torch op, an event wait, another stream's
    work) starts as it would without these, as we read the CUDA documentation, so the forward keeps nothing but
    kernel launches between its first launch and its last (flash_qla.ops.context_parallel.split_tables). H200:
    forward 2/8 8x4096 1.3 % faster, its training step 0.7 % (benchmark/NOTES.md v30). The narrow walks (fused_fwd,
    fused_bwd) start without it: launched early, the forward walk of 16/32 1x32768 ran 4 % slower.
    """
    T.pdl_sync()
    T.pdl_trigger()


# The device functions the kernels call by T.call_extern, in one source that each kernel calling one imports
# (T.import_source): TileLang takes one import a kernel ("Try to merge two annotations with different values for key
# pragma_import_c" otherwise), so every kernel imports this one, guarded (a kernel may import it more than once). The
# functions a kernel does not call are not compiled into it.
# - flash_qla_stsm_x4, flash_qla_stsm_x4_trans, flash_qla_ldsm_x4_trans: stmatrix.x4, stmatrix.x4.trans and
#   ldmatrix.x4.trans of the four 32-bit words regs[first : first + 4] (pairs of 16-bit values) of a thread's local
#   array (flash_qla.ops.staging). TileLang's fragment copies emit stmatrix only into a tile of the fragment's own
#   orientation, and a fragment element read outside T.Parallel counts as replicated, so these moves go through
#   functions that take the fragment's local array itself;
# - flash_qla_ring_trips: ring_trips' count (below).
DEVICE_FUNCTIONS = """
#ifndef FLASH_QLA_DEVICE_FUNCTIONS
#define FLASH_QLA_DEVICE_FUNCTIONS
__device__ __forceinline__ void flash_qla_stsm_x4(void* smem, const void* regs, int first) {
  const unsigned* r = reinterpret_cast<const unsigned*>(regs) + first;
  asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\\n"
               :: "r"((unsigned)__cvta_generic_to_shared(smem)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]));
}
__device__ __forceinline__ void flash_qla_stsm_x4_trans(void* smem, const void* regs, int first) {
  const unsigned* r = reinterpret_cast<const unsigned*>(regs) + first;
  asm volatile("stmatrix.sync.aligned.x4.trans.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\\n"
               :: "r"((unsigned)__cvta_generic_to_shared(smem)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]));
}
__device__ __forceinline__ void flash_qla_ldsm_x4_trans(const void* smem, void* regs, int first) {
  unsigned* r = reinterpret_cast<unsigned*>(regs) + first;
  asm volatile("ldmatrix.sync.aligned.x4.trans.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];\\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((unsigned)__cvta_generic_to_shared(smem)));
}
__device__ __forceinline__ int flash_qla_ring_trips(int n) {
  int warp = __shfl_sync(0xffffffff, threadIdx.x / 32, 0);  // cutlass::canonical_warp_idx_sync()
  return warp >= 1 && warp < 4 ? 0 : n;
}
#endif
"""


def ring_trips(n):
    """Inside a kernel: the trip count of a T.Pipelined loop of n steps that TileLang warp-specializes into a TMA ring
    (fused_fwd, fused_fwd_wide, fused_bwd, fused_bwd_wide): n, but 0 for warps 1-3 of the producer warpgroup
    (threads 32-127; TileLang puts the producer first), which then skip the loop.

    TileLang has every producer thread wait for each ring stage to be free (an mbarrier parity wait) and only warp
    0's elected thread load it and arrive; nothing waits for warps 1-3. One that reaches its wait for a stage after
    the consumers have freed it again sees the parity it waits for once more and waits for a later phase, which
    after the last chunk never comes. That was the split forward's hang with session 96's lead: one block of the
    offsets walk left with one or two producer warps of 1-3 in a stage wait, warp 0 and every consumer done (H100,
    cuda-gdb in sessions 105-107); with the lead, 238 calls before it in session 107 and 378-15 547 before; with
    warps 1-3 out of the loop the same calls ran clean for the rest of that run's ~170 s, o and the final states
    bitwise those of the kernels before (benchmark/NOTES.md v107). Without warps 1-3 the ring is warp 0's and the
    consumers' alone, which wait for each other at every stage.

    The count is DEVICE_FUNCTIONS' flash_qla_ring_trips, bound to a variable before the loop (T.bind): each role's
    branch computes it once, `int v = flash_qla_ring_trips(...)`, and loops to v. Its warp is CUTLASS's
    canonical_warp_idx_sync, threadIdx.x / 32 broadcast from lane 0: TileLang renumbers the consumers' thread variable
    in their branch, not this; and ptxas keeps the broadcast value in a uniform register, where with the per-thread
    threadIdx.x / 32 the bound took a register more and the walks whose consumers use every register they have
    (fused_fwd_wide with h0, and its packed form) spilled 8 bytes (test_kernels_compile). Written as TileLang
    arithmetic (if_then_else on the warp), the bound reached TileLang's Z3 prover in every pass that reasons about the
    loop, and lowering a walk took ~14x as long (fused_fwd_wide, 16/16, 64 columns: 76 s against 5.3 s, the same
    device code but for the bound's spelling; benchmark/NOTES.md v108); the call is opaque to it. Left in the loop's
    condition (no bind), the call ran every trip and ptxas spilled there too.
    """
    T.import_source(DEVICE_FUNCTIONS)
    return T.bind(T.call_extern("int32", "flash_qla_ring_trips", n))


def token_major(*packed):
    """Inside a kernel: the [T, ...] views of packed token-major arguments [1, T, ...] (flash_qla.dispatch's
    layout), one for each, a tuple. The host hands the kernels the packed tensors as they are (a view a tensor
    cost ~1 µs of host time a launch); the same memory and strides, so the device code is a [T, ...]
    argument's, byte for byte."""
    return tuple(T.reshape(x, x.shape[1:]) for x in packed)
