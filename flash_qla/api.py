"""Public entry points: validation, defaults, state layout, qk L2 norm and packing around the core.

Under torch.compile the host code is never traced: its plans (sequence lengths read from cu_seqlens, tensor
caches) would be guarded on and recompiled for every batch pattern, and the kernel launches cannot be traced.
chunk_gated_delta_rule is a custom operator of the caller's graph, which runs the eager call:
- without a gradient to compute, `torch.ops.flash_qla.chunk_gated_delta_rule` (_operator);
- with one, where `torch._dynamo.config.capture_dynamic_output_shape_ops` is on,
  `torch.ops.flash_qla.chunk_gated_delta_rule_training` (_training_operator) and its backward operator: its outputs
  include what the forward keeps for the backward (checkpoints, a split's maps, kept states), whose presence and
  sizes follow cu_seqlens' values, which the graph learns at run time (the flag lets it).
Else, and for the low-level entry points (h's size follows the values too), the call is a graph break (eager_only:
torch.compiler.disable, as FLA's own entry point) and runs eagerly between the caller's graphs."""

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from flash_qla import tensor_cache
from flash_qla.autograd import ChunkGatedDeltaRuleFunction, training_backward, training_forward
from flash_qla.dispatch import _backward, _forward
from flash_qla.tensor_cache import cache_last
from flash_qla.validation import check_backward_inputs, check_inputs, check_options, check_shapes, seqlens_of


def eager_only(fn):
    """fn, run eagerly under torch.compile: a compiled caller traces into the returned entry, finds
    is_compiling() true and breaks its graph at torch.compiler.disable(fn). An eager call takes fn
    straight: the disabled wrapper's own work (it swaps the frame evaluation callback in and out) is
    ~0.45 µs of host time a call on the CPU machine, the entry's check ~0.1."""
    disabled = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return entry


def _default_scale(scale, q):
    """K ** -0.5 unless given (as a Python float)."""
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def _pack(*tensors):
    """[B, T, ...] -> [1, B * T, ...]: dense batch rows become packed sequences (validated inputs:
    one B for all)."""
    if tensors[0].shape[0] == 1:
        return tensors
    return [x.reshape(1, -1, *x.shape[2:]) for x in tensors]  # one view (a copy only where strides need one)


def _unpack(x, B, T):
    """[1, B * T, ...] -> [B, T, ...]."""
    return x if B == 1 else x.reshape(B, T, *x.shape[2:])


def _packed_cu_seqlens(cu_seqlens, q):
    """int32 [N + 1] boundaries; a dense batch is B sequences of length T."""
    if cu_seqlens is None:
        B, T = q.shape[:2]
        stream = tensor_cache.stream_key(q)
        if stream is None:  # capturing a CUDA graph: a cached tensor would hold no values yet
            return _dense_cu_seqlens.__wrapped__(B, T, q.device, 0)
        return _dense_cu_seqlens(B, T, q.device, stream)
    return cu_seqlens if cu_seqlens.dtype == torch.int32 else _as_int32(cu_seqlens)


@cache_last(device_result=True)
def _as_int32(cu_seqlens):
    """int64 boundaries (FLA passes its own) as int32, converted once per tensor: the layers of a step then
    share the converted tensor, and with it the chunk tables derived from it (flash_qla.ops.chunks)."""
    return cu_seqlens.to(torch.int32)


@functools.lru_cache(maxsize=64)
def _dense_cu_seqlens(B, T, device, stream):
    """[0, T, 2T, ..., BT] int32, built once per (B, T, device) and stream (tensor_cache.stream_key: a key only).

    The layers of a step and the steps of a run share it, and with it the chunk table derived
    from it (flash_qla.ops.chunks). Nothing writes to it. Per stream, as every cached device result here
    (tensor_cache.cache_last): made on the stream that reads it, its values are there before any kernel
    reads them, and when it is dropped the allocator reuses its memory in that stream's order. Built as a
    normal tensor even under torch.inference_mode: a later call with a gradient saves it for the backward.
    """
    with torch.inference_mode(False):
        return torch.arange(B + 1, dtype=torch.int32, device=device) * T


