"""Every kernel launch of the GPU forward and backward against the kernel's own signature, without a GPU.

The orchestration (flash_qla.ops.forward, backward, context_parallel) runs on CPU tensors along each route the
planner takes, with each kernel's executable swapped for a stand-in that checks the arguments as TileLang's
launcher does on the GPU: their number, each tensor's dims, dtype and contiguity, the static extents, and that
the symbolic ones (tokens, slots, sequences) agree between arguments; and, which TileLang does not check (a kernel
faults on it), that each tensor's data starts at a 16-byte aligned address. The kernels are traced, not compiled: their
signatures are their TIR functions' parameters. Streams are stand-ins too; nothing is computed. On the GPU a
mismatch raises at the launch; here it fails in CI.
"""

import contextlib
import inspect
from typing import NamedTuple

import pytest
import tilelang
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tvm import arith, tirx

import flash_qla
from flash_qla import api, autograd, dispatch
from flash_qla.arch import SM90
from flash_qla.ops.chunks import checkpoint_pieces
from flash_qla.ops import backward, forward
from flash_qla.reference.inputs import make_inputs
from gpu_cases import strided

SCALARS = {"int32": int, "float32": float}


class Launch:
    """A kernel's parameters, checking each launch's arguments against them; `launched` records the kernel's name."""

    def __init__(self, func, launched):
        self.name = str(func.attrs["global_symbol"])
        buffers = func.buffer_map
        self.params = [
            (str(buffers[p].name if p in buffers else p.name), buffers.get(p), str(p.dtype)) for p in func.params
        ]
        self.launched = launched

    def __call__(self, *args):
        assert len(args) == len(self.params), f"{self.name}: {len(args)} arguments, {len(self.params)} parameters"
        sizes, compound = {}, []
        for (name, buffer, dtype), arg in zip(self.params, args):
            where = f"{self.name}({name})"
            if buffer is None:
                assert type(arg) is SCALARS[dtype], f"{where}: {type(arg).__name__} for {dtype}"
                continue
            assert isinstance(arg, torch.Tensor), f"{where}: {type(arg).__name__}"
            shape = list(buffer.shape)
            assert arg.dim() == len(shape), f"{where}: shape {tuple(arg.shape)} for {shape}"
            assert arg.dtype == getattr(torch, str(buffer.dtype)), f"{where}: {arg.dtype} for {buffer.dtype}"
            assert arg.is_contiguous(), f"{where}: strides {arg.stride()}"
            past = arg.data_ptr() % forward.ALIGNMENT
            assert past == 0, f"{where}: data {past} bytes past an aligned address"
            for extent, size in zip(shape, arg.shape):
                if isinstance(extent, tirx.Var):
                    assert sizes.setdefault(extent, size) == size, (
                        f"{where}: {extent} = {size}, elsewhere {sizes[extent]}"
                    )
                else:
                    compound.append((where, extent, size))
        for where, extent, size in compound:  # constants, and `n + 1` (its n bound by it where no dim is n alone)
            if isinstance(extent, tirx.Add) and isinstance(extent.a, tirx.Var) and extent.a not in sizes:
                sizes[extent.a] = size - int(extent.b)
            value = arith.Analyzer().simplify(tirx.stmt_functor.substitute(extent, sizes))
            assert int(value) == size, f"{where}: {size} for {extent} = {value}"
        self.launched.append(self.name)


class Stream:
    """Stands in for a CUDA stream: the orchestration forks and joins streams, nothing runs on them."""

    def wait_stream(self, other):
        pass


