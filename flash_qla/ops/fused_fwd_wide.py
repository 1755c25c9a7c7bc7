"""Fused chunked forward for V-tiles of 64 and 128: the walk of fused_fwd with the state transposed.

Computes what fused_fwd computes (o, the final state and, when asked, h; the same
math, rounding and masking: on a sequence's last chunk each consumer warpgroup zeroes the k
tile's rows past the end itself, staging.zero_rows_past_by_warpgroup), for V-tiles of
BV = 64 · (consumer warpgroups) columns, with every product transposed so that the V columns are
its M side:

    Wᵀ     = Sᵀ Kᵀ                                             [BV, C]
    Uᵀ     = Vᵀ − Wᵀ diag(e^γ)                                 [BV, C]
    v_newᵀ = Uᵀ Aᵀ                                             [BV, C]
    Oᵀ     = scale · (Sᵀ Qᵀ diag(e^γ) + v_newᵀ Pᵀ)              [BV, C]
    Sᵀ    <- e^{γ_L} Sᵀ + v_newᵀ diag(e^{γ_L − γ}) K           [BV, K]

Sᵀ, Uᵀ and v_newᵀ are then the A operands of the next products, which wgmma reads straight
from registers (rounded to the input dtype, as fused_fwd rounds them into shared memory):
only the TMA'd q, k, A and P tiles are read from shared memory, and no tile the consumers
write is staged there except o for its store. So the consumer warpgroups, one per 64
columns, share the ring's q, k, A and P tiles but nothing else: each runs an independent
chain, and two chains per SM hide each other's latency. They never wait for each other
either: each stages and stores only its own 64 columns of o, between named barriers of its
own 128 threads (o_s is the only shared tile the consumers write, and TileLang, seeing these
barriers, adds no block-wide one; the ring is synchronised by its mbarriers). 16/32 8x4096: the walk takes 0.291 ms (0.333 with one consumer-wide barrier pair
per chunk, fused_fwd at BV = 64 0.466; benchmark/NOTES.md v7 steps 2-3, v8 step 1). wgmma's
M is 64 rows per warpgroup, so this form needs BV >= 64; narrower tiles (few sequences x
heads) run fused_fwd. At BV = 64 (one chain per block) it takes 0.8 of fused_fwd's time at
that width: 2/8 8x4096 0.119 -> 0.096 ms, 16/64 1x32768 0.894 -> 0.715, outputs bitwise
equal (benchmark/NOTES.md v10).

Inputs and outputs as fused_fwd, except that the gate arrives as kkt_solve's `gates`
[Hv, slots, 2, C] fp32 (e^γ and e^{γ_L − γ}, 0 past the chunk's end) in the place of γ.
Schedule: grid (V / BV, Hv, N); TileLang's warp specialization: a producer warpgroup (its warp 0:
launch.ring_trips) streams the tiles through a `num_stages`-deep TMA ring, BV / 64 consumer warpgroups (every product
splits its M = BV rows over them, `FullRow`). Per chunk the S chain is three dependent
products (Sᵀ Kᵀ, Uᵀ Aᵀ, v_newᵀ K); Sᵀ Qᵀ and v_newᵀ Pᵀ are issued next to them, and
under the first pair the consumers store the previous chunk's o and read the gate factors
(o is staged transposed by stmatrix at BV = 64, by 2-byte stores at 128: staging.row_store).
That O path is a third of the walk at BV = 64 (2/8 8x4096: 93 µs, the chain without it 57-60), and
it costs the chain through the SM they share, not by sitting on the chain: on a warpgroup of its
own in a hand-specialized prototype (o bitwise equal) the walk took 88 µs, its products, stores and
the chain's staging of Sᵀ and v_newᵀ for it still taking ~30 µs (benchmark/NOTES.md v34).
The gate factors scale columns here (tokens are the N side): each thread keeps e^γ and
e^{γ_L − γ} of the 16 columns its accumulator fragments hold, read from the ring's copy of
kkt_solve's `gates` (computed here, they were 32 exponentials a thread per chunk, 64x the
distinct values). V is read transposed from its ring tile, which is swizzled so that a
warp's reads hit distinct banks. The recompute (STATES_ONLY) stages each chunk's Sᵀ in shared
memory as h's rows and stores it by TMA, each warpgroup its own 64 columns (staging.state_store;
against element-wise stores from the registers 0.351 -> 0.289 ms at 16/32 8x4096, h bitwise
equal, benchmark/NOTES.md v13), and so does the
training forward that keeps the states (KEEP_H: h in the input dtype beside o); the fp32 h of
STORE_H alone and the checkpoints are still stored element by element from the registers.

PACKED (the inference forward over many short sequences, flash_qla.ops.forward.sequences_per_block):
grid (V / BV, Hv, groups), a block walks the global chunks of the sequences groups[n] .. groups[n + 1]
in one ring, their state started at each sequence's first chunk (from h0, or zero) and stored to the
final states after its last, the empty ones' final states their initial ones. The chunks' token
offsets no longer follow from one sequence start: chunk_rows' row of each (first token, tokens,
sequence, flags) comes through the ring with its tiles (the producer reads the first token itself
for the tiles' coordinates), in a 128-byte stage (a TMA destination's alignment), and the previous
chunk's o is stored at its own offset and length. Per chunk the same arithmetic: o and the final states
bitwise those of one sequence a block. H100 (benchmark/NOTES.md v75 step 3), kernels of the inference
forward: 2/8 over 1024 sequences of 8 tokens 502 -> 345 µs (32 a block), 16/32 1964 -> 1347 (128);
512 of 64 tokens 292 -> 263 and 1125 -> 1077: what is left a sequence is its chunk's chain and its
final state's stores (64 KiB a v-head at 128 columns: 537 MB over 1024 sequences at 2/8, 0.16 ms at the
H100's 3.35 TB/s). The empty sequences' final states are copied after the walk, the columns the threads'
fastest index (16-byte stores; with the rows fastest, 2/8 over 512 sequences of 64 tokens and 512 empty ones
took 1249 µs against 333 one a block on the H200, v75 step 2).
Arguments as the walk's but (…, P, groups [n_groups + 1], chunk_offsets, rows [slots, 4], h0, o, ht,
scale).
"""