def _state_in(state, state_v_first, q):
    """User layout -> [N, Hv, K, V] in float32 (float64 for float64 inputs, PyTorch path only)."""
    if state is None:
        return None
    return (state.transpose(-1, -2) if state_v_first else state).to(torch.promote_types(q.dtype, torch.float32))


def _state_out(state, state_v_first):
    """[N, Hv, K, V] -> user layout."""
    if state is None or not state_v_first:
        return state
    return state.transpose(-1, -2)


def _differentiable(q, k, v, g, beta, initial_state):
    """Whether a call builds an autograd node: grad mode on and an input that requires a gradient."""
    return torch.is_grad_enabled() and (
        q.requires_grad
        or k.requires_grad
        or v.requires_grad
        or g.requires_grad
        or beta.requires_grad
        or (initial_state is not None and initial_state.requires_grad)
    )


def _l2norm(x):
    """L2-normalise over the last dim in float32 (float64 stays float64)."""
    return F.normalize(x.to(torch.promote_types(x.dtype, torch.float32)), dim=-1, eps=1e-6).to(x.dtype)


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    state_v_first=False,
    auto_cp=True,
    head_first=False,
    keep_states=None,
):
    """Gated Delta Rule over whole sequences, differentiable.

    Per sequence and value head, the state S [K, V] evolves token by token:
    ``S = exp(g_t) S``; ``S += k_t (beta_t (v_t - S^T k_t))^T``; ``o_t = S^T (scale q_t)``.

    Parameters
    ----------
    q, k : Tensor, [B, T, Hqk, K]
        bfloat16 or float16; float32 and float64 on the PyTorch path (CPU tensors) only, a CUDA
        float32 q raises. k has q's dtype.
    v : Tensor, [B, T, Hv, V]
        q's dtype. ``Hv % Hqk == 0``; value head h reads qk head ``h // (Hv // Hqk)``.
    g : Tensor, [B, T, Hv]
        Log-space decay per token (<= 0 for a decay), any float dtype, used in float32. Finite, as
        every input (not checked: see the README's Usage on what the GPU kernels assume).
    beta : Tensor, [B, T, Hv]
        Any float dtype.
    scale : float, optional
        Multiplies q (any real number but a bool, e.g. a NumPy float); defaults to ``K ** -0.5``.
    initial_state : Tensor, [N, Hv, K, V] ([N, Hv, V, K] if state_v_first), optional
        Any float dtype, used in float32. Zeros when omitted.
    output_final_state : bool
        Return the state after each sequence's last token.
    use_qk_l2norm_in_kernel : bool
        L2-normalise q and k over K first (in float32, eps 1e-6; its backward is included).
    cu_seqlens : Tensor, [N + 1], int32 or int64, optional
        Boundaries of N sequences packed along T, which requires B == 1; zero-length
        sequences are allowed (their state passes through). Read once on the host for
        validation (a device sync on GPU). Without it every batch row is one sequence, N = B.
        The lengths and chunk tables are kept per tensor and version: refill a kept tensor in
        place only with PyTorch ops (they count as edits), not with torch.distributed collectives
        or kernels writing through its pointer (pass a new tensor then).
    state_v_first : bool
        States are laid out [N, Hv, V, K] instead of [N, Hv, K, V].
    auto_cp : bool
        Let the planner split long sequences where that pays (GPU only). The forward walks
        long sequences over few heads (one sequence of about 8192 tokens or more at up to 32
        v-heads where its model says the pieces fill the GPU better, flash_qla.ops.forward.splits_forward,
        or a few such sequences over few heads; with a gradient to compute also where only its
        backward gains, e.g. 16/48 at 28672+4096 tokens, but not where the forward keeps every state
        for it and fills the GPU's SMs without splitting, e.g. 16/32 at 8192) in pieces of 32 chunks (64 for o
        alone where that costs the last walk no wave, flash_qla.ops.forward.split_piece_chunks) that run in
        parallel, each from its exact start state
        (DESIGN.md §1's exact route: o and final_state agree with the unsplit walk within
        rounding; the walks that find the start states leave out the chunks whose effect the gates
        decay below 2^-24 of a state, flash_qla.ops.context_parallel). The planner assumes gates
        like a model's, most heads decaying; where every head's gate barely decays (g ≈ −1e-3
        everywhere) those walks leave nothing out and a split forward can take 1.2-1.3x the
        unsplit one: auto_cp=False walks whole (benchmark/NOTES.md v86). With a gradient to compute,
        the GPU forward keeps the state every 32 chunks (fp32, at most (T // 64 + N) // 32 + N + 1 states a call,
        saved for the backward) when long sequences over few heads would leave the backward's
        state recompute with too few blocks (and whenever the forward split: the pieces' start states are those states),
        and the backward restarts it from them in parallel pieces. Where the forward splits its
        sequences, the backward walk of the gradients splits them too (the same maps, walked
        backward in time).
        The gradients are the same either way, up to rounding where the walks split.
    head_first : bool
        Must be False: [B, H, T, D] inputs are not supported.
    keep_states : bool or None
        With a gradient to compute on the GPU, whether the forward keeps the state at every chunk
        start for the backward (in q's dtype, [T / 64 + N, Hv, K, V]: 512 bytes a token and
        v-head in bf16, 4x the A kept anyway) instead of the backward recomputing them: memory
        between the forward and the backward for time. None (the default) keeps them where they
        take at most 256 MiB (flash_qla.ops.forward.KEEP_STATES_MAX_BYTES; in bf16 or fp16 every
        call of 8192 tokens or fewer at up to 64 v-heads, 32768 at up to 16) and recomputes them
        beyond, where they add up over a model's layers (16/32 at 32768 tokens: 512 MiB); True
        keeps them always, False never. Measured on the H200 (benchmark/NOTES.md v52, v63), a
        training step kept against recomputed: 16/48 over 1 x 2048 tokens 289.7 -> 257.2 µs,
        16/64 1 x 2048 334.0 -> 305.8, 2/8 8 x 4096 632.7 -> 586.0, 8/32 1 x 32768 2.642 ->
        2.522 ms; what the forward keeps for the backward at 16/32 over 8 x 4096 tokens 268 ->
        788 MiB, one call's peak unchanged (the backward's recompute allocates the states
        anyway). The gradients are the same either way: the forward walks the states with the
        recompute's arithmetic (bitwise equal in every case tested), except where the choice moves
        the split (auto_cp: a forward keeping its states walks whole where the whole walk keeps
        32 chains busy, e.g. 16/32 at 8192 tokens), which agrees within rounding. Ignored without
        a gradient to compute and on the PyTorch path.

    Returns
    -------
    o : Tensor, [B, T, Hv, V], dtype of q.
    final_state : Tensor, [N, Hv, K, V] ([N, Hv, V, K] if state_v_first), float32
        (float64 for float64 inputs); None unless output_final_state.

    Differentiable in q, k, v, g, beta and initial_state; when none of them requires a
    gradient (or grad mode is off) no autograd node is built. Under torch.compile the call is
    one operator of the caller's graph without a gradient to compute, and with one where
    torch._dynamo.config.capture_dynamic_output_shape_ops is on; else a graph break (the module docstring).
    """
    if torch.compiler.is_compiling():  # torch.compile traces the caller
        return _traced(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
            state_v_first, auto_cp, head_first, keep_states,
        )  # fmt: skip
    check_options(head_first)
    seqlens = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    B, T = q.shape[:2]
    args = (
        *_pack(q, k, v, g, beta),
        _default_scale(scale, q),
        _state_in(initial_state, state_v_first, q),
        _packed_cu_seqlens(cu_seqlens, q),
        output_final_state,
    )
    if _differentiable(q, k, v, g, beta, initial_state):
        o, final_state = ChunkGatedDeltaRuleFunction.apply(*args, seqlens, auto_cp, keep_states)
    else:  # nothing to differentiate: no autograd node, nothing saved for a backward, A in scratch
        _, _, o, _, final_state, _, _, _ = _forward(*args, False, seqlens, auto_cp, scratch=True)
    return _unpack(o, B, T), _state_out(final_state, state_v_first)