@pytest.fixture
def launched(monkeypatch):
    """Swap every kernel factory the orchestration calls for one that traces the kernel (no compile) into a
    Launch, and the GPU-only calls for stand-ins. Returns the names of the kernels launched, in order."""
    names, traced = [], {}
    monkeypatch.setattr(tilelang, "compile", lambda func, target=None, **kwargs: func)

    def tracing(factory):
        def build(*args, **kwargs):
            key = (factory, args, tuple(kwargs.items()))  # two factories may take the same arguments
            if key not in traced:
                traced[key] = Launch(factory.__wrapped__(*args, **kwargs), names)
            return traced[key]

        return build

    for module in (forward, backward):
        for name in dir(module):
            if name.endswith("_kernel") and hasattr(getattr(module, name), "cache_info"):
                monkeypatch.setattr(module, name, tracing(getattr(module, name)))
        monkeypatch.setattr(module, "executable", lambda kernel: kernel)
    for module in (forward, backward):
        monkeypatch.setattr(module, "get_profile", lambda device: SM90)
        monkeypatch.setattr(module, "on_device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(module, "side_stream", lambda device: Stream())
        monkeypatch.setattr(module, "current_stream", lambda device: Stream())
    monkeypatch.setattr(backward, "multiprocessors", lambda device: SM90.num_sms)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: None)
    forward.forward_plan.cache_clear()
    backward.backward_plan.cache_clear()
    yield names
    forward.forward_plan.cache_clear()
    backward.backward_plan.cache_clear()


def packed_inputs(seqlens, Hqk, Hv, dtype, h0, beta_dtype=None):
    """Packed inputs [1, T, ...] on the CPU, as flash_qla.dispatch hands them over (values do not matter); β in q's
    dtype unless given."""
    T, K = sum(seqlens), 128
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    q, k = (torch.zeros(1, T, Hqk, K, dtype=dtype) for _ in range(2))
    v = torch.zeros(1, T, Hv, K, dtype=dtype)
    g, beta = torch.zeros(1, T, Hv), torch.zeros(1, T, Hv, dtype=beta_dtype or dtype)
    state = torch.zeros(len(seqlens), Hv, K, K) if h0 else None
    return q, k, v, g, beta, K**-0.5, state, cu


class Route(NamedTuple):
    """A route through the orchestration: inputs, forward options, planner decisions forced (name: value), and
    the kernels the forward and the backward after it launch (None: no backward)."""

    seqlens: tuple
    heads: tuple
    dtype: torch.dtype = torch.bfloat16
    h0: bool = False
    beta_dtype: torch.dtype | None = (
        None  # β's, when not q's (float32: kkt_solve reads it so, chunk_grads stores dβ so)
    )
    options: dict = {}
    planner: dict = {}
    forward: set = frozenset()
    backward: set | None = None


