"""The backward as the kernels compute it, stage by stage, in PyTorch: the spec of flash_qla.ops.

Per chunk (C tokens) and v-head, with γ = g_cum, e^γ and e^{γ_L − γ} zero past the
sequence's end, S the state at the chunk's start, N = StrictLower(K Kᵀ ⊙ Γ) (no β),
P = Q Kᵀ ⊙ Γ ⊙ Lower and A = (I + diag(β) N)⁻¹ diag(β) as the forward keeps it:

  forward, recomputed (state walk, forward in time)
    U     = V − diag(e^γ) K S
    v_new = A U
    S'    = e^{γ_L} S + Kᵀ diag(e^{γ_L − γ}) v_new

  dh (state-gradient walk, backward in time; dS' = gradient of S', dht at the end)
    dv_new = scale Pᵀ dO + diag(e^{γ_L − γ}) K dS'
    dU     = Aᵀ dv_new                              (= dV)
    dS     = e^{γ_L} dS' + scale Qᵀ diag(e^γ) dO − Kᵀ diag(e^γ) dU

  chunk gradients (every chunk in parallel, from S, dS', dv_new, dU)
    W   = U − N v_new               (= (I + N diag(β))⁻¹ U, so v_new = diag(β) W)
    dP  = scale dO v_newᵀ ⊙ Lower,  dN = −dU v_newᵀ ⊙ StrictLower
    dQ  = scale diag(e^γ) dO Sᵀ + (dP ⊙ Γ) K
    dK  = (dP ⊙ Γ)ᵀ Q − diag(e^γ) dU Sᵀ + diag(e^{γ_L − γ}) v_new dS'ᵀ
          + (dN ⊙ Γ) K + (dN ⊙ Γ)ᵀ K
    dβ  = rowsum((dv_new − Nᵀ dU) ⊙ W) = rowsum(dU ⊙ v_new) / β²   (the quotient: BETA_MIN)
    dγ  = e^γ ⊙ rowsum(scale dO ⊙ Q S − dU ⊙ K S) − e^{γ_L − γ} ⊙ rowsum(v_new ⊙ K dS')
          + rowsum(R) − colsum(R),  R = dP ⊙ P + dN ⊙ N
          and, at the last valid token, + e^{γ_L} ⟨S, dS'⟩ + Σ_i e^{γ_L − γ_i} ⟨v_new_i, (K dS')_i⟩
    dg  = reverse chunk-local cumsum of dγ

Why the β terms need no X = (I + diag(β) N)⁻¹: with A = diag(β) Â, Â = (I + N diag(β))⁻¹
(push-through identity), the gradient of N is −Âᵀ diag(β) dv_new (Â U)ᵀ diag(β) = −dU v_newᵀ,
and Â U = W = U − N v_new, so nothing is divided by β and no inverse is formed again.
The same identities make those factors quotients: v_new = diag(β) W, and dU = Aᵀ dv_new = diag(β) (I + Nᵀ diag(β))⁻¹
dv_new, so dU + diag(β) Nᵀ dU = diag(β) dv_new, dv_new − Nᵀ dU = diag(β)⁻¹ dU, and dβ = rowsum(dU ⊙ v_new) / β²:
none of the products N v_new, Pᵀ dO and Nᵀ dU. The kernels take the quotient in a chunk whose valid tokens all have
|β| ≥ BETA_MIN, the products in any other (β = 0 makes the quotient 0 / 0).
"""

import torch

from flash_qla.reference.chunked import CHUNK_SIZE, _ChunkLayout

# The least |β| for which dβ is the quotient: from 2⁻¹⁰ on, nothing the quotient reads has lost precision in the
# kernels' dtypes. Row i of A (and of v_new, dU) carries the factor β_i: in fp16 an entry β_i c of A below 2⁻¹⁴ is
# subnormal, absolute error 2⁻²⁵, which divided by β_i ≥ 2⁻¹⁰ leaves c (of order 1) within 2⁻¹⁵; the fp32 products
# dU ⊙ v_new ~ β² stay far above underflow. sigmoid(x) < 2⁻¹⁰ needs x < −6.9, and such a chunk only loses the speed.
BETA_MIN = 2.0**-10


def dbeta_by_quotient(beta, valid):
    """Per chunk and v-head ([..., C] -> [..., 1]): whether dβ is the quotient, every valid β at least BETA_MIN
    in magnitude (the tokens past a chunk's end do not count); else the products."""
    return ((beta.abs() >= BETA_MIN) | ~valid).all(-1, keepdim=True)


