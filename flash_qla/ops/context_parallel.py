"""Context-parallel walks: long sequences over few heads, walked in pieces (DESIGN.md §1).

The exact route, shortened where the gates decay.

A single sequence gives the forward walk Hv · V / BV chains of all its chunks (2/8 at 32768
tokens: 64 chains of 512 chunks, half the SMs idle). Here the sequence is cut into pieces of
E = profile.checkpoint_chunks chunks (flash_qla.ops.chunks.checkpoint_pieces; an inference forward on the O path
twice that where flash_qla.ops.forward.split_piece_chunks says so: `every`) that walk in
parallel. Each piece maps its start state affinely, S_end = M S_start + b, with

    M = T_E ··· T_1,  T_c = e^{γ_L} I − Kᵀ diag(e^{γ_L − γ}) A diag(e^γ) K     [K, K]
    b = the piece's end state from S_start = 0                                   [K, V]

(γ, A, K of chunk c). With V = 0 the walk without o (walk_kernel STATES_ONLY) carries S to
T_c S, and K = V, so walked from S = I it ends at M (the MAPS variant: the identity start and
the zero V are the kernel's, nothing is read for them, and it writes D = M − I as the two bf16
halves compose_maps multiplies with); walked from S = 0 with the real V it ends at b: two
launches over all pieces, which keep only the end states, on two streams (the map walk beside the
offsets walk: where the gates decay each walks a few pieces in full and leaves most SMs idle
meanwhile; training step 16/32 1x32768 2835.3 -> 2807.6 µs, 4/16 1461.8 -> 1429.1, inference
forward 4/16 1x32768 450.0 -> 415.9, 2/8 211.2 -> 202.7; benchmark/NOTES.md v44). compose_maps
composes the maps into every piece's start state, and the forward walk (HAS_H0) runs over
the pieces from them, giving o (and h) of every chunk; the final state is the last piece's
end state. For o alone that walk is fused_fwd_opath where it pays (flash_qla.ops.forward.walk_plan): P formed
there, kkt_solve forms only the bounds, and the map and offsets walks read no P.

Not done: walking each sequence's first pieces before compose_maps (their start states need none: the first starts
at the initial state, the next at the end state of the one before), beside the map and offsets walks, on streams of
their own, the other pieces after compose_maps on a stream a sequence. Built in session 96 (a lead of one or two
pieces where that left the walk after compose_maps a wave of blocks less; H100: 16/16 16384+16384 422 -> 405 µs,
16/32 28672+4096 706 -> 670), it hung the GPU: one call in a few hundred to ~15 000 never finished, at 4/16 and
16/16 16384+16384; the same calls without a lead ran 109 000 times (H100, benchmark/NOTES.md v103, v105, v106).
Removed in session 103. The walk left running was the offsets walk, one block of it, with one or two of its producer
warps 1-3 in a ring stage wait that nothing would end: TileLang's ring, which launch.ring_trips now keeps to warp 0
(benchmark/NOTES.md v107). The branch `lead-back` brings the lead back; with the ring fix its calls ran clean in
session 107, not yet counted or timed.

The start states are the sequential walk's up to rounding (both walks round S to the input
dtype as a tensor-core operand every chunk, at different points): 2/8 1x32768, o within
3.4e-3 of the fp32 reference either way, 2.4e-4 apart; 4/16 1x32768 3.43e-3 either way.
H200 (benchmark/NOTES.md v12-v13), 2/8 1x32768: the forward 0.599 ms whole, 0.466 split with
the maps from the backward's recompute (a zero V and identity start states as tensors, every
chunk's state stored), 0.328 with the MAPS walks, 0.288 with compose_maps reading D ready-made
(the walks over pieces 45 µs each, the composition 36); the training step 1.53 ms against 2.24
with auto_cp off (here the start states are the checkpoints: no checkpointing walk). Several
sequences split alike: the walks run all their pieces at once, the composition one block per
sequence, head and V-tile over that sequence's pieces (flash_qla.ops.chunks.first_pieces); a
zero-length sequence has none (its final state is its initial state). 2/8 2x16384: forward
0.341 -> 0.276 ms, training step 1.166 -> 0.972 (v14).

The backward walk splits the same way, walked last to first. Over a piece it maps the state
gradient at the piece's end affinely to the one at its start, dS_start = Mᵀ dS_end + b', with
the same M (the adjoint of each chunk's T_c: the backward walk's linear part) and b' the
piece's dS_start from dS_end = 0: the MAPS walk gives M (a training forward that split hands
its D over), the backward walk from zero over all pieces at once (ENDS_ONLY: it writes only
each piece's dS_start) gives b', compose_maps (REVERSE) composes the transposed maps from dht,
last piece first, into every piece's end gradient, and the backward walk runs over the pieces
from them (dh, dv of every chunk; dh0 is the first piece's start gradient). Gradients
within 1.3e-3 of the whole walk's. H200 (benchmark/NOTES.md v14): the low-level backward 2/8
1x32768 1.650 -> 1.223 ms, 4/16 1.997 -> 1.797; the training step 2/8 1x32768 1.469 -> 1.000.

Where the gates decay, most of those three extra walks (M, b, b') is negligible, and left out
(DESIGN.md §1's gate-driven route, on the exact route's walks). A token maps the state by
e^{g_t} (I − β_t k_t k_tᵀ), whose norm is e^{g_t} max(1, |1 − β_t ‖k_t‖²|), so a chunk's
transition T_c has ‖T_c‖ ≤ e^{L_c}, L_c = γ_L + Σ_t ln max(1, |1 − β_t ‖k_t‖²|) (kkt_solve's
log_norms; ‖k_t‖ = 1 and 0 ≤ β_t ≤ 2 make the sum 0), and so does its adjoint. Per piece of
chunks 1..n and v-head, each walk block decides in its prologue from its piece's L_c
(flash_qla.ops.negligible):
  - M = T_n ··· T_1 is negligible when Σ_{c ≤ n} L_c ≤ ln NEGLIGIBLE: the MAPS walk then walks no
    chunk and writes no D (compose_maps' S + D S + b is b there), and compose_maps, which
    makes the same test (the same warp sum), takes b without its products;
  - b, walked from 0 over chunks s + 1..n instead of 1..n, leaves out T_n ··· T_{s+1} x_s (x_s
    the state after chunk s): negligible when Σ_{c > s} L_c ≤ ln NEGLIGIBLE; the offsets walk
    skips the largest such s first chunks;
  - b', walked back from 0 over chunks e..1 instead of n..1, leaves out T_1ᵀ ··· T_eᵀ y_e:
    negligible when Σ_{c ≤ e} L_c ≤ ln NEGLIGIBLE; the end walk skips the n − e last chunks for
    the least such e.
"Negligible" is a norm at most NEGLIGIBLE = 2^-24 times a state's, below fp32's rounding of that
state (the walks round S to the input dtype, 2^-8 of it in bf16, every chunk). Under DESIGN.md
§4's model gates at 32768 tokens the three walks keep 12.7 %, 28.2 % and 28.2 % of their chunks
at 16/32, 0 %, 18 % and 18 % at 2/8. H200 (benchmark/NOTES.md v43, against the same code with the
bounds zeroed): training step 16/32 1x32768 3.189 -> 2.831 ms, 2/8 1x32768 0.885 -> 0.728, forward
2/8 1x32768 0.292 -> 0.210; results within 1.4e-3 of the walks without skips. The backward's own
split (the low-level backward, no training forward before it) takes the same bounds from kkt_solve's
backward mode, which forms them again (the forward mode's bits): low-level backward 4/16 1x32768
1.671 -> 1.551 ms, 2/8 1x32768 0.900 -> 0.912 (its map and end walks run beside the recompute
there, in SMs it leaves idle; benchmark/NOTES.md v46).
"""