import tilelang
import tilelang.language as T
from tilelang.layout import make_full_bank_swizzled_layout

from flash_qla.arch import ArchProfile
from flash_qla.ops.chunks import ROW_FIELDS
from flash_qla.ops.launch import follow_previous_kernel, kernel_factory, ring_trips, token_major
from flash_qla.ops.negligible import walk_start
from flash_qla.ops.staging import (
    ROWS_PER_WARPGROUP,
    STAGE_PAD,
    alloc_state_stage,
    row_store,
    state_store,
    state_stores_done,
    zero_rows_past_by_warpgroup,
)


@kernel_factory
def fused_fwd_wide_kernel(
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
    PACKED: bool = False,
):
    """Compile (or load from TileLang's cache) the wide-tile fused forward for one static config.

    Arguments as fused_fwd_kernel; BV is a multiple of 64 (one consumer warpgroup per 64 columns).
    """
    assert not (CHECKPOINT and STORE_H), "h holds either every state or the checkpoints"
    assert not MAPS or (STATES_ONLY and not (HAS_H0 or STORE_H or CHECKPOINT)), "MAPS walks from I, keeps the end"
    assert not KEEP_H or (STORE_H and not STATES_ONLY), "KEEP_H: h in the input dtype beside o"
    assert not PACKED or not (STORE_H or STATES_ONLY or CHECKPOINT), "PACKED: the inference forward (o, final states)"
    E = profile.checkpoint_chunks  # the checkpoints' spacing (CHECKPOINT)
    # SKIPS: a split's pieces have at most PIECE chunks (flash_qla.ops.forward.split_piece_chunks)
    PIECE = profile.checkpoint_chunks if PIECE_CHUNKS is None else PIECE_CHUNKS
    assert BV % ROWS_PER_WARPGROUP == 0, "one consumer warpgroup per 64 rows of Sᵀ"
    STAGED_H = STORE_H and (STATES_ONLY or KEEP_H)  # h in the input dtype, staged for its TMA store
    h_dtype = dtype if STAGED_H else "float32"
    # MAPS ends in D = M − I as compose_maps' operands: bf16 halves hi | lo side by side
    ht_dtype, ht_cols = ("bfloat16", 2 * V) if MAPS else ("float32", V)
    C = profile.chunk
    GROUPS = Hv // Hqk
    NV = V // BV
    accum = "float32"
    THREADS = 128 * BV // ROWS_PER_WARPGROUP
    ROWS = T.GemmWarpPolicy.FullRow  # every product splits its M = BV rows over the warpgroups
    TILE_REGS = C * BV // THREADS  # fp32 registers per consumer thread of a [BV, C] accumulator
    STATE_REGS = K * BV // THREADS  # ... of the [BV, K] state
    tokens = T.dynamic("tokens")
    n_seqs = T.dynamic("n_seqs")
    n_h0 = T.dynamic("n_h0")
    n_chunks = T.dynamic("n_chunks")
    n_slots = T.dynamic("n_slots")
    n_bounds = T.dynamic("n_bounds")
    n_groups = T.dynamic("n_groups")
    # the split's map and offset walks (flash_qla.ops.context_parallel): only the pieces' end
    # states, from the chunks that move them more than negligibly (kkt_solve's log_norms say which)
    SKIPS = STATES_ONLY and not STORE_H

    ROW_STAGE = 32  # int32s of a chunk row's shared copy: 128 bytes, so that every stage of the ring starts aligned
    store_o = row_store(BV, C)  # o[t0 : t0 + valid] = Otᵀ, each warpgroup its own 64 columns
    store_h = state_store(BV, K)  # h[c] = Sbᵀ (the recompute's), each warpgroup its own 64 columns
    zero_k_rows = zero_rows_past_by_warpgroup(C, K)  # k_s[valid:] = 0, each warpgroup for itself

    def chunks_walked(seqlen, first_chunk, chunk_offsets, end_seq):
        """The block's chunk count: its sequence's (or piece's), or PACKED its sequences' together."""
        return chunk_offsets[end_seq] - first_chunk if PACKED else T.ceildiv(seqlen, C)

    @T.macro
    def walk(q, k, v, gates, A, P, cu_seqlens, chunk_offsets, log_norms, h0, o, ht, h, scale, bx, ih, n, rows):
        """The block (bx, ih, n): V-tile, v-head and sequence (piece), or PACKED the group of sequences
        cu_seqlens[n] .. cu_seqlens[n + 1] (the walk's `groups`) whose chunks `rows` describe."""
        ihk = ih // GROUPS
        v0 = bx * BV
        tx = T.get_thread_binding()
        if PACKED:
            first_seq = cu_seqlens[n]
            end_seq = cu_seqlens[n + 1]
            first_chunk = chunk_offsets[first_seq]
            seqlen = None
        else:
            bos, first_chunk = walk_start(log_norms, ih, cu_seqlens, chunk_offsets, n, C, PIECE, SKIPS, MAPS)
            seqlen = cu_seqlens[n + 1] - bos
            end_seq = None

        q_s = T.alloc_shared([C, K], dtype)
        k_s = T.alloc_shared([C, K], dtype)
        v_s = T.alloc_shared([C, BV], dtype)
        a_s = T.alloc_shared([C, C], dtype)
        p_s = T.alloc_shared([C, C], dtype)
        gates_s = T.alloc_shared([2, C], accum)  # e^γ, e^{γ_L − γ}
        if PACKED:  # the chunk's row: first token, tokens, sequence, flags (1: its first chunk, 2: its last)
            rows_s = T.alloc_shared([ROW_STAGE], "int32")  # a TMA destination: each ring stage 128-byte aligned
            prev_t0 = T.alloc_var("int32")  # the previous chunk's first token and tokens, for its o
            prev_valid = T.alloc_var("int32")
        o_s = T.alloc_shared([C, BV + STAGE_PAD], dtype)  # o staged for its store, rows padded
        if STAGED_H:
            h_s = alloc_state_stage(BV, K, dtype)  # h staged for its TMA store
        # V is read a column per thread group: swizzled 128-byte rows, else the rows a warp
        # reads at once (2 apart) all start in one bank
        T.annotate_layout({v_s: make_full_bank_swizzled_layout(v_s)})

        St = T.alloc_fragment([BV, K], accum)  # Sᵀ
        Sb = T.alloc_fragment([BV, K], dtype)  # Sᵀ in the input dtype: A operand
        Wt = T.alloc_fragment([BV, C], accum)  # (K S)ᵀ
        Ot = T.alloc_fragment([BV, C], accum)
        Ub = T.alloc_fragment([BV, C], dtype)  # Uᵀ: A operand
        VNt = T.alloc_fragment([BV, C], accum)  # v_newᵀ
        VNb = T.alloc_fragment([BV, C], dtype)  # v_newᵀ: A operand
        VDb = T.alloc_fragment([BV, C], dtype)  # v_newᵀ diag(e^{γ_L − γ}): A operand
        Ot_prev = T.alloc_fragment([BV, C], dtype)  # the previous chunk's o, stored one chunk late
        # per-column gate factors, laid out like the accumulators' columns
        eg = T.alloc_fragment([C], accum)  # e^γ, 0 past the end
        ed = T.alloc_fragment([C], accum)  # e^{γ_L − γ}, 0 past the end
        decay = T.alloc_var(accum)  # e^{γ_L}

        if PACKED:  # the state starts at each sequence's first chunk
            prev_t0 = 0
            prev_valid = 0
        elif HAS_H0:
            for j, d in T.Parallel(BV, K):
                St[j, d] = h0[n, ih, d, v0 + j]
        elif MAPS:  # this tile's columns of I
            for j, d in T.Parallel(BV, K):
                St[j, d] = T.if_then_else(d == v0 + j, 1.0, 0.0)
        else:
            T.clear(St)
        if not STATES_ONLY:
            T.clear(Ot_prev)  # stored only from the second chunk on

        for c in T.Pipelined(
            ring_trips(chunks_walked(seqlen, first_chunk, chunk_offsets, end_seq)), num_stages=profile.num_stages
        ):
            if PACKED:
                T.copy(rows[first_chunk + c, :], rows_s[:ROW_FIELDS])
                t0 = rows[first_chunk + c, 0]  # the copies' (the producer's); the consumers read rows_s
                valid = rows_s[1]
                if rows_s[3] % 2 == 1:  # a sequence's first chunk: its initial state
                    if HAS_H0:
                        for j, d in T.Parallel(BV, K):
                            St[j, d] = h0[rows_s[2], ih, d, v0 + j]
                    else:
                        T.clear(St)
            else:
                t0 = bos + c * C
                valid = T.min(C, seqlen - c * C)  # tokens of this chunk in the sequence
            if not STATES_ONLY:
                T.copy(q[t0:t0 + C, ihk, :], q_s)
                T.copy(P[t0:t0 + C, ih, :], p_s)
            T.copy(k[t0:t0 + C, ihk, :], k_s)
            if not MAPS:
                T.copy(v[t0:t0 + C, ih, v0:v0 + BV], v_s)
            T.copy(A[t0:t0 + C, ih, :], a_s)
            T.copy(gates[ih, first_chunk + c, :, :], gates_s)

            if STORE_H and not STAGED_H:
                for j, d in T.Parallel(BV, K):
                    h[first_chunk + c, ih, d, v0 + j] = St[j, d]
            if CHECKPOINT:
                if c > 0 and (first_chunk + c) % E == 0:
                    for j, d in T.Parallel(BV, K):
                        h[(first_chunk + c) // E, ih, d, v0 + j] = St[j, d]
            T.copy(St, Sb)
            if STAGED_H:
                store_h(Sb, h_s, h, first_chunk + c, ih, v0, tx)
            # Sᵀ becomes the accumulator of the update (before the issue: see fused_fwd)
            decay = gates_s[0, valid - 1]
            for j, d in T.Parallel(BV, K):
                St[j, d] = St[j, d] * decay

            # (K S)ᵀ (the S chain) and (Q S)ᵀ (the O path) in flight together; under them the
            # previous chunk's o and the gate factors
            with T.ws_op("k_s_q_s"):  # one op: the ring frees q_s only after the wait
                T.wgmma_gemm(Sb, k_s, Wt, transpose_B=True, clear_accum=True, policy=ROWS)
                if not STATES_ONLY:
                    T.wgmma_gemm(Sb, q_s, Ot, transpose_B=True, clear_accum=True, policy=ROWS)
                    if c > 0:  # the previous chunk's: full within a sequence, PACKED maybe a sequence's last
                        if PACKED:
                            store_o(Ot_prev, o_s, o, prev_t0, prev_valid, ih, v0, tx)
                        else:
                            store_o(Ot_prev, o_s, o, t0 - C, C, ih, v0, tx)
                for i in T.Parallel(C):
                    eg[i] = gates_s[0, i]
                    ed[i] = gates_s[1, i]
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(Wt, num_regs=TILE_REGS)
                if not STATES_ONLY:
                    T.warpgroup_fence_operand(Ot, num_regs=TILE_REGS)
            if valid < C:  # a sequence's last chunk: the next sequence's k rows out of the update
                zero_k_rows(k_s, None, valid, tx)
            if MAPS:  # V = 0
                for j, i in T.Parallel(BV, C):
                    Ub[j, i] = -Wt[j, i] * eg[i]
            else:
                for j, i in T.Parallel(BV, C):
                    Ub[j, i] = v_s[i, j] - Wt[j, i] * eg[i]
            if valid < C:  # and out of Uᵀ (from V's and K S's columns there) and v_newᵀ (from A's rows)
                for j, i in T.Parallel(BV, C):
                    Ub[j, i] = T.if_then_else(i < valid, Ub[j, i], T.cast(0, dtype))
            T.gemm(Ub, a_s, VNt, transpose_B=True, clear_accum=True, policy=ROWS)
            if valid < C:
                for j, i in T.Parallel(BV, C):
                    VNt[j, i] = T.if_then_else(i < valid, VNt[j, i], 0.0)
            for j, i in T.Parallel(BV, C):
                VDb[j, i] = VNt[j, i] * ed[i]
            if not STATES_ONLY:
                for j, i in T.Parallel(BV, C):
                    Ot[j, i] = Ot[j, i] * eg[i]
                T.copy(VNt, VNb)

            # Sᵀ += v_newᵀ diag(e^{γ_L − γ}) K (the S chain) and Oᵀ += v_newᵀ Pᵀ in flight together
            with T.ws_op("k_s_p_s"):  # one op: the ring frees k_s and p_s only after the wait
                T.wgmma_gemm(VDb, k_s, St, policy=ROWS)
                if not STATES_ONLY:
                    T.wgmma_gemm(VNb, p_s, Ot, transpose_B=True, policy=ROWS)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(St, num_regs=STATE_REGS)
                if not STATES_ONLY:
                    T.warpgroup_fence_operand(Ot, num_regs=TILE_REGS)
            if not STATES_ONLY:  # rounded now: the store under the next products reads these
                for j, i in T.Parallel(BV, C):
                    Ot_prev[j, i] = Ot[j, i] * scale
            if PACKED:
                prev_t0 = rows_s[0]
                prev_valid = valid
                if rows_s[3] >= 2:  # a sequence's last chunk: its final state
                    for j, d in T.Parallel(BV, K):
                        ht[rows_s[2], ih, d, v0 + j] = St[j, d]

        if STAGED_H:
            state_stores_done()
        if PACKED:
            if chunk_offsets[end_seq] > first_chunk:
                store_o(Ot_prev, o_s, o, prev_t0, prev_valid, ih, v0, tx)
            # the group's empty sequences: their initial state, the columns (contiguous in ht) the threads' fastest
            # index (over (j, d) a warp's 4-byte stores fell 32 rows of ht apart: a sector each)
            for s in T.serial(first_seq, end_seq):
                if chunk_offsets[s + 1] == chunk_offsets[s]:
                    if HAS_H0:
                        for d, j in T.Parallel(K, BV):
                            ht[s, ih, d, v0 + j] = h0[s, ih, d, v0 + j]
                    else:
                        for d, j in T.Parallel(K, BV):
                            ht[s, ih, d, v0 + j] = 0.0
        elif not STATES_ONLY and seqlen > 0:
            last = (seqlen - 1) // C
            store_o(Ot_prev, o_s, o, bos + last * C, seqlen - last * C, ih, v0, tx)
        if MAPS:
            if seqlen > 0:  # no D where M is negligible (every chunk skipped) or the piece empty
                for j, d in T.Parallel(BV, K):
                    St[j, d] = St[j, d] - T.if_then_else(d == v0 + j, 1.0, 0.0)
                for j, d in T.Parallel(BV, K):
                    ht[n, ih, d, v0 + j] = St[j, d]
                    ht[n, ih, d, V + v0 + j] = St[j, d] - T.cast(T.cast(St[j, d], ht_dtype), accum)
        elif not PACKED:
            for j, d in T.Parallel(BV, K):
                ht[n, ih, d, v0 + j] = St[j, d]

    # two signatures (the packed walk takes the groups and the chunks' rows in place of cu_seqlens, log_norms and h)
    if PACKED:

        @T.prim_func
        def fused_fwd_wide(
            q: T.Tensor([1, tokens, Hqk, K], dtype),
            k: T.Tensor([1, tokens, Hqk, K], dtype),
            v: T.Tensor([1, tokens, Hv, V], dtype),
            gates: T.Tensor([Hv, n_slots, 2, C], accum),
            A: T.Tensor([1, tokens, Hv, C], dtype),
            P: T.Tensor([1, tokens, Hv, C], dtype),
            groups: T.Tensor([n_groups + 1], "int32"),
            chunk_offsets: T.Tensor([n_seqs + 1], "int32"),
            rows: T.Tensor([n_slots, ROW_FIELDS], "int32"),
            h0: T.Tensor([n_h0, Hv, K, V], accum),
            o: T.Tensor([1, tokens, Hv, V], dtype),
            ht: T.Tensor([n_seqs, Hv, K, ht_cols], ht_dtype),
            scale: T.float32,
        ):
            with T.Kernel(NV, Hv, n_groups, threads=THREADS) as (iv, ih, n):
                q, k, v, A, P, o = token_major(q, k, v, A, P, o)
                follow_previous_kernel()
                walk(q, k, v, gates, A, P, groups, chunk_offsets, None, h0, o, ht, None, scale, iv, ih, n, rows)

        return tilelang.compile(fused_fwd_wide, target=profile.target)

    @T.prim_func
    def fused_fwd_wide(
        q: T.Tensor([1, tokens, Hqk, K], dtype),
        k: T.Tensor([1, tokens, Hqk, K], dtype),
        v: T.Tensor([1, tokens, Hv, V], dtype),
        gates: T.Tensor([Hv, n_slots, 2, C], accum),
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
            follow_previous_kernel()
            walk(q, k, v, gates, A, P, cu_seqlens, chunk_offsets, log_norms, h0, o, ht, h, scale, iv, ih, n, None)

    return tilelang.compile(fused_fwd_wide, target=profile.target)