_eager_call = torch.compiler.disable(chunk_gated_delta_rule)  # under torch.compile: a graph break, then the call


def _traced(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, state_v_first,
    auto_cp, head_first, keep_states,
):  # fmt: skip
    """chunk_gated_delta_rule while torch.compile traces its caller: one operator where the arguments are what the
    operators' schemas take (tensors, a Python scale, bools; keep_states None or a bool), _operator without a gradient
    to compute, with one _training_operator (after the L2 norm, which autograd differentiates) where the graph may
    hold outputs whose sizes follow input values (its saved ones: torch._dynamo.config.capture_dynamic_output_shape_ops;
    without it dynamo would break the graph at the operator and run it, for ~75 µs more host time than the eager
    call's autograd Function on the CPU machine: README). Else the eager call (a graph break), whose validation then
    names whatever argument is wrong."""
    tensors = (q, k, v, g, beta, *(x for x in (initial_state, cu_seqlens) if x is not None))
    differentiable = _differentiable(q, k, v, g, beta, initial_state)
    if not (
        all(isinstance(x, torch.Tensor) for x in tensors)
        and (scale is None or type(scale) in (int, float))
        and all(type(flag) is bool for flag in (use_qk_l2norm_in_kernel, state_v_first, auto_cp))
        and (keep_states is None or type(keep_states) is bool)
        and (not differentiable or torch._dynamo.config.capture_dynamic_output_shape_ops)
    ):
        return _eager_call(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
            state_v_first, auto_cp, head_first, keep_states,
        )  # fmt: skip
    check_options(head_first)
    if not differentiable:
        o, final_state = _operator(
            q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, state_v_first, auto_cp
        )
    else:
        if use_qk_l2norm_in_kernel and q.is_floating_point() and k.is_floating_point():  # else the fake's error
            q, k = _l2norm(q), _l2norm(k)
        o, final_state, *_ = _training_operator(
            q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, auto_cp, keep_states
        )
    return o, final_state if output_final_state else None


