"""Chunk-local gate cumsum, K Kᵀ + triangular solve, and the masked Q Kᵀ: everything per chunk.

Computes, for every chunk of 64 tokens (chunks restart at each sequence start) and
v-head h, with β = beta, γ = cumsum(g) over the chunk (fp32) and Γ_ij = e^{γ_i − γ_j}:

    g_cum = γ                                                    [C]
    M     = StrictLower(diag(β) K Kᵀ ⊙ Γ)                       [C, C] fp32
    A     = (I + M)⁻¹ diag(β)                                    [C, C]
    P     = Q Kᵀ ⊙ Γ ⊙ Lower                                     [C, C]

P is what the fused forward multiplies v_new with; computing it here, once per chunk,
keeps a [C, C] x [C, K] product and C² exponentials out of the sequential kernel (where
they would run once per V-tile). Measured on the H200 (benchmark/NOTES.md v33): P is a
quarter of this kernel's time (2/8 8x4096 64.9 -> 49.3 µs without it, 16/32 247 -> 184),
while formed in the 64-column forward walk (o bitwise equal) it made the walk 93 -> 157 µs:
its exponentials and staging land on the walk's one dependent chain. Formed beside the chain
instead, on two warpgroups of their own taking alternate chunks (fused_fwd_opath), it costs
that walk less than it saves here: an inference forward at 64 columns runs this kernel without
P (FORM_P off: no q, no Q Kᵀ, no P), 2/8 8x4096 forward 157.6 -> 150.3 µs (v37).

Inputs (packed varlen, T tokens in all;
the token-major tensors, outputs too, passed packed, [1, T, ...], and read as the [T, ...] shown: launch.token_major):
    q, k    [T, Hqk, K]  input dtype; v-head h reads qk-head h // (Hv // Hqk)
    g       [T, Hv]      fp32 (the launcher converts)
    beta    [T, Hv]      the input dtype or fp32 (`beta_dtype`; read as fp32: no cast launch
                         for the common bf16 / fp16 β)
    chunk_table [slots, 2] int32, (first token, tokens) of each global chunk
                         (flash_qla.ops.chunks; 0 tokens past the last chunk)
Outputs (then slots, int, the grid's chunk slots, the last argument):
    g_cum   [T, Hv]      fp32
    gamma   [Hv, slots, C] fp32, γ again, chunk-major (slot = global chunk index): the
                         fused kernels load a chunk's γ with one aligned TMA box
    gates   [Hv, slots, 2, C] fp32, e^γ and e^{γ_L − γ} (γ_L: the chunk's last valid token),
                         0 past the chunk's end, for fused_fwd_wide and fused_fwd_opath (its threads hold 16
                         columns each: computing them there took 32 exponentials a thread)
    A, P    [T, Hv, C]   input dtype (P with FORM_P); row t holds row (t − chunk start) of its
                         chunk's matrix; columns past the row (and past the chunk's end) are 0
    log_norms [Hv, slots] fp32 (with P and BOUNDS): L = γ_L + Σ_i ln max(1, |1 − β_i ‖k_i‖²|), a bound on the
                         log of the norm of the chunk's state transition (the split walks' skips,
                         flash_qla.ops.context_parallel)

Schedule: grid (Hv, chunk slots), one warpgroup per block, `profile.kkt_blocks_per_sm`
blocks resident per SM (a register cap for ptxas: blocks overlap each other's loads and
solves, so occupancy pays). Persistent blocks instead, each taking every blocks-th item with the
next item's chunk row, g and β loaded under this one's solve, ran slower (forward mode with P at
16/32 1x32768 243.5 -> 286.1 µs at 5 blocks an SM, where the loop's registers spill, 260.5 at 4;
outputs bitwise equal): the other resident blocks already cover the prologue's latency
(benchmark/NOTES.md v55). The v-heads of a chunk are neighbours in the launch order, so the
v-heads of one qk-head read its q and k tiles from L2 rather than each from DRAM (with
the slots first, at 16/32 8x4096: forward mode 0.307 -> 0.294 ms, backward mode 0.144 ->
0.117, outputs bitwise equal; benchmark/NOTES.md v11). Slot j reads its chunk's first
token and length from the chunk table with one load (it was a binary search over
chunk_offsets: the same time, 0.31 ms at 16/32 8x4096, so the prologue's wait is not the
search). The launcher sizes the grid with the
upper bound T // C + N; slots past the last chunk exit at once. q and k arrive by
cp.async (rows past the end zero-filled) while γ and β are loaded and γ summed (6 %
faster than synchronous loads). g and β are loaded together, each thread from a valid row (the
chunk's last past its end) and masked as stored: guarded loads issued β's only once g's had
arrived. The bound (log_norms) keeps K Kᵀ's diagonal from the element pass below and takes its
64 logarithms in one warp at the end: a guarded logarithm per element held cost 8 % of the
kernel's instructions (ncu, benchmark/NOTES.md v54). Both changes, outputs bitwise equal, on the
H200: forward mode with P 265.6 -> 244.4 µs at 16/32 1x32768, 70.4 -> 64.1 at 2/8 8x4096;
backward mode with the bounds 170.1 -> 135.8 and 43.5 -> 36.7; the inference forward at 16/32
1x32768 731.6 -> 709.1 µs. Q Kᵀ and K Kᵀ run together on the tensor cores
(wgmma, fp32 accumulate); one element-wise pass then scales both accumulators in registers,
with one exponential Γ_ij for both, and a second (after the masks) stores P and M to shared
memory (one pass doing both waited for each element's γ loads behind the previous element's
stores, which the compiler cannot reorder: the split took kkt_solve 0.349 -> 0.311 ms at
16/32 8x4096).
The inverse X = (I + M)⁻¹ is formed in fp32 by blocks:
  1. the eight 8 x 8 diagonal blocks by forward substitution, half a warp per block and
     one column of the block per lane (lanes l and l + 8 share one): a column needs no
     other lane's values, only M's rows, which the half-warp reads as broadcasts; the
     column stays in registers until the block is done;
  2. three doubling merges (8 -> 16 -> 32 -> 64), T₁ = M₂₁ X₁₁, then X₂₁ = −X₂₂ T₁, on the
     tensor cores: mma.sync m16n8k8 in tf32, each warp one or two 16 x 8 output tiles of
     each product (8 x 8 in the first merge: the mma's other rows are zeros), skipping the
     k-blocks where the triangular X₁₁ or X₂₂ is zero. Each operand is split into its tf32
     part and the remainder, and three products a k-block (3xTF32) keep every product to
     ~2⁻²¹ of its terms, where one tf32 product keeps ~2⁻¹¹ (`tile_product`). They were CUDA-core products with register tiles, whose operands
     came as broadcast shared-memory loads: 41 % of the stage's shared wavefronts
     (benchmark/NOTES.md v20 step 4b). On the tensor cores a warp loads each operand
     element of a k-block once: low-level forward 0.570 -> 0.540 ms at 16/32 8x4096, 0.171
     -> 0.165 at 2/8, merging from blocks of 16; from blocks of 8, whose substitution's
     dependent chain is 28 multiply-adds a column where 16 rows took 120, 0.543 -> 0.532
     and 0.165 -> 0.162 (another machine start); A as far from a float64 reference as with
     the CUDA-core merges, to three digits (v24).
M and X share one fp32 buffer: each block of M is read before X overwrites it.
With the merges on the CUDA cores the stage was bound by the L1's load/store pipe (ncu: 85 %
busy, two thirds of it shared-memory loads; benchmark/NOTES.md v20 steps 4-4b), so its
shared-memory traffic is laid out for few wavefronts: the masks are applied in registers, so
that P and M are stored as unconditional copies, two columns a thread at once; rows of M and X
are 72 floats apart (`PAD`), where those 8-byte stores and the merges' 8-byte operand loads hit
distinct banks; each
thread reads its four columns of β once for A's read-out. Against the masked scalar stores, rows
68 floats apart and β read for every row: kkt_solve 0.295 -> 0.287 ms at 16/32 8x4096, 0.078
-> 0.076 at 2/8, outputs bitwise equal (v20 step 6).
"""

