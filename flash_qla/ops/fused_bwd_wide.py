"""Backward walk for V-tiles of 64 and 128: the walk of fused_bwd with the state gradient transposed.

Computes what fused_bwd computes (dh, dv and dh0; the same math and masking), for
V-tiles of BV = 64 · (consumer warpgroups) columns, with every product transposed so that
the V columns are its M side (γ = g_cum, e^γ and e^{γ_L − γ} zero past the sequence's end,
P = Q Kᵀ ⊙ Γ ⊙ Lower, dS'ᵀ the gradient of the state after the chunk, walked last to first):

    dv_newᵀ = scale · dOᵀ P + dS'ᵀ Kᵀ diag(e^{γ_L − γ})               [BV, C]
    dvᵀ     = dv_newᵀ A                                              [BV, C]
    dSᵀ    <- e^{γ_L} dS'ᵀ + dOᵀ diag(scale · e^γ) Q − dvᵀ diag(e^γ) K   [BV, K]

dS'ᵀ, dOᵀ (as loaded, the scale going on the fp32 product dOᵀ P; masked past the sequence's end:
the tiles' rows there belong to the next sequence; P's, A's, q's and k's are zeroed, each consumer
warpgroup for itself, staging.zero_rows_past_by_warpgroup), dv_newᵀ and dvᵀ diag(e^γ) are the A
operands of the next products, which wgmma reads straight from registers (rounded to the input
dtype, as fused_bwd rounds them into shared memory): only the TMA'd q, k, dO, A and P tiles are read
from shared memory, and the consumers write shared memory only to stage dh and dv for their
stores. So the consumer warpgroups, one per 64 columns, share the ring's tiles but nothing else:
each runs an independent chain, and two chains per SM hide each other's latency (fused_fwd_wide's form).
Both forms run near the DRAM rate at full grids, so the gain is the bytes fused_bwd reads
twice (q, k, A and P for each of two V-tiles): 16/32 8x4096 0.660 ms (fused_bwd, BV = 64) ->
0.607 (BV = 128); at BV = 64 (one chain) 2/8 8x4096 0.173 -> 0.166, 16/64 1x32768 1.262 ->
1.207 ms; outputs bitwise equal (benchmark/NOTES.md v10).

Inputs and outputs as fused_bwd (ENDS_ONLY too: only dh0 written), except that the gate
arrives as kkt_solve's `gates` [Hv, slots, 2, C] fp32 (e^γ and e^{γ_L − γ}, 0 past the
chunk's end) in the place of γ.
Schedule: grid (V / BV, Hv, N), chunks walked last to first; TileLang's warp specialization:
a producer warpgroup (its warp 0: launch.ring_trips) streams the tiles through a `num_stages`-deep TMA ring, BV / 64
consumer warpgroups (every product splits its M = BV rows over them, `FullRow`). Per chunk
the chain is three dependent steps: (K dS')ᵀ and (Pᵀ dO)ᵀ in flight together, then dv_newᵀ A,
then the dOᵀ Q and dvᵀ K updates of dSᵀ together, under which the chunk's dv is stored. The
dOᵀ Q update waits for the last step (it could go with the first) so that its operand is not
live beside the first step's: there, the consumer's registers ran out and ptxas kept 32 bytes
of indices in local memory, which missed L1 and were reloaded every chunk (ncu: waits on
L1TEX loads, these among them, were 47 % of the walk's stalls). Moved, none are left: the
low-level backward at 16/32 8x4096 2.315 -> 2.210 ms (the walk ~0.54 -> ~0.43), outputs bitwise
equal (benchmark/NOTES.md v17). dv is stored (transposed through shared memory for whole-row
stores, each warpgroup its own 64 columns between barriers of its own 128 threads). dS'ᵀ is staged
the same way at the chunk's start and goes to dh by TMA (staging.state_store; from the registers,
element by element, a warp's 2-byte stores touched 8 rows of dh 256 bytes apart: 16/32 8x4096
0.609 -> 0.541 ms, 16/64 1.185 -> 1.003, outputs bitwise equal; benchmark/NOTES.md v14). dv is
rounded to the input dtype in registers before its staging (it was rounded by the staging stores),
so that at 64 columns both stagings are stmatrix.x4.trans, 12 instructions a thread where 2-byte
stores took 96: at one block an SM the walk's consumer issues its own chain (ncu at 16/32 1x2048:
~1000 instructions a warp and chunk, a third of its cycles issuing; waits on the products' results
13 %, on the loads 7 %), so fewer instructions are a shorter chunk. Training step 16/32 1x2048
218.9 -> 212.2 µs, 32/32 1x2048 225.0 -> 221.0, low-level backward 16/32 1x32768 2232 -> 2163;
16/32 4096x8 (DRAM-bound) unchanged; gradients bitwise equal (benchmark/NOTES.md v56). dO is read
transposed from its ring tile, which is swizzled so that a warp's reads hit distinct banks; at 64
columns by ldmatrix.x4.trans (staging.load_transposed: four instructions a thread for each of its two
reads, where 2-byte loads took 32): training step 16/32 1x2048 212.4 -> 210.2 µs, 32/32 1x2048 221.2 ->
219.0, gradients bitwise equal (benchmark/NOTES.md v56 step 8, v57). dOᵀ P's operand is dO as
loaded and the scale goes on its fp32 product, where dv_newᵀ is formed: dOᵀ was widened to fp32,
scaled, selected and rounded back every chunk (static SASS of the 16/32 walk 1800 -> 1680
instructions at 64 columns, 2000 -> 1816 at 128), and dv_new no longer rounds a scaled copy of dO
(as fused_bwd; benchmark/NOTES.md v89).
Training step (H100, one process, interleaved): 16/32 4096x8 (128 columns) 2725.3 -> 2711.5 µs, 16/16
8192x4 (64) 1519.4 -> 1521.1, 32/32 2048x2 (64) 386.9 -> 388.2, within the rounds' spread; the
gradients nearer the fp32 reference (16/32 4096x8, relative L2: dv 3.52e-3 -> 3.28e-3, dβ 4.27e-3 ->
4.09e-3; dq unchanged).
"""