# cudagraph_unsafe: the call's plan and chunk tables follow cu_seqlens' values, which a CUDA graph's replay would not
# read again, so Inductor's CUDA graphs (mode="reduce-overhead") leave the operator out
@torch.library.custom_op("flash_qla::chunk_gated_delta_rule", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _operator(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float],
    initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    use_qk_l2norm_in_kernel: bool,
    state_v_first: bool,
    auto_cp: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_gated_delta_rule without a gradient, as one operator of a torch.compile graph: o and final_state of the
    eager call (final_state always: the kernels write it either way)."""
    o, final_state = chunk_gated_delta_rule(
        q, k, v, g, beta, scale, initial_state, True, use_qk_l2norm_in_kernel, cu_seqlens, state_v_first, auto_cp
    )
    # in the strides the fake gives them, as the kernels write them: o contiguous, final_state K-first in memory (a
    # transposed view with state_v_first; the PyTorch path's follows initial_state's strides)
    return o.contiguous(), _state_out(_state_out(final_state, state_v_first).contiguous(), state_v_first)


@_operator.register_fake
def _operator_outputs(
    q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, state_v_first, auto_cp
):  # fmt: skip
    """The operator's outputs as torch.compile traces it (no values): the checks that need none, then o [B, T, Hv, V]
    in q's dtype and final_state [N, Hv, K, V] (a transposed view with state_v_first, as the call returns it)."""
    check_shapes(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, values=False)
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state = q.new_empty((N, v.shape[2], q.shape[3], v.shape[3]), dtype=torch.promote_types(q.dtype, torch.float32))
    return v.new_empty(v.shape), _state_out(state, state_v_first)


def _saved_specs(dtype):
    """{name: (dims, dtype)} of what _training_operator returns beyond o and final_state, training_forward's `saved` in
    its order, for q's dtype. Whether the forward keeps one, and its shape, follow the device (the PyTorch path keeps
    g_cum and A, the GPU the others, checkpoints, D and states where its planner keeps them) and cu_seqlens' values
    (checkpoints, D): one not kept is an empty tensor of its dims and dtype, and the fake gives every dim a size it
    does not know while tracing (an unbacked SymInt), which the run then binds."""
    f32, state = torch.float32, torch.promote_types(dtype, torch.float32)
    return {
        "g_cum": (3, state), "A": (4, dtype), "checkpoints": (4, f32), "D": (4, torch.bfloat16), "log_norms": (2, f32),
        "P": (4, dtype), "gamma": (3, f32), "gates": (4, f32), "states": (4, dtype),
    }  # fmt: skip


@torch.library.custom_op(
    "flash_qla::chunk_gated_delta_rule_training", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)  # fmt: skip
def _training_operator(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float],
    initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    state_v_first: bool,
    auto_cp: bool,
    keep_states: Optional[bool],
) -> tuple[(torch.Tensor,) * 11]:  # o, final_state and the nine of _saved_specs
    """chunk_gated_delta_rule with a gradient to compute (q and k L2-normalised before where asked) as one operator of
    a torch.compile graph, differentiable (_training_gradients): o, final_state (always: the kernels write it either
    way), then what the backward takes (_saved_specs), from the eager call's forward."""
    seqlens = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
    B, T = q.shape[:2]
    o, final_state, saved = training_forward(
        *_pack(q, k, v, g, beta), _default_scale(scale, q), _state_in(initial_state, state_v_first, q),
        _packed_cu_seqlens(cu_seqlens, q), True, seqlens, auto_cp, keep_states,
    )  # fmt: skip
    saved = [
        q.new_empty((0,) * dims, dtype=dtype) if x is None else x.contiguous()
        for x, (dims, dtype) in zip(saved, _saved_specs(q.dtype).values())
    ]
    return _unpack(o, B, T).contiguous(), _state_out(final_state.contiguous(), state_v_first), *saved