import contextlib
from typing import NamedTuple

import torch

from flash_qla.ops import buffers
from flash_qla.ops.chunks import checkpoint_pieces, first_pieces, sequence_pieces
from flash_qla.ops.launch import fork


def split_specs(n_seqs: int, slots: int, Hv: int, K: int, V: int, every: int) -> tuple:
    """((shape, dtype), ...) of a split walk's buffers over n_seqs sequences and `slots` chunk slots in pieces of
    `every` chunks, one row per piece of checkpoint_pieces (N + slots // every, the empty ones past the last
    included): D (maps_of_pieces), then b, starts and ends (split_walk)."""
    n = n_seqs + slots // every
    return ((n, Hv, K, 2 * K), torch.bfloat16), *(((n, Hv, K, V), torch.float32),) * 3


def maps_of_pieces(maps, maps_gate, q, k, v, A, P, bounds, firsts, scale, log_norms, D, streams=None):
    """Fills D [n, Hv, K, 2 K] (split_specs' first) with M − I of each of the n pieces that bounds and firsts
    (checkpoint_pieces' token bounds and first chunks, as the walk's cu_seqlens and chunk_offsets) give (the rows of
    the empty ones past the last unused), as compose_maps reads it, and returns it: `maps` is the executable of
    the forward walk's MAPS variant, taking maps_gate; it reads neither v nor h0: v, of o's shape and dtype, and
    the placeholder stand in; log_norms: kkt_solve's (no D written where M is negligible; zeros: every chunk walked).
    streams: (beside, main): walk on beside, forked from main, the current stream (launch.fork; main must wait
    for beside before anything reads D: split_walk's join); every tensor the walk reads outlives that wait (the
    caller's, or cached) but the tables where they are not cached (a cu_seqlens made under inference_mode, a CUDA
    graph's capture: flash_qla.tensor_cache), which are marked used on beside."""
    Hv, V = v.shape[2:]
    K = q.shape[-1]
    assert K == V, "the transition M is walked as a state"
    placeholder = buffers.placeholder(v.device, Hv, K, V)
    with contextlib.nullcontext() if streams is None else fork(*streams):
        maps(q, k, v, maps_gate, A, P, bounds, firsts, log_norms, placeholder, v, D, placeholder, scale)
    if streams is not None:  # their blocks are not reused before the walk on beside is done
        bounds.record_stream(streams[0])
        firsts.record_stream(streams[0])
    return D


