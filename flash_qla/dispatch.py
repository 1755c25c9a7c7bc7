"""The one place that picks the implementation of the core forward and backward.

Both functions take validated, packed inputs: q, k [1, T, Hqk, K]; v [1, T, Hv, V];
g, beta [1, T, Hv]; cu_seqlens [N + 1] int32 (dense batches arrive as N = B sequences of
length T); scale a float; states K-first [N, Hv, K, V] in float32 (float64 when q is
float64), or None.

CPU tensors run the PyTorch reference. CUDA tensors run the TileLang kernels of the
device's architecture (flash_qla.arch), forward and backward. CUDA inputs the kernels
cannot take raise (a ValueError naming q, from the kernels' plans: flash_qla.ops.forward.check_kernel_inputs),
rather than silently taking a path hundreds of times slower.
"""

import functools

from flash_qla.reference.chunked import chunk_gated_delta_rule_bwd_ref, chunk_gated_delta_rule_fwd_ref


@functools.cache
def _gpu_forward():
    """flash_qla.ops.forward, imported at the first GPU call (CPU tensors never load TileLang); once:
    an import statement costs ~1 µs of host time on every call."""
    from flash_qla.ops import forward

    return forward


@functools.cache
def _gpu_backward():
    """flash_qla.ops.backward, as _gpu_forward."""
    from flash_qla.ops import backward

    return backward


def _forward(
    q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, output_h, seqlens, auto_cp=False,
    training=False, keep_states=False, scratch=False,
):  # fmt: skip
    """Core forward; g is the raw gate. seqlens: the sequence lengths (host ints, as validation read
    them from cu_seqlens: no sync here). auto_cp: the planner may walk long sequences in pieces
    and, when training (a backward will follow), keep state checkpoints for it where they pay.
    keep_states (training, GPU): keep the state at every chunk start for the backward, which then
    does not recompute them (chunk_terms); None: where they are small (flash_qla.ops.forward.keeps_states).
    scratch (GPU; not with training or output_h): the call returns o and final_state alone, and
    kkt_solve's outputs live in scratch buffers that the next such call of the same shapes on the
    stream reuses (flash_qla.ops.buffers.scratch): g_cum and A are then None.

    Returns
    -------
    g_cum : [1, T, Hv] float32, chunk-local inclusive cumsum of g.
    A : [1, T, Hv, 64], dtype of q (see chunk_gated_delta_rule_fwd).
    o : [1, T, Hv, V], dtype of q.
    h : [NT, Hv, K, V] float32, state at the start of each chunk; None unless output_h.
    final_state : [N, Hv, K, V] float32; None unless output_final_state.
    checkpoints : for _backward, or None: always None unless training with auto_cp, and on the
        PyTorch path. The state every profile.checkpoint_chunks chunks by checkpoint row
        (flash_qla.ops.forward.keeps_checkpoints, checkpoint_rows) or, when the walk split (maps
        given), every piece's start state in the pieces' order (flash_qla.ops.context_parallel).
    maps : for _backward, or None: when a training forward walked its sequence in pieces, the
        pieces' maps D and kkt_solve's bounds log_norms (flash_qla.ops.context_parallel), which the
        backward walk's split reuses.
    chunk_terms : for _backward, or None: when training on the GPU, kkt_solve's P, γ and gates
        (flash_qla.ops.kkt_solve) and, with keep_states, the states at every chunk start (else
        None), which the backward then takes instead of computing them again.
    """
    if q.is_cuda:
        return _gpu_forward().forward_kernels(
            q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, output_h, seqlens, auto_cp,
            training, keep_states, scratch,
        )  # fmt: skip
    outputs = chunk_gated_delta_rule_fwd_ref(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, output_h
    )
    return (*outputs, None, None, None)


def _backward(
    q, k, v, g_cum, beta, A, do, dht, scale, initial_state, cu_seqlens, seqlens, checkpoints=None, maps=None,
    auto_cp=False, chunk_terms=None,
):  # fmt: skip
    """Core backward; g_cum, A, checkpoints, maps and chunk_terms are what _forward returned (g_cum
    may be None when chunk_terms is given: the GPU backward then does not read it), do [1, T, Hv, V],
    dht [N, Hv, K, V] or None; seqlens, auto_cp as for _forward: the planner may then walk long
    sequences in pieces where the forward would (after a forward that split, maps given, the
    backward walk splits the same pieces).

    Returns
    -------
    dq, dk, dv, dbeta, dg, dh0
        Each in its input's dtype; dg w.r.t. the raw gate g (the reverse chunk-local cumsum of
        the gradient w.r.t. g_cum), in g_cum's dtype (float32 without g_cum); dh0 None without
        initial_state.
        The kernels use A; the reference recomputes the forward and ignores it.
    """
    if q.is_cuda:
        return _gpu_backward().backward_kernels(
            q, k, v, g_cum, beta, A, do, dht, scale, initial_state, cu_seqlens, seqlens, checkpoints, maps, auto_cp,
            chunk_terms,
        )  # fmt: skip
    return chunk_gated_delta_rule_bwd_ref(q, k, v, g_cum, beta, do, dht, scale, initial_state, cu_seqlens)