@_training_operator.register_fake
def _training_outputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, auto_cp, keep_states):
    """o and final_state as _operator's fake gives them, then the saved outputs: dims and dtypes, sizes unknown."""
    o, final_state = _operator_outputs(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, False, state_v_first, auto_cp
    )  # fmt: skip
    ctx = torch.library.get_ctx()
    saved = [
        q.new_empty([ctx.new_dynamic_size() for _ in range(dims)], dtype=dtype)
        for dims, dtype in _saved_specs(q.dtype).values()
    ]
    return o, final_state, *saved


def _keep_for_gradients(ctx, inputs, output):
    """_training_operator's autograd context: its inputs and saved outputs (no gradient flows into those), and the
    dtypes the gradients of g and initial_state come back in."""
    q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, auto_cp, _ = inputs
    saved = output[2:]
    ctx.save_for_backward(q, k, v, beta, initial_state, cu_seqlens, *saved)
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)  # as ChunkGatedDeltaRuleFunction: an unused output's gradient stays None
    ctx.scale, ctx.state_v_first, ctx.auto_cp = scale, state_v_first, auto_cp
    ctx.g_dtype = g.dtype
    ctx.state_dtype = None if initial_state is None else initial_state.dtype


def _training_gradients(ctx, do, dht, *_):
    """Gradients of q, k, v, g, beta and initial_state (None for the options), by _training_backward_operator."""
    q, k, v, beta, initial_state, cu_seqlens, *saved = ctx.saved_tensors
    dq, dk, dv, dbeta, dg, dh0 = _training_backward_operator(
        do, dht, q, k, v, beta, initial_state, cu_seqlens, ctx.scale, ctx.state_v_first, ctx.auto_cp, saved
    )  # fmt: skip
    dh0 = None if initial_state is None else dh0.to(ctx.state_dtype)
    return dq, dk, dv, dg.to(ctx.g_dtype), dbeta, None, dh0, None, None, None, None


