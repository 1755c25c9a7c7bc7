"""Autograd for chunk_gated_delta_rule: the core forward and backward of flash_qla.dispatch, and what the forward
keeps for the backward (training_forward, training_backward: the autograd Function's and, under torch.compile,
flash_qla.api's training operators')."""

import torch

from flash_qla.dispatch import _backward, _forward


def training_forward(
    q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, seqlens, auto_cp, keep_states
):  # fmt: skip
    """o, final_state and `saved`, what the backward takes: (g_cum, A, checkpoints, D, log_norms, P, γ, gates,
    states), each None where this forward keeps none. A always; on the GPU kkt_solve's P, γ and gates and, where the
    planner keeps them, state checkpoints, the split walk's maps (D, log_norms) and the state at every chunk start;
    g_cum only where the backward reads it: with the kept P, γ and gates the GPU backward does not. Arguments as
    flash_qla.dispatch._forward takes them (packed, validated)."""
    g_cum, A, o, _, final_state, checkpoints, maps, chunk_terms = _forward(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, False, seqlens, auto_cp, True,
        keep_states,
    )  # fmt: skip
    P, gamma, gates, states = chunk_terms if chunk_terms is not None else (None, None, None, None)
    if chunk_terms is not None:
        g_cum = None
    D, log_norms = maps if maps is not None else (None, None)
    return o, final_state, (g_cum, A, checkpoints, D, log_norms, P, gamma, gates, states)


def training_backward(q, k, v, beta, initial_state, cu_seqlens, saved, do, dht, scale, seqlens, auto_cp):
    """dq, dk, dv, dbeta, dg (float32: g_cum's dtype), dh0 from training_forward's `saved`; do None where only
    final_state reached the loss, dht None where it did not."""
    g_cum, A, checkpoints, D, log_norms, P, gamma, gates, states = saved
    maps = (D, log_norms) if D is not None else None
    chunk_terms = (P, gamma, gates, states) if P is not None else None
    if do is None:  # only final_state reached the loss
        do = torch.zeros_like(v)
    if dht is not None:  # K-first in memory, whatever layout autograd hands it in (the PyTorch path rounds by it)
        dht = dht.contiguous()
    return _backward(
        q, k, v, g_cum, beta, A, do, dht, scale, initial_state, cu_seqlens, seqlens, checkpoints, maps, auto_cp,
        chunk_terms,
    )  # fmt: skip


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """o, final_state from packed, validated inputs (see flash_qla.dispatch); saves what training_forward keeps
    for the backward.

    An output whose gradient never arrives (final_state that the loss does not use, most often)
    gets none: no zero tensor is filled for it (set_materialize_grads(False)), and the backward
    runs as without dht (a zero dht would be filled, [N, Hv, K, V] in fp32, and read back)."""

    @staticmethod
    def forward(
        ctx, q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, seqlens, auto_cp, keep_states
    ):  # fmt: skip
        """seqlens, auto_cp, keep_states: as flash_qla.dispatch._forward takes them."""
        o, final_state, saved = training_forward(
            q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, seqlens, auto_cp, keep_states
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, beta, initial_state, cu_seqlens, *saved)
        ctx.set_materialize_grads(False)
        ctx.scale = scale
        ctx.g_dtype = g.dtype
        ctx.seqlens, ctx.auto_cp = seqlens, auto_cp  # the backward plans from the same lengths
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, initial_state, cu_seqlens, *saved = ctx.saved_tensors
        dq, dk, dv, dbeta, dg, dh0 = training_backward(
            q, k, v, beta, initial_state, cu_seqlens, saved, do, dht, ctx.scale, ctx.seqlens, ctx.auto_cp
        )  # fmt: skip
        return dq, dk, dv, dg.to(ctx.g_dtype), dbeta, None, dh0, None, None, None, None, None
