"""Stores of the transposed walks' register tiles: [BV, C] outputs (o; dv) and
the [BV, K] state (h; dh); and fused_fwd_opath's copies between register tiles and shared memory
by stmatrix / ldmatrix: `stage_rows` (a tile in its own orientation: o, Sᵀ, v_newᵀ) and
`load_transposed` (Vᵀ as a product's A operand).

The transposed walks (fused_fwd_wide, fused_bwd_wide) hold their [C, BV] outputs as [BV, C]
accumulators, one consumer warpgroup per 64 of the BV rows. Each warpgroup stages and stores
only its own 64 columns, between named barriers of its own 128 threads: the walks' chains
never wait for each other.
- `row_store` writes such a tile to x[t0 : t0 + valid, ih, v0 : v0 + BV] through a staging
  tile [C, BV + STAGE_PAD], so that global stores are whole 16-byte row pieces (a chunk's rows
  past `valid` belong to the next sequence: no TMA box can stop there). At one warpgroup
  (BV = 64) a 16-bit tile (o) is staged by stmatrix.x4.trans, four instructions a thread where
  2-byte stores took 32 and 16 byte permutes (ncu put a third of the wide walks' consumer stall
  samples in these stagings): forward 2/8 8x4096 0.1597 -> 0.1568 ms, outputs bitwise equal. At
  two warpgroups (BV = 128) the same made the forward slower (16/32 8x4096 0.530 -> 0.555 ms;
  why was not found), so there, and for fp32 tiles, the 2-byte stores stay
  (benchmark/NOTES.md v31 step 6). The backward's dv is rounded to a 16-bit tile before its
  staging, so it takes stmatrix at BV = 64 too (benchmark/NOTES.md v56).
- `state_store` writes a state Sᵀ (the recompute's S, the training forward's kept S, the
  backward walk's dS') to h[c, ih, :, v0 : v0 + BV] by TMA: each warpgroup stages its [K, 64]
  block in a swizzled tile (`alloc_state_stage`) and one of its threads issues the bulk store,
  which runs while the chain goes on; the next staging first waits until that store has read
  the tile (`state_stores_done` at the walk's end). Against 16-byte stores by every thread from a
  padded tile: training step 2/8 8x4096 0.720 -> 0.703 ms (keep_states 0.650 -> 0.642), 16/32,
  4/16 and 1x32768 within 0.5 %, gradients bitwise equal (benchmark/NOTES.md v23). A 16-bit state
  at one warpgroup (BV = 64: the recompute's and keep_states' h, the backward walk's dh) is staged by
  stmatrix.x4.trans, 8 instructions a thread where 2-byte stores took 64 (the swizzle keeps each
  16-byte row piece whole; benchmark/NOTES.md v56).
"""

import tilelang.language as T
from tilelang.layout import make_full_bank_swizzled_layout

from flash_qla.ops.launch import DEVICE_FUNCTIONS

ROWS_PER_WARPGROUP = 64  # wgmma's M per warpgroup
# elements of padding per row of a staging tile: rows 144 or 272 bytes apart (BV = 64, 128) start
# 4 banks apart, so the 8 rows of 16 bytes of each matrix that stmatrix writes fill the 32 banks
# once, and a warp's 2-byte transposed stores (4 rows, 2 apart, at once) are conflict-free
STAGE_PAD = 8
# first named barrier id of the staging, one per consumer warpgroup (TileLang's own use ids < 4)
STAGE_BARRIER = 4