@torch.library.custom_op(
    "flash_qla::chunk_gated_delta_rule_training_backward", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)  # fmt: skip
def _training_backward_operator(
    do: Optional[torch.Tensor],
    dht: Optional[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    scale: Optional[float],
    state_v_first: bool,
    auto_cp: bool,
    saved: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of _training_operator from its saved outputs: dq, dk, dv, dbeta in their inputs' shapes and
    dtypes, dg [B, T, Hv] and dh0 (initial_state's layout; empty without one) in float32 (float64 for float64
    inputs). do None: only final_state reached the loss; dht None: final_state did not."""
    B, T = q.shape[:2]
    seqlens = (T,) * B if cu_seqlens is None else seqlens_of(cu_seqlens, T)  # validated by the forward, remembered
    q_, k_, v_, beta_ = _pack(q, k, v, beta)
    grads = training_backward(
        q_, k_, v_, beta_, _state_in(initial_state, state_v_first, q), _packed_cu_seqlens(cu_seqlens, q),
        [None if x.numel() == 0 else x for x in saved], None if do is None else _pack(do)[0],
        _state_in(dht, state_v_first, q), _default_scale(scale, q), seqlens, auto_cp,
    )  # fmt: skip
    *grads, dh0 = grads
    dh0 = q.new_empty((0,) * 4, dtype=torch.promote_types(q.dtype, torch.float32)) if dh0 is None else dh0.contiguous()
    return (*(_unpack(x, B, T).contiguous() for x in grads), _state_out(dh0, state_v_first))


@_training_backward_operator.register_fake
def _training_backward_outputs(do, dht, q, k, v, beta, initial_state, cu_seqlens, scale, state_v_first, auto_cp, saved):
    """The gradients' shapes and dtypes (no values)."""
    state = torch.promote_types(q.dtype, torch.float32)
    if initial_state is None:
        dh0 = q.new_empty((0,) * 4, dtype=state)
    else:
        dh0 = _state_out(q.new_empty((*initial_state.shape[:2], q.shape[3], v.shape[3]), dtype=state), state_v_first)
    grads = (x.new_empty(x.shape) for x in (q, k, v, beta))
    return (*grads, q.new_empty(beta.shape, dtype=state), dh0)


_training_operator.register_autograd(_training_gradients, setup_context=_keep_for_gradients)


@eager_only
def chunk_gated_delta_rule_fwd(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    output_final_state=True,
    output_h=False,
    state_v_first=False,
    auto_cp=True,
):
    """Forward of the chunked Gated Delta Rule, returning what the backward needs. Not differentiable.

    Sequences are split into chunks of 64 tokens, restarting at each sequence start (the
    last chunk of a sequence may be shorter); NT is the number of chunks of all sequences.

    Parameters
    ----------
    q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first
        As for chunk_gated_delta_rule; g is the raw gate.
    output_final_state : bool
        Return final_state.
    output_h : bool
        Return h.
    auto_cp : bool
        As for chunk_gated_delta_rule: long sequences over few heads walk in pieces (the
        same results within rounding).

    Returns
    -------
    g_cum : Tensor, [B, T, Hv], float32
        Chunk-local inclusive cumsum of g.
    A : Tensor, [B, T, Hv, 64], dtype of q
        Row t holds row ``t - chunk_start`` of its chunk's
        ``(I + StrictLower(diag(beta) K K^T ⊙ Γ))^-1 diag(beta)``, ``Γ_ij = exp(γ_i - γ_j)``,
        γ the chunk's g_cum; columns count from the chunk start; entries above the diagonal
        and past the chunk's last token are 0.
    o : Tensor, [B, T, Hv, V], dtype of q.
    h : Tensor, [NT, Hv, K, V], float32, or None
        The state at the start of each chunk, chunks of all sequences in order (a dense
        batch has B * ceil(T / 64)); always K-first. None unless output_h.
    final_state : Tensor, [N, Hv, K, V] ([N, Hv, V, K] if state_v_first), float32, or None
        None unless output_final_state.

    float32 outputs are float64 for float64 inputs (PyTorch path only).
    """
    seqlens = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
    B, T = q.shape[:2]
    with torch.no_grad():
        g_cum, A, o, h, final_state, _, _, _ = _forward(
            *_pack(q, k, v, g, beta),
            _default_scale(scale, q),
            _state_in(initial_state, state_v_first, q),
            _packed_cu_seqlens(cu_seqlens, q),
            output_final_state,
            output_h,
            seqlens,
            auto_cp,
        )
    return _unpack(g_cum, B, T), _unpack(A, B, T), _unpack(o, B, T), h, _state_out(final_state, state_v_first)


@eager_only
def chunk_gated_delta_rule_bwd(
    q,
    k,
    v,
    g,
    beta,
    A,
    do,
    dht=None,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    state_v_first=False,
    auto_cp=True,
):
    """Backward of chunk_gated_delta_rule_fwd.

    Parameters
    ----------
    q, k, v, beta, scale, initial_state, cu_seqlens, state_v_first
        As given to chunk_gated_delta_rule_fwd.
    g : Tensor, [B, T, Hv]
        The g_cum that chunk_gated_delta_rule_fwd returned (not the raw gate).
    A : Tensor, [B, T, Hv, 64]
        The A that chunk_gated_delta_rule_fwd returned. The PyTorch path recomputes the
        forward instead and ignores it.
    do : Tensor, [B, T, Hv, V]
        Gradient of o.
    dht : Tensor, [N, Hv, K, V] ([N, Hv, V, K] if state_v_first), optional
        Gradient of final_state; None counts as zero.
    auto_cp : bool
        The backward walk of long sequences over few heads runs in pieces where forming the
        pieces' maps here pays, a narrower margin than chunk_gated_delta_rule_fwd's (one sequence:
        2/8 from 8705 tokens, 4/16 at 12865-16384, 25345-32768 and 37761-49152 tokens and from 50177, 16/32 never;
        flash_qla.ops.forward.splits_backward; the same gradients within rounding; the lengths are
        those validation read from cu_seqlens: no second sync).

    Returns
    -------
    dq, dk, dv, dbeta : Tensor
        Shapes and dtypes of q, k, v, beta.
    dg : Tensor, [B, T, Hv], dtype of g
        Gradient w.r.t. the raw gate: the reverse chunk-local cumsum of the gradient w.r.t. g_cum.
    dh0 : Tensor, layout of initial_state, float32 (float64 for float64 inputs), or None
        None when initial_state is None.
    """
    seqlens = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
    check_backward_inputs(q, v, A, do, dht, cu_seqlens, state_v_first)
    B, T = q.shape[:2]
    dq, dk, dv, dbeta, dg, dh0 = _backward(
        *_pack(q, k, v, g, beta, A, do),
        _state_in(dht, state_v_first, q),
        _default_scale(scale, q),
        _state_in(initial_state, state_v_first, q),
        _packed_cu_seqlens(cu_seqlens, q),
        seqlens,
        auto_cp=auto_cp,
    )
    return (*(_unpack(x, B, T) for x in (dq, dk, dv, dbeta, dg)), _state_out(dh0, state_v_first))
