"""Backward orchestration on the GPU: four stages, no host synchronisation.

Reads like flash_qla/reference/backward_stages.py:
  1. kkt_solve (backward mode): P = Q Kᵀ ⊙ Γ ⊙ Lower and chunk-major γ (and its
     exponentials) from g_cum, and the chunks' bounds (log_norms, from β and K Kᵀ's diagonal)
     that shorten a split walk's extra walks where the gates decay (flash_qla.ops.context_parallel);
     A is the forward's (kept, not recomputed). After a training
     forward (autograd) this launch is skipped: the forward's kkt_solve wrote the same P, γ
     and gates for its own walk, and training keeps them (`chunk_terms`). That costs P's
     activation memory, the size of A (134 MB a layer at 16/32 and T = 32768 in bf16; γ and
     the gates add 13 MB) and saves the launch: training step on the H200 at 16/32 8x4096
     2.697 -> 2.577 ms, gradients bitwise equal (benchmark/NOTES.md v19). The low-level
     backward, which gets only g_cum and A, computes them;
  2. the forward walk, STATES_ONLY: the states S at every chunk start, recomputed in the
     input dtype. Keeping them from the forward instead would cost [chunks, Hv, K, V] of
     activation memory, 4x the size of A (537 MB per layer in bf16 at 16/32 and T = 32768).
     Measured on the H200 at 16/32 (benchmark/NOTES.md v12): the forward walk storing them
     in fp32 takes +0.31 ms at 8x4096 and +0.24 ms at 1x32768 (in bf16, half the bytes:
     ~0.15 and ~0.12, estimated; both walks then stored h element by element from
     registers), where the recompute takes 0.29 and 0.30 ms (v13, its h stores staged
     through shared memory: 0.35 and 0.36 before): keeping them would save ~0.2 ms of a
     3.0-3.7 ms training step for 4x A's memory. Where the states are large (long sequences, many
     heads) memory wins, so recomputing is the default there; where they take at most
     flash_qla.ops.forward.KEEP_STATES_MAX_BYTES (256 MiB) a training forward keeps them by
     default (keep_states=None; True and False force either choice): the training forward walk
     stores them in the input dtype, staged as the recompute stores them, and this step is
     skipped (`chunk_terms`' states); training step 16/48 1x2048 289.7 -> 257.2 µs, 16/64 1024x8
     1196.8 -> 1111.8, 2/8 4096x8 632.7 -> 586.0, gradients bitwise equal (benchmark/NOTES.md v63).
     Measured (v22): training step 16/32 8x4096 2.568 -> 2.449 ms, 1x32768 3.342 -> 3.167, 2/8 8x4096 0.715
     -> 0.653, gradients bitwise equal; the forward keeps 520 MiB more at 16/32 8x4096.
     Where a training forward kept checkpoints (the state every
     profile.checkpoint_chunks chunks in fp32, 1/16 of h's bytes in bf16;
     flash_qla.ops.forward.keeps_checkpoints), the walk restarts from them in pieces of
     that many chunks, all in parallel: long sequences over few heads give it too few
     blocks otherwise. The states are the same either way (each piece starts from the fp32
     state the forward walk had there, and walks the same arithmetic). Training step, H200:
     16/32 1x32768 4.05 -> 3.78 ms, 2/8 1x32768 2.24 -> 1.81 (benchmark/NOTES.md v11).
     A forward that split walked the same pieces and hands their start states over in the
     pieces' order, read as they are (they were copied into the checkpoint rows there and
     gathered back here, ~0.1 ms of copies at 16/32 1x32768: training step 3.176 -> 3.136 ms,
     4/16 1x32768 1.626 -> 1.610, gradients bitwise equal; benchmark/NOTES.md v28).
     It runs on a second stream beside step 3, which does not read the states: where few
     heads leave SMs idle, each walk runs in the other's idle SMs (results bitwise the same).
     H200, one stream -> two (benchmark/NOTES.md v19): low-level backward 2/8 1x32768 1.185
     -> 0.926 ms, 4/8 5000+70+0+3000 0.358 -> 0.254; training step 4/8 5000+70+0+3000 0.449 ->
     0.377, 2/8 1x32768 0.941 -> 0.926; 16/32 unchanged within 0.02 ms (its walks fill the SMs);
     where neither splits, the two widths are chosen together (beside_widths), so that the
     recompute's grid runs beside the walk's, not after it;
  3. the backward walk (fused_bwd_wide for V-tiles of 64 or 128 columns, fused_bwd for
     narrower ones): the state gradients dS' walked backward in time, dv, dh0. Long
     sequences over few heads walk in pieces where the forward split them (it hands over its
     maps) or, without them, where forming the maps pays (splits_backward, from the lengths
     validation read; flash_qla.ops.context_parallel.split_backward_walk);
  4. chunk_grads: dq, dk (summed over the v-heads of each qk-head in a fixed order, so
     results are bitwise reproducible), dβ and dg of every chunk in parallel; where the (chunk,
     qk-head) items leave the blocks' last round mostly idle (most often: fewer items than SMs), each
     item's v-heads in two halves on two blocks where that saves more than the halves' exchange costs
     (grads_parts).

What a call decides from its shapes and options alone (the route, the V-tile widths, the kernels) is
decided once per shapes and options (backward_plan), as the forward's (flash_qla.ops.forward.forward_plan).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from flash_qla.arch import ArchProfile, get_profile, multiprocessors
from flash_qla.ops import buffers
from flash_qla.ops.chunk_grads import chunk_grads_kernel
from flash_qla.ops.chunks import checkpoint_pieces, chunk_tables, count_pieces
from flash_qla.ops.compose_maps import compose_maps_kernel
from flash_qla.ops.context_parallel import maps_of_pieces, split_backward_walk, split_specs
from flash_qla.ops.forward import (
    BLOCK_V_CHOICES,
    DTYPE_NAMES,
    RECOMPUTE_CHUNK_US,
    WIDE_BLOCK_V,
    beta_kernel_dtype,
    check_kernel_inputs,
    checkpoint_pieces_expected,
    choose_block_v,
    chunk_step_time,
    kernel_input,
    splits_backward,
    walk_gate,
    walk_kernel,
)
from flash_qla.ops.fused_bwd import fused_bwd_kernel
from flash_qla.ops.fused_bwd_wide import fused_bwd_wide_kernel
from flash_qla.ops.kkt_solve import kkt_solve_kernel
from flash_qla.ops.launch import current_stream, executable, fork, on_device, side_stream


def backward_walk_kernel(BV: int):
    """The backward walk's kernel factory for V-tiles of BV columns (the gate as in walk_gate)."""
    return fused_bwd_wide_kernel if BV in WIDE_BLOCK_V else fused_bwd_kernel


