"""Fused chunked forward at 64 columns with the O path on warpgroups of its own, forming P itself.

Computes o and the final state of every (sequence, v-head, 64-column V-tile), what
fused_fwd_wide computes at BV = 64 for an inference forward (no h, no checkpoints), from
kkt_solve's A and γ without its P (kkt_solve with FORM_P off): P is formed here. With S the
state of the V-tile (held as Sᵀ [BV, K]), per chunk of C tokens:

  the S chain (one warpgroup, the chain of fused_fwd_wide):
    Wᵀ     = Sᵀ Kᵀ,  Uᵀ = Vᵀ − Wᵀ diag(e^γ),  v_newᵀ = Uᵀ Aᵀ     [BV, C]
    Sᵀ    <- e^{γ_L} Sᵀ + v_newᵀ diag(e^{γ_L − γ}) K              [BV, K]
  the O path (two warpgroups, alternate chunks), in o's own orientation:
    P      = Q Kᵀ ⊙ Γ ⊙ Lower,  Γ_ij = 2^{(γ_i − γ_j) log2 e}     [C, C]
    O      = scale · (diag(e^γ) Q S + P v_new)                    [C, BV]

P is kkt_solve's P (the same product and factors; it is rounded to the input dtype as the A
operand of P v_new, where kkt_solve rounded it for its store), so o matches fused_fwd_wide's
to rounding (2/8 8x4096: 1.5e-5 relative; both 3.4e-3 from the fp32 reference) and the final
state is bitwise equal.

Inputs (packed varlen, T tokens in all;
the token-major tensors, outputs too, passed packed, [1, T, ...], and read as the [T, ...] shown: launch.token_major):
    q, k        [T, Hqk, K]  input dtype; v-head h reads qk-head h // (Hv // Hqk)
    v           [T, Hv, V]   input dtype
    gates       [Hv, slots, 2, C] fp32, e^γ and e^{γ_L − γ} (kkt_solve)
    A           [T, Hv, C]   input dtype (kkt_solve)
    gamma       [Hv, slots, C] fp32, γ chunk-major (kkt_solve)
    cu_seqlens, chunk_offsets [N + 1] int32
    h0          [N, Hv, K, V] fp32 (HAS_H0; else any [1, Hv, K, V] placeholder)
Outputs (then scale, float, the last argument):
    o           [T, Hv, V]   input dtype
    ht          [N, Hv, K, V] fp32, the final state

Schedule: grid (V / 64, Hv, N), 512 threads, one block an SM (216 320 bytes of shared memory):
- warp 0 streams k, the gates, v, A, q and γ of each chunk by TMA into a 3-deep ring (full /
  empty mbarriers; a slot is free once the chain and the chunk's O warpgroup have read it);
  its warpgroup keeps 24 registers a thread (setmaxnreg). A sequence's last chunk, when it ends
  before the tile does, it loads onto an mbarrier of its own, waits for it, zeroes the rows past
  the end of k, v and A (the next sequence's: so nothing of them, not even an Inf or NaN, reaches
  S or o, where gate factors and masks of 0 would not cancel it) and only then hands the slot
  over; the consumers' loops carry no masking of their own (the chain's, zeroing and selecting
  itself, ran 7 % slower on every chunk: benchmark/NOTES.md, session 66);
- warpgroup 3, the chain (240 registers): as fused_fwd_wide's at BV = 64, with Sᵀ (rounded)
  staged for the O path under Sᵀ Kᵀ and v_newᵀ under the state update, each by stmatrix into the
  tile of the chunk's parity (mbarriers sfull / sempty, vfull / vempty, one pair a parity), and
  Vᵀ read from the ring by ldmatrix.trans under Sᵀ Kᵀ (4 instructions a thread where 2-byte
  loads took 32);
- warpgroups 1 and 2 (120 registers), the O path of the even and the odd chunks: Q Kᵀ (wgmma,
  both operands from the ring) as soon as the chunk is in, P formed in its accumulator's
  registers, then Q S from the staged Sᵀ, the e^γ row scale, P v_new (P the A operand straight
  from registers) from the staged v_newᵀ, and o staged by stmatrix into a swizzled tile of the
  warpgroup's own and stored by one TMA bulk store (a sequence's last chunk by rows: its rows
  past the end are the next sequence's), between named barriers of the warpgroup's 128 threads
  (ids 10 and 11, clear of those TileLang numbers itself).
The roles hand tiles over by mbarriers alone, and within the chain no thread reads shared memory
another chain thread wrote, so the kernel is compiled without TileLang's thread-storage sync pass,
whose barriers (four a chunk on the chain, one on each O warpgroup) ordered nothing that needed it.
Each O warpgroup has two chunks' time for each of its chunks, so the chain stages S_{c+1}
without waiting for chunk c's O path; what the O path still costs the chain is the SM they
share (its products on the tensor cores, its issue slots).

Measured on the H200 (benchmark/NOTES.md v37, v38), bf16, kernel time: at 2/8 8x4096 kkt_solve
without P takes 49.2 µs against 64.5 and this walk 104-105.5 against fused_fwd_wide's 93 (with
one O warpgroup for all chunks it took 120.5: P's product and exponentials made the O path
longer than the chain). The library's inference forward with this route / with kkt_solve's P
and fused_fwd_wide, in one process, µs: 2/8 8x4096 150.3 / 157.6, 4/8 8x4096 152.3 / 160.7,
8/32 2x4096 153.0 / 159.6, 16/48 3x2048 207.2 / 214.7, 16/64 1x2048 80.3 / 85.5, 16/64 1x32768
1099.7 / 1152.7 (v37). Without the sync pass's barriers, with the stagings and V's read by
stmatrix / ldmatrix (v38, outputs bitwise equal): 2/8 8x4096 149.1 -> 144.3 µs (the barriers
alone -1.1, the three together -4.8), 4/8 8x4096 151.1 -> 146.4, 16/64 1x2048 80.1 -> 77.8; V
read under Sᵀ Kᵀ rather than after it, 1.1-1.5 µs more (2/8 145.2-145.8 -> 143.7-144.3). The
forward takes this walk for o alone wherever flash_qla.ops.forward.o_path_pays says it pays: where
its walk over whole sequences would run at 64 columns, at 32 from ~19 sequence-heads, and at 128 from ~119
(v48: 0.5-2 % faster there, 10 % at 16/16 8x4096; in v38, before V's read moved, 2.4-3.6 % slower at
16/32, 8/32, 4/16, 16/64, 16/48 8x4096), and over a split's pieces by the same model (the pieces are its sequences:
their token bounds and first chunks as cu_seqlens and chunk_offsets, their start states as h0, their end states as
ht; H100, inference forward, 0.84-0.94x, e.g. 16/32 28672+4096 810.0 -> 753.5 µs, 16/16 16384+16384 490.1 -> 413.6,
benchmark/NOTES.md v85 step 6), but never where that walk would run at 128 columns and no sequence has a fifth
chunk: the two O warpgroups take alternate chunks and hide each one's P under the later chunks' chains, and this
walk has twice that walk's blocks (flash_qla.ops.forward.SHORT_CHUNKS; H100, 2/8 over 1024 sequences of 8 tokens
648.8 against 494.9 µs at 128 columns, over 170 of 192 201.7 against 192.2, benchmark/NOTES.md sessions 73 and
76). A training forward keeps
kkt_solve's P for the backward and walks with fused_fwd_wide (this walk with that P loaded into
the O warpgroups' registers instead of formed: 99-100 µs against fused_fwd_wide's 93 at 2/8
8x4096, v38 step 6), and the low-level forward's h is fused_fwd_wide's.
"""

