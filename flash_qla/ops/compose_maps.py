"""The start state of every piece of a split sequence, from the pieces' affine maps.

Computes, for the consecutive pieces j of each sequence and every v-head, with M_j [K, K] and
b_j [K, V] the maps S_end = M_j S_start + b_j (flash_qla.ops.context_parallel):

    S_0 = s0 (the initial state, or 0),   S_{j+1} = S_j + D_j S_j + b_j,   D_j = M_j − I

and writes every S_j. REVERSE composes the backward walk's maps instead, the adjoints of the
same pieces walked last to first (dS_start = M_jᵀ dS_end + b_j, b_j the piece's dS_start from
dS_end = 0): with J pieces,

    X_0 = s0 (dht, or 0),   X_{r+1} = X_r + D_jᵀ X_r + b_j,   j = J − 1 − r,

writing X_r, the gradient of the state at the end of piece j, in row j.
Where kkt_solve's bounds show a piece's M negligible (flash_qla.ops.negligible.map_negligible,
the test its map walk made before leaving D unwritten), S + D S + b is b (X + Dᵀ X + b likewise): the
products are left out, and S (X) is b.
The product runs on the tensor cores in three bf16 products, D_hi S_hi +
D_hi S_lo + D_lo S_hi (x = x_hi + x_lo, each half rounded to bf16), with an fp32 accumulator:
about 16 bits of each operand, where one bf16 product keeps 8 and loses the state when the map
forgets it (M ≈ 0: S + D S cancels to the rounding of S). D_hi and D_lo arrive as they are
multiplied: the walk that forms M writes them (walk_kernel's MAPS variant), all pieces in
parallel, so the sequential part here converts only S.

Inputs:
    D       [pieces, Hv, K, 2 K] bf16: D_j = M_j − I, D_hi in columns [0, K), D_lo in [K, 2 K)
    b       [pieces, Hv, K, V] fp32
    first_pieces [N + 1] int32: sequence n's pieces are rows first_pieces[n] .. first_pieces[n + 1] − 1
            (flash_qla.ops.chunks.first_pieces; rows past the last are never read)
    bounds, first_chunks [pieces + 1] int32: the pieces' token bounds and first global chunks
            (flash_qla.ops.chunks.checkpoint_pieces)
    log_norms [Hv, slots] fp32: kkt_solve's bounds on the chunks' transitions (zeros: nothing negligible)
    s0      [N, Hv, K, V] fp32 (read when HAS_S0)
Outputs:
    starts  [pieces, Hv, K, V] fp32 (REVERSE: the pieces' end-state gradients)

Schedule: grid (V / BV, Hv, N), a block walks its sequence's pieces with its [K, BV] slice of S
in fp32 registers (the products' accumulator), 256 threads in two roles that hand each piece over
through a two-stage ring (full / empty mbarriers):
- warp 0 makes each piece's negligible test (its 32 lanes, the map walk's warp sum), leaves it in
  shared memory for the consumer, and loads the piece's b slice by TMA, and D's two halves only
  where M is not negligible (64 of the piece's 80 KB);
- one consumer warpgroup stores S as the piece's start, reads the test from the ring and takes b, or
  runs the three products (one wait for all three).
So the sequential part waits on neither a global load (the test's bounds and log_norms) nor a
negligible piece's D. Sequential walk of the pieces (16 at 32768 tokens): ~30 small launches of
torch matmuls took longer than the split saved; with D converted here from fp32 M, each piece's
loads waited for, 80 µs at 2/8 1x32768 (benchmark/NOTES.md v13). TileLang's pipeline (its warp
specialization of a T.Pipelined loop) made the test on the consumer's path and loaded every D:
against it, training step 16/32 1x32768 2805.3 -> 2782.5 µs, 4/16 1x32768 1425.9 -> 1399.9, 2/8
1x32768 719.1 -> 713.9, inference forward 4/16 1x32768 414.8 -> 403.9; outputs bitwise equal
(benchmark/NOTES.md v44).
"""

import tilelang
import tilelang.language as T
from tilelang.transform import PassConfigKey

from flash_qla.arch import ArchProfile
from flash_qla.ops.launch import follow_previous_kernel, kernel_factory
from flash_qla.ops.negligible import map_negligible

BV = 32  # V-tile width: 4 blocks a head at V = 128
STAGES = 2  # the ring's depth: 80 KB a piece (D's halves and b's slice)
S_BARRIER = 1  # the named barrier of the consumer warpgroup's 128 threads (0 is __syncthreads')


