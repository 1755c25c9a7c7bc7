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
P (FORM_P off: no q, no Q Kᵀ, no P), 2/8 8x4096 forward 157.6 -> 150.3 µs (v37); so does one whose O-path
walk takes a split's pieces, with the bounds (BOUNDS) its map and offsets walks skip by: H100, kkt_solve alone
at 16/32 1x32768 241.7 µs with P, 171.7 without (v85 step 1), the inference forward at 16/32 28672+4096 810.0 ->
753.5 µs (v85 step 6).

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
    log_norms [Hv, slots] fp32 (with BOUNDS): L = γ_L + Σ_i ln max(1, |1 − β_i ‖k_i‖²|), a bound on the
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
     ~2⁻²¹ of its terms, where one tf32 product keeps ~2⁻¹¹ (SOLVE's
     flash_qla_tile_product). They were CUDA-core products with register tiles, whose operands
     came as broadcast shared-memory loads: 41 % of the stage's shared wavefronts
     (benchmark/NOTES.md v20 step 4b). On the tensor cores a warp loads each operand
     element of a k-block once: low-level forward 0.570 -> 0.540 ms at 16/32 8x4096, 0.171
     -> 0.165 at 2/8, merging from blocks of 16; from blocks of 8, whose substitution's
     dependent chain is 28 multiply-adds a column where 16 rows took 120, 0.543 -> 0.532
     and 0.165 -> 0.162 (another machine start); A as far from a float64 reference as with
     the CUDA-core merges, to three digits (v24).