def stage_rows(R: int):
    """The macro stage_rows(X, x_s, b, tx): x_s[b, :, :R] = X, by stmatrix.x4, R / 16 instructions a thread.

    X [64, R] 16-bit fragment in a wgmma accumulator's layout, which is also a wgmma A operand's (one
    warpgroup's: fused_fwd_opath's O, tokens its rows; the chain's Sᵀ and v_newᵀ), x_s [buffers, 64, >= R]
    shared, b a buffer index, tx the thread's index in its warpgroup. In lane l of warp w, element
    4k + 2h + e of the local array is X[16 w + 8 h + l / 4, 8 k + 2 (l % 4) + e], so 32-bit word 4n + q is
    8 x 8 matrix q of instruction n (rows 16 w + 8 (q % 2).., columns 8 (2 n + q / 2)..), whose row l % 8
    lane l addresses when l / 8 = q. No barrier: the caller orders the tile's reads and writes.
    """
    assert R % 16 == 0, "each stmatrix.x4 stages 16 columns"

    @T.macro
    def stage(X, x_s, b, tx):
        warp = tx // 32
        lane = tx % 32
        T.import_source(DEVICE_FUNCTIONS)
        for n in T.unroll(R // 16):
            row = 16 * warp + 8 * (lane // 8 % 2) + lane % 8
            col = 8 * (2 * n + lane // 16)
            T.call_extern("handle", "flash_qla_stsm_x4", T.access_ptr(x_s[b, row, col], "w", 8), X.data, 4 * n)

    return stage


def x4_transposed(R: int, function: str, access: str):
    """The macro x4_transposed(Xt, x_s, b, tx): one warpgroup's [64, R] 16-bit fragment Xt moved to or from
    x_s[b, :R, :64] (x_s[:R, :64] when b is None), transposed, by `function` (DEVICE_FUNCTIONS' stmatrix.x4.trans
    or ldmatrix.x4.trans: flash_qla.ops.launch), R / 16 instructions a thread; access "w" or "r".

    Xt is in a wgmma accumulator's (and A operand's) layout, tx the thread's index in its warpgroup: in lane l of
    warp w, element 4k + 2h + e of the local array is Xt[16 w + 8 h + l / 4, 8 k + 2 (l % 4) + e], so 32-bit word
    4n + q is 8 x 8 matrix q of instruction n (rows of x_s 8 k.., k = 2 n + q / 2; columns 16 w + 8 h.., h = q %
    2), whose row l % 8 lane l addresses when l / 8 = q. Each address is a whole 16-byte row piece, which a
    swizzled x_s keeps whole. No barrier: the caller orders the tile's reads and writes.
    """
    assert R % 16 == 0, "each x4 instruction moves 16 rows (two 8 x 8 matrices of tokens a column pair)"

    @T.macro
    def move(Xt, x_s, b, tx):
        warp = tx // 32
        lane = tx % 32
        T.import_source(DEVICE_FUNCTIONS)
        for n in T.unroll(R // 16):
            row = 8 * (2 * n + lane // 16) + lane % 8
            col = 16 * warp + 8 * (lane // 8 % 2)
            if b is None:
                T.call_extern("handle", function, T.access_ptr(x_s[row, col], access, 8), Xt.data, 4 * n)
            else:
                T.call_extern("handle", function, T.access_ptr(x_s[b, row, col], access, 8), Xt.data, 4 * n)

    return move


def load_transposed(R: int):
    """The macro load_transposed(Xt, x_s, b, tx): Xt = x_s[b, :R, :64]ᵀ (x_s[:R, :64] when b is None), by
    ldmatrix.x4.trans (x4_transposed).

    Xt [64, R] 16-bit fragment in a wgmma A operand's layout: fused_fwd_opath's Vᵀ from v's ring (x_s [buffers, R,
    >= 64], b a buffer index), or the backward walk's dOᵀ from its pipelined ring tile (x_s [R, 64], b None;
    TileLang's warp specialization sees the read through the pointer, so the tile's wait comes before it and its
    release after). Four instructions a thread at R = 64, where 2-byte loads took 32 (benchmark/NOTES.md v38 step 1).
    """
    return x4_transposed(R, "flash_qla_ldsm_x4_trans", "r")


def stmatrix_transposed(R: int):
    """The macro stmatrix_transposed(Xt, x_s, b, tx): x_s[b, :R, :64] = Xtᵀ (x_s[:R, :64] when b is None), by
    stmatrix.x4.trans (x4_transposed)."""
    return x4_transposed(R, "flash_qla_stsm_x4_trans", "w")


def stage_transposed(BV: int, R: int):
    """The macro stage_transposed(Xt, x_s, tx): x_s[:, this warpgroup's 64 columns] = Xtᵀ.

    Xt [BV, R] fragment in a wgmma accumulator's layout, x_s [R, BV + STAGE_PAD] shared; between
    named barriers of the warpgroup's own 128 threads (the first: its reads of the last staged tile
    are done). At BV = 64 a 16-bit Xt is stored by stmatrix.x4.trans (stmatrix_transposed), four
    instructions a thread for R = 64. Otherwise (two warpgroups, or an fp32 Xt) Xt is rounded and
    stored element by element (2-byte stores); the module docstring says why.
    """
    stmatrix = stmatrix_transposed(R)

    @T.macro
    def stage(Xt, x_s, tx):
        wg = tx // 128
        T.sync_threads(STAGE_BARRIER + wg, 128)
        if BV == ROWS_PER_WARPGROUP and Xt.dtype in ("bfloat16", "float16"):
            stmatrix(Xt, x_s, None, tx)
        else:
            for j, i in T.Parallel(BV, R):
                x_s[i, j] = Xt[j, i]
        T.sync_threads(STAGE_BARRIER + wg, 128)

    return stage


def row_store(BV: int, C: int):
    """The macro row_store(Xt, x_s, x, t0, valid, ih, v0, tx): x[t0 : t0 + valid, ih, v0 : v0 + BV] = Xtᵀ.

    Xt [BV, C] fragment, x_s [C, BV + STAGE_PAD] shared, tx the consumer thread index.
    """
    stage = stage_transposed(BV, C)

    @T.macro
    def store(Xt, x_s, x, t0, valid, ih, v0, tx):
        wg = tx // 128
        lane = tx % 128
        stage(Xt, x_s, tx)
        for r in T.unroll(C // 16):  # 16 rows x 8 vectors of 8 elements per pass
            row = r * 16 + lane // 8
            col = wg * ROWS_PER_WARPGROUP + lane % 8 * 8
            if row < valid:
                for e in T.vectorized(8):
                    x[t0 + row, ih, v0 + col + e] = x_s[row, col + e]

    return store


def alloc_state_stage(BV: int, K: int, dtype: str):
    """The staging tile of state_store: [BV // 64, K, 64], one [K, 64] block per warpgroup, its
    128-byte rows swizzled (TMA's 128-byte swizzle; a warp's transposed 2-byte stores touch 4 rows
    at once, which the swizzle puts in distinct banks). Allocate inside the kernel."""
    x_s = T.alloc_shared([BV // ROWS_PER_WARPGROUP, K, ROWS_PER_WARPGROUP], dtype)
    T.annotate_layout({x_s: make_full_bank_swizzled_layout(x_s)})
    return x_s


def state_store(BV: int, K: int):
    """The macro state_store(St, x_s, h, c, ih, v0, tx): h[c, ih, :, v0 : v0 + BV] = Stᵀ, by TMA.

    St [BV, K] fragment (16-bit at BV = 64: staged by stmatrix_transposed), x_s from
    alloc_state_stage, tx the consumer thread index. Asynchronous:
    call state_stores_done() before the kernel ends. Stored from the registers element by
    element instead, a warp's 2-byte stores touch 8 rows of h 256 bytes apart: the state
    recompute at 16/32 8x4096 took 0.351 ms against 0.289 staged, the backward walk 0.609
    against 0.541 (benchmark/NOTES.md v13, v14).
    """
    W = ROWS_PER_WARPGROUP
    stmatrix = stmatrix_transposed(K)

    @T.macro
    def store(St, x_s, h, c, ih, v0, tx):
        wg = tx // 128
        T.tma_store_wait(0)  # in the thread that issued the last store: it has read x_s
        T.sync_threads(STAGE_BARRIER + wg, 128)
        if BV == W and St.dtype in ("bfloat16", "float16"):
            stmatrix(St, x_s, 0, tx)
        else:
            for j, d in T.Parallel(BV, K):
                x_s[j // W, d, j % W] = St[j, d]
        T.fence_proxy_async()  # the staged tile, visible to the TMA unit
        T.sync_threads(STAGE_BARRIER + wg, 128)
        T.tma_copy(x_s[wg, :, :], h[c, ih, :, v0 + wg * W:v0 + wg * W + W], leader_scope_threads=128)

    return store


@T.macro
def state_stores_done():
    """Wait until the last state_store has read its staging tile (before the block's shared memory goes)."""
    T.tma_store_wait(0)


# A sequence's last chunk: the walks' ring tiles are TMA boxes of C rows, so there the rows past `valid` come from
# the next sequence. The products' gate factors and masks multiply them by zero, which does not cancel an Inf or
# NaN: zeroed, a non-finite token reaches no other sequence's results.


@T.macro
def zero_rows_past(x_s, valid):
    """x_s[valid:, :] = 0 in a tile [C, W] whose load was waited for (behind a product that read the ring tile,
    or chunk_grads' copies' wait), by the block's threads as TileLang lays the loop out."""
    for i, j in T.Parallel(x_s.shape[0], x_s.shape[1]):
        if i >= valid:
            x_s[i, j] = T.cast(0, x_s.dtype)


@T.macro
def zero_ring_rows_past(x_s, valid):
    """zero_rows_past for a ring tile of a warp-specialized walk with one consumer warpgroup (whose barriers
    TileLang places), wherever the call stands: it reads one element of the tile first, so that TileLang's
    warp specialization waits for the tile's load before the zeroing (a store alone is no use of the tile
    to it). A read-modify-write of the whole tile does as well, but took a barrier per row group."""
    seen = T.alloc_var(x_s.dtype)
    seen = x_s[0, 0]  # noqa: F841 (read for its wait)
    zero_rows_past(x_s, valid)


def zero_rows_past_by_lanes(C: int, W: int, lanes: int):
    """The macro zero_rows_past_by_lanes(x_s, b, valid, lane): x_s[b, valid:, :] = 0 (x_s[valid:, :] when b is
    None) in a tile [C, W] (16-bit) by `lanes` threads, lane their index (0 .. lanes - 1): 16-byte stores, no
    barrier (the caller orders them)."""
    VEC = 8
    assert C * W % (lanes * VEC) == 0

    @T.macro
    def zero(x_s, b, valid, lane):
        for n in T.serial(C * W // (lanes * VEC)):
            i = (n * lanes + lane) * VEC // W
            col = (n * lanes + lane) * VEC % W
            if i >= valid:
                for e in T.vectorized(VEC):
                    if b is None:
                        x_s[i, col + e] = T.cast(0, x_s.dtype)
                    else:
                        x_s[b, i, col + e] = T.cast(0, x_s.dtype)

    return zero


def zero_rows_past_by_warpgroup(C: int, W: int):
    """The macro zero_rows_past_by_warpgroup(x_s, b, valid, tx): x_s[b, valid:, :] = 0 (x_s[valid:, :] when b
    is None) in a ring tile [C, W] (16-bit) of a walk with several consumer warpgroups (fused_fwd_wide,
    fused_bwd_wide), each zeroing for itself (tx the consumer thread index).

    Call it after the tile's load was waited for: after a product that reads the tile, or inside the ws_op of
    the first one (TileLang's warp specialization waits for an op's tiles before the op; a store alone is no
    use of the tile to it, which would not wait for the load before it). Every warpgroup zeroes the whole region
    (the same values) and waits on a named barrier of its own 128 threads, after a proxy fence that shows the
    stores to wgmma, so the warpgroups' chains still never wait for each other (another warpgroup's product
    reading those rows meanwhile takes them into only its results past `valid`, which the walks drop).
    """
    zero_rows = zero_rows_past_by_lanes(C, W, 128)

    @T.macro
    def zero(x_s, b, valid, tx):
        lane = tx % 128
        T.sync_threads(STAGE_BARRIER + tx // 128, 128)  # ordering nothing, but TileLang's sync pass otherwise puts its
        # own barrier before the call's branch, on every chunk
        zero_rows(x_s, b, valid, lane)
        T.fence_proxy_async()
        T.sync_threads(STAGE_BARRIER + tx // 128, 128)

    return zero
