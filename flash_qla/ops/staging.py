"""Row stores of the transposed walks' register tiles: [BV, C] outputs (o; dv_new and dv) and
the [BV, K] state (h; dh).

The transposed walks (fused_fwd_wide, fused_bwd_wide) hold their [C, BV] outputs as [BV, C]
accumulators, one consumer warpgroup per 64 of the BV rows. `row_store` writes such a tile to
x[t0 : t0 + valid, ih, v0 : v0 + BV] through a shared-memory staging tile [C, BV + STAGE_PAD],
so that global stores are whole 16-byte row pieces; `state_store` writes a state Sᵀ (the
recompute's S, the backward walk's dS') to h[c, ih, :, v0 : v0 + BV] the same way. Each warpgroup stages and stores only its own
64 columns, between named barriers of its own 128 threads: the walks' chains never wait for
each other.
"""

import tilelang.language as T

ROWS_PER_WARPGROUP = 64  # wgmma's M per warpgroup
# elements of padding per row of a staging tile: a warp's transposed 2-byte stores touch 4 rows
# (2 apart) at once; padded rows start 8 banks apart, so the stores are conflict-free
STAGE_PAD = 8
# first named barrier id of the staging, one per consumer warpgroup (TileLang's own use ids < 4)
STAGE_BARRIER = 4


def stage_transposed(BV: int, R: int):
    """The macro stage_transposed(Xt, x_s, tx): x_s[:, this warpgroup's 64 columns] = Xtᵀ.

    Xt [BV, R] fragment, x_s [R, BV + STAGE_PAD] shared; between named barriers of the
    warpgroup's own 128 threads (the first: its reads of the last staged tile are done).
    """

    @T.macro
    def stage(Xt, x_s, tx):
        wg = tx // 128
        T.sync_threads(STAGE_BARRIER + wg, 128)
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


def state_store(BV: int, K: int):
    """The macro state_store(St, x_s, h, c, ih, v0, tx): h[c, ih, :, v0 : v0 + BV] = Stᵀ.

    St [BV, K] fragment, x_s [K, BV + STAGE_PAD] shared, tx the consumer thread index. Stored
    from the registers element by element instead, a warp's 2-byte stores touch 8 rows of h 256
    bytes apart: the state recompute at 16/32 8x4096 took 0.351 ms against 0.289 staged, the
    backward walk 0.609 against 0.541 (benchmark/NOTES.md v13, v14).
    """
    stage = stage_transposed(BV, K)

    @T.macro
    def store(St, x_s, h, c, ih, v0, tx):
        wg = tx // 128
        lane = tx % 128
        stage(St, x_s, tx)
        for r in T.unroll(K // 16):  # 16 rows x 8 vectors of 8 elements per pass
            row = r * 16 + lane // 8
            col = wg * ROWS_PER_WARPGROUP + lane % 8 * 8
            for e in T.vectorized(8):
                h[c, ih, row, v0 + col + e] = x_s[row, col + e]

    return store