def chunk_gated_delta_rule_bwd_stages(
    q, k, v, g_cum, beta, A, do, dht=None, scale=None, initial_state=None, cu_seqlens=None
):
    """Same contract as chunk_gated_delta_rule_bwd_ref, but uses the forward's A and the stage formulas.

    Computes in the wider of q's dtype and float32. Returns dq, dk, dv, dbeta, dg, dh0 in that dtype.
    """
    B, T, Hqk, K = q.shape
    Hv, V = v.shape[-2:]
    scale = K**-0.5 if scale is None else scale
    dtype = torch.promote_types(q.dtype, torch.float32)
    layout = _ChunkLayout(B, T, cu_seqlens, q.device)
    group = Hv // Hqk
    q, k = (layout.gather(x.to(dtype).repeat_interleave(group, dim=2)) for x in (q, k))  # [N, NC, Hv, C, K]
    v, do = (layout.gather(x.to(dtype)) for x in (v, do))  # [N, NC, Hv, C, V]
    gamma, beta = (layout.gather(x.to(dtype)) for x in (g_cum, beta))  # [N, NC, Hv, C]
    A = layout.gather(A.to(dtype))  # [N, NC, Hv, C, C]

    valid = layout.valid[:, :, None, :]
    last = layout.last_index()[:, :, None, None].expand(*gamma.shape[:3], 1)
    gamma_last = gamma.gather(-1, last)  # [N, NC, Hv, 1]
    eg = torch.where(valid, gamma.exp(), 0)
    ed = torch.where(valid, (gamma_last - gamma).exp(), 0)
    decay = gamma_last[..., None].exp()  # [N, NC, Hv, 1, 1]
    lower = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=q.device).tril()
    Gamma = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    P = (q @ k.transpose(-1, -2)) * Gamma
    N_ = (k @ k.transpose(-1, -2) * Gamma).tril(-1)

    # forward, recomputed: S at every chunk start
    Nseq, NC = layout.valid.shape[:2]
    S = q.new_zeros(Nseq, Hv, K, V) if initial_state is None else initial_state.to(dtype)
    hs = []
    for c in range(NC):
        hs.append(S)
        U = v[:, c] - eg[:, c, ..., None] * (k[:, c] @ S)
        S = decay[:, c] * S + k[:, c].transpose(-1, -2) @ (ed[:, c, ..., None] * (A[:, c] @ U))
    S = torch.stack(hs, 1)  # [N, NC, Hv, K, V]

    # dh: state gradients, backward in time
    dS = q.new_zeros(Nseq, Hv, K, V) if dht is None else dht.to(dtype)
    dhs, dvns, dUs = [None] * NC, [None] * NC, [None] * NC
    for c in reversed(range(NC)):
        dhs[c] = dS
        dvn = scale * P[:, c].transpose(-1, -2) @ do[:, c] + ed[:, c, ..., None] * (k[:, c] @ dS)
        dU = A[:, c].transpose(-1, -2) @ dvn
        dS = (
            decay[:, c] * dS
            + scale * q[:, c].transpose(-1, -2) @ (eg[:, c, ..., None] * do[:, c])
            - k[:, c].transpose(-1, -2) @ (eg[:, c, ..., None] * dU)
        )
        dvns[c], dUs[c] = dvn, dU
    dh0 = dS
    dSn, dvn, dU = (torch.stack(x, 1) for x in (dhs, dvns, dUs))

    # chunk gradients, all chunks at once
    KS, QS, KdS = k @ S, q @ S, k @ dSn
    U = v - eg[..., None] * KS
    v_new = A @ U
    W = U - N_ @ v_new
    dP = (scale * do @ v_new.transpose(-1, -2)).tril()
    dN = (-dU @ v_new.transpose(-1, -2)).tril(-1)
    dQK, dKK = dP * Gamma, dN * Gamma
    dq = scale * eg[..., None] * (do @ S.transpose(-1, -2)) + dQK @ k
    dk = (
        dQK.transpose(-1, -2) @ q
        - eg[..., None] * (dU @ S.transpose(-1, -2))
        + ed[..., None] * (v_new @ dSn.transpose(-1, -2))
        + dKK @ k
        + dKK.transpose(-1, -2) @ k
    )
    dbeta = torch.where(
        dbeta_by_quotient(beta, valid),
        (dU * v_new).sum(-1) / torch.where(valid, beta, 1) ** 2,
        ((dvn - N_.transpose(-1, -2) @ dU) * W).sum(-1),
    )
    R = dP * P + dN * N_
    vKdS = (v_new * KdS).sum(-1)  # [N, NC, Hv, C]
    dgamma = (
        eg * (scale * do * QS - dU * KS).sum(-1)
        - ed * vKdS
        + R.sum(-1)
        - R.sum(-2)
    )
    at_last = (decay[..., 0, 0] * (S * dSn).sum((-1, -2)) + (ed * vKdS).sum(-1))[..., None]
    dgamma = dgamma + torch.zeros_like(dgamma).scatter(-1, last, at_last)
    dg = torch.where(valid, dgamma, 0).flip(-1).cumsum(-1).flip(-1)

    def to_tokens(x):
        return layout.scatter(x)

    def group_sum(x):  # [B, T, Hv, K] -> [B, T, Hqk, K], the v-heads of each qk-head summed
        return x.view(B, T, Hqk, group, K).sum(3)

    return (
        group_sum(to_tokens(dq)),
        group_sum(to_tokens(dk)),
        to_tokens(dU),
        to_tokens(dbeta),
        to_tokens(dg),
        dh0 if initial_state is not None else None,
    )