FWD_SPLIT = {"kkt_solve", "fused_fwd_wide", "compose_maps"}  # kkt_solve, the map and offsets walks, compose, the walk
ROUTES = {
    "inference_opath": Route((2048,), (16, 32), options=dict(scratch=True), forward={"kkt_solve", "fused_fwd_opath"}),
    "inference_narrow_16": Route(
        (2048,), (2, 8), h0=True, options=dict(scratch=True), forward={"kkt_solve", "fused_fwd"}
    ),
    "inference_wide_128_fp16": Route(
        (2048, 2048),
        (16, 48),
        torch.float16,
        options=dict(output_final_state=True),
        forward={"kkt_solve", "fused_fwd_wide"},
    ),
    "inference_opath_h0_beta_fp32": Route(
        (2048,),
        (16, 32),
        h0=True,
        beta_dtype=torch.float32,
        options=dict(output_final_state=True),
        forward={"kkt_solve", "fused_fwd_opath"},
    ),
    # o alone: the pieces walked by the O-path walk, kkt_solve without P but with the bounds
    "inference_split": Route(
        (32768,), (2, 8), h0=True, options=dict(output_final_state=True), forward=FWD_SPLIT | {"fused_fwd_opath"}
    ),
    "inference_split_beta_fp32_scratch": Route(
        (28672, 4096),
        (16, 32),
        beta_dtype=torch.float32,
        options=dict(scratch=True, output_final_state=True),
        forward=FWD_SPLIT | {"fused_fwd_opath"},
    ),
    # several short sequences a block (PACKED), empty ones among them
    "inference_packed_h0": Route(
        (1, 64, 65, 128, 0) * 40, (2, 8), h0=True, options=dict(scratch=True, output_final_state=True),
        forward={"kkt_solve", "fused_fwd_wide"},
    ),
    "low_level_output_h_split": Route(
        (32768,),
        (2, 8),
        h0=True,
        beta_dtype=torch.float32,
        options=dict(output_h=True, output_final_state=True),
        forward=FWD_SPLIT,
        backward=FWD_SPLIT | {"fused_fwd", "fused_bwd_wide", "chunk_grads"},
    ),
    "low_level_output_h_varlen": Route(
        (0, 1, 63, 64, 65, 130),
        (4, 8),
        h0=True,
        options=dict(output_h=True),
        forward={"kkt_solve", "fused_fwd"},
        backward={"kkt_solve", "fused_fwd_wide", "fused_bwd_wide", "chunk_grads"},
    ),
    "low_level_split_backward": Route(
        (32768,),
        (2, 8),
        options=dict(auto_cp=False),
        forward={"kkt_solve", "fused_fwd"},
        backward={"kkt_solve", "fused_fwd", "fused_fwd_wide", "fused_bwd_wide", "compose_maps", "chunk_grads"},
    ),
    # the backward's recompute and its split's end walk take the same factory arguments (fused_fwd_wide's and
    # fused_bwd_wide's: a stand-in kept by arguments alone launched one for the other)
    "low_level_split_backward_unequal": Route(
        (64, 1, 64, 1, 1, 20000),
        (2, 4),
        torch.float16,
        options=dict(output_h=True),
        forward=FWD_SPLIT,
        backward={"kkt_solve", "fused_fwd_wide", "fused_bwd_wide", "compose_maps", "chunk_grads"},
    ),
    "training_kept_states": Route(
        (1000,) * 8,
        (2, 8),
        h0=True,
        options=dict(training=True, keep_states=True),
        forward={"kkt_solve", "fused_fwd_wide"},
        backward={"fused_bwd_wide", "chunk_grads"},
    ),
    "training_narrow": Route(
        (2048,),
        (2, 8),
        torch.float16,
        h0=True,
        options=dict(training=True),
        forward={"kkt_solve", "fused_fwd"},
        backward={"fused_bwd", "chunk_grads"},
    ),
    "training_checkpoints": Route(
        (12288,),
        (16, 32),
        options=dict(training=True, keep_states=False),
        planner=dict(splits_forward=False),
        forward={"kkt_solve", "fused_fwd"},
        backward={"fused_fwd_wide", "fused_bwd_wide", "chunk_grads"},
    ),
    "training_split": Route(
        (32768,),
        (2, 8),
        torch.float16,
        h0=True,
        options=dict(training=True, output_final_state=True),
        forward=FWD_SPLIT,
        backward={"fused_bwd_wide", "compose_maps", "chunk_grads"},
    ),
    "training_split_recompute": Route(  # the backward's recompute walks from the split forward's start states
        (32768,),
        (2, 8),
        beta_dtype=torch.float32,
        options=dict(training=True, keep_states=False),
        forward=FWD_SPLIT,
        backward={"fused_fwd_wide", "fused_bwd_wide", "compose_maps", "chunk_grads"},
    ),
}


