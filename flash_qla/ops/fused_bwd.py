"""Fused chunked backward walk: the state gradient dS carried backward in time, giving dv.

Computes, for every (sequence n, v-head h, V-tile) and chunk c of 64 tokens walked from
the last to the first, with γ = g_cum, γ_L = γ of the chunk's last valid token, e^γ and
e^{γ_L − γ} zero past the sequence's end, dS' the gradient of the state after the chunk
(fp32, on chip for the whole walk; dht or 0 at the end) and P = Q Kᵀ ⊙ Γ ⊙ Lower:

    dv_new = scale · Pᵀ dO + diag(e^{γ_L − γ}) K dS'            [C, BV]
    dv     = Aᵀ dv_new                                          [C, BV]
    dS    <- e^{γ_L} dS' + Qᵀ diag(scale · e^γ) dO − Kᵀ diag(e^γ) dv

dv is the gradient of v: v enters only through U = V − diag(e^γ) K S and v_new = A U
(flash_qla/reference/backward_stages.py has the whole derivation). The walk needs no
forward state: dS' depends on S only through quantities it never reads. On a sequence's last
chunk (the walk's first) the tiles' rows past its end are the next sequence's: dv_new's are
selected to 0 and those of dO, P, A, q and k zeroed in their tiles (staging.zero_ring_rows_past), so
not even an Inf or NaN there reaches this sequence (a product with a zero factor would not cancel it).
The first zeroing (dO, P, k) holds its own barriers: TileLang's sync pass, which cannot place its
stores, otherwise puts one before and one after the branch on every chunk (8 consumer barriers a
chunk where 10). Training step against those two on every chunk (H100, one process, interleaved;
benchmark/NOTES.md v90): 16/32 1x2048 204.3 -> 203.2 µs, 2/8 1x2048 117.1 -> 116.4, 16/16 and 32/32
1x2048 within 0.1 %; the gradients bitwise equal. The pass's other barriers stay: compiled without the pass,
with 4 consumer barriers a chunk placed in the source where it places 8 (before and after dS''s staging, before
Aᵀ dv_new, before Kᵀ dv), the step ran 0.6-1.0 % slower at 1x2048 on an H200 (16/32 200.2 -> 201.3 µs, 2/8 116.4
-> 117.6; benchmark/NOTES.md v91): each placed barrier sits between a staging and the product that reads it.

Inputs (packed varlen, T tokens in all;
the token-major tensors, outputs too, passed packed, [1, T, ...], and read as the [T, ...] shown: launch.token_major):
    q, k     [T, Hqk, K]    input dtype; v-head h reads qk-head h // (Hv // Hqk)
    do       [T, Hv, V]     input dtype, gradient of o
    gamma    [Hv, slots, C] fp32, γ chunk-major (kkt_solve)
    A, P     [T, Hv, C]     input dtype (kkt_solve)
    cu_seqlens, chunk_offsets [N+1] int32
    log_norms [Hv, slots] fp32 (read when ENDS_ONLY) kkt_solve's bound on each chunk's transition
                            norm: the walk leaves out the chunks it shows negligible
                            (flash_qla.ops.context_parallel); else any [Hv, x]
    dht      [N, Hv, K, V]  fp32 (read when HAS_DHT)
Outputs (then scale, float, the last argument):
    dh       [slots, Hv, K, V] input dtype, dS' of every chunk (slot = global chunk index),
                            rounded as chunk_grads uses it: as a tensor-core operand
    dv       [T, Hv, V]     input dtype
    (dv_new stays on chip: chunk_grads forms it again from P, dO and dS' with one [C, C]
    product instead of loading it; benchmark/NOTES.md v17)
    dh0      [N, Hv, K, V]  fp32 gradient of the initial state (written when STORE_DH0)
    (ENDS_ONLY: dh0 alone, each sequence's dS at its start: the context-parallel backward's
    offsets, flash_qla.ops.context_parallel)

Schedule: as fused_fwd, grid (V / BV, Hv, N), one block walks its sequence's chunks in reverse
(the launcher runs this form for V-tiles of 32 and 16 columns; tiles of 64 and 128 run
fused_bwd_wide, the same walk transposed; like fused_fwd, it starts without `follow_previous_kernel`);
T.Pipelined streams the tiles of the coming chunks through a TMA ring, and TileLang
warp-specializes a producer warpgroup (its warp 0 feeds the ring: launch.ring_trips) and one wgmma
consumer warpgroup. dS stays in fp32
registers and is staged to shared memory in the input dtype once per chunk as the operand of K
dS'. The products that do not wait on each other run in flight together: K dS' and Pᵀ dO (with
diag(scale · e^γ) dO staged under them), then Aᵀ dv_new with Qᵀ dO (into the decayed dS) issued
behind it and waited for apart (wgmma.wait_group 1: dv and −diag(e^γ) dv are staged while Qᵀ dO
runs), then Kᵀ dv with dv's stores under it; three waits per chunk, not five. dS' goes to dh by TMA
from its operand tile, and the wait for that store's read of the tile comes at the next chunk's
staging, not at once. These three (the TMA wait, the dv stores, Qᵀ dO behind Aᵀ dv_new) took the
H200 training step at 16/16 1x2048 163.8 -> 155.6 µs, 4/16 1x2048 154.6 -> 147.0, 2/8 1x2048 132.5 ->
129.7 (gradients bitwise equal; benchmark/NOTES.md v57). Pᵀ dO reads dO's ring tile as it
arrived and the scale goes on the fp32 product, where dv_new is formed (dv_new = scale · DVN + ...: a
multiply an element of the accumulator). Against scale · dO staged as an operand tile of its own (a
multiply, a select and a rounding an element of dO, and the tile's stores), training step (H100, one
process, interleaved; benchmark/NOTES.md v89): 16/32 1x2048 208.9 -> 204.3 µs, 32/32 222.9 -> 220.5,
16/16 149.8 -> 147.4, 2/8 119.5 -> 116.9, 8/24 180.0 -> 175.3; and dv_new no longer rounds scale · dO
to the input dtype first, so the gradients are nearer the fp32 reference (16/32 1x2048, relative L2:
dv 3.50e-3 -> 3.26e-3, dβ 4.27e-3 -> 4.05e-3; dq unchanged). The consumer reads the dO tile into
registers before storing diag(scale · e^γ) dO: read from shared memory element by element, each
load waited behind the previous element's stores, which the compiler may not reorder (the walk
0.734 -> 0.659 ms at 16/32 8x4096; NOTES.md v9).
"""

