"""Chunked WY form of the Gated Delta Rule (DESIGN.md §1) in PyTorch, chunks of CHUNK_SIZE tokens.

Everything that depends only on one chunk (the cumulated gate, A, w, u) is computed for all
chunks at once; only the state update loops over chunk positions, all sequences together.
The backward recomputes the forward and differentiates it (torch.func.vjp).
"""

import torch

CHUNK_SIZE = 64


class _ChunkLayout:
    """Maps tokens [B, T, H, ...] to chunks [N, NC, H, C, ...] and back.

    Without cu_seqlens every batch row is one sequence. Chunks restart at each sequence
    start; a sequence's chunks past its end, and the tail of its last chunk, are padding.
    """

    def __init__(self, B, T, cu_seqlens, device):
        if cu_seqlens is None:
            bounds = [(b * T, (b + 1) * T) for b in range(B)]
        else:
            cu = cu_seqlens.tolist()
            bounds = list(zip(cu[:-1], cu[1:]))
        bos, eos = (torch.tensor(x, dtype=torch.long, device=device).view(-1, 1) for x in zip(*bounds))
        num_chunks = max(-(-(e - b) // CHUNK_SIZE) for b, e in bounds)
        index = bos + torch.arange(num_chunks * CHUNK_SIZE, device=device)  # [N, NC * C]
        self.valid = (index < eos).view(len(bounds), num_chunks, CHUNK_SIZE)  # [N, NC, C]
        self.index = torch.where(self.valid, index.view_as(self.valid), B * T)  # padding reads row B * T
        self.shape = (B, T)

    def gather(self, x):
        """[B, T, H, ...] -> [N, NC, H, C, ...], padding zero."""
        flat = x.flatten(0, 1)
        padded = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        return padded[self.index].movedim(2, 3)

    def scatter(self, x):
        """[N, NC, H, C, ...] -> [B, T, H, ...], padding dropped."""
        x = x.movedim(3, 2)[self.valid]
        return x.view(*self.shape, *x.shape[1:])

    def last_index(self):
        """[N, NC]: position of each chunk's last token (0 for a chunk of padding only)."""
        return (self.valid.sum(-1) - 1).clamp(min=0)


def chunk_local_cumsum(g, cu_seqlens=None, reverse=False):
    """Inclusive cumsum of g [B, T, H] inside each chunk (reverse=True sums from the chunk's end)."""
    layout = _ChunkLayout(*g.shape[:2], cu_seqlens, g.device)
    x = layout.gather(g)  # [N, NC, H, C]
    x = x.flip(-1).cumsum(-1).flip(-1) if reverse else x.cumsum(-1)
    return layout.scatter(x)


def _forward_from_gcum(q, k, v, g_cum, beta, scale, initial_state, cu_seqlens, layout=None):
    """Differentiable core of the forward; inputs as for chunk_gated_delta_rule_fwd_ref, g cumulated; layout:
    cu_seqlens' _ChunkLayout when made already (it reads cu_seqlens' values).

    Returns A [B, T, Hv, C], o [B, T, Hv, V], h [NT, Hv, K, V] and the final state [N, Hv, K, V],
    all in the compute dtype.
    """
    B, T, Hqk, K = q.shape
    Hv, V = v.shape[-2:]
    dtype = torch.promote_types(q.dtype, torch.float32)
    layout = _ChunkLayout(B, T, cu_seqlens, q.device) if layout is None else layout
    group = Hv // Hqk
    q, k = (layout.gather(x.to(dtype).repeat_interleave(group, dim=2)) for x in (q, k))  # [N, NC, Hv, C, K]
    v, gamma, beta = (layout.gather(x.to(dtype)) for x in (v, g_cum, beta))  # [N, NC, Hv, C(, V)]

    # γ at each chunk's last token; padding takes it too, as if its g were 0.
    last = layout.last_index()[:, :, None, None].expand(*gamma.shape[:3], 1)
    gamma_last = gamma.gather(-1, last)  # [N, NC, Hv, 1]
    gamma = torch.where(layout.valid[:, :, None, :], gamma, gamma_last)

    # Γ_ij = exp(γ_i - γ_j) on and below the diagonal, 0 above (masked before exp: no overflow).
    lower = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=q.device).tril()
    Gamma = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()

    # A = (I + StrictLower(diag(beta) K K^T ⊙ Γ))^-1 diag(beta), all chunks at once.
    kkt = (beta[..., None] * (k @ k.transpose(-1, -2)) * Gamma).tril(-1)
    eye = torch.eye(CHUNK_SIZE, dtype=dtype, device=q.device)
    A = torch.linalg.solve_triangular(eye + kkt, torch.diag_embed(beta), upper=False, unitriangular=True)
    w = A @ (k * gamma.exp()[..., None])  # [N, NC, Hv, C, K]
    u = A @ v  # [N, NC, Hv, C, V]
    qk = (q @ k.transpose(-1, -2)) * Gamma  # Q K^T ⊙ Γ ⊙ Lower
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma_last - gamma).exp()[..., None]  # K ⊙ exp(γ_last - γ)

    N, num_chunks = layout.valid.shape[:2]
    S = q.new_zeros(N, Hv, K, V) if initial_state is None else initial_state.to(dtype)
    hs, outs = [], []
    for c in range(num_chunks):  # chunk c of every sequence; padding chunks leave S unchanged
        hs.append(S)
        v_new = u[:, c] - w[:, c] @ S
        outs.append(scale * (q_decayed[:, c] @ S + qk[:, c] @ v_new))
        S = gamma_last[:, c, :, :, None].exp() * S + k_to_end[:, c].transpose(-1, -2) @ v_new
    h = torch.stack(hs, dim=1)[layout.valid[:, :, 0]]  # chunks that hold tokens, in order
    return layout.scatter(A), layout.scatter(torch.stack(outs, dim=1)), h, S