import tilelang
import tilelang.language as T
from tilelang.layout import make_full_bank_swizzled_layout
from tilelang.transform import PassConfigKey

from flash_qla.arch import ArchProfile
from flash_qla.ops.launch import follow_previous_kernel, kernel_factory, token_major
from flash_qla.ops.staging import load_transposed, stage_rows, zero_rows_past_by_lanes

LOG2E = 1.4426950408889634
BV = 64  # one chain: the V-tile is wgmma's M of one warpgroup
STAGES = 3  # the ring's depth (2 cost the O-warpgroup walk 7 µs: benchmark/NOTES.md v34)
O_BARRIER = 10  # named barriers of the O warpgroups' stagings: 10 and 11
# a thread's registers by warpgroup role (setmaxnreg): 24 + 2·120 + 240 = 504 <= 4 · 128, the launch's 128 a thread
# over four warpgroups (a setmaxnreg to the launch's own 128 faults on the H200: benchmark/NOTES.md v37 step 1)
REGS_LOADS, REGS_O, REGS_CHAIN = 24, 120, 240


@kernel_factory
def fused_fwd_opath_kernel(Hqk: int, Hv: int, K: int, V: int, dtype: str, profile: ArchProfile, HAS_H0: bool):
    """Compile (or load from TileLang's cache) the O-path walk for one static config."""
    C = profile.chunk
    GROUPS = Hv // Hqk
    NV = V // BV
    accum = "float32"
    tokens = T.dynamic("tokens")
    n_seqs = T.dynamic("n_seqs")
    n_h0 = T.dynamic("n_h0")
    n_slots = T.dynamic("n_slots")
    stage_o = stage_rows(BV)
    stage_s = stage_rows(K)
    stage_vn = stage_rows(C)
    load_vt = load_transposed(C)
    zero_k_rows = zero_rows_past_by_lanes(C, K, 32)  # by the loading warp, on a sequence's last chunk
    zero_v_rows = zero_rows_past_by_lanes(C, BV, 32)
    zero_a_rows = zero_rows_past_by_lanes(C, C, 32)

    @T.macro
    def load_chunk(q, k, v, A, gates, gamma, q_s, k_s, v_s, a_s, gates_s, gam_s, s, t0, slot, ihk, ih, v0, bars, b):
        """A chunk's tiles (slot its gates' and γ's) into ring slot s by TMA, onto mbarrier bars[b]."""
        T.tma_copy(k[t0:t0 + C, ihk, :], k_s[s, :, :], barrier=bars[b])
        T.tma_copy(gates[ih, slot, :, :], gates_s[s, :, :], barrier=bars[b])
        T.tma_copy(v[t0:t0 + C, ih, v0:v0 + BV], v_s[s, :, :], barrier=bars[b])
        T.tma_copy(A[t0:t0 + C, ih, :], a_s[s, :, :], barrier=bars[b])
        T.tma_copy(q[t0:t0 + C, ihk, :], q_s[s, :, :], barrier=bars[b])
        T.tma_copy(gamma[ih, slot, :], gam_s[s, :], barrier=bars[b])

    @T.macro
    def o_path(
        p: int, PK, PKb, O, Ob, gr, gc, og, q_s, k_s, gam_s, gates_s, s_buf, vn_buf, o_s, o, full, empty,
        sfull, sempty, vfull, vempty, seqlen, bos, ih, v0, tx, scale,
    ):  # fmt: skip
        """O warpgroup p's chunks p, p + 2, ...: P, O, and o's store."""
        for cc in T.serial(T.ceildiv(T.ceildiv(seqlen, C) - p, 2)):
            c = 2 * cc + p
            s = c % STAGES
            t0 = bos + c * C
            valid = T.min(C, seqlen - c * C)
            T.mbarrier_wait_parity(full[s], (c // STAGES) & 1)
            T.wgmma_gemm(q_s[s, :, :], k_s[s, :, :], PK, transpose_B=True, clear_accum=True)
            for i in T.Parallel(C):
                gr[i] = gam_s[s, i] * LOG2E
                og[i] = gates_s[s, 0, i]
            for j in T.Parallel(C):
                gc[j] = gam_s[s, j] * LOG2E
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(PK, num_regs=C * C // 128)
            for i, j in T.Parallel(C, C):
                PKb[i, j] = T.if_then_else(j <= i, PK[i, j] * T.exp2(gr[i] - gc[j]), 0.0)
            T.mbarrier_wait_parity(sfull[p], cc & 1)
            T.wgmma_gemm(q_s[s, :, :], s_buf[p, :, :], O, transpose_B=True, clear_accum=True)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(O, num_regs=C * BV // 128)
            T.mbarrier_arrive(sempty[p])
            for i, j in T.Parallel(C, BV):
                O[i, j] = O[i, j] * og[i]
            T.mbarrier_wait_parity(vfull[p], cc & 1)
            T.wgmma_gemm(PKb, vn_buf[p, :, :], O, transpose_B=True)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(O, num_regs=C * BV // 128)
            T.mbarrier_arrive(vempty[p])
            T.mbarrier_arrive(empty[s])
            for i, j in T.Parallel(C, BV):
                Ob[i, j] = O[i, j] * scale
            T.tma_store_wait(0)  # in the thread that issued the last store: it has read o_s[p]
            T.sync_threads(O_BARRIER + p, 128)
            stage_o(Ob, o_s, p, tx - 128 * (p + 1))
            T.fence_proxy_async()
            T.sync_threads(O_BARRIER + p, 128)
            if valid == C:
                T.tma_copy(o_s[p, :, :], o[t0:t0 + C, ih, v0:v0 + BV], leader_scope_threads=128)
            else:  # a sequence's last chunk: its rows past the end are the next sequence's
                for r in T.unroll(C // 16):
                    row = r * 16 + (tx - 128 * (p + 1)) // 8
                    col = (tx - 128 * (p + 1)) % 8 * 8
                    if row < valid:
                        for e in T.vectorized(8):
                            o[t0 + row, ih, v0 + col + e] = o_s[p, row, col + e]
        T.tma_store_wait(0)

    @T.prim_func
    def fused_fwd_opath(
        q: T.Tensor([1, tokens, Hqk, K], dtype),
        k: T.Tensor([1, tokens, Hqk, K], dtype),
        v: T.Tensor([1, tokens, Hv, V], dtype),
        gates: T.Tensor([Hv, n_slots, 2, C], accum),
        A: T.Tensor([1, tokens, Hv, C], dtype),
        gamma: T.Tensor([Hv, n_slots, C], accum),
        cu_seqlens: T.Tensor([n_seqs + 1], "int32"),
        chunk_offsets: T.Tensor([n_seqs + 1], "int32"),
        h0: T.Tensor([n_h0, Hv, K, V], accum),
        o: T.Tensor([1, tokens, Hv, V], dtype),
        ht: T.Tensor([n_seqs, Hv, K, V], accum),
        scale: T.float32,
    ):
        with T.Kernel(NV, Hv, n_seqs, threads=512) as (iv, ih, n):
            q, k, v, A, o = token_major(q, k, v, A, o)
            follow_previous_kernel()
            ihk = ih // GROUPS
            v0 = iv * BV
            tx = T.get_thread_binding()
            bos = cu_seqlens[n]
            seqlen = cu_seqlens[n + 1] - bos
            first_chunk = chunk_offsets[n]

            q_s = T.alloc_shared([STAGES, C, K], dtype)
            k_s = T.alloc_shared([STAGES, C, K], dtype)
            v_s = T.alloc_shared([STAGES, C, BV], dtype)
            a_s = T.alloc_shared([STAGES, C, C], dtype)
            gates_s = T.alloc_shared([STAGES, 2, C], accum)
            gam_s = T.alloc_shared([STAGES, C], accum)
            s_buf = T.alloc_shared([2, BV, K], dtype)  # the chain's Sᵀ for Q S, by chunk parity
            vn_buf = T.alloc_shared([2, BV, C], dtype)  # the chain's v_newᵀ for P v_new
            o_s = T.alloc_shared([2, C, BV], dtype)  # o staged for its TMA store, by O warpgroup
            # swizzled as wgmma reads them (s_buf, vn_buf: the O warpgroups' B operands); stmatrix / ldmatrix move
            # whole 16-byte row pieces, which the swizzle keeps whole
            T.annotate_layout({x: make_full_bank_swizzled_layout(x) for x in (o_s, v_s, s_buf, vn_buf)})
            full = T.alloc_barrier([32] * STAGES)
            last = T.alloc_barrier([32])  # a sequence's last chunk's loads, when it ends before the tile
            empty = T.alloc_barrier([256] * STAGES)  # the chain and the chunk's O warpgroup
            sfull = T.alloc_barrier([128, 128])
            sempty = T.alloc_barrier([128, 128])
            vfull = T.alloc_barrier([128, 128])
            vempty = T.alloc_barrier([128, 128])

            # the chain's
            St = T.alloc_fragment([BV, K], accum)
            Sb = T.alloc_fragment([BV, K], dtype)
            Wt = T.alloc_fragment([BV, C], accum)
            Ub = T.alloc_fragment([BV, C], dtype)
            VNt = T.alloc_fragment([BV, C], accum)
            VNb = T.alloc_fragment([BV, C], dtype)
            VDb = T.alloc_fragment([BV, C], dtype)
            eg = T.alloc_fragment([C], accum)
            ed = T.alloc_fragment([C], accum)
            decay = T.alloc_var(accum)
            # each O warpgroup's own: Q Kᵀ, P (the A operand), O, o rounded, γ log2 e of P's rows and
            # columns, e^γ of O's rows
            PK0, PK1 = T.alloc_fragment([C, C], accum), T.alloc_fragment([C, C], accum)
            PKb0, PKb1 = T.alloc_fragment([C, C], dtype), T.alloc_fragment([C, C], dtype)
            O0, O1 = T.alloc_fragment([C, BV], accum), T.alloc_fragment([C, BV], accum)
            Ob0, Ob1 = T.alloc_fragment([C, BV], dtype), T.alloc_fragment([C, BV], dtype)
            gr0, gr1 = T.alloc_fragment([C], accum), T.alloc_fragment([C], accum)
            gc0, gc1 = T.alloc_fragment([C], accum), T.alloc_fragment([C], accum)
            og0, og1 = T.alloc_fragment([C], accum), T.alloc_fragment([C], accum)

            if tx < 128:  # warp 0 streams the tiles; warps 1-3 only give their registers away
                T.set_max_nreg(REGS_LOADS, 0)
                if tx < 32:
                    for c in T.serial(T.ceildiv(seqlen, C)):
                        s = c % STAGES
                        t0 = bos + c * C
                        valid = T.min(C, seqlen - c * C)
                        tiles = (q, k, v, A, gates, gamma, q_s, k_s, v_s, a_s, gates_s, gam_s)
                        T.mbarrier_wait_parity(empty[s], ((c // STAGES) & 1) ^ 1)
                        if valid == C:
                            load_chunk(*tiles, s, t0, first_chunk + c, ihk, ih, v0, full, s)
                        else:  # the next sequence's rows out (module docstring), then the hand-over
                            load_chunk(*tiles, s, t0, first_chunk + c, ihk, ih, v0, last, 0)
                            T.mbarrier_arrive(last[0])
                            T.mbarrier_wait_parity(last[0], 0)
                            zero_k_rows(k_s, s, valid, tx)
                            zero_v_rows(v_s, s, valid, tx)
                            zero_a_rows(a_s, s, valid, tx)
                            T.fence_proxy_async()  # the stores, before the consumers' products read the tiles
                        T.mbarrier_arrive(full[s])
            elif tx < 256:
                T.set_max_nreg(REGS_O, 0)
                o_path(
                    0, PK0, PKb0, O0, Ob0, gr0, gc0, og0, q_s, k_s, gam_s, gates_s, s_buf, vn_buf, o_s, o, full, empty,
                    sfull, sempty, vfull, vempty, seqlen, bos, ih, v0, tx, scale,
                )  # fmt: skip
            elif tx < 384:
                T.set_max_nreg(REGS_O, 0)
                o_path(
                    1, PK1, PKb1, O1, Ob1, gr1, gc1, og1, q_s, k_s, gam_s, gates_s, s_buf, vn_buf, o_s, o, full, empty,
                    sfull, sempty, vfull, vempty, seqlen, bos, ih, v0, tx, scale,
                )  # fmt: skip
            else:  # the S chain
                T.set_max_nreg(REGS_CHAIN, 1)
                if HAS_H0:
                    for j, d in T.Parallel(BV, K):
                        St[j, d] = h0[n, ih, d, v0 + j]
                else:
                    T.clear(St)
                for c in T.serial(T.ceildiv(seqlen, C)):
                    s = c % STAGES
                    valid = T.min(C, seqlen - c * C)
                    T.mbarrier_wait_parity(full[s], (c // STAGES) & 1)
                    T.copy(St, Sb)
                    decay = gates_s[s, 0, valid - 1]
                    for j, d in T.Parallel(BV, K):
                        St[j, d] = St[j, d] * decay
                    T.wgmma_gemm(Sb, k_s[s, :, :], Wt, transpose_B=True, clear_accum=True)
                    # Sᵀ for the O path, staged under Sᵀ Kᵀ
                    T.mbarrier_wait_parity(sempty[c % 2], ((c // 2) & 1) ^ 1)
                    stage_s(Sb, s_buf, c % 2, tx - 384)
                    T.fence_proxy_async()
                    T.mbarrier_arrive(sfull[c % 2])
                    for i in T.Parallel(C):
                        eg[i] = gates_s[s, 0, i]
                        ed[i] = gates_s[s, 1, i]
                    load_vt(Ub, v_s, s, tx - 384)  # Vᵀ, under Sᵀ Kᵀ
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(Wt, num_regs=C * BV // 128)
                    for j, i in T.Parallel(BV, C):
                        Ub[j, i] = Ub[j, i] - Wt[j, i] * eg[i]
                    T.wgmma_gemm(Ub, a_s[s, :, :], VNt, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(VNt, num_regs=C * BV // 128)
                    for j, i in T.Parallel(BV, C):
                        VDb[j, i] = VNt[j, i] * ed[i]
                    T.wgmma_gemm(VDb, k_s[s, :, :], St)
                    # v_newᵀ for the O path, staged under the state update
                    T.copy(VNt, VNb)
                    T.mbarrier_wait_parity(vempty[c % 2], ((c // 2) & 1) ^ 1)
                    stage_vn(VNb, vn_buf, c % 2, tx - 384)
                    T.fence_proxy_async()
                    T.mbarrier_arrive(vfull[c % 2])
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(St, num_regs=K * BV // 128)
                    T.mbarrier_arrive(empty[s])
                for j, d in T.Parallel(BV, K):
                    ht[n, ih, d, v0 + j] = St[j, d]

    # every hand-off is ordered by the kernel itself (module docstring): TileLang's own barriers would add five
    # a chunk, four on the chain
    no_sync_pass = {PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}
    return tilelang.compile(fused_fwd_opath, target=profile.target, pass_configs=no_sync_pass)