import tilelang
import tilelang.language as T
from tilelang.layout import make_full_bank_swizzled_layout

from flash_qla.arch import ArchProfile
from flash_qla.ops.launch import follow_previous_kernel, kernel_factory, ring_trips, token_major
from flash_qla.ops.negligible import kept_first_chunks
from flash_qla.ops.staging import (
    ROWS_PER_WARPGROUP,
    STAGE_PAD,
    alloc_state_stage,
    load_transposed,
    row_store,
    state_store,
    state_stores_done,
    zero_rows_past_by_warpgroup,
)


@kernel_factory
def fused_bwd_wide_kernel(
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
    """Compile (or load from TileLang's cache) the wide-tile backward walk for one static config.

    Arguments as fused_bwd_kernel; BV is a multiple of 64 (one consumer warpgroup per 64 columns).
    """
    assert STORE_DH0 or not ENDS_ONLY, "a walk that stores nothing"
    assert BV % ROWS_PER_WARPGROUP == 0, "one consumer warpgroup per 64 rows of dSᵀ"
    C = profile.chunk
    GROUPS = Hv // Hqk
    NV = V // BV
    accum = "float32"
    THREADS = 128 * BV // ROWS_PER_WARPGROUP
    ROWS = T.GemmWarpPolicy.FullRow  # every product splits its M = BV rows over the warpgroups
    TILE_REGS = C * BV // THREADS  # fp32 registers per consumer thread of a [BV, C] accumulator
    STATE_REGS = K * BV // THREADS  # ... of the [BV, K] state gradient
    tokens = T.dynamic("tokens")
    n_seqs = T.dynamic("n_seqs")
    n_dht = T.dynamic("n_dht")
    n_dh0 = T.dynamic("n_dh0")
    n_slots = T.dynamic("n_slots")
    n_bounds = T.dynamic("n_bounds")
    E = profile.checkpoint_chunks  # a piece's chunks at most

    store_rows = row_store(BV, C)  # x[t0 : t0 + valid] = Xtᵀ, each warpgroup its own 64 columns
    store_dh = state_store(BV, K)  # dh[c] = dS'ᵀ, each warpgroup its own 64 columns
    load_dot = load_transposed(C)  # dOᵀ from its ring tile, at one warpgroup
    zero_qk_rows = zero_rows_past_by_warpgroup(C, K)  # on a sequence's last chunk, the rows past its end = 0
    zero_cc_rows = zero_rows_past_by_warpgroup(C, C)

    @T.prim_func
    def fused_bwd_wide(
        q: T.Tensor([1, tokens, Hqk, K], dtype),
        k: T.Tensor([1, tokens, Hqk, K], dtype),
        do: T.Tensor([1, tokens, Hv, V], dtype),
        gates: T.Tensor([Hv, n_slots, 2, C], accum),
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
            follow_previous_kernel()
            ihk = ih // GROUPS
            v0 = iv * BV
            tx = T.get_thread_binding()
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
            gates_s = T.alloc_shared([2, C], accum)  # e^γ, e^{γ_L − γ}
            if not ENDS_ONLY:
                dv_s = T.alloc_shared([C, BV + STAGE_PAD], dtype)  # dv staged for its store, rows padded
                dh_s = alloc_state_stage(BV, K, dtype)  # dS' staged for its TMA store
            # dO is read a column per thread group: swizzled 128-byte rows, else the rows a warp
            # reads at once (2 apart) all start in one bank
            T.annotate_layout({do_s: make_full_bank_swizzled_layout(do_s)})

            dSt = T.alloc_fragment([BV, K], accum)  # dSᵀ
            Db = T.alloc_fragment([BV, K], dtype)  # dS'ᵀ in the input dtype: A operand
            DOm = T.alloc_fragment([BV, C], dtype)  # dOᵀ, 0 past the end: A operand
            DOe = T.alloc_fragment([BV, C], dtype)  # dOᵀ diag(scale · e^γ): A operand
            KDt = T.alloc_fragment([BV, C], accum)  # (K dS')ᵀ
            DVNt = T.alloc_fragment([BV, C], accum)  # dv_newᵀ
            DVNb = T.alloc_fragment([BV, C], dtype)  # dv_newᵀ: A operand
            DVt = T.alloc_fragment([BV, C], accum)  # dvᵀ
            if not ENDS_ONLY:
                DVb = T.alloc_fragment([BV, C], dtype)  # dvᵀ rounded, staged (by stmatrix at BV = 64)
            DUe = T.alloc_fragment([BV, C], dtype)  # −dvᵀ diag(e^γ): A operand
            # per-column gate factors, laid out like the accumulators' columns
            eg = T.alloc_fragment([C], accum)  # e^γ, 0 past the end
            ed = T.alloc_fragment([C], accum)  # e^{γ_L − γ}, 0 past the end
            decay = T.alloc_var(accum)  # e^{γ_L}

            if HAS_DHT:
                for j, d in T.Parallel(BV, K):
                    dSt[j, d] = dht[n, ih, d, v0 + j]
            else:
                T.clear(dSt)

            for r in T.Pipelined(ring_trips(n_chunks), num_stages=profile.num_stages):
                c = n_chunks - 1 - r
                t0 = bos + c * C
                valid = T.min(C, seqlen - c * C)  # tokens of this chunk in the sequence
                T.copy(q[t0:t0 + C, ihk, :], q_s)
                T.copy(k[t0:t0 + C, ihk, :], k_s)
                T.copy(do[t0:t0 + C, ih, v0:v0 + BV], do_s)
                T.copy(A[t0:t0 + C, ih, :], a_s)
                T.copy(P[t0:t0 + C, ih, :], p_s)
                T.copy(gates[ih, first_chunk + c, :, :], gates_s)

                T.copy(dSt, Db)
                if not ENDS_ONLY:
                    store_dh(Db, dh_s, dh, first_chunk + c, ih, v0, tx)
                for i in T.Parallel(C):
                    eg[i] = gates_s[0, i]
                    ed[i] = gates_s[1, i]
                if BV == ROWS_PER_WARPGROUP:  # dOᵀ by ldmatrix.x4.trans
                    load_dot(DOm, do_s, None, tx)
                else:
                    for j, i in T.Parallel(BV, C):
                        DOm[j, i] = do_s[i, j]
                if valid < C:  # dO's columns past the end are the next sequence's
                    for j, i in T.Parallel(BV, C):
                        DOm[j, i] = T.if_then_else(i < valid, DOm[j, i], T.cast(0, dtype))

                # (K dS')ᵀ and (Pᵀ dO)ᵀ (the dv chain) in flight together
                with T.ws_op("k_s_p_s"):  # one op: the ring frees p_s only after the wait
                    if valid < C:  # a sequence's last chunk (the walk's first): the next sequence's rows out
                        zero_cc_rows(p_s, None, valid, tx)  # of dOᵀ P (dOᵀ's columns there are 0: a product
                        zero_qk_rows(k_s, None, valid, tx)  # of zero and an Inf is no zero) and the update's K
                    T.wgmma_gemm(Db, k_s, KDt, transpose_B=True, clear_accum=True, policy=ROWS)
                    T.wgmma_gemm(DOm, p_s, DVNt, clear_accum=True, policy=ROWS)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(KDt, num_regs=TILE_REGS)
                    T.warpgroup_fence_operand(DVNt, num_regs=TILE_REGS)
                for j, i in T.Parallel(BV, C):
                    DVNb[j, i] = DVNt[j, i] * scale + KDt[j, i] * ed[i]
                if valid < C:  # columns past the end: (K dS')ᵀ's there read k's rows of the next sequence
                    for j, i in T.Parallel(BV, C):
                        DVNb[j, i] = T.if_then_else(i < valid, DVNb[j, i], T.cast(0, dtype))

                # dvᵀ = dv_newᵀ A, then dSᵀ <- e^{γ_L} dS'ᵀ + dOᵀ diag(scale · e^γ) Q − dvᵀ diag(e^γ) K,
                # both update products in flight together with the dv store under them
                with T.ws_op("a_s"):  # one op: the zeroing after the tile's wait
                    if valid < C:
                        zero_cc_rows(a_s, None, valid, tx)
                    T.gemm(DVNb, a_s, DVt, clear_accum=True, policy=ROWS)
                decay = gates_s[0, valid - 1]
                for j, d in T.Parallel(BV, K):
                    dSt[j, d] = dSt[j, d] * decay
                if BV == ROWS_PER_WARPGROUP:
                    load_dot(DOe, do_s, None, tx)
                    for j, i in T.Parallel(BV, C):
                        DUe[j, i] = -DVt[j, i] * eg[i]
                        DOe[j, i] = DOe[j, i] * (scale * eg[i])
                else:
                    for j, i in T.Parallel(BV, C):
                        DUe[j, i] = -DVt[j, i] * eg[i]
                        DOe[j, i] = do_s[i, j] * (scale * eg[i])
                if valid < C:  # dO's columns past the end are the next sequence's
                    for j, i in T.Parallel(BV, C):
                        DOe[j, i] = T.if_then_else(i < valid, DOe[j, i], T.cast(0, dtype))
                if not ENDS_ONLY:
                    T.copy(DVt, DVb)
                with T.ws_op("k_s_q_s"):  # one op: the ring frees k_s and q_s only after the wait
                    if valid < C:
                        zero_qk_rows(q_s, None, valid, tx)
                    T.wgmma_gemm(DOe, q_s, dSt, policy=ROWS)
                    T.wgmma_gemm(DUe, k_s, dSt, policy=ROWS)
                    if not ENDS_ONLY:
                        store_rows(DVb, dv_s, dv, t0, valid, ih, v0, tx)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(dSt, num_regs=STATE_REGS)

            if not ENDS_ONLY:
                state_stores_done()
            if STORE_DH0:
                for j, d in T.Parallel(BV, K):
                    dh0[n, ih, d, v0 + j] = dSt[j, d]

    return tilelang.compile(fused_bwd_wide, target=profile.target)