# µs a chunk of one block (one SM) of the backward walk per V-tile width, alone on the H200 (bf16, K = V = 128,
# grids of at most one wave, over 2/8 8x4096 and 16/32, 4/16, 2/8 1x2048; benchmark/NOTES.md v47), for its pairing
# with the state recompute (beside_widths; the recompute's: RECOMPUTE_CHUNK_US). Against 64 columns its two chains at
# 128 take 1.4x one chain, the recompute's 1.5x. The backward walk over pieces (a split) takes its width from the
# forward walk's table (flash_qla.ops.forward.FORWARD_CHUNK_US), which picks as this one does on DESIGN.md §4's
# layouts and patterns (8 and 16 pieces) except 8/24 at 8; elsewhere it takes 64 columns where this table takes 128
# at 4/16 and 16/16 over 9-12 pieces and 2/8 over 17-24 (not measured).
BACKWARD_CHUNK_US = {128: 2.90, 64: 2.05, 32: 1.94, 16: 1.47}
# The walk's chunk takes longer in a fuller grid (its blocks' tile loads share L2 and DRAM): beside_widths costs it
# BACKWARD_CHUNK_US x (1 + GRID_LOAD x blocks / SMs) / (1 + GRID_LOAD x TABLE_LOAD), the table's grids having held
# about half the SMs. Fitted on the H200's training steps over all 16 width pairs of 11 configs (benchmark/NOTES.md
# v58 step 3): the table alone picks the fastest pair, or one within 0.2 %, at ten; at 8/24 1x2048 it put the walk
# at 32 columns (96 blocks) beside the recompute at 128, where 64 / 64 runs 2.5 % faster. With the load every
# GRID_LOAD in (0.17, 0.25) picks right at all eleven, and of the pairs it changes (24 sequence x head pairs: 8/24
# single sequences, 2/8 over three) each was measured faster, gradients bitwise equal: training step 8/24 1x512 73.7 ->
# 70.2 µs, 1x1024 103.1 -> 99.5, 1x2048 187.3 -> 182.6, 1x4096 357.5 -> 346.9, 2/8 2048x3 200.0 -> 194.9
# (benchmark/NOTES.md v59).
GRID_LOAD = 0.2
TABLE_LOAD = 0.5


