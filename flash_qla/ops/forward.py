"""Forward orchestration on the GPU: kkt_solve (with the gate cumsum), then the fused walk.

Reads like DESIGN.md §1: g_cum and A for all chunks in parallel, then one walk over the
chunks of each (sequence, v-head, V-tile) that produces o, the final state and, when
asked, the per-chunk states h: fused_fwd_wide for V-tiles of 64 or 128 columns, fused_fwd
for narrower ones. An inference forward (o alone) takes fused_fwd_opath at 64 columns instead
wherever that pays (o_path_pays: at 64 columns, at 32 from ~19 sequence-heads, at 128 from ~119; never at 128
over sequences of at most four chunks), which forms P itself, and kkt_solve skips P (walk_plan; 2/8 8x4096 157.6 ->
150.3 µs on the H200, benchmark/NOTES.md v37; 16/32 1x32768 walked whole 896.7 -> 859.3, 8x4096 549.7 -> 537.4,
v48). Long sequences over few heads walk in pieces instead (splits_forward, flash_qla.ops.context_parallel), o alone
there too by fused_fwd_opath where it pays over the pieces (walk_plan: kkt_solve then forms the bounds without P); many
short ones several a block (sequences_per_block: fused_fwd_wide's PACKED).
What a call decides from its shapes and options alone (the route, the V-tile width, the kernels)
is decided once per shapes and options (forward_plan): the layers of a model step repeat them. A
training forward may keep state checkpoints for the backward's recompute (keeps_checkpoints,
flash_qla.ops.backward) or every state, so that the backward recomputes none: where they are small
(keeps_states) or asked to (keep_states).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from flash_qla.arch import ArchProfile, get_profile
from flash_qla.ops import buffers
from flash_qla.ops.chunks import chunk_rows, chunk_tables, count_pieces, piece_chunks, sequence_groups
from flash_qla.ops.compose_maps import compose_maps_kernel
from flash_qla.ops.context_parallel import maps_of_pieces, split_specs, split_tables, split_walk
from flash_qla.ops.fused_fwd import fused_fwd_kernel
from flash_qla.ops.fused_fwd_opath import BV as OPATH_BLOCK_V
from flash_qla.ops.fused_fwd_opath import fused_fwd_opath_kernel
from flash_qla.ops.fused_fwd_wide import fused_fwd_wide_kernel
from flash_qla.ops.kkt_solve import kkt_solve_kernel
from flash_qla.ops.launch import current_stream, executable, on_device, side_stream
from flash_qla.reference.chunked import CHUNK_SIZE

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = ((128, 128),)
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


# CUDA's limit on a grid's y and z extents: kkt_solve's grid has a block row per chunk slot (T // 64 + N), the walks
# one per sequence, or per piece of one (N + slots // checkpoint_chunks: pieces_fit_the_grid)
MAX_GRID_YZ = 65535


def kernel_unsupported_reason(dtype: torch.dtype, K: int, V: int, T: int, n_seqs: int) -> str | None:
    """Why the kernels cannot run a call of q's dtype, head dims K and V, T tokens and n_seqs sequences, or None."""
    if dtype not in SUPPORTED_DTYPES:
        return f"the GPU kernels take bfloat16 or float16 q/k/v, got {dtype}"
    if (K, V) not in SUPPORTED_HEAD_DIMS:
        return f"the GPU kernels support head dims (K, V) in {SUPPORTED_HEAD_DIMS}, got ({K}, {V})"
    slots = T // CHUNK_SIZE + n_seqs
    if slots > MAX_GRID_YZ:
        return (
            f"the GPU kernels take at most {MAX_GRID_YZ} chunk slots (T // 64 + N) a call, got {slots} "
            f"(T = {T} tokens, N = {n_seqs} sequences): split the call"
        )
    return None


def check_kernel_inputs(dtype: torch.dtype, K: int, V: int, T: int, n_seqs: int) -> None:
    """Raise a ValueError naming q where the kernels cannot run the call (kernel_unsupported_reason): the first
    thing a plan does (forward_plan, flash_qla.ops.backward.backward_plan), so a plan made is a call they run."""
    reason = kernel_unsupported_reason(dtype, K, V, T, n_seqs)
    if reason is not None:
        raise ValueError(f"q: {reason}")


BLOCK_V_CHOICES = (128, 64, 32, 16)  # V-tile widths of the forward walk, widest first
# tiles this wide run the transposed walks (fused_fwd_wide, fused_bwd_wide: one consumer
# warpgroup and one chain per 64 columns); narrower ones fused_fwd and fused_bwd
WIDE_BLOCK_V = (128, 64)
# µs a chunk of one block (one SM) of the inference forward's walk per V-tile width (fused_fwd_wide, fused_fwd) and of
# fused_fwd_opath (64 columns), each alone at one wave, and what P costs kkt_solve a chunk of one v-head; H200, bf16,
# K = V = 128 (benchmark/NOTES.md v48: the walks over 1x2048, 1x8192 and 8x4096 at 2/8, 4/16, 16/32; P's cost
# 6.0-7.1e-3 µs over eight layouts, the O path's gain with the walks' difference added back). They pick the forward
# walk's width (whole_walk_width) and the backward walk's over pieces (choose_block_v), decide the O path
# (o_path_pays) and model the split (split_ratio). A narrow tile reads q, k, A and P and runs K S for fewer columns,
# but not proportionally less time; at 128 columns the transposed walk runs two chains that slow each other down, 1.5x
# one at 64.
FORWARD_CHUNK_US = {128: 2.13, 64: 1.41, 32: 1.33, 16: 1.06}
O_PATH_CHUNK_US = {OPATH_BLOCK_V: 1.45}
KKT_P_CHUNK_US = 0.0065
# the same for the backward's state recompute (the walk without o), alone, grids of at most one wave (2/8 8x4096 and
# 16/32, 4/16, 2/8 1x2048; benchmark/NOTES.md v47): its width, its pairing with the backward walk
# (flash_qla.ops.backward), the checkpoints' decision and the split model's map walks, which walk the same way.
# These tables replaced relative ones (sessions 7-11), which made the two chains at 128 columns dearer against 64
# (2x one, where they take 1.5x) and took 64 columns where these take 128, at many sequences x heads only (2/8 from
# 34 sequences, 4/16 from 17, 16/32 from 9): training step relative -> these, µs (benchmark/NOTES.md v50): 2/8
# 36x1024 752.2 -> 744.7, 40x512 432.8 -> 428.2, 4/16 18x1024 745.5 -> 738.6, 20x2048 1553.6 -> 1543.9, 16/32 9x1024
# 769.1 -> 761.5, 10x2048 1589.1 -> 1577.6; inference forward unchanged; gradients bitwise equal.
RECOMPUTE_CHUNK_US = {128: 1.85, 64: 1.22, 32: 1.38, 16: 1.16}


