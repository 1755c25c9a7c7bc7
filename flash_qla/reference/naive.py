"""Token-by-token Gated Delta Rule recurrence (DESIGN.md §1): the oracle every test compares against."""

import torch


def naive_recurrent_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, output_final_state=True
):
    """Run the recurrence one token at a time.

    Computes in the wider of q's dtype and float32; give float64 inputs for an exact oracle.
    Differentiable through plain autograd.

    Parameters
    ----------
    q, k : Tensor, [B, T, Hqk, K]
    v : Tensor, [B, T, Hv, V]; v-head h reads qk-head h // (Hv // Hqk).
    g : Tensor, [B, T, Hv]
        Log-space decay per token (raw, not cumulated).
    beta : Tensor, [B, T, Hv]
    scale : float, optional
        Defaults to K ** -0.5.
    initial_state : Tensor, [N, Hv, K, V], optional
        Zeros when omitted.
    cu_seqlens : Tensor, [N + 1], optional
        Packed sequence boundaries (B == 1); without it every batch row is one sequence.
    output_final_state : bool

    Returns
    -------
    o : Tensor, [B, T, Hv, V], dtype of q.
    final_state : Tensor, [N, Hv, K, V] in the compute dtype, or None.
    """
    B, T, Hqk, K = q.shape
    Hv, V = v.shape[-2:]
    scale = K**-0.5 if scale is None else scale
    out_dtype, dtype = q.dtype, torch.promote_types(q.dtype, torch.float32)
    group = Hv // Hqk
    # [B * T, H, D]: every token of every sequence in order.
    q, k = (x.to(dtype).repeat_interleave(group, dim=2).flatten(0, 1) for x in (q, k))
    v, g, beta = (x.to(dtype).flatten(0, 1) for x in (v, g, beta))
    if cu_seqlens is None:
        bounds = [(b * T, (b + 1) * T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        bounds = list(zip(cu[:-1], cu[1:]))

    outputs, final_states = [], []
    for n, (bos, eos) in enumerate(bounds):
        S = q.new_zeros(Hv, K, V) if initial_state is None else initial_state[n].to(dtype)  # [Hv, K, V]
        for t in range(bos, eos):
            S = S * g[t].exp()[:, None, None]
            v_new = beta[t, :, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
            S = S + k[t, :, :, None] * v_new[:, None, :]
            outputs.append(torch.einsum("hkv,hk->hv", S, scale * q[t]))
        final_states.append(S)
    o = torch.stack(outputs).view(B, T, Hv, V).to(out_dtype)
    return o, (torch.stack(final_states) if output_final_state else None)
