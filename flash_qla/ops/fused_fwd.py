"""Fused chunked forward: the sequential walk over chunks producing o, h and the final state.

Computes, for every (sequence n, v-head h, V-tile) and chunk c of 64 tokens, with
γ = g_cum (chunk-local cumsum), γ_L = γ of the chunk's last valid token, S the state at
the chunk's start (fp32, on chip for the whole walk) and P = Q Kᵀ ⊙ Γ ⊙ Lower (from
kkt_solve):

    v_new = A (V − diag(e^γ) K S)                     [C, BV]
    O     = scale · (diag(e^γ) Q S + P v_new)         [C, BV]
    S    <- e^{γ_L} S + Kᵀ diag(e^{γ_L − γ}) v_new

Reformulations of DESIGN.md §1, each exact in real arithmetic:
- v_new = u − w S with u = A V and w = A (K ⊙ e^γ) is A (V − (K ⊙ e^γ) S): A is applied
  once, to a [C, BV] tile, instead of forming w ([C, C] x [C, K]) and u.
- The gate factors are applied to the fp32 products, not to the bf16 operands: (Q ⊙ e^γ) S
  = diag(e^γ) (Q S), likewise K S, and (K ⊙ e^{γ_L−γ})ᵀ v_new = Kᵀ (diag(e^{γ_L−γ}) v_new).
  No [C, K] tile is rescaled per chunk (C·BV multiplies instead of 3·C·K), and the decayed
  operands are not rounded to the input dtype.
- P is computed once per chunk in kkt_solve, not once per V-tile here.
Rounding: V − diag(e^γ) K S and v_new are rounded to the input dtype once each as
tensor-core operands (the usual form rounds u, w and v_new).

Inputs (packed varlen, T tokens in all; `cu_seqlens` [N+1] int32;
the token-major tensors, outputs too, passed packed, [1, T, ...], and read as the [T, ...] shown: launch.token_major):
    q, k     [T, Hqk, K]   input dtype; v-head h reads qk-head h // (Hv // Hqk)
    v        [T, Hv, V]    input dtype
    gamma    [Hv, slots, C] fp32, chunk-local cumsum of g, chunk-major (kkt_solve; a TMA box
                           must start 16-byte aligned, which token-major rows do not)
    A, P     [T, Hv, C]    input dtype (kkt_solve)
    chunk_offsets [N+1]    int32, first global chunk index of each sequence (its chunks' rows of gamma,
                           log_norms and h)
    log_norms [Hv, slots]  fp32 (read by STATES_ONLY without STORE_H: the split's map and offset walks)
                           kkt_solve's bound on each chunk's transition norm: those walks leave out the
                           chunks it shows negligible (flash_qla.ops.context_parallel); else any [Hv, x]
    h0       [N, Hv, K, V] fp32 (read when HAS_H0)
Outputs (then scale, float, the last argument):
    o        [T, Hv, V]    input dtype
    ht       [N, Hv, K, V] fp32 final state
    h        [NT, Hv, K, V] fp32 state at the start of each chunk (written when STORE_H; in the
                           input dtype with KEEP_H, and with STATES_ONLY, where o is not written);
                           with CHECKPOINT the checkpoint buffer (forward.checkpoint_rows): row m
                           the state at the start of global chunk m E, E = profile.checkpoint_chunks,
                           where that chunk is not a sequence's first

Schedule: grid (V / BV, Hv, N), one block walks its sequence's chunks in order. The
launcher runs this form for V-tiles of 32 and 16 columns: tiles of 64 and 128 run
fused_fwd_wide, the same walk transposed (its products read the chain's operands from
registers; at BV = 64, 0.8 of this kernel's time, benchmark/NOTES.md v10). It starts without
`follow_previous_kernel` (flash_qla.ops.launch: launched early it ran slower; NOTES.md v30).
T.Pipelined streams the q/k/v/A/P/γ tiles of the next chunks through a `num_stages`-deep
shared-memory ring with TMA; on SM90 TileLang splits the block into a producer
warpgroup (TMA issue, mbarrier waits: its warp 0 alone, launch.ring_trips) and one consumer
warpgroup (`profile.fused_threads`) that runs every product with wgmma into fp32 register accumulators. S stays in
registers (fp32) for the whole walk and is staged to shared memory in the input dtype
once per chunk as the B operand of Q S and K S (a 16-bit h is stored from that tile by TMA, the
wait for the store's read of it coming at the next chunk's staging). Per chunk the S chain is three dependent
products (K S, A U, Kᵀ v_new); the O path's Q S and P v_new are issued asynchronously
next to K S and Kᵀ v_new, so a chunk waits on the tensor cores three times, not five.
While K S and Q S run, the consumers do the work that does not need them: the previous
chunk's o (its O is kept one chunk in registers, so its staging and stores leave the S
chain), the gate factors, and V read from the ring into registers.
The per-row gate factors e^γ and e^{γ_L − γ} live in registers laid out like the
accumulators' rows (each thread computes its own rows'), so the element-wise steps of the
chain read no shared memory besides their tile (17 % faster per chunk than staging them).
Tokens past the end of the sequence (last chunk) are masked: their gate factors are 0, their
rows of V − diag(e^γ) K S and of v_new are selected to 0 and, after K S, their rows of the k
tile are zeroed (staging.zero_rows_past), so nothing of the next sequence's rows that the tiles
load reaches S or o, not even an Inf or NaN (a product with a zero factor would not cancel it);
their rows of o are not stored. nvcc if-converts those selects onto every chunk (40 SEL/FSEL on the S chain at 32
columns, 20 at 16). Zeroing the rows of k, v and A in the ring before K S instead (a branch with its own two
barriers; no selects) was not faster: H200, one process, interleaved, the 1x2048 training step 0.4 % faster at
16/32, 0.5 % at 2/8, within 0.1 % at 16/16 and 32/32, 0.3 % slower at 8/24, and the 2/8 1x2048 inference forward
2.0 % slower, its chunks all full (it waits for A's load before K S, where this walk waits at A U: the likely
cost; benchmark/NOTES.md v92 step 1). Zeroing only k's and v's rows there (v_new's still selected, A's load
waited for at A U) moved no more: H100, the training step 0.6 % slower at 16/32 1x2048, 1.0 % faster at 2/8
1x2048, 0.2 % faster at 16/32 1000+1048, the 2/8 1x2048 inference forward within 0.2 % (v93 step 1).
v_new's tile (P v_new's operand) is stored from the loop that stages diag(e^{γ_L − γ}) v_new: two consumer
barriers there where a stmatrix copy of its own took three. Training step (H100, one process,
interleaved, with fused_bwd's zeroing barriers (fused_bwd.py); benchmark/NOTES.md v90): 16/32 1x2048 203.2 -> 202.1 µs,
2/8 116.4 -> 115.9, 16/16 145.0 -> 144.6, 32/32 219.9 -> 219.2; the gradients bitwise equal.
"""