@kernel_factory
def compose_maps_kernel(
    Hv: int, K: int, V: int, profile: ArchProfile, HAS_S0: bool, REVERSE: bool = False, PIECE_CHUNKS: int | None = None
):  # fmt: skip
    """Compile (or load from TileLang's cache) the composition of the pieces' maps for one config.

    REVERSE: the backward walk's composition, transposed maps over the pieces last to first. PIECE_CHUNKS: the
    chunks a piece has at most, where it is not profile.checkpoint_chunks (flash_qla.ops.forward.split_piece_chunks).
    """
    PIECE = profile.checkpoint_chunks if PIECE_CHUNKS is None else PIECE_CHUNKS
    pieces = T.dynamic("pieces")
    n_seqs = T.dynamic("n_seqs")
    n_s0 = T.dynamic("n_s0")  # N, or 1 for the placeholder when not HAS_S0
    n_slots = T.dynamic("n_slots")
    C = profile.chunk
    f32, bf16 = "float32", "bfloat16"

    @T.prim_func
    def compose_maps(
        D: T.Tensor([pieces, Hv, K, 2 * K], bf16),
        b: T.Tensor([pieces, Hv, K, V], f32),
        first_pieces: T.Tensor([n_seqs + 1], "int32"),
        bounds: T.Tensor([pieces + 1], "int32"),
        first_chunks: T.Tensor([pieces + 1], "int32"),
        log_norms: T.Tensor([Hv, n_slots], f32),
        s0: T.Tensor([n_s0, Hv, K, V], f32),
        starts: T.Tensor([pieces, Hv, K, V], f32),
    ):
        with T.Kernel(V // BV, Hv, n_seqs, threads=256) as (iv, ih, n):
            follow_previous_kernel()
            v0 = iv * BV
            tx = T.get_thread_binding()
            first = first_pieces[n]
            count = first_pieces[n + 1] - first
            d_hi = T.alloc_shared([STAGES, K, K], bf16)
            d_lo = T.alloc_shared([STAGES, K, K], bf16)
            b_s = T.alloc_shared([STAGES, K, BV], f32)
            negligible = T.alloc_shared([STAGES], "int32")  # the producer's test of each piece in the ring
            s_hi = T.alloc_shared([K, BV], bf16)
            s_lo = T.alloc_shared([K, BV], bf16)
            full = T.alloc_barrier([32] * STAGES)
            empty = T.alloc_barrier([128] * STAGES)
            S = T.alloc_fragment([K, BV], f32)

            if tx < 128:  # warp 0 tests each piece and streams what its step reads; warps 1-3 idle
                T.set_max_nreg(24, 0)
                if tx < 32:
                    for r in T.serial(count):
                        j = first + (count - 1 - r if REVERSE else r)
                        s = r % STAGES
                        T.mbarrier_wait_parity(empty[s], ((r // STAGES) & 1) ^ 1)
                        chunks = T.ceildiv(bounds[j + 1] - bounds[j], C)
                        if map_negligible(log_norms, ih, first_chunks[j], chunks, PIECE):
                            if tx == 0:
                                negligible[s] = 1
                        else:
                            if tx == 0:
                                negligible[s] = 0
                            T.tma_copy(D[j, ih, :, 0:K], d_hi[s, :, :], barrier=full[s])
                            T.tma_copy(D[j, ih, :, K:2 * K], d_lo[s, :, :], barrier=full[s])
                        T.tma_copy(b[j, ih, :, v0:v0 + BV], b_s[s, :, :], barrier=full[s])
                        T.mbarrier_arrive(full[s])  # releases lane 0's test with it
            else:  # one warpgroup walks the pieces: S in fp32 registers, the products' accumulator
                T.set_max_nreg(240, 1)
                if HAS_S0:
                    T.copy(s0[n, ih, :, v0:v0 + BV], S)
                else:
                    T.clear(S)
                for r in T.serial(count):
                    j = first + (count - 1 - r if REVERSE else r)
                    s = r % STAGES
                    T.copy(S, starts[j, ih, :, v0:v0 + BV])
                    T.mbarrier_wait_parity(full[s], (r // STAGES) & 1)
                    if negligible[s] == 1:
                        T.copy(b_s[s, :, :], S)
                    else:
                        T.sync_threads(S_BARRIER, 128)  # the last piece's products have read s_hi, s_lo
                        for i, c in T.Parallel(K, BV):
                            s_hi[i, c] = S[i, c]
                            s_lo[i, c] = S[i, c] - T.cast(T.cast(S[i, c], bf16), f32)
                        for i, c in T.Parallel(K, BV):
                            S[i, c] = S[i, c] + b_s[s, i, c]
                        T.fence_proxy_async()
                        T.sync_threads(S_BARRIER, 128)
                        T.wgmma_gemm(d_hi[s, :, :], s_hi, S, transpose_A=REVERSE)
                        T.wgmma_gemm(d_hi[s, :, :], s_lo, S, transpose_A=REVERSE)
                        T.wgmma_gemm(d_lo[s, :, :], s_hi, S, transpose_A=REVERSE)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(S, num_regs=K * BV // 128)
                    T.mbarrier_arrive(empty[s])

    # every hand-off is ordered by the kernel itself (the ring's mbarriers, the consumer's named barrier)
    no_sync_pass = {PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}
    return tilelang.compile(compose_maps, target=profile.target, pass_configs=no_sync_pass)