import tilelang
import tilelang.language as T

from flash_qla.arch import ArchProfile
from flash_qla.ops.launch import follow_previous_kernel, kernel_factory, token_major

LOG2E = 1.4426950408889634
DIAG = 8  # diagonal blocks inverted by forward substitution
PAD = 8  # floats of padding per row of the fp32 shared matrices (banks: the module docstring)
# bf16/fp16 elements of padding per row of P's staging tile: rows 144 bytes apart, so the 8
# rows that a warp's accumulator stores touch at once start in 8 different banks (unpadded,
# all 8 start in bank 0: 8-way conflicts; 5 % of kkt_solve's time on the H200)
P_PAD = 8
# 2^x as the one MUFU.EX2 it is, flushing results below 2^-126 to 0, for the decay pass's Γ_ij: exp2f wraps it in a
# fix-up for such results (a compare and two predicated multiplies, 3 of the pass's ~7 instructions an element). H200
# (benchmark/NOTES.md v54 step 6): forward mode without P -2.6 to -3.4 %, with P -0.8 to -1.5 %; A and P differ from
# exp2f's only where Γ_ij < 2^-126 (at most 3.8e-38 apart)
EX2_FTZ = """
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""


@kernel_factory
def kkt_solve_kernel(
    Hqk: int,
    Hv: int,
    K: int,
    dtype: str,
    profile: ArchProfile,
    beta_dtype: str = "float32",
    BACKWARD: bool = False,
    FORM_P: bool = True,
    BOUNDS: bool = True,
):
    """Compile (or load from TileLang's cache) the kkt+solve stage for one static config.

    BACKWARD: g is already g_cum (the forward's output) and only gamma, gates, P and, with BOUNDS,
    log_norms are written (no solve, no A): the low-level backward, given the forward's g_cum and A,
    needs P and chunk-major γ again, and where its walk splits the bounds its map and end walks skip
    by (the forward mode's bits; β is read for them only); a training backward takes the forward's own
    (flash_qla.ops.backward).
    FORM_P off: no P (the kernel takes neither q nor P: arguments k, g, ..., A, slots), for
    fused_fwd_opath, which forms P itself; and no log_norms, which are formed with P.
    BOUNDS off (backward mode only): no log_norms (the argument is not written) and β not read.
    The bounds cost the backward mode K Kᵀ's product for its diagonal, β's loads and registers (76 ->
    90 a thread): low-level backward 16/32 8x4096 2.00 -> 2.05 ms, 2/8 8x4096 0.538 -> 0.551 on the
    H200 where every call formed them, so only a split backward does: 4/16 1x32768 1.671 -> 1.551 ms,
    2/8 1x32768 0.900 -> 0.912 (its map and end walks run beside the recompute in SMs it leaves idle,
    so shortening them saves less than the bounds cost; benchmark/NOTES.md v46). Since the bound's logarithms left
    the element pass (v54) the backward mode takes 117.2 µs without the bounds and 135.8 with them at 16/32 1x32768
    (170.1 before).
    """
    assert beta_dtype in (dtype, "float32")
    assert BOUNDS or BACKWARD, "the forward mode forms the bounds with P"
    assert BOUNDS or beta_dtype == "float32", "without the bounds β is not read: no variant per dtype"
    assert FORM_P or not BACKWARD, "the backward mode is there to form P"
    KKT = not BACKWARD or BOUNDS  # K Kᵀ formed: for the solve, or its diagonal for the bounds
    C = profile.chunk
    THREADS = profile.threads
    GROUPS = Hv // Hqk
    assert THREADS == 4 * 32 and C == 8 * DIAG, "half a warp per diagonal block"
    accum = "float32"
    tokens = T.dynamic("tokens")
    n_slots = T.dynamic("n_slots")

    @T.macro
    def tile_product(a_s, a_row, a_col, b_s, b_row, b_col, k_first, k_last, lane, pair, frag, hi, lo, c, c0, rows: int):
        """One warp's 16 x 8 tile of A B over the k-blocks [k_first, k_last), into c[c0 : c0 + 4].

        Block kb multiplies A's `rows` x 8 tile at (a_row, a_col + 8 kb) by B's 8 x 8 tile at
        (b_row + 8 kb, b_col); rows = 8 leaves the mma's rows 8-15 zero (c[c0 + 2 :] unused).

        mma.sync m16n8k8 in tf32, three products a k-block (3xTF32): each operand x is
        split into hi = x with its 13 low mantissa bits cleared (what the tensor core reads of
        it) and lo = x − hi (exact), and lo·hi + hi·lo + hi·hi is summed in fp32: every product
        to ~2⁻²¹ of |a||b| where one tf32 product keeps ~2⁻¹¹. Lane (g, t) feeds the fragment's
        k = t and k = t + 4 from the k-block's columns 2t and 2t + 1 (a sum over k does not
        depend on its order, as long as A's and B's agree), so its A operand is two 8-byte loads
        (rows g and g + 8), conflict-free at rows 72 floats apart, where columns t and t + 4
        take four 4-byte loads with 2-way conflicts.
        """
        g = lane // 4
        t = lane % 4
        for e in T.unroll(4):
            c[c0 + e] = 0.0
        for kb in T.serial(k_first, k_last):
            k0 = 8 * kb + 2 * t
            for r in T.unroll(2):  # A[g + 8 r, k0 : k0 + 2] -> a_r, a_{r+2}
                if r < rows // 8:
                    for j in T.vectorized(2):
                        pair[j] = a_s[a_row + g + 8 * r, a_col + k0 + j]
                    frag[r] = pair[0]
                    frag[r + 2] = pair[1]
                else:  # an 8-row tile: the mma's rows 8-15 are zeros
                    frag[r] = 0.0
                    frag[r + 2] = 0.0
            frag[4] = b_s[b_row + k0, b_col + g]
            frag[5] = b_s[b_row + k0 + 1, b_col + g]
            for e in T.unroll(6):
                hi[e] = T.reinterpret(T.bitwise_and(T.reinterpret(frag[e], "uint32"), T.uint32(0xFFFFE000)), accum)
                lo[e] = frag[e] - hi[e]
            # the small terms first; A is a buffer's first 4 values, B its last 2
            T.ptx_mma(accum, "m16n8k8", "row", "col", "tf32", "tf32", "fp32", lo.data, 0, hi.data, 4, c.data, c0, False)
            T.ptx_mma(accum, "m16n8k8", "row", "col", "tf32", "tf32", "fp32", hi.data, 0, lo.data, 4, c.data, c0, False)
            T.ptx_mma(accum, "m16n8k8", "row", "col", "tf32", "tf32", "fp32", hi.data, 0, hi.data, 4, c.data, c0, False)

    @T.macro
    def merge(x_s, t_s, pair, frag, hi, lo, c, tx, s: int):
        """Join pairs of inverted s x s diagonal blocks of X into 2s x 2s inverses (M₂₁ -> X₂₁ in place).

        T₁ = M₂₁ X₁₁ into t_s, then X₂₁ = −X₂₂ T₁ over M₂₁, as tiles of 16 x 8 (8 x 8 when s = 8)
        on the tensor cores (`tile_product`); the k-blocks where the lower triangular X₁₁ (columns
        of tile n: k >= 8 n) or X₂₂ (rows of tile m: k < 16 m + 16) is zero are skipped. s = 8:
        warp w takes pair w, one tile of each product. s = 16: warp w takes pair w // 2, columns
        8 (w % 2). s = 32 (one pair): warp w takes tiles (0, w) and (1, 3 − w) of T₁ (5 k-blocks
        each warp) and (0, w), (1, w) of X₂₁ (6 each).
        """
        warp = tx // 32
        lane = tx % 32
        g = lane // 4
        t = lane % 4
        NB = s // 8  # k-blocks of a full product, and warps a pair
        ROWS = min(s, 16)  # rows of an output tile
        TILES = max(s // 16, 1)  # row tiles of the block
        b = warp // NB
        base = 2 * s * b
        w = warp % NB
        for m in T.unroll(TILES):
            n = w + m * (NB - 1 - 2 * w)  # column tiles w, then NB - 1 - w
            tile_product(
                x_s, base + s + 16 * m, base, x_s, base, base + 8 * n, n, NB, lane, pair, frag, hi, lo, c, 0, ROWS
            )
            for r in T.unroll(ROWS // 8):
                for j in T.unroll(2):
                    t_s[s * b + 16 * m + g + 8 * r, 8 * n + 2 * t + j] = c[2 * r + j]
        # both tiles of X₂₁ before either is stored over M₂₁ (one barrier, not one a tile)
        for m in T.unroll(TILES):
            k_last = T.min(2 * m + 2, NB)
            tile_product(
                x_s, base + s + 16 * m, base + s, t_s, s * b, 8 * w, 0, k_last, lane, pair, frag, hi, lo, c, 4 * m, ROWS
            )
        for m in T.unroll(TILES):
            for r in T.unroll(ROWS // 8):
                for j in T.unroll(2):
                    x_s[base + s + 16 * m + g + 8 * r, base + 8 * w + 2 * t + j] = -c[4 * m + 2 * r + j]

    @T.macro
    def kkt_solve_body(q, k, g, beta, chunk_table, g_cum, gamma, gates, A, P, log_norms, slots):
        """The kernel; q and P are None when FORM_P is off."""
        with T.Kernel(Hv, slots, threads=THREADS, prelude=EX2_FTZ) as (ih, slot):
            follow_previous_kernel()
            ihk = ih // GROUPS
            tx = T.get_thread_binding()
            T.annotate_min_blocks_per_sm(profile.kkt_blocks_per_sm)
            if FORM_P:
                q_s = T.alloc_shared([C, K], dtype)
            k_s = T.alloc_shared([C, K], dtype)
            if FORM_P:
                p_s = T.alloc_shared([C, C + P_PAD], dtype)  # P staged for its store, rows padded
            gam_s = T.alloc_shared([C], accum)
            beta_s = T.alloc_shared([C], accum)
            if FORM_P and BOUNDS:
                diag_s = T.alloc_shared([C], accum)  # K Kᵀ's diagonal after β: β_i ‖k_i‖² (log_norms)
            # M (strictly lower), overwritten block by block with X = (I + M)⁻¹: each M block is
            # read (diagonal blocks into registers, M₂₁ into T₁) before X takes its place
            x_s = T.alloc_shared([C, C + PAD], accum)
            t_s = T.alloc_shared([C // 2, C // 2 + PAD], accum)  # M₂₁ X₁₁ of the merges
            KK = T.alloc_fragment([C, C], accum)
            if FORM_P:
                QK = T.alloc_fragment([C, C], accum)
            xc = T.alloc_local([DIAG], accum)  # this lane's column of its diagonal block of X
            pair = T.alloc_local([2], accum)
            frag = T.alloc_local([6], accum)  # a k-block's A (4) and B (2) operands of a tile product
            hi = T.alloc_local([6], accum)
            lo = T.alloc_local([6], accum)
            c = T.alloc_local([8], accum)  # two 16 x 8 tiles' accumulators
            bcol = T.alloc_local([4], accum)  # β of this thread's four columns of A
            t0 = T.alloc_var("int32")
            g_row = T.alloc_var("int32")  # this thread's token of g and β (the prologue)
            g_val = T.alloc_var(accum)
            beta_val = T.alloc_var(accum)
            valid = T.alloc_var("int32")
            growth = T.alloc_var(accum)

            t0 = chunk_table[slot, 0]
            valid = chunk_table[slot, 1]
            if valid > 0:
                # q and k arrive by cp.async while γ and β are loaded and γ is summed
                if FORM_P:
                    T.async_copy(q[t0:t0 + C, ihk, :], q_s)
                T.async_copy(k[t0:t0 + C, ihk, :], k_s)
                # both loads before either store, from a valid row (the chunk's last past its end): one
                # memory latency for the two, where guarded copies waited for g's before issuing β's
                if tx < C:
                    g_row = t0 + T.min(tx, valid - 1)
                    g_val = g[g_row, ih]
                    if KKT:
                        beta_val = T.cast(beta[g_row, ih], accum)
                    gam_s[tx] = T.if_then_else(tx < valid, g_val, 0.0)
                    if KKT:
                        beta_s[tx] = T.if_then_else(tx < valid, beta_val, 0.0)
                if not BACKWARD:
                    T.cumsum(gam_s, dim=0)
                for i in T.Parallel(C):
                    gamma[ih, slot, i] = gam_s[i]
                    gates[ih, slot, 0, i] = T.if_then_else(i < valid, T.exp2(gam_s[i] * LOG2E), 0.0)
                    gates[ih, slot, 1, i] = T.if_then_else(i < valid, T.exp2((gam_s[valid - 1] - gam_s[i]) * LOG2E), 0.0)
                if not BACKWARD:
                    for i in T.Parallel(C):
                        if i < valid:
                            g_cum[t0 + i, ih] = gam_s[i]

                T.ptx_wait_group(0)
                T.sync_threads()
                # Q Kᵀ and K Kᵀ in flight together; one pass scales both in registers with one
                # exponential per element (Γ_ij is the same factor in both), a second stores P and
                # M: with no shared-memory store among its γ reads, the first pass's loads are free
                # to run ahead
                if FORM_P:
                    T.wgmma_gemm(q_s, k_s, QK, transpose_B=True, clear_accum=True)
                if KKT:
                    T.wgmma_gemm(k_s, k_s, KK, transpose_B=True, clear_accum=True)
                T.wait_wgmma(0)
                if FORM_P:
                    T.warpgroup_fence_operand(QK, num_regs=C * C // THREADS)
                if KKT:
                    T.warpgroup_fence_operand(KK, num_regs=C * C // THREADS)
                for i, j in T.Parallel(C, C):
                    decay = T.call_extern(accum, "ex2_ftz", (gam_s[i] - gam_s[j]) * LOG2E)
                    if FORM_P:
                        QK[i, j] = QK[i, j] * decay
                    if KKT:
                        KK[i, j] = beta_s[i] * KK[i, j] * decay
                # the masks in registers, then unconditional copies: two columns a thread in one store
                for i, j in T.Parallel(C, C):
                    if FORM_P:
                        QK[i, j] = T.if_then_else(j <= i, QK[i, j], 0.0)
                    # the bound on the chunk's transition norm (flash_qla.ops.context_parallel): token
                    # i's factor grows the state by at most max(1, |1 − β_i ‖k_i‖²|), β_i ‖k_i‖² on the
                    # diagonal here (Γ_ii = 1), kept for one warp's logarithms at the end (in this pass, a
                    # guarded logarithm per element held cost 8 % of the kernel's instructions). Formed with
                    # P only (the O-path walk's kkt_solve serves no split)
                    if FORM_P and BOUNDS and i == j:
                        diag_s[i] = KK[i, j]
                    if not BACKWARD:
                        KK[i, j] = T.if_then_else(j < i and i < valid, KK[i, j], 0.0)
                for i, j in T.Parallel(C, C):
                    if FORM_P:
                        p_s[i, j] = QK[i, j]
                    if not BACKWARD:
                        x_s[i, j] = KK[i, j]
                if FORM_P:
                    for i, j in T.Parallel(C, C):
                        if i < valid:
                            P[t0 + i, ih, j] = p_s[i, j]

                if not BACKWARD:  # X = (I + M)⁻¹ and A = X diag(β)
                    # 1. diagonal blocks: half-warp h inverts block h, lane l solves column l % 8:
                    #    x_i = δ_il − Σ_{j<i} M_ij x_j (the same M_ij for a half-warp's lanes: broadcasts)
                    base = tx // 16 * DIAG
                    col = tx % DIAG
                    for i in T.unroll(DIAG):
                        xc[i] = T.if_then_else(i == col, 1.0, 0.0)
                        for j in T.unroll(i):
                            xc[i] -= x_s[base + i, base + j] * xc[j]
                    for i in T.unroll(DIAG):  # lanes l and l + 8 store the same value
                        x_s[base + i, base + col] = xc[i]

                    # 2. doubling merges: blocks of 8, 16, then of 32
                    merge(x_s, t_s, pair, frag, hi, lo, c, tx, DIAG)
                    merge(x_s, t_s, pair, frag, hi, lo, c, tx, 2 * DIAG)
                    merge(x_s, t_s, pair, frag, hi, lo, c, tx, 4 * DIAG)

                    # A = X diag(β): thread t reads and writes columns 4 (t % 16) .. + 3 of rows
                    # t // 16, t // 16 + 8, ..., with their four β read once
                    for c in T.vectorized(4):
                        bcol[c] = beta_s[tx % 16 * 4 + c]
                    for r in T.unroll(C * C // (4 * THREADS)):
                        row = r * (THREADS // 16) + tx // 16
                        if row < valid:
                            for c in T.vectorized(4):
                                A[t0 + row, ih, tx % 16 * 4 + c] = x_s[row, tx % 16 * 4 + c] * bcol[c]
                if FORM_P and BOUNDS and tx < 32:  # L = γ_L + Σ_i ln max(1, |1 − β_i ‖k_i‖²|), two tokens a lane
                    for r in T.unroll(2):
                        pair[r] = T.if_then_else(
                            tx + 32 * r < valid, T.max(T.log(T.abs(1.0 - diag_s[tx + 32 * r])), 0.0), 0.0
                        )
                    growth = T.warp_reduce_sum(pair[0] + pair[1])
                    if tx == 0:
                        log_norms[ih, slot] = growth + gam_s[valid - 1]

    if FORM_P:

        @T.prim_func
        def kkt_solve(
            q: T.Tensor([1, tokens, Hqk, K], dtype),
            k: T.Tensor([1, tokens, Hqk, K], dtype),
            g: T.Tensor([1, tokens, Hv], accum),
            beta: T.Tensor([1, tokens, Hv], beta_dtype),
            chunk_table: T.Tensor([n_slots, 2], "int32"),
            g_cum: T.Tensor([1, tokens, Hv], accum),
            gamma: T.Tensor([Hv, n_slots, C], accum),
            gates: T.Tensor([Hv, n_slots, 2, C], accum),
            A: T.Tensor([1, tokens, Hv, C], dtype),
            P: T.Tensor([1, tokens, Hv, C], dtype),
            log_norms: T.Tensor([Hv, n_slots], accum),
            slots: T.int32,
        ):
            q, k, g, beta, g_cum, A, P = token_major(q, k, g, beta, g_cum, A, P)
            kkt_solve_body(q, k, g, beta, chunk_table, g_cum, gamma, gates, A, P, log_norms, slots)

    else:

        @T.prim_func
        def kkt_solve(
            k: T.Tensor([1, tokens, Hqk, K], dtype),
            g: T.Tensor([1, tokens, Hv], accum),
            beta: T.Tensor([1, tokens, Hv], beta_dtype),
            chunk_table: T.Tensor([n_slots, 2], "int32"),
            g_cum: T.Tensor([1, tokens, Hv], accum),
            gamma: T.Tensor([Hv, n_slots, C], accum),
            gates: T.Tensor([Hv, n_slots, 2, C], accum),
            A: T.Tensor([1, tokens, Hv, C], dtype),
            slots: T.int32,
        ):
            k, g, beta, g_cum, A = token_major(k, g, beta, g_cum, A)
            kkt_solve_body(None, k, g, beta, chunk_table, g_cum, gamma, gates, A, None, None, slots)

    return tilelang.compile(kkt_solve, target=profile.target)