import tilelang
import tilelang.language as T

from flash_qla.arch import ArchProfile
from flash_qla.ops.launch import kernel_factory, ring_trips, token_major
from flash_qla.ops.negligible import kept_first_chunks
from flash_qla.ops.staging import STAGE_BARRIER, zero_ring_rows_past

LOG2E = 1.4426950408889634
# elements of padding per row of the dv staging tile (the o tile's pattern in fused_fwd:
# unpadded, a warp's 4-byte accumulator stores to 8 rows are 4- / 8-way bank conflicted)
DV_PAD = 8


@kernel_factory
def fused_bwd_kernel(
    Hqk: int,
    Hv: int,
    K: int,
    V: int,
    BV: int,
    dtype: str,
    profile: ArchProfile,
    HAS_DHT: bool,
    STORE_DH0: bool,
    ENDS_ONLY: bool = False,
):
    """Compile (or load from TileLang's cache) the backward walk for one static config.

    ENDS_ONLY: only dh0 is written (no dh, dv): the walks of the context-parallel
    backward that give each piece's offset (flash_qla.ops.context_parallel).
    """
    assert STORE_DH0 or not ENDS_ONLY, "a walk that stores nothing"
    C = profile.chunk
    GROUPS = Hv // Hqk
    NV = V // BV
    accum = "float32"
    THREADS = profile.fused_threads
    TILE_REGS = C * BV // THREADS  # fp32 registers per consumer thread of a [C, BV] accumulator
    STATE_REGS = K * BV // THREADS  # ... of the [K, BV] state gradient
    tokens = T.dynamic("tokens")
    n_seqs = T.dynamic("n_seqs")
    n_dht = T.dynamic("n_dht")
    n_dh0 = T.dynamic("n_dh0")
    n_slots = T.dynamic("n_slots")
    n_bounds = T.dynamic("n_bounds")
    E = profile.checkpoint_chunks  # a piece's chunks at most

    @T.prim_func
    def fused_bwd(
        q: T.Tensor([1, tokens, Hqk, K], dtype),
        k: T.Tensor([1, tokens, Hqk, K], dtype),
        do: T.Tensor([1, tokens, Hv, V], dtype),
        gamma: T.Tensor([Hv, n_slots, C], accum),
        A: T.Tensor([1, tokens, Hv, C], dtype),
        P: T.Tensor([1, tokens, Hv, C], dtype),
        cu_seqlens: T.Tensor([n_seqs + 1], "int32"),
        chunk_offsets: T.Tensor([n_seqs + 1], "int32"),
        log_norms: T.Tensor([Hv, n_bounds], accum),
        dht: T.Tensor([n_dht, Hv, K, V], accum),
        dh: T.Tensor([n_slots, Hv, K, V], dtype),
        dv: T.Tensor([1, tokens, Hv, V], dtype),
        dh0: T.Tensor([n_dh0, Hv, K, V], accum),
        scale: T.float32,
    ):
        with T.Kernel(NV, Hv, n_seqs, threads=THREADS) as (iv, ih, n):
            q, k, do, A, P, dv = token_major(q, k, do, A, P, dv)
            ihk = ih // GROUPS
            v0 = iv * BV
            bos = cu_seqlens[n]
            if ENDS_ONLY:  # the fewest first chunks outside which b' is negligible; the rest left out
                keep = kept_first_chunks(log_norms, ih, chunk_offsets[n], T.ceildiv(cu_seqlens[n + 1] - bos, C), E)
                seqlen = T.min(cu_seqlens[n + 1] - bos, keep * C)
            else:
                seqlen = cu_seqlens[n + 1] - bos
            first_chunk = chunk_offsets[n]
            n_chunks = T.ceildiv(seqlen, C)

            q_s = T.alloc_shared([C, K], dtype)
            k_s = T.alloc_shared([C, K], dtype)
            do_s = T.alloc_shared([C, BV], dtype)
            a_s = T.alloc_shared([C, C], dtype)
            p_s = T.alloc_shared([C, C], dtype)
            gam_s = T.alloc_shared([C], accum)
            ds_s = T.alloc_shared([K, BV], dtype)  # dS' in the input dtype, B operand
            doe_s = T.alloc_shared([C, BV], dtype)  # diag(scale · e^γ) dO
            dvn_s = T.alloc_shared([C, BV], dtype)  # dv_new, the operand of Aᵀ dv_new
            due_s = T.alloc_shared([C, BV], dtype)  # −diag(e^γ) dv
            if not ENDS_ONLY:
                dv_s = T.alloc_shared([C, BV + DV_PAD], dtype)  # dv staged for its store, rows padded
            eg_s = T.alloc_shared([C], accum)  # e^γ, 0 past the end, for the dO tile steps

            dS = T.alloc_fragment([K, BV], accum)
            DVN = T.alloc_fragment([C, BV], accum)
            KD = T.alloc_fragment([C, BV], accum)
            DV = T.alloc_fragment([C, BV], accum)
            DO = T.alloc_fragment([C, BV], dtype)  # dO in registers: the stores of its scaled copy wait on no load
            # the same gate factors in registers, laid out like the accumulators' rows
            eg = T.alloc_fragment([C], accum)
            ed = T.alloc_fragment([C], accum)  # e^{γ_L − γ}, 0 past the end
            g_last = T.alloc_var(accum)

            if HAS_DHT:
                T.copy(dht[n, ih, :, v0:v0 + BV], dS)
            else:
                T.clear(dS)

            for r in T.Pipelined(ring_trips(n_chunks), num_stages=profile.num_stages):
                c = n_chunks - 1 - r
                t0 = bos + c * C
                valid = T.min(C, seqlen - c * C)  # tokens of this chunk in the sequence
                T.copy(q[t0:t0 + C, ihk, :], q_s)
                T.copy(k[t0:t0 + C, ihk, :], k_s)
                T.copy(do[t0:t0 + C, ih, v0:v0 + BV], do_s)
                T.copy(A[t0:t0 + C, ih, :], a_s)
                T.copy(P[t0:t0 + C, ih, :], p_s)
                T.copy(gamma[ih, first_chunk + c, :], gam_s)

                g_last = gam_s[valid - 1]
                for i in T.Parallel(C):
                    eg_s[i] = T.if_then_else(i < valid, T.exp2(gam_s[i] * LOG2E), 0.0)
                for i in T.Parallel(C):
                    eg[i] = T.if_then_else(i < valid, T.exp2(gam_s[i] * LOG2E), 0.0)
                    ed[i] = T.if_then_else(i < valid, T.exp2((g_last - gam_s[i]) * LOG2E), 0.0)
                if not ENDS_ONLY:
                    T.tma_store_wait(0)  # in the thread that issued the last chunk's dh store: it has read ds_s
                T.copy(dS, ds_s)
                if not ENDS_ONLY:  # by TMA, waited for at the next chunk's staging
                    T.tma_copy(ds_s, dh[first_chunk + c, ih, :, v0:v0 + BV], leader_scope_threads=THREADS)
                if valid < C:  # a sequence's last chunk (the walk's first): the next sequence's rows out of
                    # Pᵀ dO and Qᵀ diag(scale · e^γ) dO (a product of zero and an Inf is no zero, so both factors'
                    # rows), and out of the update's Kᵀ. The branch's own barriers: without them TileLang's sync
                    # pass puts one before and one after it, on every chunk
                    T.sync_threads(STAGE_BARRIER, THREADS)  # ordering nothing (the ring orders the slots' reuse)
                    zero_ring_rows_past(do_s, valid)
                    zero_ring_rows_past(p_s, valid)
                    zero_ring_rows_past(k_s, valid)
                    T.fence_proxy_async()  # the stores seen by wgmma
                    T.sync_threads(STAGE_BARRIER, THREADS)
                T.copy(do_s, DO)

                # dS <- e^{γ_L} dS' + Qᵀ diag(scale e^γ) dO − Kᵀ diag(e^γ) dv: the decay now (before the
                # products are issued: ptxas waits for every pending product before registers a product
                # wrote last are read), the products below
                for d, j in T.Parallel(K, BV):
                    dS[d, j] = dS[d, j] * T.exp2(g_last * LOG2E)
                # dv_new = scale Pᵀ dO + diag(e^{γ_L − γ}) K dS': its two products in flight together
                with T.ws_op("p_s_do_s"):  # one op: the ring frees p_s and do_s only after the wait
                    T.wgmma_gemm(k_s, ds_s, KD, clear_accum=True)
                    T.wgmma_gemm(p_s, do_s, DVN, transpose_A=True, clear_accum=True)
                    for i, j in T.Parallel(C, BV):  # the operand of Qᵀ dO, under them
                        doe_s[i, j] = DO[i, j] * (scale * eg_s[i])
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(KD, num_regs=TILE_REGS)
                    T.warpgroup_fence_operand(DVN, num_regs=TILE_REGS)
                for i, j in T.Parallel(C, BV):
                    DVN[i, j] = DVN[i, j] * scale + KD[i, j] * ed[i]
                if valid < C:  # out of dv_new (K dS' read k's rows there), Aᵀ dv_new and Qᵀ dO
                    for i, j in T.Parallel(C, BV):
                        DVN[i, j] = T.if_then_else(i < valid, DVN[i, j], 0.0)
                    zero_ring_rows_past(q_s, valid)
                    zero_ring_rows_past(a_s, valid)
                T.copy(DVN, dvn_s)

                # dv = Aᵀ dv_new, then Qᵀ diag(scale e^γ) dO into dS behind it: waited for with the update's
                # product, it runs under dv's staging
                with T.ws_op("a_s_q_s_k_s"):  # one op: the ring frees a_s, q_s and k_s only after the last wait
                    T.wgmma_gemm(a_s, dvn_s, DV, transpose_A=True, clear_accum=True)
                    T.wgmma_gemm(q_s, doe_s, dS, transpose_A=True)
                    T.wait_wgmma(1)  # Aᵀ dv_new's group; Qᵀ dO's still in flight
                    T.warpgroup_fence_operand(DV, num_regs=TILE_REGS)
                    for i, j in T.Parallel(C, BV):
                        due_s[i, j] = -DV[i, j] * eg[i]
                    if not ENDS_ONLY:
                        for i, j in T.Parallel(C, BV):
                            dv_s[i, j] = DV[i, j]
                    T.wgmma_gemm(k_s, due_s, dS, transpose_A=True)
                    if not ENDS_ONLY:  # dv's stores under the update
                        for i, j in T.Parallel(C, BV):
                            if i < valid:
                                dv[t0 + i, ih, v0 + j] = dv_s[i, j]
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(dS, num_regs=STATE_REGS)

            if not ENDS_ONLY:
                T.tma_store_wait(0)  # the last dh store has read ds_s before the block's shared memory goes
            if STORE_DH0:
                T.copy(dS, dh0[n, ih, :, v0:v0 + BV])

    return tilelang.compile(fused_bwd, target=profile.target)