class SplitTables(NamedTuple):
    """What a split forward's walks read of its pieces (split_tables), all derived from cu_seqlens."""

    every: int  # the pieces' chunks at most
    bounds: torch.Tensor  # [P + 1] int32: checkpoint_pieces' token bounds of the pieces
    firsts: torch.Tensor  # [P + 1] int32: their first global chunks
    seq_pieces: torch.Tensor  # [N + 1] int32: first_pieces' first piece of each sequence
    last_rows: torch.Tensor  # [N] int64: sequence_pieces' last piece of each sequence


def split_tables(cu_seqlens, slots, C: int, every: int) -> SplitTables:
    """The tables of a split forward over pieces of at most `every` chunks of C tokens (maps_of_pieces, split_walk),
    built before kkt_solve launches (flash_qla.ops.forward): the walks after kkt_solve each launch early behind the
    kernel before them (programmatic dependent launch, launch.follow_previous_kernel), which nothing but kernel
    launches and stream forks is to sit between. (Session 106 moved them here while a copy there was suspected of
    the lead's hang; session 107 found the hang in the walks' ring: launch.ring_trips.)"""
    bounds, firsts, seq_pieces, _, _, last_rows = _pieces(cu_seqlens, slots, C, every)
    return SplitTables(every, bounds, firsts, seq_pieces, last_rows)


def _pieces(cu_seqlens, slots, C, E):
    """A split walk's tables, pieces of at most E chunks of C tokens: checkpoint_pieces' bounds and firsts,
    first_pieces' rows of each sequence, n, the pieces counted (an upper bound: the pieces past the last are
    empty), and sequence_pieces' first and last piece of each sequence (all derived from cu_seqlens once)."""
    bounds, firsts, _ = checkpoint_pieces(cu_seqlens, C, slots, E)
    seq_pieces = first_pieces(cu_seqlens, C, slots, E)
    return bounds, firsts, seq_pieces, bounds.numel() - 1, *sequence_pieces(cu_seqlens, C, slots, E)


def _per_sequence(states, rows, seq_pieces, seqlens, passthrough):
    """states[rows], one row per sequence; a zero-length sequence (no piece) gets `passthrough`
    (its initial state or dht; None: zeros) instead."""
    taken = states.index_select(0, rows)
    if 0 not in seqlens:
        return taken
    empty = (seq_pieces[1:] == seq_pieces[:-1]).view(-1, 1, 1, 1)
    return torch.where(empty, 0.0 if passthrough is None else passthrough, taken)