class TensorOps(TorchDispatchMode):
    """Records each ATen op that computes (neither an allocation nor a view) with the number of kernels `launched`
    before it."""

    def __init__(self, launched):
        super().__init__()
        self.launched, self.ops = launched, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and "empty" not in func.name():  # empty, new_empty, empty_like, empty_strided
            self.ops.append((func.name(), len(self.launched)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("route", ROUTES.values(), ids=ROUTES.keys())
def test_every_launch_matches_its_kernel(launched, monkeypatch, route):
    """The forward (and, where the route has one, the backward after it: a training one from what the forward kept,
    else the low-level one from g_cum and A) launches each kernel with arguments its signature takes; the kernels
    launched are the route's. Between the forward's first launch (kkt_solve) and its last, no tensor is computed:
    the kernels after kkt_solve wait for the one before them alone (flash_qla.ops.context_parallel.split_tables)."""
    for name, decision in route.planner.items():
        monkeypatch.setattr(forward, name, lambda *args, decision=decision, **kwargs: decision)
    q, k, v, g, beta, scale, h0, cu = packed_inputs(
        route.seqlens, *route.heads, route.dtype, route.h0, route.beta_dtype
    )
    options = dict(dict(output_final_state=False, output_h=False, auto_cp=True, training=False), **route.options)
    with TensorOps(launched) as tensor_ops:
        g_cum, A, o, h, final_state, checkpoints, maps, chunk_terms = forward.forward_kernels(
            q, k, v, g, beta, scale, h0, cu, options["output_final_state"], options["output_h"], route.seqlens,
            options["auto_cp"], options["training"], options.get("keep_states"), options.get("scratch", False),
        )  # fmt: skip
    assert o.shape == v.shape and set(launched) == route.forward, launched
    assert launched[0] == "kkt_solve" and any(before == 0 for _, before in tensor_ops.ops), "the tables were made"
    between = [(op, launched[before - 1]) for op, before in tensor_ops.ops if 0 < before < len(launched)]
    assert not between, f"computed after a launch and before the forward's last: (op, after kernel) {between}"
    N, Hv, K = len(route.seqlens), route.heads[1], 128
    assert final_state.shape == (N, Hv, K, K) if options["output_final_state"] else final_state is None
    chunks = sum(-(-n // SM90.chunk) for n in route.seqlens)
    assert h.shape == (chunks, Hv, K, K) if options["output_h"] else h is None
    if route.backward is None:
        return
    del launched[:]
    do, dht = torch.zeros_like(o), torch.zeros(len(route.seqlens), route.heads[1], 128, 128)
    grads = backward.backward_kernels(
        q, k, v, g_cum, beta, A, do, dht, scale, h0, cu, route.seqlens, checkpoints, maps, True, chunk_terms
    )
    assert set(launched) == route.backward, launched
    assert [x.shape for x in grads[:5]] == [q.shape, k.shape, v.shape, beta.shape, g.shape]


def test_routes_reach_every_kernel():
    """The routes above launch every kernel the precompile lists build (each route's launches are its table
    entry's: test_every_launch_matches_its_kernel; a kernel's name is its factory's without `_kernel`)."""
    reached = set().union(*(route.forward | (route.backward or set()) for route in ROUTES.values()))
    layout = (SM90, 2, 8, "bfloat16")
    builds = forward.forward_kernel_builds(*layout) + backward.backward_kernel_builds(*layout)
    assert reached == {factory.__name__.removesuffix("_kernel") for factory, _ in builds}


@pytest.fixture
def gpu_route(launched, monkeypatch):
    """As `launched`, and CPU tensors take flash_qla.dispatch's GPU branch from the public API down."""

    def gpu_branch(core, kernels):
        """core's arguments, bound by its own signature (defaults filled in), handed to the GPU kernels."""
        signature = inspect.signature(core)

        def branch(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return kernels(*bound.args)

        return branch

    gpu_forward = gpu_branch(dispatch._forward, forward.forward_kernels)
    gpu_backward = gpu_branch(dispatch._backward, backward.backward_kernels)
    for module in (api, autograd):
        monkeypatch.setattr(module, "_forward", gpu_forward)
        monkeypatch.setattr(module, "_backward", gpu_backward)
    return launched


# training routes through torch.compile's training operators: what the forward keeps for the backward on each
TRAINED = {
    "training_kept_states": ("A", "P", "gamma", "gates", "states"),
    "training_checkpoints": ("A", "checkpoints", "P", "gamma", "gates"),
    "training_split": ("A", "D", "log_norms", "P", "gamma", "gates", "states"),
    "training_split_recompute": ("A", "checkpoints", "D", "log_norms", "P", "gamma", "gates"),
}


@pytest.mark.parametrize("name", TRAINED)
def test_training_operators_on_the_gpu_route(gpu_route, monkeypatch, name):
    """flash_qla.api's training operator pair (torch.compile's, with capture_dynamic_output_shape_ops) along a route
    of the GPU's host code: each saved output comes in the dims and dtype the operator's fake gives it (a compiled run
    binds the fake's sizes to it), kept where the route keeps it; the backward operator launches every kernel as its
    signature takes it, the route's kernels, and returns each gradient in its input's shape and dtype."""
    route = ROUTES[name]
    for planned, decision in route.planner.items():
        monkeypatch.setattr(forward, planned, lambda *args, decision=decision, **kwargs: decision)
    q, k, v, g, beta, scale, h0, cu = packed_inputs(
        route.seqlens, *route.heads, route.dtype, route.h0, route.beta_dtype
    )
    o, final_state, *saved = torch.ops.flash_qla.chunk_gated_delta_rule_training(
        q, k, v, g, beta, scale, h0, cu, False, True, route.options.get("keep_states")
    )  # fmt: skip
    assert set(gpu_route) == route.forward and o.shape == v.shape
    specs = api._saved_specs(q.dtype)
    assert [(x.dim(), x.dtype) for x in saved] == list(specs.values())
    assert tuple(kept for kept, x in zip(specs, saved) if x.numel()) == TRAINED[name]
    del gpu_route[:]
    grads = torch.ops.flash_qla.chunk_gated_delta_rule_training_backward(
        torch.zeros_like(o), torch.zeros_like(final_state), q, k, v, beta, h0, cu, scale, False, True, saved
    )  # fmt: skip
    assert set(gpu_route) == route.backward, gpu_route
    inputs = (q, k, v, beta, g, *(() if h0 is None else (h0,)))
    assert [(x.shape, x.dtype) for x in grads[: len(inputs)]] == [(x.shape, x.dtype) for x in inputs]


@pytest.mark.parametrize("B,layout", [(2, None), (2, "fused"), (1, "batch_stride"), (2, "offset")])
def test_training_through_the_public_api(gpu_route, B, layout):
    """chunk_gated_delta_rule over a dense batch (of two: one reshape packs each input), with a learnable initial
    state in the V-first layout and the final state in the loss, its inputs contiguous or views of other memory
    (gpu_cases.strided): autograd's forward and backward launch every kernel with arguments its signature takes
    (contiguous ones among them), and every gradient comes back in its input's shape."""
    T, Hqk, Hv, K = 300, 2, 8, 128
    x = make_inputs(B, T, Hqk, Hv, K, K)
    if layout is not None:
        x = {name: strided(t, layout) for name, t in x.items()}
    x = {name: t.detach().requires_grad_() for name, t in x.items()}
    h0 = torch.zeros(B, Hv, K, K, requires_grad=True)
    o, final_state = flash_qla.chunk_gated_delta_rule(
        **x, initial_state=h0, output_final_state=True, state_v_first=True
    )
    assert "kkt_solve" in gpu_route and o.shape == x["v"].shape and final_state.shape == h0.shape
    (o.float().sum() + final_state.sum()).backward()
    assert "chunk_grads" in gpu_route
    for t in (*x.values(), h0):
        assert t.grad is not None and t.grad.shape == t.shape


def test_the_low_level_entry_points_over_a_dense_batch(gpu_route):
    """chunk_gated_delta_rule_fwd with every output over a dense batch of two, then chunk_gated_delta_rule_bwd from
    its g_cum and A: each launch as its kernel's signature takes it; the outputs in the documented shapes."""
    B, T, Hqk, Hv, K = 2, 200, 4, 8, 128
    q, k = (torch.zeros(B, T, Hqk, K, dtype=torch.float16) for _ in range(2))
    v, do = (torch.zeros(B, T, Hv, K, dtype=torch.float16) for _ in range(2))
    g, beta = torch.zeros(B, T, Hv), torch.zeros(B, T, Hv, dtype=torch.float16)
    h0 = torch.zeros(B, Hv, K, K)
    g_cum, A, o, h, final_state = flash_qla.chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, initial_state=h0, output_h=True
    )
    assert (g_cum.shape, A.shape, o.shape) == ((B, T, Hv), (B, T, Hv, 64), v.shape)
    assert h.shape == (B * -(-T // 64), Hv, K, K) and final_state.shape == h0.shape
    grads = flash_qla.chunk_gated_delta_rule_bwd(q, k, v, g_cum, beta, A, do, dht=final_state, initial_state=h0)
    assert [x.shape for x in grads] == [q.shape, k.shape, v.shape, beta.shape, g.shape, h0.shape]
    assert "chunk_grads" in gpu_route


def test_current_stream_is_looked_up_once_per_stream_handle(monkeypatch):
    """launch.current_stream keeps torch.cuda.current_stream's Stream per (device, raw handle): the same object while
    the handle stays current, torch's lookup again for a stream not seen before (streams simulated on the CPU)."""
    from flash_qla.ops import launch

    handle, looked_up = [7], []

    def torch_current_stream(device=None):
        looked_up.append(handle[0])
        return ("stream", handle[0])

    monkeypatch.setattr(launch, "_current_streams", {})
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: handle[0], raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", torch_current_stream)
    device = torch.device("cuda", 0)
    first = launch.current_stream(device)
    assert launch.current_stream(device) is first and looked_up == [7]
    handle[0] = 9  # another stream made current
    assert launch.current_stream(device) == ("stream", 9) and looked_up == [7, 9]
    handle[0] = 7
    assert launch.current_stream(device) is first and looked_up == [7, 9]
    assert launch.current_stream(torch.device("cuda", 1)) == ("stream", 7) and looked_up == [7, 9, 7]  # per device


@pytest.mark.parametrize(
    "seqlens,heads,h0",
    [((28672, 4096), (16, 32), True), ((5000, 0, 70, 9000), (2, 8), False), ((9000,), (2, 8), True)],
    ids=["28672+4096", "varlen_empty", "one_long"],
)
def test_split_walk_walks_every_piece_after_the_composition(launched, monkeypatch, seqlens, heads, h0):
    """A split forward on the O path walks every piece (pieces of 64 chunks at 16/32 28672+4096, else 32:
    flash_qla.ops.forward.split_piece_chunks) in one launch after compose_maps, over the split's piece tables, from
    the start states compose_maps writes, each piece's end state into its row of the split's end states."""
    from flash_qla.ops import context_parallel

    walks, states = [], {}
    record = Launch.__call__

    def recording(self, *args):
        record(self, *args)
        if self.name == "fused_fwd_opath":  # the pieces' walk: (..., bounds, firsts, starts, o, ends, scale)
            walks.append((args[6].tolist(), args[8].data_ptr(), args[10].data_ptr()))

    signature = inspect.signature(context_parallel.split_walk)

    def split_walk(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        states.update(starts=bound.arguments["starts"].data_ptr(), ends=bound.arguments["ends"].data_ptr())
        return context_parallel.split_walk(*args, **kwargs)

    monkeypatch.setattr(Launch, "__call__", recording)
    monkeypatch.setattr(forward, "split_walk", split_walk)
    monkeypatch.setattr(forward, "splits_forward", lambda *args: True)
    monkeypatch.setattr(forward, "o_path_pays", lambda *args: True)
    every = forward.split_piece_chunks(seqlens, heads[1], 128, SM90)
    assert every == (64 if heads == (16, 32) else SM90.checkpoint_chunks)
    q, k, v, g, beta, scale, state, cu = packed_inputs(seqlens, *heads, torch.bfloat16, h0)
    forward.forward_kernels(q, k, v, g, beta, scale, state, cu, True, False, seqlens, True, False, None, True)
    slots = sum(seqlens) // SM90.chunk + len(seqlens)
    bounds = checkpoint_pieces(cu, SM90.chunk, slots, every)[0].tolist()
    assert walks == [(bounds, states["starts"], states["ends"])]