def beside_widths(walks: int, walk_chunks: int, N: int, chunks: int, Hv: int, V: int, profile: ArchProfile):
    """(BV_h, BV): the V-tile widths of the state recompute (`walks` walks of `walk_chunks` chunks: the
    sequences, or the checkpoint pieces) and of the backward walk (N sequences of `chunks` chunks), which run
    at once, the recompute on a second stream.

    Each block of either takes an SM. The walk follows the kernel before it by programmatic launch, so its
    blocks take their SMs first; the recompute's run on the SMs it leaves while it walks (in rounds) and on
    all of them after. Modelled: both grids' time is the walk's, if the recompute fits in the SMs left
    before the walk ends, else the two one after the other (each in waves of the SMs; equal lengths assumed;
    the walk's chunk costed at its grid's load, GRID_LOAD). Choosing the two widths apart (each the least
    waves x chunk cost for a grid alone) gave each a grid of about one wave, together two, run one after the
    other. H200, training step, apart -> together (one process, interleaved; gradients bitwise equal;
    benchmark/NOTES.md v47): 2/8 8x4096 667.6 -> 649.8 µs (the walk at 128 columns beside the recompute at
    64), 16/32 1x2048 261.2 -> 218.9 (both at 64), 4/16 1x2048 179.4 -> 156.4, 16/32 1x8192 857.3 -> 802.1
    (low-level backward 786.3 -> 590.1); 16/32 8x4096 unchanged (each grid fills the SMs). Ties go to the
    faster recompute alone, then to the wider walk.
    """
    sms = profile.num_sms
    best = None
    for bv in BLOCK_V_CHOICES:
        blocks = N * Hv * (V // bv)
        load = (1 + GRID_LOAD * min(blocks, sms) / sms) / (1 + GRID_LOAD * TABLE_LOAD)
        walk = chunks * chunk_step_time(N, Hv, V, bv, profile, BACKWARD_CHUNK_US) * load
        for bv_h in BLOCK_V_CHOICES:
            alone = walk_chunks * chunk_step_time(walks, Hv, V, bv_h, profile, RECOMPUTE_CHUNK_US)
            both = walk + alone  # one after the other
            if blocks < sms:  # the recompute's rounds on the SMs the walk leaves
                rounds = -(-walks * Hv * (V // bv_h) // (sms - blocks))
                both = min(both, max(walk, rounds * walk_chunks * RECOMPUTE_CHUNK_US[bv_h]))
            key = (both, alone, -bv)
            if best is None or key < best[0]:
                best = (key, (bv_h, bv))
    return best[1]


# the parts chunk_grads may split a (chunk, qk-head) item into (grads_parts): whole, or two halves of its v-heads
GRADS_PARTS = (1, 2)
# what an item's exchange between its parts costs a round of chunk_grads' blocks, in v-heads walked: the first
# part's fp32 sums stored, the second part's wait for them and their loads. H200, chunk_grads' kernel time
# (benchmark/NOTES.md v59, v60): ~7 µs at 2/8 1x2048 (one round, its start included) against ~9.5 a v-head (0.74);
# at full grids in parts against whole, 8/32 1x32768 1116 -> 1366 µs (63 rounds of 2 v-heads against 32 of 4: ~4.4
# a round, 0.5 of a v-head), 16/32 4096x8 1113 -> 1749 (125 rounds of 1 against 63 of 2: 0.58), 16/64 4096x8 2135 ->
# 2692 (125 of 2 against 63 of 4: 0.54)
PARTS_EXCHANGE = 0.75


def grads_parts(n_chunks: int, Hqk: int, Hv: int, sms: int) -> int:
    """How many items chunk_grads splits each (chunk, qk-head) into, each walking Hv / Hqk / parts of its
    v-heads: the least rounds of its persistent blocks x (v-heads an item, and PARTS_EXCHANGE where in parts),
    ties to fewer parts.

    One block an SM walks its items' v-heads one after the other, so where the items are fewer than the
    SMs (few qk-heads, short sequences: 2/8 at 2048 tokens has 64 items of 4 v-heads) most SMs idle. In
    two parts, an item's dq and dk are the sum of the parts' (two addends: bitwise reproducible), added
    by the part that counts second, through an fp32 buffer and a count an item. Where the items fill the
    SMs' rounds anyway (the 32768-token rows of 16/32, 8/32 and 16/64) the parts save at most a round's
    rounding and pay their exchange every round: training step in parts -> whole, 8/32 1x32768 2878 -> 2620
    µs, 16/32 4096x8 2986 -> 2366, 16/64 4096x8 5086 -> 4524 (benchmark/NOTES.md v60).
    """
    groups = Hv // Hqk
    options = [p for p in GRADS_PARTS if groups % p == 0]

    def cost(p):
        rounds = -(-n_chunks * Hqk * p // sms)
        return rounds * (groups // p + (PARTS_EXCHANGE if p > 1 else 0))

    return min(options, key=lambda p: (cost(p), p))


def backward_kernels(
    q, k, v, g_cum, beta, A, do, dht, scale, initial_state, cu_seqlens, seqlens, checkpoints, maps, auto_cp,
    chunk_terms,
):  # fmt: skip
    """The GPU backward; arguments and returns as flash_qla.dispatch._backward.

    q, k [1, T, Hqk, K]; v, do [1, T, Hv, V]; g_cum (or None, given chunk_terms), beta [1, T, Hv];
    A [1, T, Hv, 64];
    cu_seqlens [N + 1] int32 and the lengths it holds (host ints); dht, initial_state
    [N, Hv, K, V] float32 or None; checkpoints, maps, chunk_terms: what the forward returned for
    them, or None; auto_cp: the backward walk splits the sequences where forming their maps pays
    (splits_backward); it always splits the pieces of a forward that split (their maps given).
    """
    with on_device(q.device):  # launches go to q's device, not the current one
        return _backward_kernels(
            q, k, v, g_cum, beta, A, do, dht, scale, initial_state, cu_seqlens, seqlens, checkpoints, maps, auto_cp,
            chunk_terms,
        )  # fmt: skip


class BackwardPlan(NamedTuple):
    """What a backward decides from its shapes and options alone (backward_plan): the same for every
    layer of a model step, so decided once. Executables are TileLang's TVM-FFI callables."""

    profile: ArchProfile
    slots: int  # chunk slots: T // C + N, an upper bound known without a sync
    kkt: Callable | None  # kkt_solve in backward mode; None when the training forward kept its outputs
    recompute: Callable | None  # the states-only forward walk; None when the forward kept every state
    BV_h: int | None  # its V-tile width
    split: bool  # the backward walk runs over pieces (flash_qla.ops.context_parallel)
    walk: Callable  # the backward walk: over whole sequences, or over the pieces from their end gradients
    BV: int  # its V-tile width
    ends_walk: Callable | None  # split: the walk from zero keeping the pieces' start gradients (ENDS_ONLY)
    compose: Callable | None  # split: compose_maps over the pieces' end gradients (REVERSE)
    map_walk: Callable | None  # split without the forward's maps: the MAPS walk forming them
    BV_maps: int | None  # its V-tile width
    grads: Callable  # chunk_grads (dβ stored in the beta_dtype the plan was made for)
    parts: int  # its parts of an item (grads_parts)
    blocks: int  # chunk_grads' persistent blocks


@functools.lru_cache(maxsize=256)
def backward_plan(
    device, T, seqlens, Hqk, Hv, K, V, dtype, beta_dtype, kept_terms, kept_states, has_checkpoints, has_maps, has_h0,
    has_dht, auto_cp,
):  # fmt: skip
    """The BackwardPlan of a backward over these shapes (dtype: q's torch dtype; beta_dtype: dβ's in the kernel,
    flash_qla.ops.forward.beta_kernel_dtype's) and what the forward handed
    over (kept_terms: kkt_solve's P, γ and gates; kept_states: every state; has_checkpoints, has_maps),
    remembered. Made on every call, the decisions (the split model over every sequence) and the kernel
    lookups took 13-28 µs of the backward's host time on the H200 (after a training forward, GPU idle:
    2/8 8x4096 166-180 -> 150-153 µs, 16/32 1x2048 155-160 -> 137-146; benchmark/NOTES.md v40). A new
    seqlens pattern is planned afresh. The first thing: check_kernel_inputs (flash_qla.ops.forward)."""
    check_kernel_inputs(dtype, K, V, T, len(seqlens))
    profile = get_profile(device)
    C = profile.chunk
    N = len(seqlens)
    name = DTYPE_NAMES[dtype]
    slots = T // C + N
    beta_name = DTYPE_NAMES.get(beta_dtype, "float32")
    # a training forward that split hands its maps over: the same pieces then (its planner's decision,
    # from the same lengths); without them the backward forms its own where that pays (splits_backward)
    split = has_maps or (auto_cp and splits_backward(seqlens, Hv, V, profile))
    kkt = None
    if not kept_terms:  # backward mode: P, γ and the gates from g_cum, and where the walk splits the bounds
        kkt = kkt_solve_kernel(Hqk, Hv, K, name, profile, beta_name if split else "float32", True, True, split)
        kkt = executable(kkt)
    # the recompute's walks: the sequences, or the checkpoint pieces (the empty pieces past the last, for which a
    # checkpointed walk has room, exit at once: the widths are chosen for the pieces that walk)
    chunks = -(-T // (C * N))  # a sequence's, equal lengths assumed
    walks, walk_chunks = N, chunks
    if has_checkpoints:
        walks, walk_chunks = checkpoint_pieces_expected(N, T, profile), profile.checkpoint_chunks
    ends_walk = compose = map_walk = BV_maps = BV_h = None
    if split:  # the recompute runs beside the end walk and compose_maps, each width chosen alone
        if not kept_states:
            BV_h = choose_block_v(walks, Hv, V, profile, RECOMPUTE_CHUNK_US)
        pieces = count_pieces(seqlens, C, profile.checkpoint_chunks)
        BV = choose_block_v(pieces, Hv, V, profile)
        walk = backward_walk_kernel(BV)(Hqk, Hv, K, V, BV, name, profile, True, has_h0)
        ends_walk = executable(backward_walk_kernel(BV)(Hqk, Hv, K, V, BV, name, profile, False, True, True))
        compose = executable(compose_maps_kernel(Hv, K, V, profile, has_dht, True))
        if not has_maps:  # the forward did not split: its MAPS walk forms them
            BV_maps = choose_block_v(pieces, Hv, V, profile, RECOMPUTE_CHUNK_US)
            map_walk = walk_kernel(BV_maps)(Hqk, Hv, K, V, BV_maps, name, profile, False, False, True, False, True)
            map_walk = executable(map_walk)
    else:
        if kept_states:  # the walk alone
            BV = choose_block_v(N, Hv, V, profile)
        else:  # the walk beside the recompute
            BV_h, BV = beside_widths(walks, walk_chunks, N, chunks, Hv, V, profile)
        walk = backward_walk_kernel(BV)(Hqk, Hv, K, V, BV, name, profile, has_dht, has_h0)
    recompute = None
    if not kept_states:
        has_start = has_checkpoints or has_h0
        recompute = executable(walk_kernel(BV_h)(Hqk, Hv, K, V, BV_h, name, profile, has_start, True, True))
    sms = multiprocessors(device)
    parts = grads_parts(sum(-(-n // C) for n in seqlens), Hqk, Hv, sms)
    grads = executable(chunk_grads_kernel(Hqk, Hv, K, V, name, profile, beta_name, parts))
    blocks = min(sms, slots * Hqk * parts)  # persistent: one block an SM
    return BackwardPlan(
        profile, slots, kkt, recompute, BV_h, split, executable(walk), BV, ends_walk, compose, map_walk, BV_maps, grads,
        parts, blocks,
    )  # fmt: skip


def _backward_kernels(
    q, k, v, g_cum, beta, A, do, dht, scale, initial_state, cu_seqlens, seqlens, checkpoints, maps, auto_cp,
    chunk_terms,
):  # fmt: skip
    _, T, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    N = len(seqlens)
    states = None if chunk_terms is None else chunk_terms[3]
    has_dht, has_h0 = dht is not None, initial_state is not None
    dbeta_dtype = beta_kernel_dtype(beta, q)
    plan = backward_plan(
        q.device, T, seqlens, Hqk, Hv, K, V, q.dtype, dbeta_dtype, chunk_terms is not None, states is not None,
        checkpoints is not None, maps is not None, has_h0, has_dht, auto_cp,
    )  # fmt: skip
    profile, slots = plan.profile, plan.slots
    C = profile.chunk
    beta_dtype, g_dtype = beta.dtype, torch.float32 if g_cum is None else g_cum.dtype
    q, k, v = kernel_input(q), kernel_input(k), kernel_input(v)
    do, A = kernel_input(do, q.dtype), kernel_input(A, q.dtype)
    cu_seqlens = kernel_input(cu_seqlens)
    chunk_offsets, chunks = chunk_tables(cu_seqlens, C, slots)
    placeholder = buffers.placeholder(q.device, Hv, K, V)
    unbounded = buffers.no_bounds(q.device, Hv)  # the walks' log_norms where their flags say it is not read
    f32 = torch.float32

    # 1. P, chunk-major γ and the bounds, unless the (training) forward kept its own
    if chunk_terms is not None:
        P, gamma, gates, _ = chunk_terms
        log_norms = None if maps is None else maps[1]  # its bounds come with its maps
    else:
        gamma = buffers.new((Hv, slots, C), f32, q)
        gates = buffers.new((Hv, slots, 2, C), f32, q)
        P = buffers.new((1, T, Hv, C), q.dtype, q)
        log_norms = buffers.new((Hv, slots), f32, q)  # formed where the walk splits (its plan's kkt)
        g_cum = kernel_input(g_cum, f32)
        beta_in = kernel_input(beta, dbeta_dtype) if plan.split else g_cum  # read for the bounds only
        # backward mode: g_cum is read as g (no cumsum), and A is neither formed nor written
        plan.kkt(q, k, g_cum, beta_in, chunks, g_cum, gamma, gates, A, P, log_norms, slots)

    # 2. states at every chunk start (the final state is a by-product; o is not computed), over
    # the sequences or, from the forward's checkpoints, over pieces of them. On a second stream,
    # beside step 3 (the backward walk does not read the states): each runs in the SMs the other
    # leaves idle. Every tensor the second stream touches is allocated before it forks (or on it)
    # and referenced here until the join before step 4, so the allocator reuses none of it early
    beside = None
    if states is not None:  # kept by the training forward (keep_states): nothing to recompute
        h = states
    else:
        h = buffers.new((slots, Hv, K, V), q.dtype, q)
        if checkpoints is None:
            walks, firsts = cu_seqlens, chunk_offsets
        else:
            walks, firsts, rows = checkpoint_pieces(cu_seqlens, C, slots, profile.checkpoint_chunks)
        ht = torch.empty(walks.numel() - 1, Hv, K, V, dtype=f32, device=q.device)
        beside, main = side_stream(q.device), current_stream(q.device)
        with fork(beside, main):
            if checkpoints is None:
                h0 = initial_state
            elif maps is not None:  # a forward that split: its pieces' start states, in the pieces' order
                h0 = checkpoints
            else:  # kept by chunk (flash_qla.ops.forward.checkpoint_rows)
                h0 = checkpoints.index_select(0, rows)
            # STATES_ONLY never touches o: v, of o's shape and dtype, stands in (no [T, Hv, V] buffer)
            plan.recompute(
                q, k, v, walk_gate(plan.BV_h, gamma, gates), A, P, walks, firsts, unbounded,
                placeholder if h0 is None else kernel_input(h0), v, ht, h, scale,
            )  # fmt: skip

    # 3. state gradients, backward in time, over the sequences or over pieces of them
    dh = buffers.new((slots, Hv, K, V), q.dtype, q)
    dv = buffers.new_like(v)
    dht = kernel_input(dht, f32) if has_dht else None
    if plan.split:
        if plan.map_walk is not None:  # the forward did not split: its MAPS walk forms the maps
            if log_norms is None:  # nor hand bounds over (a training forward, its planner patched): all walked
                log_norms = torch.zeros(Hv, slots, device=q.device)
            bounds, firsts, _ = checkpoint_pieces(cu_seqlens, C, slots, profile.checkpoint_chunks)
            D = maps_of_pieces(
                plan.map_walk, walk_gate(plan.BV_maps, gamma, gates), q, k, v, A, P, bounds, firsts, scale, log_norms,
                buffers.new(*split_specs(N, slots, Hv, K, V, profile.checkpoint_chunks)[0], q),
            )  # fmt: skip
        else:  # a training forward's
            D = maps[0]
        dh0 = split_backward_walk(
            plan.walk, plan.ends_walk, plan.compose, D, walk_gate(plan.BV, gamma, gates), q, k, do, A, P, cu_seqlens,
            slots, seqlens, scale, dht, dh, dv, has_h0, log_norms, profile,
        )  # fmt: skip
    else:
        dh0 = buffers.new((N, Hv, K, V), f32, q) if has_h0 else placeholder
        plan.walk(
            q, k, do, walk_gate(plan.BV, gamma, gates), A, P, cu_seqlens, chunk_offsets,
            unbounded, placeholder if dht is None else dht, dh, dv, dh0, scale,
        )  # fmt: skip

    # 4. chunk gradients, once the states are there
    if beside is not None:
        main.wait_stream(beside)
    dq, dk = buffers.new_like(q), buffers.new_like(k)
    dbeta, dg = buffers.new((1, T, Hv), dbeta_dtype, q), buffers.new((1, T, Hv), f32, q)
    if plan.parts > 1:  # the dq and dk sums of an item's first part, and a count an item
        dq_first, dk_first = (buffers.new((slots, C, Hqk, K), f32, q) for _ in range(2))
        counts = buffers.counters(slots * Hqk, q).view(slots, Hqk)
    else:
        dq_first, counts = buffers.no_parts(q.device, C, Hqk, K)
        dk_first = dq_first
    plan.grads(
        q, k, v, do, dv, A, gamma, h, dh, chunks, dq, dk, dbeta, dg, dq_first, dk_first, counts, scale, slots,
        plan.blocks,
    )  # fmt: skip

    return (
        dq,
        dk,
        dv,
        dbeta.to(beta_dtype),  # a conversion only where β has neither q's dtype nor fp32
        dg.to(g_dtype),
        dh0 if has_h0 else None,
    )


def backward_kernel_builds(profile: ArchProfile, Hqk: int, Hv: int, dtype: str, K: int = 128, V: int = 128):
    """Every (factory, args) training compiles for one head layout, beyond the inference forward's."""
    # kkt_solve in backward mode: forming the bounds (a split walk's), with β in either dtype, and not
    builds = [(kkt_solve_kernel, (Hqk, Hv, K, dtype, profile, bd, True)) for bd in (dtype, "float32")]
    builds.append((kkt_solve_kernel, (Hqk, Hv, K, dtype, profile, "float32", True, True, False)))
    for bv in BLOCK_V_CHOICES:
        # the states-only recompute, over whole sequences or from the checkpoints, and the forward
        # walk keeping checkpoints
        for has_h0 in (False, True):
            builds.append((walk_kernel(bv), (Hqk, Hv, K, V, bv, dtype, profile, has_h0, True, True)))
        for has_h0 in (False, True):
            builds.append((walk_kernel(bv), (Hqk, Hv, K, V, bv, dtype, profile, has_h0, False, False, True)))
    for bv in BLOCK_V_CHOICES:
        for has_dht in (False, True):
            for store_dh0 in (False, True):
                builds.append((backward_walk_kernel(bv), (Hqk, Hv, K, V, bv, dtype, profile, has_dht, store_dh0)))
        # the pieces' offsets of a split backward walk (its maps are the forward's MAPS walk)
        builds.append((backward_walk_kernel(bv), (Hqk, Hv, K, V, bv, dtype, profile, False, True, True)))
    builds += [(compose_maps_kernel, (Hv, K, V, profile, has_dht, True)) for has_dht in (False, True)]
    for parts in GRADS_PARTS:
        if (Hv // Hqk) % parts == 0:
            builds += [(chunk_grads_kernel, (Hqk, Hv, K, V, dtype, profile, bd, parts)) for bd in (dtype, "float32")]
    return builds
