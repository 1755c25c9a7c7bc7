"""Which chunks of a piece the split's extra walks leave out (flash_qla.ops.context_parallel).

kkt_solve bounds each chunk's transition: ‖T_c‖ ≤ e^{L_c}, log_norms [Hv, slots] fp32. A walk
block of the split's map, offset or end walk sums the L_c of its piece (≤ E chunks, first global
chunk `first`, `count` chunks) in its prologue and walks only the chunks whose part of its
result is more than NEGLIGIBLE of a state's norm. The macros return the chunk count they decide
(walk_start: where a forward walk block starts, from that count).

Their variables are stores to registers in the producer warpgroup, which TileLang's register
split (AnnotateWarpGroupRegAlloc) takes for a SIMT copy: it would then give every warpgroup the
same registers and the consumers' tiles would spill (16-24 bytes of stack at 128 columns). So the
macros ask for the split it makes otherwise, 24 registers a producer thread and 240 a consumer
one (the walks run one producer and one or two consumer warpgroups).
"""

import math

import tilelang.language as T

# a walk leaves out what moves its result by at most this much of a state's norm: below fp32's
# rounding of that state (the walks round S to the input dtype, 2^-8 of it in bf16, every chunk)
NEGLIGIBLE = 2.0**-24
LOG_NEGLIGIBLE = math.log(NEGLIGIBLE)


@T.macro
def map_negligible(log_norms, ih, first, count, E: int):
    """Whether the piece's transition M = T_n ··· T_1 (n = count ≤ E chunks) is negligible: Σ_c L_c ≤ ln
    NEGLIGIBLE. Lane l of the calling warp adds chunks l, l + 32, ...; a warp sum gives every lane, and every
    kernel that asks (the map walk, compose_maps), the same bits."""
    lane = T.get_thread_binding() % 32
    total = T.alloc_var("float32")
    if E <= 32:  # a chunk a lane
        total = T.warp_reduce_sum(T.if_then_else(lane < count, log_norms[ih, first + lane], 0.0))
    else:
        part = T.alloc_var("float32")
        part = 0.0
        for r in range(-(-E // 32)):
            part += T.if_then_else(r * 32 + lane < count, log_norms[ih, first + r * 32 + lane], 0.0)
        total = T.warp_reduce_sum(part)
    return total <= LOG_NEGLIGIBLE


@T.macro
def skipped_first_chunks(log_norms, ih, first, count, E: int, whole: bool):
    """The first chunks of the piece its forward walk leaves out. whole (the map walk, M =
    T_n ··· T_1): all of them when M is negligible (map_negligible), else none. Otherwise (the
    offset walk, b from 0): the largest s with Σ_{c ≥ s} L_c ≤ ln NEGLIGIBLE (what T_n ··· T_{s+1}
    does to the state after chunk s), else 0."""
    T.annotate_producer_reg_dealloc(24)
    T.annotate_consumer_reg_alloc(240)
    skip = T.alloc_var("int32")
    skip = 0
    if whole:
        if map_negligible(log_norms, ih, first, count, E):
            skip = count
    else:  # suffix sums, last chunk first: the first that is negligible gives the largest s
        bound = T.alloc_var("float32")
        bound = 0.0
        for r in T.unroll(E):
            if E - 1 - r < count:
                bound += log_norms[ih, first + E - 1 - r]
                if skip == 0 and bound <= LOG_NEGLIGIBLE:
                    skip = E - 1 - r
    return skip


@T.macro
def walk_start(log_norms, ih, cu_seqlens, chunk_offsets, n, C: int, E: int, skips: bool, whole: bool):
    """The first token and first global chunk a forward walk block starts its piece n at: past the
    chunks skipped_first_chunks leaves out where skips (the split's map and offset walks; all of
    them: none), else the piece's own."""
    if skips:
        count = T.ceildiv(cu_seqlens[n + 1] - cu_seqlens[n], C)
        skip = skipped_first_chunks(log_norms, ih, chunk_offsets[n], count, E, whole)
        return T.min(cu_seqlens[n] + skip * C, cu_seqlens[n + 1]), chunk_offsets[n] + skip
    return cu_seqlens[n], chunk_offsets[n]


@T.macro
def kept_first_chunks(log_norms, ih, first, count, E: int):
    """The first chunks of the piece its end walk (b' walked back from 0) needs: the
    least e with Σ_{c < e} L_c ≤ ln NEGLIGIBLE (what T_1ᵀ ··· T_eᵀ does to the gradient before
    chunk e), else all `count`."""
    T.annotate_producer_reg_dealloc(24)
    T.annotate_consumer_reg_alloc(240)
    keep = T.alloc_var("int32")
    bound = T.alloc_var("float32")
    keep = count
    bound = 0.0
    for c in T.unroll(E):
        if c < count:
            bound += log_norms[ih, first + c]
            if keep == count and bound <= LOG_NEGLIGIBLE:
                keep = c + 1
    return keep