def split_walk(
    walk, D, offsets, offsets_gate, compose, q, k, v, A, P, tables, seqlens, scale, initial_state, log_norms, b,
    starts, ends, streams=None,
):  # fmt: skip
    """o and the final states of the sequences, walked in pieces; fills the pieces' start states.

    walk(bounds, firsts, starts, o, ends): the forward walk over the pieces from their start states, filling o
    and every piece's end state (flash_qla.ops.forward: fused_fwd_wide or fused_fwd with HAS_H0, storing h
    where asked, or fused_fwd_opath, the pieces its sequences); offsets: the TileLang executable of the walk
    giving b (STATES_ONLY, from S = 0, no h), offsets_gate its gate input (flash_qla.ops.forward.walk_gate);
    D: the pieces' maps (maps_of_pieces, at offsets' width); compose: compose_maps' executable (HAS_S0 when
    initial_state is given); q, k [1, T, Hqk, K], v [1, T, Hv, V], A, P [1, T, Hv, C] as the offsets walk
    takes them (it reads no P: any [1, T, Hv, C] tensor of A's dtype stands in); tables: split_tables' (over pieces
    of flash_qla.ops.forward.split_piece_chunks' length, for which the kernels were built), made before kkt_solve;
    seqlens: the sequences' lengths (host ints); initial_state [N, Hv, K, V] float32 or None; log_norms:
    kkt_solve's; b, starts, ends: split_specs' buffers (every piece's offset, start and end state; rows past the
    last non-empty piece not written); streams: (beside, main) when maps_of_pieces walked D on beside (main, the
    current stream, then waits for it before compose_maps); None when D was walked on the current stream.

    Returns o [1, T, Hv, V] and final_state [N, Hv, K, V]; starts holds every piece's start state, in
    checkpoint_pieces' order (a training backward's recompute walks the same pieces from them).
    """
    Hv, V = v.shape[2:]
    K = q.shape[-1]
    _, bounds, firsts, seq_pieces, last_rows = tables
    placeholder = buffers.placeholder(v.device, Hv, K, V)
    # STATES_ONLY never touches o, nor h without STORE_H: v, of o's shape and dtype, and the
    # placeholder stand in
    offsets(q, k, v, offsets_gate, A, P, bounds, firsts, log_norms, placeholder, v, b, placeholder, scale)
    if streams is not None:
        beside, main = streams
        main.wait_stream(beside)
    s0 = placeholder if initial_state is None else initial_state
    compose(D, b, seq_pieces, bounds, firsts, log_norms, s0, starts)

    o = buffers.new_like(v)
    walk(bounds, firsts, starts, o, ends)
    # each sequence's last piece ends at its final state
    return o, _per_sequence(ends, last_rows, seq_pieces, seqlens, initial_state)


def split_backward_walk(
    walk, ends_walk, compose, D, gate, q, k, do, A, P, cu_seqlens, slots, seqlens, scale, dht, dh, dv, store_dh0,
    log_norms, profile,
):
    """The backward walk of the sequences in pieces: fills dh and dv, returns dh0.

    walk / ends_walk: the TileLang executables of the backward walk from per-piece end gradients
    (HAS_DHT, STORE_DH0 = store_dh0) and of the one from zero keeping only the pieces' start
    gradients (ENDS_ONLY), both taking `gate`; compose: compose_maps' executable (REVERSE, HAS_S0 when dht is
    given); D: the pieces' maps (maps_of_pieces, or those of
    a forward that split the same sequences); q, k, do, A, P as the walks take them;
    cu_seqlens [N + 1] and the lengths it holds (host ints); dht [N, Hv, K, V] float32 or None;
    dh [slots, Hv, K, V], dv [1, T, Hv, V]: the outputs; log_norms: kkt_solve's (zeros: every chunk walked). Returns dh0
    [N, Hv, K, V] float32 when store_dh0, else None.
    """
    Hv, V = dv.shape[2:]
    K = q.shape[-1]
    bounds, firsts, seq_pieces, n, first_rows, _ = _pieces(cu_seqlens, slots, profile.chunk, profile.checkpoint_chunks)
    f32 = torch.float32
    placeholder = buffers.placeholder(dv.device, Hv, K, V)
    offsets = buffers.new((n, Hv, K, V), f32, dv)
    ends_walk(q, k, do, gate, A, P, bounds, firsts, log_norms, placeholder, dh, dv, offsets, scale)
    # every piece's end gradient; the rows of the empty pieces past the last are read, not used
    ends = buffers.new((n, Hv, K, V), f32, dv)
    compose(D, offsets, seq_pieces, bounds, firsts, log_norms, placeholder if dht is None else dht, ends)
    starts = buffers.new((n, Hv, K, V), f32, dv) if store_dh0 else placeholder
    walk(q, k, do, gate, A, P, bounds, firsts, log_norms, ends, dh, dv, starts, scale)
    if not store_dh0:
        return None
    # each sequence's first piece starts at dh0 (a zero-length one passes dht through)
    return _per_sequence(starts, first_rows, seq_pieces, seqlens, dht)