def chunk_gated_delta_rule_fwd_ref(
    q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, output_final_state=True, output_h=False
):
    """Chunked forward; same contract as flash_qla.chunk_gated_delta_rule_fwd with K-first states.

    Computes in the wider of q's dtype and float32: g_cum, h and final_state come in that dtype
    (float32, or float64 for float64 inputs); A and o in q's dtype.

    Parameters
    ----------
    q, k : Tensor, [B, T, Hqk, K]
    v : Tensor, [B, T, Hv, V]
    g, beta : Tensor, [B, T, Hv]; g is the raw log-space gate.
    scale : float, optional
        Defaults to K ** -0.5.
    initial_state : Tensor, [N, Hv, K, V], optional
    cu_seqlens : Tensor, [N + 1], optional
        Packed sequence boundaries (B == 1); without it every batch row is one sequence.
    output_final_state, output_h : bool

    Returns
    -------
    g_cum : [B, T, Hv], chunk-local inclusive cumsum of g.
    A : [B, T, Hv, CHUNK_SIZE], row t holds row (t - chunk start) of its chunk's A.
    o : [B, T, Hv, V]
    h : [NT, Hv, K, V], state at the start of every chunk of every sequence, in order; or None.
    final_state : [N, Hv, K, V] or None.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g_cum = chunk_local_cumsum(g.to(torch.promote_types(q.dtype, torch.float32)), cu_seqlens)
    A, o, h, final_state = _forward_from_gcum(q, k, v, g_cum, beta, scale, initial_state, cu_seqlens)
    return (
        g_cum,
        A.to(q.dtype),
        o.to(q.dtype),
        h if output_h else None,
        final_state if output_final_state else None,
    )


def chunk_gated_delta_rule_bwd_ref(
    q, k, v, g_cum, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None
):
    """Backward by recomputing the chunked forward from g_cum and differentiating it (torch.func.vjp).

    Parameters are those of chunk_gated_delta_rule_fwd_ref, with the forward's g_cum in place of
    g, plus do [B, T, Hv, V] and dht [N, Hv, K, V] (optional), the gradients of o and final_state.

    Returns
    -------
    dq, dk, dv, dbeta, dg, dh0
        Each in its input's dtype; dg is the gradient w.r.t. the raw gate g (the reverse
        chunk-local cumsum of the gradient w.r.t. g_cum); dh0 is None without initial_state.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    layout = _ChunkLayout(*q.shape[:2], cu_seqlens, q.device)

    def outputs(q, k, v, g_cum, beta, *h0):
        _, o, _, final_state = _forward_from_gcum(
            q, k, v, g_cum, beta, scale, h0[0] if h0 else None, cu_seqlens, layout
        )  # fmt: skip
        return (o,) if dht is None else (o, final_state)

    # torch.func.vjp rather than autograd.grad: it differentiates inside a custom operator's run too, where autograd
    # does not record (flash_qla.api's training operators); the layout outside it, where a tensor's values can be read
    primals = (q, k, v, g_cum, beta, *(() if initial_state is None else (initial_state,)))
    results, vjp = torch.func.vjp(outputs, *(x.detach() for x in primals))
    cotangents = (do.to(results[0].dtype),) if dht is None else (do.to(results[0].dtype), dht.to(results[1].dtype))
    grads = vjp(cotangents)
    dq, dk, dv, dg_cum, dbeta = grads[:5]
    dg = chunk_local_cumsum(dg_cum, cu_seqlens, reverse=True)
    return dq, dk, dv, dbeta, dg, (grads[5] if initial_state is not None else None)