import tilelang
import tilelang.language as T

from flash_qla.arch import ArchProfile
from flash_qla.ops.launch import kernel_factory, ring_trips, token_major
from flash_qla.ops.negligible import walk_start
from flash_qla.ops.staging import zero_rows_past

LOG2E = 1.4426950408889634
# elements of padding per row of the o staging tile: the accumulator's 4-byte stores of a
# warp cover 8 rows at once; unpadded rows are 64 / 128 bytes apart (BV = 32 / 64) and the
# stores are 4- / 8-way bank conflicted, padded rows start in 8 different banks
O_PAD = 8


@kernel_factory
def fused_fwd_kernel(
    Hqk: int,
    Hv: int,
    K: int,
    V: int,
    BV: int,
    dtype: str,
    profile: ArchProfile,
    HAS_H0: bool,
    STORE_H: bool,
    STATES_ONLY: bool = False,
    CHECKPOINT: bool = False,
    MAPS: bool = False,
    KEEP_H: bool = False,
    PIECE_CHUNKS: int | None = None,
):
    """Compile (or load from TileLang's cache) the fused forward for one static config.

    STATES_ONLY skips o (no q or P loads, no Q S or P v_new products): with STORE_H it is the
    backward's recompute, which stores h in the input dtype (the precision its consumers read
    it in) and the final state; without, only the final state is written (a piece's offset b
    in flash_qla.ops.context_parallel).
    KEEP_H (with STORE_H, a training forward with keep_states): h in the input dtype, stored as
    the recompute stores it, for the backward, which then recomputes nothing.
    CHECKPOINT (training forwards): h holds only the checkpoints, the states at the global
    chunks j = m · profile.checkpoint_chunks inside a sequence (not at its first chunk), in
    row m, fp32; the backward restarts its state recompute from them (flash_qla.ops.backward).
    MAPS (with STATES_ONLY, no h0, no h): a piece's transition M (flash_qla.ops.context_parallel):
    the walk starts from the identity and takes V as 0 (v is not read); ht [N, Hv, K, 2 V]
    bf16 gets D = M − I as compose_maps reads it, rounded to bf16 (hi) beside the rest (lo).
    Where log_norms show M negligible, it walks no chunk and writes nothing: compose_maps makes the
    same test and reads no D there. Against storing D = −I there, training step 16/32 1x32768
    2781.0 -> 2765.2 µs, inference forward 4/16 1x32768 404.8 -> 393.7 (benchmark/NOTES.md v45).
    PIECE_CHUNKS (the map and offsets walks): the chunks a split's piece has at most, where it is not
    profile.checkpoint_chunks (an inference split's longer pieces, flash_qla.ops.forward.split_piece_chunks).
    """
    assert not (CHECKPOINT and STORE_H), "h holds either every state or the checkpoints"
    assert not MAPS or (STATES_ONLY and not (HAS_H0 or STORE_H or CHECKPOINT)), "MAPS walks from I, keeps the end"
    assert not KEEP_H or (STORE_H and not STATES_ONLY), "KEEP_H: h in the input dtype beside o"
    E = profile.checkpoint_chunks  # the checkpoints' spacing (CHECKPOINT)
    # SKIPS: a split's pieces have at most PIECE chunks (flash_qla.ops.forward.split_piece_chunks)
    PIECE = profile.checkpoint_chunks if PIECE_CHUNKS is None else PIECE_CHUNKS
    STAGED_H = STORE_H and (STATES_ONLY or KEEP_H)  # h in the input dtype, stored from s_s
    h_dtype = dtype if STAGED_H else "float32"
    ht_dtype, ht_cols = ("bfloat16", 2 * V) if MAPS else ("float32", V)
    C = profile.chunk
    GROUPS = Hv // Hqk
    NV = V // BV
    accum = "float32"
    THREADS = profile.fused_threads
    TILE_REGS = C * BV // THREADS  # fp32 registers per consumer thread of a [C, BV] accumulator
    STATE_REGS = K * BV // THREADS  # ... of the [K, BV] state
    tokens = T.dynamic("tokens")
    n_seqs = T.dynamic("n_seqs")
    n_h0 = T.dynamic("n_h0")
    n_chunks = T.dynamic("n_chunks")
    n_slots = T.dynamic("n_slots")
    n_bounds = T.dynamic("n_bounds")
    # the split's map and offset walks (flash_qla.ops.context_parallel): only the pieces' end
    # states, from the chunks that move them more than negligibly (kkt_solve's log_norms say which)
    SKIPS = STATES_ONLY and not STORE_H

    @T.macro
    def store_o(O_done, o_s, o, t0, valid, ih, v0):
        """o[t0 : t0 + valid] = O_done, staged through o_s for whole-row stores."""
        for i, j in T.Parallel(C, BV):
            o_s[i, j] = O_done[i, j]
        for i, j in T.Parallel(C, BV):
            if i < valid:
                o[t0 + i, ih, v0 + j] = o_s[i, j]

    @T.prim_func
    def fused_fwd(
        q: T.Tensor([1, tokens, Hqk, K], dtype),
        k: T.Tensor([1, tokens, Hqk, K], dtype),
        v: T.Tensor([1, tokens, Hv, V], dtype),
        gamma: T.Tensor([Hv, n_slots, C], accum),
        A: T.Tensor([1, tokens, Hv, C], dtype),
        P: T.Tensor([1, tokens, Hv, C], dtype),
        cu_seqlens: T.Tensor([n_seqs + 1], "int32"),
        chunk_offsets: T.Tensor([n_seqs + 1], "int32"),
        log_norms: T.Tensor([Hv, n_bounds], accum),
        h0: T.Tensor([n_h0, Hv, K, V], accum),
        o: T.Tensor([1, tokens, Hv, V], dtype),
        ht: T.Tensor([n_seqs, Hv, K, ht_cols], ht_dtype),
        h: T.Tensor([n_chunks, Hv, K, V], h_dtype),
        scale: T.float32,
    ):
        with T.Kernel(NV, Hv, n_seqs, threads=THREADS) as (iv, ih, n):
            q, k, v, A, P, o = token_major(q, k, v, A, P, o)
            ihk = ih // GROUPS
            v0 = iv * BV
            bos, first_chunk = walk_start(log_norms, ih, cu_seqlens, chunk_offsets, n, C, PIECE, SKIPS, MAPS)
            seqlen = cu_seqlens[n + 1] - bos

            q_s = T.alloc_shared([C, K], dtype)
            k_s = T.alloc_shared([C, K], dtype)
            v_s = T.alloc_shared([C, BV], dtype)
            a_s = T.alloc_shared([C, C], dtype)
            p_s = T.alloc_shared([C, C], dtype)
            gam_s = T.alloc_shared([C], accum)
            s_s = T.alloc_shared([K, BV], dtype)  # S in the input dtype, B operand
            u_s = T.alloc_shared([C, BV], dtype)  # V − diag(e^γ) K S
            vn_s = T.alloc_shared([C, BV], dtype)  # v_new
            vd_s = T.alloc_shared([C, BV], dtype)  # diag(e^{γ_L − γ}) v_new
            o_s = T.alloc_shared([C, BV + O_PAD], dtype)  # o staged for its store, rows padded

            S = T.alloc_fragment([K, BV], accum)
            W = T.alloc_fragment([C, BV], accum)
            O = T.alloc_fragment([C, BV], accum)
            VN = T.alloc_fragment([C, BV], accum)
            O_prev = T.alloc_fragment([C, BV], accum)  # the previous chunk's O, stored one chunk late
            VF = T.alloc_fragment([C, BV], dtype)  # V, read from the ring before the K S wait
            # per-row gate factors in registers, laid out like the accumulators' rows
            eg = T.alloc_fragment([C], accum)  # e^γ, 0 past the end
            ed = T.alloc_fragment([C], accum)  # e^{γ_L − γ}, 0 past the end
            g_last = T.alloc_var(accum)

            if HAS_H0:
                T.copy(h0[n, ih, :, v0:v0 + BV], S)
            elif MAPS:  # this tile's columns of I
                for d, j in T.Parallel(K, BV):
                    S[d, j] = T.if_then_else(d == v0 + j, 1.0, 0.0)
            else:
                T.clear(S)
            if not STATES_ONLY:
                T.clear(O_prev)  # stored only from the second chunk on

            for c in T.Pipelined(ring_trips(T.ceildiv(seqlen, C)), num_stages=profile.num_stages):
                t0 = bos + c * C
                valid = T.min(C, seqlen - c * C)  # tokens of this chunk in the sequence
                if not STATES_ONLY:
                    T.copy(q[t0:t0 + C, ihk, :], q_s)
                    T.copy(P[t0:t0 + C, ih, :], p_s)
                T.copy(k[t0:t0 + C, ihk, :], k_s)
                if not MAPS:
                    T.copy(v[t0:t0 + C, ih, v0:v0 + BV], v_s)
                T.copy(A[t0:t0 + C, ih, :], a_s)
                T.copy(gamma[ih, first_chunk + c, :], gam_s)

                if STORE_H and not STAGED_H:
                    T.copy(S, h[first_chunk + c, ih, :, v0:v0 + BV])
                if CHECKPOINT:
                    if c > 0 and (first_chunk + c) % E == 0:
                        T.copy(S, h[(first_chunk + c) // E, ih, :, v0:v0 + BV])
                if STAGED_H:
                    T.tma_store_wait(0)  # in the thread that issued the last chunk's h store: it has read s_s
                T.copy(S, s_s)
                if STAGED_H:  # by TMA, waited for at the next chunk's staging
                    T.tma_copy(s_s, h[first_chunk + c, ih, :, v0:v0 + BV], leader_scope_threads=THREADS)
                # S becomes the accumulator of the update: e^{γ_L} S, Kᵀ diag(e^{γ_L − γ}) v_new
                # added below (before the products are issued: S was last written by a product,
                # and ptxas waits for every pending product before such registers are read)
                g_last = gam_s[valid - 1]
                for d, j in T.Parallel(K, BV):
                    S[d, j] = S[d, j] * T.exp2(g_last * LOG2E)

                # inter-chunk terms against the state at the chunk's start: K S (the S chain)
                # and Q S (the O path) in flight together; under them, the previous chunk's o,
                # the gate factors and V into registers
                with T.ws_op("k_s_q_s"):  # one op: the ring frees q_s only after the wait
                    T.wgmma_gemm(k_s, s_s, W, clear_accum=True)
                    if not STATES_ONLY:
                        T.wgmma_gemm(q_s, s_s, O, clear_accum=True)
                        if c > 0:  # every chunk but a sequence's last is full
                            store_o(O_prev, o_s, o, t0 - C, C, ih, v0)
                    for i in T.Parallel(C):
                        eg[i] = T.if_then_else(i < valid, T.exp2(gam_s[i] * LOG2E), 0.0)
                        ed[i] = T.if_then_else(i < valid, T.exp2((g_last - gam_s[i]) * LOG2E), 0.0)
                    if not MAPS:
                        T.copy(v_s, VF)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(W, num_regs=TILE_REGS)
                    if not STATES_ONLY:
                        T.warpgroup_fence_operand(O, num_regs=TILE_REGS)
                if valid < C:  # a sequence's last chunk: the next sequence's rows (past valid) out of the
                    zero_rows_past(k_s, valid)  # update's Kᵀ, and of U = V − diag(e^γ) K S (K S's rows there read k's)
                    for i, j in T.Parallel(C, BV):
                        W[i, j] = T.if_then_else(i < valid, W[i, j], 0.0)
                    if not MAPS:
                        for i, j in T.Parallel(C, BV):
                            VF[i, j] = T.if_then_else(i < valid, VF[i, j], T.cast(0, dtype))
                if MAPS:  # V = 0
                    for i, j in T.Parallel(C, BV):
                        u_s[i, j] = -W[i, j] * eg[i]
                else:
                    for i, j in T.Parallel(C, BV):
                        u_s[i, j] = VF[i, j] - W[i, j] * eg[i]
                T.gemm(a_s, u_s, VN, clear_accum=True)
                if valid < C:  # A's rows there are the next sequence's
                    for i, j in T.Parallel(C, BV):
                        VN[i, j] = T.if_then_else(i < valid, VN[i, j], 0.0)
                for i, j in T.Parallel(C, BV):
                    vd_s[i, j] = VN[i, j] * ed[i]
                    if not STATES_ONLY:  # v_new's tile, from this loop (a stmatrix copy took a barrier of its own)
                        vn_s[i, j] = VN[i, j]
                if not STATES_ONLY:
                    for i, j in T.Parallel(C, BV):
                        O[i, j] = O[i, j] * eg[i]

                # S += Kᵀ diag(e^{γ_L − γ}) v_new (the S chain) and O += P v_new in flight together
                with T.ws_op("k_s_p_s"):  # one op: the ring frees k_s and p_s only after the wait
                    T.wgmma_gemm(k_s, vd_s, S, transpose_A=True)
                    if not STATES_ONLY:
                        T.wgmma_gemm(p_s, vn_s, O)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(S, num_regs=STATE_REGS)
                    if not STATES_ONLY:
                        T.warpgroup_fence_operand(O, num_regs=TILE_REGS)
                if not STATES_ONLY:
                    # stored under the next chunk's products. A multiply, not a copy: a copy is
                    # propagated away, the store then reads registers a product wrote last, and
                    # ptxas makes it wait for the next chunk's products
                    for i, j in T.Parallel(C, BV):
                        O_prev[i, j] = O[i, j] * scale

            if STAGED_H:
                T.tma_store_wait(0)  # the last h store has read s_s before the block's shared memory goes
            if not STATES_ONLY and seqlen > 0:
                last = (seqlen - 1) // C
                store_o(O_prev, o_s, o, bos + last * C, seqlen - last * C, ih, v0)
            if MAPS:
                if seqlen > 0:  # no D where M is negligible (every chunk skipped) or the piece empty
                    for d, j in T.Parallel(K, BV):
                        S[d, j] = S[d, j] - T.if_then_else(d == v0 + j, 1.0, 0.0)
                    for d, j in T.Parallel(K, BV):
                        ht[n, ih, d, v0 + j] = S[d, j]
                        ht[n, ih, d, V + v0 + j] = S[d, j] - T.cast(T.cast(S[d, j], ht_dtype), accum)
            else:
                T.copy(S, ht[n, ih, :, v0:v0 + BV])

    return tilelang.compile(fused_fwd, target=profile.target)