M and X share one fp32 buffer: each block of M is read before X overwrites it, and each merge's T₁
waits in the merged block's upper block (zero in X), zeroed again once read.
Steps 1 and 2 are one device function (SOLVE, called on the buffer), with pointer offsets and
every k-block a warp could take unrolled (the ones it skips branched over): as TileLang code (its
loops over a warp's k-blocks, bounds by warp; 2-D indices; T₁ in a buffer of its own) the kernel
had 2296 instructions, now 2016. H100, kkt_solve alone, µs, outputs bitwise equal
(benchmark/NOTES.md v84): 16/32 1x32768 with P 244.8 -> 240.4, without P 179.1 -> 171.4; 2/8
4x8192 65.3 -> 64.1, 47.1 -> 45.3; 4/16 2x16384 122.9 -> 119.6, 88.2 -> 85.2 (a second run:
0.968-0.986x); inference forwards 0.987-0.998x. TileLang's loops unrolled alone: 0.991-0.999x.
Every step ends at a barrier of the whole block, though the blocks of 8 (a warp's) and 16 (a pair
of warps') need only a warp's or a pair's: with those, six block-wide barriers fewer, kkt_solve
took 1.04-1.15x as long as with the TileLang merges (why was not found).
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

# The solve X = (I + M)⁻¹ of the module docstring's steps 1 and 2, as one device function (why: the docstring)
SOLVE = """
__device__ __forceinline__ void flash_qla_mma_tf32(float* c, const unsigned* a, const unsigned* b) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// c = A B over the k-blocks [first, last) of NB (unrolled; first and last may depend on the warp): A's ROWS x 8
// tile at a + 8 kb (rows ROW floats apart; ROWS = 8 leaves the mma's rows 8-15 zero), B's 8 x 8 tile at
// b + 8 kb ROW. mma.sync m16n8k8 in tf32, three products a k-block (3xTF32): each operand x is split into
// hi = x with its 13 low mantissa bits cleared (what the tensor core reads of it) and lo = x - hi (exact), and
// lo hi + hi lo + hi hi is summed in fp32: every product to ~2^-21 of |a||b| where one tf32 product keeps
// ~2^-11. Lane (g, t) feeds the fragment's k = t and t + 4 from the k-block's columns 2t and 2t + 1 (a sum over
// k does not depend on its order, as long as A's and B's agree): A's operand is two 8-byte loads (rows g and
// g + 8), conflict-free at rows 72 floats apart, where columns t and t + 4 take four 4-byte loads
template <int ROW, int ROWS, int NB>
__device__ __forceinline__ void flash_qla_tile_product(float* c, const float* a, const float* b, int first, int last,
                                                       int lane) {
  const int g = lane >> 2, t = lane & 3;
  c[0] = c[1] = c[2] = c[3] = 0.0f;
#pragma unroll
  for (int kb = 0; kb < NB; ++kb) {
    if (kb < first || kb >= last) continue;
    const int k0 = 8 * kb + 2 * t;
    float f[6];
    const float2 a0 = *reinterpret_cast<const float2*>(a + g * ROW + k0);
    f[0] = a0.x;
    f[2] = a0.y;
    if (ROWS == 16) {
      const float2 a1 = *reinterpret_cast<const float2*>(a + (g + 8) * ROW + k0);
      f[1] = a1.x;
      f[3] = a1.y;
    } else {
      f[1] = 0.0f;
      f[3] = 0.0f;
    }
    f[4] = b[k0 * ROW + g];
    f[5] = b[(k0 + 1) * ROW + g];
    unsigned hi[6], lo[6];
#pragma unroll
    for (int e = 0; e < 6; ++e) {
      hi[e] = __float_as_uint(f[e]) & 0xFFFFE000u;
      lo[e] = __float_as_uint(f[e] - __uint_as_float(hi[e]));
    }
    flash_qla_mma_tf32(c, lo, hi + 4);  // the small terms first
    flash_qla_mma_tf32(c, hi, lo + 4);
    flash_qla_mma_tf32(c, hi, hi + 4);
  }
}
// x[g + 8r][2t + j] = sign c[2r + j] (r < ROWS / 8): lane (g, t)'s part of a 16 x 8 accumulator tile
template <int ROW, int ROWS>
__device__ __forceinline__ void flash_qla_tile_store(float* x, const float* c, float sign, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < ROWS / 8; ++r) {
    *reinterpret_cast<float2*>(x + (g + 8 * r) * ROW + 2 * t) = make_float2(sign * c[2 * r], sign * c[2 * r + 1]);
  }
}
// x [64, ROW] holds M (strictly lower, zeros above); on return X = (I + M)^-1, zeros above its diagonal. Each
// merge's T1 = M21 X11 is kept in the merged block's upper block (X12, zero in X) and zeroed again once read.
// One warpgroup (tx < 128); every step between barriers of the whole block
template <int ROW>
__device__ __forceinline__ void flash_qla_unit_lower_inverse(float* x, int tx) {
  const int warp = tx >> 5, lane = tx & 31;
  const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float c[8];
  {  // 1. the eight 8 x 8 diagonal blocks: half-warp h block h, lane l column l % 8 (x_i = d_il - sum_j<i M_ij x_j)
    const int base = (tx >> 4) * 8, col = tx & 7;
    float xc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      xc[i] = i == col ? 1.0f : 0.0f;
#pragma unroll
      for (int j = 0; j < i; ++j) xc[i] = xc[i] - x[(base + i) * ROW + base + j] * xc[j];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 8; ++i) x[(base + i) * ROW + base + col] = xc[i];  // lanes l and l + 8 store the same
    __syncthreads();
  }
  {  // 2. blocks of 8 -> 16: warp w pair w, one 8 x 8 tile of T1 and of X21
    float* p = x + 16 * warp * (ROW + 1);
    flash_qla_tile_product<ROW, 8, 1>(c, p + 8 * ROW, p, 0, 1, lane);
    flash_qla_tile_store<ROW, 8>(p + 8, c, 1.0f, lane);
    __syncthreads();
    flash_qla_tile_product<ROW, 8, 1>(c, p + 8 * ROW + 8, p + 8, 0, 1, lane);
    flash_qla_tile_store<ROW, 8>(p + 8 * ROW, c, -1.0f, lane);
    __syncthreads();
    flash_qla_tile_store<ROW, 8>(p + 8, zero, 1.0f, lane);
  }
  {  // 3. 16 -> 32: pair b warps 2b and 2b + 1, warp w columns 8w of T1 and of X21; X11's k-blocks < w are zero
    const int w = warp & 1;
    float* p = x + 32 * (warp >> 1) * (ROW + 1);
    __syncthreads();
    flash_qla_tile_product<ROW, 16, 2>(c, p + 16 * ROW, p + 8 * w, w, 2, lane);
    flash_qla_tile_store<ROW, 16>(p + 16 + 8 * w, c, 1.0f, lane);
    __syncthreads();  // the other warp's X21 goes over the M21 columns this warp read
    flash_qla_tile_product<ROW, 16, 2>(c, p + 16 * ROW + 16, p + 16 + 8 * w, 0, 2, lane);
    flash_qla_tile_store<ROW, 16>(p + 16 * ROW + 8 * w, c, -1.0f, lane);
    __syncthreads();
    flash_qla_tile_store<ROW, 16>(p + 16 + 8 * w, zero, 1.0f, lane);
  }
  __syncthreads();
  {  // 4. 32 -> 64: warp w T1 tiles (0, w) and (1, 3 - w) (5 k-blocks each warp), X21 tiles (0, w) and (1, w)
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const int n = m == 0 ? warp : 3 - warp;
      flash_qla_tile_product<ROW, 16, 4>(c, x + (32 + 16 * m) * ROW, x + 8 * n, n, 4, lane);
      flash_qla_tile_store<ROW, 16>(x + 16 * m * ROW + 32 + 8 * n, c, 1.0f, lane);
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < 2; ++m) {  // X22's k-blocks past its diagonal are zero
      const float* a = x + (32 + 16 * m) * ROW + 32;
      flash_qla_tile_product<ROW, 16, 4>(c + 4 * m, a, x + 32 + 8 * warp, 0, 2 * m + 2, lane);
    }
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      flash_qla_tile_store<ROW, 16>(x + (32 + 16 * m) * ROW + 8 * warp, c + 4 * m, -1.0f, lane);
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < 2; ++m) flash_qla_tile_store<ROW, 16>(x + 16 * m * ROW + 32 + 8 * warp, zero, 1.0f, lane);
  }
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
    FORM_P off (forward mode): no P (the kernel takes neither q nor P: arguments k, g, ..., A,
    [log_norms,] slots), for fused_fwd_opath, which forms P itself; log_norms with BOUNDS only (the
    O-path walk over the pieces of a split, whose map and offsets walks skip by them).
    BOUNDS off: no log_norms (the argument is not written); in the backward mode β is then not read.
    The bounds cost the backward mode K Kᵀ's product for its diagonal, β's loads and registers (76 ->
    90 a thread): low-level backward 16/32 8x4096 2.00 -> 2.05 ms, 2/8 8x4096 0.538 -> 0.551 on the
    H200 where every call formed them, so only a split backward does: 4/16 1x32768 1.671 -> 1.551 ms,
    2/8 1x32768 0.900 -> 0.912 (its map and end walks run beside the recompute in SMs it leaves idle,
    so shortening them saves less than the bounds cost; benchmark/NOTES.md v46). Since the bound's logarithms left
    the element pass (v54) the backward mode takes 117.2 µs without the bounds and 135.8 with them at 16/32 1x32768
    (170.1 before).
    """
    assert beta_dtype in (dtype, "float32")
    assert BOUNDS or not FORM_P or BACKWARD, "the forward mode forms the bounds with P"
    assert BOUNDS or not BACKWARD or beta_dtype == "float32", "without the bounds β is not read: no variant per dtype"
    assert FORM_P or not BACKWARD, "the backward mode is there to form P"
    KKT = not BACKWARD or BOUNDS  # K Kᵀ formed: for the solve, or its diagonal for the bounds
    C = profile.chunk
    THREADS = profile.threads
    GROUPS = Hv // Hqk
    assert THREADS == 4 * 32 and C == 64, "SOLVE inverts 64 x 64 in one warpgroup (half a warp an 8 x 8 block)"
    accum = "float32"
    tokens = T.dynamic("tokens")
    n_slots = T.dynamic("n_slots")

    @T.macro
    def kkt_solve_body(q, k, g, beta, chunk_table, g_cum, gamma, gates, A, P, log_norms, slots):
        """The kernel; q and P are None when FORM_P is off."""
        with T.Kernel(Hv, slots, threads=THREADS, prelude=EX2_FTZ + ("" if BACKWARD else SOLVE)) as (ih, slot):
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
            if BOUNDS:
                diag_s = T.alloc_shared([C], accum)  # K Kᵀ's diagonal after β: β_i ‖k_i‖² (log_norms)
            # M (strictly lower), overwritten block by block with X = (I + M)⁻¹: each M block is
            # read (diagonal blocks into registers, M₂₁ into T₁) before X takes its place
            x_s = T.alloc_shared([C, C + PAD], accum)
            KK = T.alloc_fragment([C, C], accum)
            if FORM_P:
                QK = T.alloc_fragment([C, C], accum)
            pair = T.alloc_local([2], accum)
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
                    # guarded logarithm per element held cost 8 % of the kernel's instructions)
                    if BOUNDS and i == j:
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
                    # declared a read: as a write, TileLang's barrier pass puts a __syncthreads between P's
                    # store (its reads of p_s, in the same dynamic buffer) and the call, which writes only x_s;
                    # the barrier after it is explicit
                    solve = f"flash_qla_unit_lower_inverse<{C + PAD}>"
                    T.call_extern("handle", solve, T.access_ptr(x_s, "r"), tx)
                    T.sync_threads()
                    # A = X diag(β): thread t reads and writes columns 4 (t % 16) .. + 3 of rows
                    # t // 16, t // 16 + 8, ..., with their four β read once
                    for c in T.vectorized(4):
                        bcol[c] = beta_s[tx % 16 * 4 + c]
                    for r in T.unroll(C * C // (4 * THREADS)):
                        row = r * (THREADS // 16) + tx // 16
                        if row < valid:
                            for c in T.vectorized(4):
                                A[t0 + row, ih, tx % 16 * 4 + c] = x_s[row, tx % 16 * 4 + c] * bcol[c]
                if BOUNDS and tx < 32:  # L = γ_L + Σ_i ln max(1, |1 − β_i ‖k_i‖²|), two tokens a lane
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

    elif BOUNDS:

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
            log_norms: T.Tensor([Hv, n_slots], accum),
            slots: T.int32,
        ):
            k, g, beta, g_cum, A = token_major(k, g, beta, g_cum, A)
            kkt_solve_body(None, k, g, beta, chunk_table, g_cum, gamma, gates, A, None, log_norms, slots)

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