def chunk_step_time(n_seqs: int, Hv: int, V: int, BV: int, profile: ArchProfile, cost=FORWARD_CHUNK_US) -> float:
    """µs of a walk over n_seqs sequences per chunk of each, from the table of µs a chunk (`cost`).

    The walk runs one block per SM, so its time is the number of waves of blocks
    (n_seqs · Hv · V / BV over the SMs, rounded up) times the time of one chunk at that width.
    """
    return -(-n_seqs * Hv * (V // BV) // profile.num_sms) * cost[BV]


def choose_block_v(n_seqs: int, Hv: int, V: int, profile: ArchProfile, cost=FORWARD_CHUNK_US) -> int:
    """V-tile width of a fused walk: the least (waves x chunk cost), ties to the wider.

    Narrow tiles win when sequences x heads is small (a single long sequence); wide tiles when
    the grid runs several waves anyway. Equal sequence lengths are assumed. `cost`: the walk's µs
    a chunk (FORWARD_CHUNK_US: the forward's, also the backward walk's over pieces;
    RECOMPUTE_CHUNK_US: the state recompute's and the map walk's).
    """
    return min(BLOCK_V_CHOICES, key=lambda bv: (chunk_step_time(n_seqs, Hv, V, bv, profile, cost), -bv))


# A training forward keeps checkpoints when the backward's state recompute, restarted from them
# in pieces of profile.checkpoint_chunks chunks, is estimated to take at most this fraction of
# the walk over whole sequences: the pieces cost some time the model leaves out (the gather of
# their start states, a final state written per piece and head)
CHECKPOINT_GAIN = 0.75


def checkpoint_pieces_expected(n_seqs: int, T: int, profile: ArchProfile) -> int:
    """Pieces of profile.checkpoint_chunks chunks the sequences split into, equal lengths assumed."""
    chunks = -(-T // (profile.chunk * n_seqs))  # per sequence
    return n_seqs * -(-chunks // profile.checkpoint_chunks)


def pieces_fit_the_grid(seqlens, profile: ArchProfile) -> bool:
    """Whether walks over pieces (a split walk, the recompute from checkpoints) fit CUDA's grid: their grid has a
    block row per piece, N + slots // checkpoint_chunks of them (flash_qla.ops.chunks.checkpoint_pieces: a piece
    for every sequence, empty ones too), which exceeds MAX_GRID_YZ only in calls of more than ~63500 sequences
    (kernel_unsupported_reason bounds the slots). Such a call walks its sequences whole."""
    n_seqs = len(seqlens)
    slots = sum(seqlens) // profile.chunk + n_seqs
    return n_seqs + slots // profile.checkpoint_chunks <= MAX_GRID_YZ


def keeps_checkpoints(seqlens, Hv: int, V: int, profile: ArchProfile) -> bool:
    """Whether a training forward over sequences of these lengths keeps the state every
    profile.checkpoint_chunks chunks.

    The backward recomputes the state at every chunk start with the forward walk; from
    checkpoints it walks pieces of at most checkpoint_chunks chunks instead of whole
    sequences, with more blocks in parallel: what long sequences over few heads need (16/32
    1x32768: 32 (sequence, head) pairs become 512). A walk's time is modelled as its waves
    times the chunks of its longest sequence (or piece).
    """
    every = profile.checkpoint_chunks
    if max(seqlens) <= every * profile.chunk or not pieces_fit_the_grid(seqlens, profile):  # no piece to split off
        return False
    chunks = [-(-n // profile.chunk) for n in seqlens]
    pieces = sum(-(-c // every) for c in chunks)
    recompute = RECOMPUTE_CHUNK_US
    return walk_time(pieces, every, Hv, V, profile, recompute) <= CHECKPOINT_GAIN * walk_time(
        len(chunks), max(chunks), Hv, V, profile, recompute
    )


def walk_time(n_seqs: int, chunks: int, Hv: int, V: int, profile: ArchProfile, cost) -> float:
    """µs of a walk over n_seqs sequences of `chunks` chunks at its best V-tile width (`cost`: µs a chunk)."""
    return chunks * min(chunk_step_time(n_seqs, Hv, V, bv, profile, cost) for bv in BLOCK_V_CHOICES)


def whole_walk_time(chunks, Hv: int, V: int, BV: int, profile: ArchProfile, cost=FORWARD_CHUNK_US) -> float:
    """µs of a walk over whole sequences of these chunk counts at V-tile width BV, unequal lengths counted.

    A block (one SM) walks its sequence's chunks. Equal lengths: whole waves (chunk_step_time). Unequal: a short
    sequence's blocks end early and leave their SMs to the blocks after them (the grid is sequence-major), so the
    walk takes the longest sequence's chunks or the SMs' average load, whichever is more. H200, inference forward,
    µs (benchmark/NOTES.md v53): 16/48 28672+4096 (192 blocks at 64 columns) the walk at 64 columns 984.2 against
    1319.8 at 128 (the equal-length choice) and 1087.9 split; in the other order (4096+28672: the long sequence's
    last 60 blocks wait for the short one's first) 1064.3. 16/64 28672+4096 (256 blocks) the O path 1043 µs, as
    1x32768 (1041): one wave, where whole waves would count two. Of the 504 decisions over the planner's test
    layouts, this model changes 72 from the equal-length one's; the 36 distinct ones, each forced both ways, all
    ran faster the new way (benchmark/NOTES.md v54): inference e.g. 16/32 20000+500+12000 906.2 -> 608.3 µs (128
    columns -> the O path), 16/48 8192+2048+2048+1024 527.7 -> 339.8 (split -> the O path), 2/8 3000+1000+200
    74.2 -> 63.2 (the O path -> 16 columns); training steps 2-8 % (16/64 28672+4096 5033 -> 4782 µs, 128 -> 64).
    """
    longest = max(chunks, default=0)
    if longest == 0:
        return 0.0
    per_seq = Hv * (V // BV)
    if min(chunks) == longest:  # equal lengths: whole waves
        return chunk_step_time(len(chunks), Hv, V, BV, profile, cost) * longest
    return max(longest, per_seq * sum(chunks) / profile.num_sms) * cost[BV]


def whole_walk_width(chunks, Hv: int, V: int, profile: ArchProfile) -> int:
    """The forward walk's V-tile width over whole sequences of these chunk counts: the least whole_walk_time,
    ties to the wider (choose_block_v's choice where the lengths are equal)."""
    return min(BLOCK_V_CHOICES, key=lambda bv: (whole_walk_time(chunks, Hv, V, bv, profile), -bv))


# The split model, in µs from the measured chunk costs above (split_ratio): the walk giving o over the pieces, the two
# map walks (M and b of flash_qla.ops.context_parallel, on two streams beside each other) over the pieces, the
# composition (sequential over a sequence's pieces, the sequences side by side) and fixed work (launches, the final
# state's copy), against the walk over whole sequences. Fitted to twelve single- and few-sequence configs on the H200
# under DESIGN.md §4's gates (2/8, 4/16, 16/32, 8/32 at 8192-32768 tokens; benchmark/NOTES.md v49): the map walks take
# MAPS_WALKS of one state recompute over the pieces (they skip what the gates make negligible), the composition
# COMPOSE_PIECE_US a piece, the fixed work SPLIT_FIXED_US; within 30 µs of every measured difference. An inference
# forward splits up to SPLIT_GAIN. Inference forward split / whole, µs: 2/8 1x8192 97.4 / 153.9 (model 0.71), 2/8
# 1x32768 198.8 / 592.2 (0.31), 4/16 1x8192 138.8 / 175.3 (0.73), 16/32 1x32768 732.0 / 858.9 (0.83), 2/8 4x8192
# 190.6 / 220.6 (0.84), 16/32 1x8192 227.5 / 225.5 (0.84, a tie), 16/48 28672+4096 1084.7 / 1316.6 (0.86), 16/32
# 1x12288 341.2 / 331.0 (1.08), 16/32 2x16384 732.6 / 539.6 (1.51). Gates that never decay leave the map walks
# nothing to skip (twice MAPS_WALKS): there the split loses where the model says 0.83-0.84 (g = -1e-3 everywhere:
# 16/32 1x32768 969.7 / 862.3, 16/32 1x8192 270.8 / 223.9, 2/8 4x8192 261.4 / 220.0) and still gains at 0.71
# (2/8 1x8192 143.5 / 152.7).
SPLIT_GAIN = 0.9
MAPS_WALKS = 1.07
COMPOSE_PIECE_US = 2.1
SPLIT_FIXED_US = 3.6
# A training forward that splits hands its maps to the backward, whose walk then splits the same pieces with no map
# walk of its own (flash_qla.ops.backward): the backward gains more than the forward's split costs, so a training
# forward splits up to TRAINING_SPLIT_GAIN of the whole walk. Training step split / whole, µs (benchmark/NOTES.md
# v49): 16/32 1x8192 785.8 / 805.3, 8/32 1x8192 761.0 / 790.9, 2/8 4x8192 698.9 / 795.6, 16/32 1x32768 2759.6 /
# 3085.5, 16/32 28672+4096 2771.2 / 3357.8 (model 0.83-0.88), 16/32 1x12288 1183.2 / 1187.5 (model 1.08); 16/64
# 28672+4096 5274.7 / 5158.0 (model 1.14), 16/32 2x16384 2756.7 / 2514.8 (model 1.51).
TRAINING_SPLIT_GAIN = 1.1
# A training forward that keeps every state (keeps_states) leaves its backward no state recompute to shorten, and the
# margin above (fitted when both routes recomputed) splits where the whole walk wins: it walks whole where the whole
# walk keeps KEPT_STATES_SPLIT_CHAINS chains busy on average (v-heads x the sequences' chunks over the longest's:
# 32, a wave of blocks at 32 columns; a short sequence beside a long one counts for its share of the time). H100,
# training step, states kept, whole / split, µs (benchmark/NOTES.md v86): 32 chains, split
# by the margin, 16/32 1x8192 749.2 / 839.6, 8/32 1x8192 728.9 / 797.0, 4/16 8192x2 735.1 / 806.8, 16/16 8192x2
# 804.9 / 920.2, 2/8 8192x4 733.4 / 734.8, 16/32 1x12288 1102.6 / 1198.2, 16/32 1x16384 1468.4 / 1558.2, 8/32
# 1x16384 1448.5 / 1479.5, 4/16 16384+16384 1449.0 / 1492.6, 16/16 16384+16384 1572.3 / 1698.5; fewer, where the
# split still pays: 16 chains 16/16 1x8192 524.3 / 507.7, 4/16 1x8192 499.7 / 450.3, 4/16 1x20000 1201.1 / 1013.2,
# 16/16 1x32768 2009.6 / 1718.5, 14.7 2/8 6000+5000 374.1 / 324.0, 8 chains 2/8 1x8192 415.7 / 264.4, 24 chains 8/24
# 1x16384 1288.5 / 1173.5 (8/24 1x8192 651.6 / 665.7 and 1x12288 968.0 / 971.7 split too, within 2 %). Without the
# states kept the margin stands (16/32 1x32768, recomputing: 3261.7 / 3106.3). Under KEEP_STATES_MAX_BYTES the rule
# meets sequences of at most 16384 tokens (32 chains x 16384 tokens x 512 bytes = 256 MiB), the range measured; longer
# ones keep their states only where keep_states=True forces it, not measured there.
KEPT_STATES_SPLIT_CHAINS = 32
# The low-level backward (no forward's maps) splits only up to BACKWARD_SPLIT_GAIN: it walks the maps itself and its
# end walk besides, against a whole backward that hides the state recompute beside its walk. H200, split / whole, ms
# (benchmark/NOTES.md v14, v15, v49): 2/8 1x32768 (model 0.31) 1.223 / 1.650, 2/8 16384x2 (0.56) 0.921 / 1.007, 4/16
# 1x32768 (0.55) 1.797 / 1.997, 2/8 1x9000 (0.68) 0.301 / 0.327, 2/8 20000+500+12000 (0.69) 0.759 / 0.895; 2/8
# 1x8192 (0.71) 0.268 / 0.274, 4/16 1x8192 (0.73) 0.449 / 0.409, 16/32 1x8192 (0.84) 0.725 / 0.592, 16/32 1x32768
# (0.83) 2.624 / 2.268. The one miss: 8/24 1x32768 (0.63) 1.971 / 1.854, where 24 chains fill more of the GPU
# than the model's forward walk credits.
BACKWARD_SPLIT_GAIN = 0.7


def split_ratio(seqlens, Hv: int, V: int, profile: ArchProfile, unequal: bool = False) -> float:
    """The walk in pieces of profile.checkpoint_chunks chunks (flash_qla.ops.context_parallel, the exact route of
    DESIGN.md §1) over the walk over whole sequences, as estimated (inf where no sequence is longer than a piece).

    The model's walks over pieces count the waves of all pieces (equal lengths assumed, as in walk_time); the
    composition runs the sequences side by side, as long as the longest one's pieces. The whole walk: every
    sequence as long as the longest (walk_time), or with unequal, at the sequences' own lengths (whole_walk_time
    at its best width).
    """
    every = profile.checkpoint_chunks
    if max(seqlens) <= every * profile.chunk:  # no sequence longer than one piece
        return float("inf")
    chunks = [-(-n // profile.chunk) for n in seqlens if n > 0]
    pieces = sum(-(-c // every) for c in chunks)
    walks = walk_time(pieces, every, Hv, V, profile, FORWARD_CHUNK_US)
    walks += MAPS_WALKS * walk_time(pieces, every, Hv, V, profile, RECOMPUTE_CHUNK_US)
    split = walks + COMPOSE_PIECE_US * -(-max(chunks) // every) + SPLIT_FIXED_US
    if unequal:
        return split / min(whole_walk_time(chunks, Hv, V, bv, profile) for bv in BLOCK_V_CHOICES)
    return split / walk_time(len(chunks), max(chunks), Hv, V, profile, FORWARD_CHUNK_US)


def splits_forward(
    seqlens, Hv: int, V: int, profile: ArchProfile, training: bool = False, keep_states: bool = False
) -> bool:
    """Whether the forward walks its sequences in pieces (split_ratio at most SPLIT_GAIN).

    Pays where sequences are long and Hv · V / BV chains leave SMs idle: a single sequence from 6401 tokens at 8
    v-heads; at 16-32 where the pieces fill their waves (16/32, inference: 7617-8192, 15105-16384, 22465-22528,
    22593-24576, 29953-32768 tokens, ...; not 12288); never above 32; or a few such sequences over few heads.
    training: the forward of a training step (its maps go to the backward), which splits up to TRAINING_SPLIT_GAIN;
    keep_states: that forward keeps every state (keeps_states), and then walks whole where the whole walk keeps
    KEPT_STATES_SPLIT_CHAINS chains busy on average (16/32 1x8192: 749 µs whole against 840 split, H100).

    The inference forward weighs the split against the whole walk at the sequences' own lengths (split_ratio's
    unequal); the training forward against every sequence as long as the longest, the model its margin was
    fitted on, which also stands in for its backward (whose walks over whole sequences are modelled so:
    flash_qla.ops.backward.beside_widths): training over unequal lengths walked whole is not measured. At
    16/48 28672+4096 the two part: the inference forward walks whole (the O path, 872.3 µs against 1087.9
    split; benchmark/NOTES.md v53), a training step splits (3.99 ms against FLA's 11.58).
    """
    if not pieces_fit_the_grid(seqlens, profile):
        return False
    if training:
        chunks = [-(-n // profile.chunk) for n in seqlens]
        if keep_states and Hv * sum(chunks) >= KEPT_STATES_SPLIT_CHAINS * max(chunks):  # the whole walk's chains
            return False
        return split_ratio(seqlens, Hv, V, profile) <= TRAINING_SPLIT_GAIN
    return split_ratio(seqlens, Hv, V, profile, unequal=True) <= SPLIT_GAIN


# A split inference forward on the O path walks pieces of 2 · checkpoint_chunks chunks (64) where that leaves its
# walk after compose_maps no more chunk steps (waves times the piece's chunks) than pieces of checkpoint_chunks (32)
# do, and the map walks over the pieces a wave of blocks at least (at 128 columns). Where the gates decay, the map
# and offsets walks then leave out about as many chunks a piece as before, half as many in all, and compose_maps
# runs half as many steps; where a head's gates barely decay, its map walks run chains twice as long, which cost the
# split where those walks have fewer blocks than SMs (2/8 1x32768: 64 at 128 columns; not measured). H100,
# inference forward, 32 -> 64 chunks (the rule's choice), kernels µs, medians of five interleaved rounds, o and the
# final state within 3.5e-3 of the fp32 reference either way (benchmark/NOTES.md v98; each sequence's first pieces
# then walked beside the map walks, a lead removed in session 103: flash_qla.ops.context_parallel): 16/32
# 28672+4096 737.5 -> 670.3 (750.2 -> 717.2 on another start), 32/32 28672+4096 798.7 -> 737.0 (803.0 -> 739.4),
# 8/24 28672+4096 563.8 -> 544.8, 16/32 1x32768 731.8 -> 673.6 (744.2 -> 687.7). Without the lead, 16/32 28672+4096
# at 64 chunks 706.4 (v102), at 32 756.3 (v96). Where the rule keeps 32 (with the lead, v98): 16/16 16384+16384
# 405.7 -> 411.4 and 4/16 16384+16384 374.1 -> 388.8 over pieces of 64. Training forwards walk pieces of
# checkpoint_chunks: their backward walks and state recompute take the same pieces.
LONG_PIECE_FACTOR = 2


def split_piece_chunks(seqlens, Hv: int, V: int, profile: ArchProfile) -> int:
    """The chunks a piece of a split inference forward on the O path has at most (the rule above): profile.
    checkpoint_chunks or LONG_PIECE_FACTOR times it."""
    short = profile.checkpoint_chunks
    long = LONG_PIECE_FACTOR * short
    if count_pieces(seqlens, profile.chunk, long) * Hv < profile.num_sms:  # the map walks' blocks, 128 columns
        return short

    def walk_chunks(every):  # the walk's waves of blocks over the pieces (a chunk step costing 1), times their chunks
        pieces = count_pieces(seqlens, profile.chunk, every)
        return chunk_step_time(pieces, Hv, V, OPATH_BLOCK_V, profile, {OPATH_BLOCK_V: 1}) * every

    return long if walk_chunks(long) <= walk_chunks(short) else short


def splits_backward(seqlens, Hv: int, V: int, profile: ArchProfile) -> bool:
    """Whether a backward handed no forward's maps (the low-level backward) walks in pieces, forming the maps itself:
    split_ratio at most BACKWARD_SPLIT_GAIN (one sequence: 2/8 from 8705 tokens, 4/16 at 12865-16384, 25345-32768 and
    37761-49152 tokens and from 50177, where the pieces fill their waves; 16/32 never)."""
    return pieces_fit_the_grid(seqlens, profile) and split_ratio(seqlens, Hv, V, profile) <= BACKWARD_SPLIT_GAIN


def checkpoint_rows(slots: int, n_seqs: int, profile: ArchProfile) -> int:
    """Rows of a forward's checkpoint buffer: row m holds the state at global chunk
    m · checkpoint_chunks (written by the walk where that chunk is inside a sequence), row
    slots // checkpoint_chunks + 1 + n sequence n's initial state."""
    return slots // profile.checkpoint_chunks + 1 + n_seqs


# where the walk would run at more than OPATH_BLOCK_V columns, sequences of at most this many chunks never take the O
# path (o_path_pays)
SHORT_CHUNKS = 4


def o_path_pays(chunks, Hv: int, V: int, BV: int, profile: ArchProfile) -> bool:
    """Whether an inference forward (o alone) over sequences of these chunk counts runs faster as fused_fwd_opath at
    64 columns, with kkt_solve forming no P, than as the walk at BV columns after a kkt_solve forming P.

    Modelled as the two walks' times (whole_walk_time), less P's cost over the sequences' chunks of every v-head. A
    chunk of the O path costs 3 % more than fused_fwd_wide's at 64 columns and 9 % more than fused_fwd's at 32; its
    two waves where 128 columns run one, 36 % more: what P saves kkt_solve pays for that at 64 columns, from ~19
    sequence-heads at 32, from ~119 at 128 (~237 where 128 columns run two waves), at equal lengths never at 16
    (at unequal ones it can: 4/16 500+1755). H200, inference
    forward, the walk at the planner's width / the O path, µs (benchmark/NOTES.md v48): 16/32 1x2048 (32) 68.7 /
    64.9, 1x32768 (whole) 896.7 / 859.3, 16/16 2x4096 131.2 / 120.7; 4/16 8x4096 (128) 276.5 / 272.2, 16/32 8x4096
    549.7 / 537.4, 16/48 8x4096 808.4 / 790.4, 16/64 8x4096 1063.8 / 1053.0, 16/16 8x4096 313.7 / 282.0; where the
    model keeps the walk: 2/8 1x2048 (16) 44.9 / 53.2, 16/48 2x2048 (128, 96 sequence-heads) 133.1 / 135.9. Short
    sequences are within ~2 µs either way, which the model does not resolve (each block's fixed work, left out):
    4/16 8x1024 79.5 / 79.5, 16/32 8x1024 158.2 / 155.9, 2/8 64x512 161.3 / 163.4 (the model's one miss, 1.3 %).
    Unequal lengths (v53): 16/48 28672+4096, the walk at 64 columns / the O path 984.2 / 872.3, 4096+28672 1064.3 /
    942.5.

    Never where the walk would run at 128 columns and no sequence has a fifth chunk (SHORT_CHUNKS): the two O
    warpgroups take alternate chunks and form each one's P beside the chain, under the chains of the chunks after it;
    a block walking a few chunks has few to hide it under, and the O path's blocks (twice those of the walk at 128
    columns) are mostly their fixed work, which the chunk costs leave out. H100, inference forward,
    output_final_state, kernels, the O path / the walk at 128 columns, µs (medians of three rounds,
    benchmark/NOTES.md sessions 73 and 76): one chunk a sequence, 2/8 1024 of 8 tokens 648.8 / 494.9, 16/32 1024 of 8
    2503.5 / 1919.5, 512 of 64 1341.5 / 1133.9; two, 2/8 256 of 128 237.1 / 212.0; three, 2/8 170 of 192 201.7 /
    192.2, 16 of 192 24.0 / 22.9, 32 of 192 45.8 / 45.2, 16/32 170 of 192 777.1 / 748.1, 8 of 192 48.1 / 47.9, 4 of
    192 24.9 / 23.7, (150, 20, 192, 64) x 16 244.9 / 211.4, 16/48 32 of 192 232.6 / 220.6, 4/16 32 of 150 81.0 / 79.2;
    four, 2/8 128 of 256 187.2 / 183.0, 16/32 714.6 / 712.8, 32 of 256 195.3 / 194.8; five even (2/8 100 of 300 175.9
    / 176.3, 16/32 662.2 / 656.8), from six the O path ahead (2/8 85 of 384 169.2 / 177.0, 64 of 512 163.9 / 170.2,
    16/32 619.7 / 670.0). Where the walk would run at 64 or 32 columns (a few sequences) its blocks are no fewer than
    the O path's, and the O path led at every length measured, as the model has it (O path / the walk at its width):
    2/8 8 of 128 14.0 / 14.9 at 64, 16/32 1 of 128 13.2 / 14.4 at 32, 8/32 2 of 128 14.1 / 15.0 at 64, 2/8 8 of 192
    16.0 / 17.2 at 64, 16/32 1 of 192 14.9 / 15.7 at 32, 4/16 4 of 192 15.9 / 17.0 at 64, 2/8 8 of 256 17.2 / 18.7.
    """
    if BV > OPATH_BLOCK_V and max(chunks, default=0) <= SHORT_CHUNKS:
        return False
    walk = whole_walk_time(chunks, Hv, V, BV, profile, FORWARD_CHUNK_US)
    o_path = whole_walk_time(chunks, Hv, V, OPATH_BLOCK_V, profile, O_PATH_CHUNK_US)
    return o_path - KKT_P_CHUNK_US * sum(chunks) * Hv <= walk


# the inference forward's walk over sequences of at most PACK_CHUNKS chunks takes several a block (fused_fwd_wide's
# PACKED) where one a block would run more than PACK_WAVES waves of blocks, each mostly its fixed work (its setup,
# the first loads' wait): as few a block as keep its blocks within PACK_WAVES waves (two, for the blocks' unequal
# lengths; one wave ran up to 4 % slower, 0.6 % faster at 2/8 over 1024 of 8 tokens). H100, kernels of the inference
# forward, one sequence a block -> packed, µs, o and final states bitwise equal (benchmark/NOTES.md v75 step 3): 2/8 1024
# sequences of 8 tokens 502 -> 345, 512 of 64 292 -> 263, 256 of 128 212 -> 208, (1, 64, 65, 128, 0, 8, 100, 127) x
# 64 306 -> 272; 16/32 1964 -> 1347, 1125 -> 1077, the mix 1217 -> 1089; at three chunks and more packing loses (v75
# step 1: 2/8 170 of 192 tokens 192.4 -> 218.8 µs, 16/32 744.6 -> 792.2). Counted as N·Hv / (PACK_WAVES · SMs) a block
# (session 74), the groups rounded up past two waves (272 blocks at 2/8 over 1024 of 8 tokens): 512 of 64 at 2/8 277 µs,
# 256 of 128 228 (v75 step 2)
PACK_WAVES = 2
PACK_CHUNKS = 2
PACKED_BLOCK_V = 128


def sequences_per_block(chunks, Hv: int, V: int, BV: int, profile: ArchProfile) -> int:
    """Sequences (of these chunk counts) a block of the inference forward's walk at BV columns takes: 1, or more
    where every sequence is short (at most PACK_CHUNKS chunks), the walk at PACKED_BLOCK_V columns and its blocks of
    one sequence would run more than PACK_WAVES waves: then the fewest whose blocks (ceil(N / per_block) a v-head and
    V-tile) fit in PACK_WAVES waves. (fused_fwd_wide packs at 64 columns too, but there whole_walk_width never has
    the blocks to pack: so many take 128.)"""
    if BV != PACKED_BLOCK_V or max(chunks, default=0) > PACK_CHUNKS:
        return 1
    groups = max(1, PACK_WAVES * profile.num_sms // (Hv * (V // BV)))  # a v-head's blocks in PACK_WAVES waves
    return -(-len(chunks) // groups)


def walk_plan(
    seqlens, Hv: int, V: int, profile: ArchProfile, auto_cp: bool, training: bool, output_h: bool, keep_states: bool
):
    """(split, BV, opath): whether the walk splits the sequences into pieces (splits_forward; keep_states: a training
    forward that keeps every state, keeps_states); the V-tile width of the walk
    over whole sequences (over the pieces: None, forward_plan's choose_block_v); and whether that walk is
    fused_fwd_opath (at 64 columns, with kkt_solve forming no P: o alone, no training, no h, where o_path_pays,
    over the sequences or over the pieces as sequences from their start states).

    Over pieces, H100, inference forward, the O path (kkt_solve without P but with its bounds) / the pieces at the
    planner's width after kkt_solve with P, µs (benchmark/NOTES.md v85 step 6): 16/32 28672+4096 753.5 / 810.0
    (736.6 / 806.6 timed again), 16/16 28672+4096 442.3 / 500.0, 16/16 16384+16384 413.6 / 490.1, 4/16 16384+16384
    375.8 / 399.4, 2/8 8192x4 186.5 / 199.0; final states bitwise equal, o within 2.5e-5. The saving is
    kkt_solve's P (70 µs at 16/32 over 32768 tokens); the O-path walk over the pieces took 0.96-1.03x the other's."""
    split = auto_cp and splits_forward(seqlens, Hv, V, profile, training, keep_states)
    if split:
        pieces = piece_chunks(seqlens, profile.chunk, profile.checkpoint_chunks)
        BV = choose_block_v(len(pieces), Hv, V, profile)
        opath = not (training or output_h) and o_path_pays(pieces, Hv, V, BV, profile)
        return True, OPATH_BLOCK_V if opath else None, opath
    chunks = [-(-n // profile.chunk) for n in seqlens]
    BV = whole_walk_width(chunks, Hv, V, profile)
    opath = not (training or output_h) and o_path_pays(chunks, Hv, V, BV, profile)
    return split, OPATH_BLOCK_V if opath else BV, opath


def walk_kernel(BV: int):
    """The fused forward's kernel factory for V-tiles of BV columns.

    Both take the same arguments, except the gate (`walk_gate`).
    """
    return fused_fwd_wide_kernel if BV in WIDE_BLOCK_V else fused_fwd_kernel


def walk_gate(BV: int, gamma: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """The gate input of walk_kernel(BV): γ (kkt_solve's `gamma`) for fused_fwd, its
    exponentials (kkt_solve's `gates`) for fused_fwd_wide."""
    return gates if BV in WIDE_BLOCK_V else gamma


# kkt_solve copies q and k 16 bytes at a time (cp.async) and the walks read q, k, v, A, P and dO by TMA: both from
# 16-byte aligned addresses only. PyTorch's allocations are aligned so; a contiguous view of other memory need not be
# (one cut from a flat buffer at an odd element, one from DLPack), and a kernel copying from it would fault (a sticky
# CUDA error). Every tensor input takes the one rule (kernel_input), g and β too, which kkt_solve reads by scalar
# loads today (~0.1 µs of host time each).
ALIGNMENT = 16


def kernel_input(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x as a kernel reads it: contiguous, of dtype (x's own when None; a same-dtype .to() costs ~1 µs of host
    time: skipped) and starting at an ALIGNMENT-byte address; a copy where x is not so."""
    if dtype is not None and x.dtype != dtype:
        x = x.to(dtype)
    x = x.contiguous()
    return x if x.data_ptr() % ALIGNMENT == 0 else x.clone()


def beta_kernel_dtype(beta: torch.Tensor, q: torch.Tensor) -> torch.dtype:
    """The dtype kkt_solve reads β in: q's dtype when β has it (no cast), float32 otherwise."""
    return beta.dtype if beta.dtype == q.dtype else torch.float32


# A training forward keeps every state for its backward by default (keep_states=None) where they take at most this many
# bytes (T / 64 · Hv · K · V in q's dtype: 512 bytes a token and v-head in bf16 at K = V = 128; the buffer has a slot
# per sequence more), so that the backward recomputes none; beyond it the backward recomputes them, and what a layer
# holds from its forward to its backward stays A and P (a quarter of the states' bytes each) with the checkpoints.
# 256 MiB: every call of DESIGN.md §4 over 8192 tokens or fewer, and those over 32768 at up to 16 v-heads. H200,
# training step, recomputed -> kept, one process, interleaved, gradients bitwise equal (benchmark/NOTES.md v63):
# 1x2048 -0.9 to -11.2 % over the nine layouts (16/48 289.7 -> 257.2 µs, 16/64 334.0 -> 305.8, 16/16 157.4 ->
# 146.2), 1024x8 -4.9 to -7.8 % (16/64, at the cap: 1196.8 -> 1111.8), 1x4096 -2.8 to -10.4 %, 1x8192 -8.0 to +0.7 %
# (+0.6-0.7 % at 4/16 and 16/16), 2/8 4096x8 632.7 -> 586.0, 16/16 8192x4 1329.4 -> 1238.9; above it, 32/32 4096x8
# (512 MiB) 2542.5 -> 2404.8 would gain too, for twice the memory. Read when a shape's plan is made (forward_plan):
# changed at run time, it applies to shapes planned after forward_plan.cache_clear().
KEEP_STATES_MAX_BYTES = 256 * 2**20


def keeps_states(keep_states, training: bool, output_h: bool, T: int, Hv: int, K: int, V: int, dtype, profile):
    """Whether a forward keeps every state for its backward: keep_states when given (True or False; True is for a
    training forward), else (None) where it is a training forward (without output_h) whose states take at most
    KEEP_STATES_MAX_BYTES."""
    if keep_states is not None:
        return keep_states
    return training and not output_h and T * Hv * K * V * dtype.itemsize // profile.chunk <= KEEP_STATES_MAX_BYTES


def forward_kernels(
    q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, output_h, seqlens, auto_cp, training,
    keep_states=False, scratch=False,
):  # fmt: skip
    """The GPU forward; arguments and returns as flash_qla.dispatch._forward.

    q, k [1, T, Hqk, K]; v [1, T, Hv, V]; g, beta [1, T, Hv]; cu_seqlens [N + 1] int32 and the
    lengths it holds (host ints: validation read a new cu_seqlens tensor once,
    flash_qla.validation); initial_state [N, Hv, K, V] float32 or None.
    No host synchronisation here.
    """
    with on_device(q.device):  # launches go to q's device, not the current one
        return _forward_kernels(
            q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, output_h, seqlens, auto_cp,
            training, keep_states, scratch,
        )  # fmt: skip


class ForwardPlan(NamedTuple):
    """What a forward decides from its shapes and options alone (forward_plan): the same for every
    layer of a model step, so decided once."""

    profile: ArchProfile
    slots: int  # chunk slots of kkt_solve's grid: T // C + N, an upper bound known without a sync
    split: bool  # the walk runs over pieces (splits_forward)
    opath: bool  # the walk is fused_fwd_opath, and kkt_solve forms no P
    per_block: int  # sequences a block of the walk takes (sequences_per_block; > 1: fused_fwd_wide's PACKED)
    specs: tuple  # ((shape, dtype), ...) of kkt_solve's outputs, in its argument order
    kkt: Callable  # kkt_solve's executable
    walk: Callable  # the walk's executable: over whole sequences, or over the pieces from their start states
    BV: int  # its V-tile width
    every: int  # split: the chunks a piece has at most (split_piece_chunks; checkpoint_chunks but on the O path)
    keeps_checkpoints: bool  # a training forward that keeps state checkpoints (keeps_checkpoints)
    keep_states: bool  # a training forward that keeps every state (keeps_states)
    # split (else None or ()): the pieces' MAPS and offsets walks, at their width, compose_maps (the executables),
    # and the buffers of the split walk (flash_qla.ops.context_parallel.split_specs)
    map_walk: Callable | None
    offsets: Callable | None
    BV_maps: int | None
    compose: Callable | None
    split_specs: tuple


@functools.lru_cache(maxsize=256)
def forward_plan(
    device, T, seqlens, Hqk, Hv, K, V, dtype, beta_dtype, has_h0, output_h, auto_cp, training, keep_states
):  # fmt: skip
    """The ForwardPlan of a forward over these shapes (torch dtypes; beta_dtype: beta_kernel_dtype's) and
    options (keep_states as the caller gave it: None, True or False), remembered, after check_kernel_inputs.
    Made on every call, the decisions (the split model over every sequence) and kernel
    lookups put kkt_solve's launch 4 µs later at 16/32 1x2048 and 12-56 µs later at 2/8 8x4096 on the
    H200's host (benchmark/NOTES.md v39). A new seqlens pattern is planned afresh, as every call was before."""
    check_kernel_inputs(dtype, K, V, T, len(seqlens))
    profile = get_profile(device)
    keep_states = keeps_states(keep_states, training, output_h, T, Hv, K, V, dtype, profile)
    assert not (keep_states and (output_h or not training)), "states are kept for a training backward"
    C = profile.chunk
    N = len(seqlens)
    name = DTYPE_NAMES[dtype]
    f32 = torch.float32
    split, BV, opath = walk_plan(seqlens, Hv, V, profile, auto_cp, training, output_h, keep_states)
    per_block = 1
    if not (split or opath or training or output_h):
        per_block = sequences_per_block([-(-n // profile.chunk) for n in seqlens], Hv, V, BV, profile)
    slots = T // C + N
    # kkt_solve's outputs: g_cum; γ again, chunk-major, for fused_fwd and fused_fwd_opath; e^γ and e^{γ_L − γ},
    # fused_fwd_wide's and fused_fwd_opath's γ; A; P = Q Kᵀ ⊙ Γ ⊙ Lower (unless the walk forms it)
    specs = ((1, T, Hv), f32), ((Hv, slots, C), f32), ((Hv, slots, 2, C), f32), ((1, T, Hv, C), dtype)
    specs += () if opath else (((1, T, Hv, C), dtype),)
    # and each chunk's log_norms (the split's skips, flash_qla.ops.context_parallel; formed with P, and without it
    # where the O path walks the pieces)
    bounds = split or not opath
    specs += (((Hv, slots), f32),) if bounds else ()
    beta_name = DTYPE_NAMES.get(beta_dtype, "float32")
    kkt = kkt_solve_kernel(Hqk, Hv, K, name, profile, beta_name, FORM_P=not opath, BOUNDS=bounds)
    # kept for a backward that recomputes the states, where they pay, and always when the walk split
    # (free then: the pieces' start states); none when every state is kept
    keeps = training and auto_cp and not split and not keep_states and keeps_checkpoints(seqlens, Hv, V, profile)
    store_h = output_h or keep_states
    map_walk = offsets = BV_maps = compose = None
    split_buffers = ()
    every = split_piece_chunks(seqlens, Hv, V, profile) if split and opath else profile.checkpoint_chunks
    pieces = count_pieces(seqlens, C, every) if split else 0
    if opath:  # over the sequences, or over the pieces from their start states
        walk = fused_fwd_opath_kernel(Hqk, Hv, K, V, name, profile, has_h0 or split)
    elif per_block > 1:
        walk = walk_kernel(BV)(Hqk, Hv, K, V, BV, name, profile, has_h0, False, PACKED=True)
    elif not split:
        walk = walk_kernel(BV)(Hqk, Hv, K, V, BV, name, profile, has_h0, store_h, False, keeps, KEEP_H=keep_states)
    else:  # the pieces (flash_qla.ops.context_parallel), each walk's width for their count
        BV = choose_block_v(pieces, Hv, V, profile)
        walk = walk_kernel(BV)(Hqk, Hv, K, V, BV, name, profile, True, store_h, KEEP_H=keep_states)
    if split:
        BV_maps = choose_block_v(pieces, Hv, V, profile, RECOMPUTE_CHUNK_US)
        # M from I with V = 0 (MAPS), b from 0: no h0, no h, no o (STATES_ONLY); pieces of every chunks
        kernel = walk_kernel(BV_maps)
        longer = {} if every == profile.checkpoint_chunks else {"PIECE_CHUNKS": every}
        map_walk = executable(kernel(Hqk, Hv, K, V, BV_maps, name, profile, False, False, True, False, True, **longer))
        offsets = executable(kernel(Hqk, Hv, K, V, BV_maps, name, profile, False, False, True, **longer))
        compose = executable(compose_maps_kernel(Hv, K, V, profile, has_h0, **longer))
        split_buffers = split_specs(N, slots, Hv, K, V, every)
    return ForwardPlan(
        profile, slots, split, opath, per_block, specs, executable(kkt), executable(walk), BV, every, keeps,
        keep_states, map_walk, offsets, BV_maps, compose, split_buffers,
    )  # fmt: skip


def _forward_kernels(
    q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, output_h, seqlens, auto_cp, training,
    keep_states, scratch,
):  # fmt: skip
    _, T, Hqk, K = q.shape
    Hv, V = v.shape[2:]
    assert not (scratch and (output_h or training)), "scratch holds what this call alone uses"
    beta_dtype = beta_kernel_dtype(beta, q)
    h0 = initial_state
    plan = forward_plan(
        q.device, T, seqlens, Hqk, Hv, K, V, q.dtype, beta_dtype, h0 is not None, output_h, auto_cp, training,
        keep_states,
    )  # fmt: skip
    profile, slots, keep_states = plan.profile, plan.slots, plan.keep_states
    C = profile.chunk
    N = len(seqlens)
    f32 = torch.float32
    # every input and table before kkt_solve: the kernels after it wait for the one before them alone
    # (launch.follow_previous_kernel), so nothing but kernel launches sits between them (split_tables)
    q, k, v = kernel_input(q), kernel_input(k), kernel_input(v)
    g = kernel_input(g, f32)
    beta = kernel_input(beta, beta_dtype)
    if h0 is not None:
        h0 = kernel_input(h0)
    cu_seqlens = kernel_input(cu_seqlens)
    chunk_offsets, chunks = chunk_tables(cu_seqlens, C, slots)
    tables = groups = rows = None
    if plan.split:
        tables = split_tables(cu_seqlens, slots, C, plan.every)
    elif plan.per_block > 1:  # groups of sequences a block, each chunk's row through the walk's ring
        groups, rows = sequence_groups(N, plan.per_block, q), chunk_rows(cu_seqlens, C, slots)
    checkpoints = None
    if plan.keeps_checkpoints:  # (never split) its last N rows: the sequences' initial states
        checkpoints = buffers.new((checkpoint_rows(slots, N, profile), Hv, K, V), f32, q)
        first_rows = checkpoints[checkpoints.shape[0] - N:]
        if h0 is not None:
            first_rows.copy_(h0)
        else:
            first_rows.zero_()
    # scratch: read by this call alone (kkt_solve's outputs and, split, the pieces' buffers)
    n_kkt = len(plan.specs)
    if scratch:
        outs = buffers.scratch(plan.specs + plan.split_specs, q)
    else:
        outs = [buffers.new(*spec, q) for spec in plan.specs]
    if plan.opath:  # the walk forms P; the bounds (log_norms) where it walks a split's pieces
        g_cum, gamma, gates, A, *bounds = outs[:n_kkt]
        P, log_norms = None, bounds[0] if bounds else None
        plan.kkt(k, g, beta, chunks, g_cum, gamma, gates, A, *bounds, slots)
    else:
        g_cum, gamma, gates, A, P, log_norms = outs[:n_kkt]
        plan.kkt(q, k, g, beta, chunks, g_cum, gamma, gates, A, P, log_norms, slots)

    h = None  # output_h's fp32 states, or the kept ones in the input dtype, indexed by chunk slot
    if output_h:
        h = buffers.new((sum(-(-n // C) for n in seqlens), Hv, K, V), f32, q)
    elif keep_states:
        h = buffers.new((slots, Hv, K, V), q.dtype, q)
    maps = None

    if plan.split:  # pieces: the start states are the checkpoints
        # (from scratch with kkt_solve's outputs, unless training: D and the start states go to the backward)
        D, b, starts, ends = outs[n_kkt:] or [buffers.new(*spec, q) for spec in plan.split_specs]
        # the walks leave out the chunks of each piece whose part of M, b (and the backward's b') the
        # gates make negligible (log_norms); the map walk runs on a second stream, beside the offsets
        # walk: where the gates decay, each leaves most SMs idle behind the few pieces it walks in full
        streams = side_stream(q.device), current_stream(q.device)
        maps_gate = walk_gate(plan.BV_maps, gamma, gates)
        P_maps = A if P is None else P  # the map and offsets walks read no P: A stands in where none was formed
        maps_of_pieces(
            plan.map_walk, maps_gate, q, k, v, A, P_maps, tables.bounds, tables.firsts, scale, log_norms, D, streams
        )  # fmt: skip
        if plan.opath:  # the pieces as the O-path walk's sequences, their start states its h0

            def walk(bounds, firsts, starts, o, ends):
                plan.walk(q, k, v, gates, A, gamma, bounds, firsts, starts, o, ends, scale)

        else:
            gate, states = walk_gate(plan.BV, gamma, gates), buffers.placeholder(q.device, Hv, K, V) if h is None else h

            def walk(bounds, firsts, starts, o, ends):
                plan.walk(q, k, v, gate, A, P, bounds, firsts, log_norms, starts, o, ends, states, scale)

        o, final_state = split_walk(
            walk, D, plan.offsets, maps_gate, plan.compose, q, k, v, A, P_maps, tables, seqlens, scale, h0,
            log_norms, b, starts, ends, streams,
        )  # fmt: skip
        if training:  # the backward walk and state recompute split the same pieces (flash_qla.ops.backward)
            maps = D, log_norms
            if not keep_states:
                checkpoints = starts
    else:
        placeholder = buffers.placeholder(q.device, Hv, K, V)
        o = buffers.new_like(v)
        final_state = buffers.new((N, Hv, K, V), f32, q)
        if h0 is None:
            h0 = placeholder
        if plan.opath:
            plan.walk(q, k, v, gates, A, gamma, cu_seqlens, chunk_offsets, h0, o, final_state, scale)
        elif plan.per_block > 1:
            plan.walk(q, k, v, gates, A, P, groups, chunk_offsets, rows, h0, o, final_state, scale)
        else:
            states = h if h is not None else checkpoints if checkpoints is not None else placeholder
            plan.walk(
                q, k, v, walk_gate(plan.BV, gamma, gates), A, P, cu_seqlens, chunk_offsets,
                log_norms, h0, o, final_state, states, scale,
            )  # fmt: skip
    return (
        None if scratch else g_cum,
        None if scratch else A,
        o,
        h if output_h else None,
        final_state if output_final_state else None,
        checkpoints,
        maps,
        # what the backward takes instead of computing it again (flash_qla.ops.backward): kkt_solve's
        # outputs, and the states when kept
        (P, gamma, gates, h if keep_states else None) if training else None,
    )


def forward_kernel_builds(profile: ArchProfile, Hqk: int, Hv: int, dtype: str, K: int = 128, V: int = 128):
    """Every (factory, args) the forward can compile for one head layout and dtype."""
    long = LONG_PIECE_FACTOR * profile.checkpoint_chunks  # an inference split's longer pieces' PIECE_CHUNKS
    builds = [(kkt_solve_kernel, (Hqk, Hv, K, dtype, profile, beta_dtype)) for beta_dtype in (dtype, "float32")]
    # an inference forward whose walk runs at 64 columns: kkt_solve without P (with the bounds where the O-path
    # walk takes a split's pieces), the O-path walk
    builds += [
        (kkt_solve_kernel, (Hqk, Hv, K, dtype, profile, bd, False, False, bounds))
        for bd in (dtype, "float32")
        for bounds in (False, True)
    ]
    builds += [(fused_fwd_opath_kernel, (Hqk, Hv, K, V, dtype, profile, has_h0)) for has_h0 in (False, True)]
    for bv in BLOCK_V_CHOICES:
        for has_h0 in (False, True):
            for store_h in (False, True):
                builds.append((walk_kernel(bv), (Hqk, Hv, K, V, bv, dtype, profile, has_h0, store_h)))
        # the inference walk taking several short sequences a block (sequences_per_block)
        if bv == PACKED_BLOCK_V:
            for has_h0 in (False, True):
                builds.append((walk_kernel(bv), (Hqk, Hv, K, V, bv, dtype, profile, has_h0, *(False,) * 5, None, True)))
        # the pieces' maps M and offsets b of a split walk (flash_qla.ops.context_parallel), and the two over an
        # inference split's longer pieces (split_piece_chunks)
        split = (Hqk, Hv, K, V, bv, dtype, profile, False, False, True)
        builds += [(walk_kernel(bv), split + (False, True)), (walk_kernel(bv), split)]
        maps, offsets = split + (False, True, False, long), split + (False, False, False, long)
        builds += [(walk_kernel(bv), maps), (walk_kernel(bv), offsets)]
    builds += [(compose_maps_kernel, (Hv, K, V, profile, has_s0)) for has_s0 in (False, True)]
    builds += [(compose_maps_kernel, (Hv, K, V, profile, has_s0, False, long)) for has_s0 in (False, True)]
    return builds


def kept_states_kernel_builds(profile: ArchProfile, Hqk: int, Hv: int, dtype: str, K: int = 128, V: int = 128):
    """The forward walks of a training forward with keep_states (over sequences, with and without h0,
    and over a split walk's pieces), beyond training's other kernels."""
    return [
        (walk_kernel(bv), (Hqk, Hv, K, V, bv, dtype, profile, has_h0, True, False, False, False, True))
        for bv in BLOCK_V_CHOICES
        for has_h0 in (False, True)
    ]
