"""Autograd for chunk_gated_delta_rule: the core forward and backward of flash_qla.dispatch."""

import torch

from flash_qla.dispatch import _backward, _forward


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """o, final_state from packed, validated inputs (see flash_qla.dispatch); saves A and, on the
    GPU, kkt_solve's P, γ and gates (and, where the planner keeps them, state checkpoints and the
    split walk's maps; with keep_states, the state at every chunk start) for the backward. g_cum
    is saved only where the backward reads it: with the kept P, γ and gates the GPU backward does
    not.

    An output whose gradient never arrives (final_state that the loss does not use, most often)
    gets none: no zero tensor is filled for it (set_materialize_grads(False)), and the backward
    runs as without dht (a zero dht would be filled, [N, Hv, K, V] in fp32, and read back)."""

    @staticmethod
    def forward(
        ctx, q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, seqlens, auto_cp, keep_states
    ):  # fmt: skip
        """seqlens, auto_cp, keep_states: as flash_qla.dispatch._forward takes them."""
        g_cum, A, o, _, final_state, checkpoints, maps, chunk_terms = _forward(
            q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, False, seqlens, auto_cp, True,
            keep_states,
        )  # fmt: skip
        P, gamma, gates, states = chunk_terms if chunk_terms is not None else (None, None, None, None)
        if chunk_terms is not None:
            g_cum = None
        D, log_norms = maps if maps is not None else (None, None)
        ctx.save_for_backward(
            q, k, v, g_cum, beta, A, initial_state, cu_seqlens, checkpoints, D, log_norms, P, gamma, gates, states
        )  # fmt: skip
        ctx.set_materialize_grads(False)
        ctx.scale = scale
        ctx.g_dtype = g.dtype
        ctx.seqlens, ctx.auto_cp = seqlens, auto_cp  # the backward plans from the same lengths
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g_cum, beta, A, initial_state, cu_seqlens, checkpoints, D, log_norms, P, gamma, gates, states = (
            ctx.saved_tensors
        )
        maps = (D, log_norms) if D is not None else None
        chunk_terms = (P, gamma, gates, states) if P is not None else None
        if do is None:  # only final_state reached the loss
            do = torch.zeros_like(v)
        dq, dk, dv, dbeta, dg, dh0 = _backward(
            q, k, v, g_cum, beta, A, do, dht, ctx.scale, initial_state, cu_seqlens, ctx.seqlens, checkpoints, maps,
            ctx.auto_cp, chunk_terms,
        )  # fmt: skip
        return dq, dk, dv, dg.to(ctx.g_dtype), dbeta, None, dh0, None, None, None, None, None
