"""Autograd for chunk_gated_delta_rule: the core forward and backward of flash_qla.dispatch."""

import torch

from flash_qla.dispatch import _backward, _forward


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """o, final_state from packed, validated inputs (see flash_qla.dispatch); saves A (and, where
    the planner keeps them, state checkpoints and the split walk's maps) for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, seqlens, auto_cp):
        """seqlens, auto_cp: as flash_qla.dispatch._forward takes them."""
        g_cum, A, o, _, final_state, checkpoints, maps = _forward(
            q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, False, seqlens, auto_cp, True
        )
        ctx.save_for_backward(q, k, v, g_cum, beta, A, initial_state, cu_seqlens, checkpoints, maps)
        ctx.scale = scale
        ctx.g_dtype = g.dtype
        ctx.seqlens, ctx.auto_cp = seqlens, auto_cp  # the backward plans from the same lengths
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g_cum, beta, A, initial_state, cu_seqlens, checkpoints, maps = ctx.saved_tensors
        dq, dk, dv, dbeta, dg, dh0 = _backward(
            q, k, v, g_cum, beta, A, do, dht, ctx.scale, initial_state, cu_seqlens, ctx.seqlens, checkpoints, maps,
            ctx.auto_cp,
        )  # fmt: skip
        return dq, dk, dv, dg.to(ctx.g_dtype), dbeta, None, dh0, None, None, None, None
