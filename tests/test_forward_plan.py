"""CPU checks of the kernels' host-side logic: chunk bookkeeping, V-tile choice, precompile CLI and its kernel lists."""

import itertools
import os

import pytest
import torch
from gpu_cases import CASES, OUTPUT_H_CASES, SPLIT_CASES, planned_walk

from flash_qla.arch import SM90, profile_by_name, unsupported_reason
from flash_qla.ops.backward import backward_kernel_builds, beside_widths, grads_parts
from flash_qla.ops.chunks import (
    checkpoint_pieces, chunk_offsets_of, chunk_rows, chunk_table, chunk_tables, count_pieces, first_pieces,
    sequence_groups, sequence_pieces,
)  # fmt: skip
from flash_qla.ops.forward import (
    BLOCK_V_CHOICES,
    FORWARD_CHUNK_US,
    KEEP_STATES_MAX_BYTES,
    RECOMPUTE_CHUNK_US,
    checkpoint_pieces_expected,
    checkpoint_rows,
    choose_block_v,
    forward_kernel_builds,
    kept_states_kernel_builds,
    chunk_step_time,
    kernel_unsupported_reason,
    keeps_checkpoints,
    split_piece_chunks,
    keeps_states,
    pieces_fit_the_grid,
    sequences_per_block,
    splits_backward,
    splits_forward,
    walk_plan,
    whole_walk_time,
)
from flash_qla.precompile import main as precompile_main


@pytest.mark.parametrize(
    "seqlens,expected",
    [
        ((64,), [0, 1]),
        ((0, 1, 65, 130), [0, 0, 1, 3, 6]),
        ((63, 0, 0, 64, 129), [0, 1, 1, 1, 2, 5]),
    ],
    ids=["one_full_chunk", "zero_one_65_130", "zeros_inside"],
)
def test_chunk_offsets(seqlens, expected):
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    offsets = chunk_offsets_of(cu, SM90.chunk)
    assert offsets.dtype == torch.int32 and offsets.tolist() == expected
    # the kkt_solve grid's upper bound T // C + N covers every chunk
    assert offsets[-1] <= sum(seqlens) // SM90.chunk + len(seqlens)


@pytest.mark.parametrize(
    "n_seqs,Hv,expected",
    [
        (8, 32, 128), (1, 32, 32), (1, 8, 16), (2, 8, 16), (2, 16, 32), (2, 64, 128), (1, 64, 64), (1, 48, 64),
        (5, 32, 64),  # 2 waves of 128 columns (4.26 µs a chunk) against 3 of 64 (4.23)
        (9, 32, 128),  # 3 waves of 128 columns against 5 of 64: two chains take 1.5x one, not 2x (training step
        # 16/32 9x1024 769.1 -> 761.5 µs with the training forward's walk at 128, benchmark/NOTES.md v50)
    ],  # fmt: skip
)
def test_block_v_least_walk_time(n_seqs, Hv, expected):
    """One wave of narrow tiles beats one of wide tiles; one wave of wide tiles beats two narrow, and three
    beat five."""
    assert choose_block_v(n_seqs, Hv, 128, SM90) == expected


@pytest.mark.parametrize(
    "seqlens,Hv,expected",
    [
        ((32768,), 32, True),  # 32 (sequence, head) pairs of 512 chunks: 16 pieces each
        ((32768,), 8, True),
        ((8192,), 32, True),
        ((2048,), 32, False),  # no longer than one piece
        ((4096,) * 8, 32, False),  # 256 pairs of wide tiles fill the SMs already
        ((32768,), 64, False),  # 64 pairs at BV = 64 fill them too
        ((16384, 16384), 32, False),
        ((28672, 4096), 32, True),  # the long sequence bounds the walk: 448 chunks
        ((20000, 8000, 4000, 768), 32, True),
    ],
    ids=["1x32768", "1x32768_8_heads", "1x8192", "1x2048", "4096x8", "1x32768_64_heads", "16384x2",
         "28672+4096", "20000+8000+4000+768"],  # fmt: skip
)
def test_checkpoints_kept_where_pieces_fill_the_gpu(seqlens, Hv, expected):
    assert keeps_checkpoints(seqlens, Hv, 128, SM90) == expected


@pytest.mark.parametrize(
    "keep,training,output_h,T,Hv,dtype,expected",
    [
        (None, True, False, 8192, 64, torch.bfloat16, True),  # 256 MiB: the cap itself
        (None, True, False, 8192 + 64, 64, torch.bfloat16, False),  # a chunk more
        (None, True, False, 32768, 16, torch.float16, True),
        (None, True, False, 32768, 32, torch.bfloat16, False),  # 512 MiB: recomputed
        (None, True, False, 8192, 64, torch.float32, False),  # fp32 states: twice the bytes
        (None, True, False, 2048, 32, torch.bfloat16, True),
        (None, False, False, 2048, 32, torch.bfloat16, False),  # no backward to keep them for
        (None, True, True, 2048, 32, torch.bfloat16, False),  # output_h: the fp32 states are returned instead
        (True, True, False, 32768, 32, torch.bfloat16, True),  # asked: kept at any size
        (False, True, False, 2048, 32, torch.bfloat16, False),  # asked not to
    ],
)
def test_states_kept_by_default_where_they_are_small(keep, training, output_h, T, Hv, dtype, expected):
    """keep_states=None keeps every state of a training forward for its backward where they take at most
    KEEP_STATES_MAX_BYTES (T / 64 chunks of [Hv, K, V] in q's dtype); True and False are followed as given."""
    assert KEEP_STATES_MAX_BYTES == 8192 * 64 * 128 * 128 * 2 // 64
    assert keeps_states(keep, training, output_h, T, Hv, 128, 128, dtype, SM90) == expected


@pytest.mark.parametrize(
    "seqlens,Hv,expected",
    [
        ((32768,), 8, True),  # 64 chains of 512 chunks against 16 x 8 pieces of 32: measured 199 vs 592 µs
        ((65536,), 8, True),
        ((32768,), 4, True),
        ((32768,), 16, True),  # measured 395 vs 659 µs
        ((16384,), 16, True),
        ((32768,), 32, True),  # measured 732 vs 859 µs
        ((16384,), 8, True),  # 8 pieces: measured 119 vs 302 µs
        ((8192,), 8, True),  # 4 pieces: measured 97 vs 154 µs
        ((8192,), 32, True),  # measured 228 vs 226 µs: a tie, inside the margin
        ((2048,), 8, False),  # one piece
        ((32768, 32768), 8, True),  # a few long sequences: 32 pieces x 8 heads
        ((32768, 0), 8, True),  # a zero-length sequence has no piece
        ((16384, 16384), 8, True),
        ((8192,) * 4, 8, True),  # measured 191 vs 221 µs
        ((4096,) * 8, 8, False),  # two pieces a sequence: three walks over them cost more than one
        ((16384, 16384), 32, False),  # measured 733 vs 540 µs
        ((28672, 4096), 48, False),  # whole (the O path at 64 columns): measured 872 vs 1088 µs split (v53)
    ],
    ids=["1x32768_8_heads", "1x65536_8_heads", "1x32768_4_heads", "1x32768_16_heads", "1x16384_16_heads",
         "1x32768_32_heads", "1x16384_8_heads", "1x8192_8_heads", "1x8192_32_heads", "1x2048", "2x32768", "32768+0",
         "2x16384", "4x8192", "8x4096", "2x16384_32_heads", "28672+4096_48_heads"],  # fmt: skip
)
def test_forward_splits_long_sequences_over_few_heads(seqlens, Hv, expected):
    assert splits_forward(seqlens, Hv, 128, SM90) == expected


@pytest.mark.parametrize(
    "seqlens,Hv,expected",
    [
        ((28672, 4096), 32, 64),  # the walk after compose_maps 4 waves of 64 chunks against 8 of 32: a tie
        ((32768,), 32, 64),  # 4 waves of 64 against 8 of 32
        ((28672, 4096), 24, 64),  # 3 waves of 64 against 6 of 32
        ((16384, 16384), 16, 32),  # the map walks over 8 pieces x 16 heads: 128 blocks, under a wave
        ((32768,), 8, 32),  # 64 blocks
        ((9000, 0, 70), 32, 32),  # 3 + 1 pieces of 64 chunks: 128 blocks
        ((12288, 12288), 24, 32),  # 3 + 3 pieces of 64 chunks x 48 blocks: 3 waves of 64 against 5 of 32
        ((36864,), 20, 64),  # 9 pieces of 64 chunks x 40 blocks: 3 waves of 64 against 6 of 32
    ],
    ids=["28672+4096_32_heads", "1x32768_32_heads", "28672+4096_24_heads", "2x16384_16_heads", "1x32768_8_heads",
         "one_piece_and_empty", "2x12288_24_heads", "1x36864_20_heads"],  # fmt: skip
)
def test_o_path_split_walks_longer_pieces_where_they_cost_no_wave(seqlens, Hv, expected):
    """A split inference forward on the O path walks pieces of 64 chunks where its walk after compose_maps runs no
    more chunk steps than over pieces of 32 and its map walks have a wave of blocks; else pieces of
    checkpoint_chunks (32)."""
    assert split_piece_chunks(seqlens, Hv, 128, SM90) == expected


@pytest.mark.parametrize(
    "seqlens,Hv,training,output_h,expected",
    [
        ((4096,) * 8, 8, False, False, (False, 64, True)),  # 2/8 8x4096: o alone at 64 columns
        ((4096,) * 8, 8, True, False, (False, 64, False)),  # training keeps kkt_solve's P for the backward
        ((4096,) * 8, 8, False, True, (False, 64, False)),  # the low-level forward's h
        # o alone where the walk would take 128 columns: the O path over two waves from ~119 sequence-heads
        ((4096,) * 8, 32, False, False, (False, 64, True)),  # measured 549.7 -> 537.4 µs
        ((4096,) * 8, 16, False, False, (False, 64, True)),  # 276.5 -> 272.2
        ((2048,) * 2, 48, False, False, (False, 128, False)),  # 96 sequence-heads: the O path 133.1 -> 135.9
        ((4096,) * 8, 32, True, False, (False, 128, False)),  # training: fused_fwd_wide at 128
        ((2048,), 32, False, False, (False, 64, True)),  # o alone where fused_fwd would take 32 (68.7 -> 64.9)
        ((4096,), 32, False, False, (False, 64, True)),  # (1x32768 splits)
        ((2048,), 32, True, False, (False, 32, False)),  # training: fused_fwd at 32
        ((2048,), 32, False, True, (False, 32, False)),
        ((2048,), 8, False, False, (False, 16, False)),  # fused_fwd at 16 is the faster walk (44.9 against 53.2)
        # pieces: the O path over them where it pays over the pieces as sequences (H100, v85: 2/8 8192x4 186.5
        # against 199.0 µs), the planner's width for them otherwise (forward_plan)
        ((32768,), 8, False, False, (True, 64, True)),
        ((32768,), 8, True, False, (True, None, False)),
        ((32768,), 8, False, True, (True, None, False)),
        ((8192,), 4, False, False, (True, None, False)),  # 4 pieces x 4 v-heads: the pieces at 16 columns
        ((28672, 4096), 48, False, False, (False, 64, True)),  # one wave at 64: 872.3 against 1319.8 at 128 (v53)
        # one chunk a sequence: no chunk after it to hide P under (H100, session 73: 648.8 against 494.9 at 128)
        ((8,) * 1024, 8, False, False, (False, 128, False)),
        ((64,) * 512, 32, False, False, (False, 128, False)),  # 1341.5 against 1133.9
        ((128,) * 256, 8, False, False, (False, 128, False)),  # two chunks: 237.1 against 212.0
        ((192,) * 170, 8, False, False, (False, 128, False)),  # three (session 76): 201.7 against 192.2
        ((256,) * 128, 8, False, False, (False, 128, False)),  # four: 187.2 against 183.0
        ((300,) * 100, 8, False, False, (False, 64, True)),  # five: 175.9 against 176.3
        ((512,) * 64, 32, False, False, (False, 64, True)),  # eight chunks: 619.7 against 670.0 at 128
        # a few short sequences, where the walk would run at 64 or 32 columns: the model's O path (session 76)
        ((128,) * 8, 8, False, False, (False, 64, True)),  # 14.0 against 14.9 at 64
        ((128,), 32, False, False, (False, 64, True)),  # 13.2 against 14.4 at 32
        ((192,) * 4, 16, False, False, (False, 64, True)),  # 15.9 against 17.0 at 64
    ],
    ids=[
        "2/8_8x4096", "training", "output_h", "16/32_8x4096", "4/16_8x4096", "16/48_2x2048", "16/32_8x4096_training",
        "16/32_1x2048", "16/32_1x4096", "16/32_1x2048_training", "16/32_1x2048_output_h", "2/8_1x2048", "split",
        "split_training", "split_output_h", "4/4_split_narrow",
        "16/48_28672+4096", "2/8_8x1024", "16/32_64x512", "2/8_128x256", "2/8_192x170", "2/8_256x128", "2/8_300x100",
        "16/32_512x64", "2/8_128x8", "16/32_128x1", "4/16_192x4",
    ],
)
def test_o_path_walk_only_for_o_alone_where_it_pays(seqlens, Hv, training, output_h, expected):
    """fused_fwd_opath (with kkt_solve forming no P) runs where only o and the final state are asked
    for and the model says kkt_solve's saving pays for its walk (o_path_pays; measured pairs)."""
    assert planned_walk(seqlens, Hv, training, output_h) == expected


@pytest.mark.parametrize(
    "seqlens,Hv,expected",
    [  # H100, training step, states kept, whole / split µs (benchmark/NOTES.md v86)
        ((8192,), 32, False),  # 749.2 / 839.6
        ((8192, 8192), 16, False),  # 804.9 / 920.2
        ((8192,) * 4, 8, False),  # 733.4 / 734.8
        ((16384,), 32, False),  # 1468.4 / 1558.2
        ((16384, 16384), 16, False),  # 1572.3 / 1698.5
        ((8192,), 16, True),  # 524.3 / 507.7
        ((20000,), 16, True),  # 1201.1 / 1013.2
        ((6000, 5000), 8, True),  # 374.1 / 324.0
        ((16384,), 24, True),  # 1288.5 / 1173.5
        ((32768,), 16, True),  # 2009.6 / 1718.5
        ((8192,) + (100,) * 40, 16, True),  # the short sequences count for their share of the walk's time
        ((28672, 4096), 16, True),  # 18.3 chains on average: the 4096 tokens walk an eighth of the time
    ],
    ids=["1x8192_32_heads", "8192x2_16_heads", "8192x4_8_heads", "1x16384_32_heads", "16384x2_16_heads",
         "1x8192_16_heads", "1x20000_16_heads", "6000+5000_8_heads", "1x16384_24_heads", "1x32768_16_heads",
         "8192_and_short_16_heads", "28672+4096_16_heads"],  # fmt: skip
)
def test_training_forward_keeping_its_states_splits_below_a_wave_of_chains(seqlens, Hv, expected):
    """A training forward that keeps every state walks whole where the whole walk keeps KEPT_STATES_SPLIT_CHAINS
    chains busy on average, v-heads x the sequences' chunks over the longest's (there the margin fitted on
    recomputing backwards split where the whole walk ran faster); fewer, it splits where the margin says so.
    Recomputing, the margin alone."""
    assert splits_forward(seqlens, Hv, 128, SM90, True, keep_states=True) == expected
    assert walk_plan(seqlens, Hv, 128, SM90, True, True, False, True)[0] == expected
    assert splits_forward(seqlens, Hv, 128, SM90, True, keep_states=False)  # every row splits by the margin
    assert keeps_states(None, True, False, sum(seqlens), Hv, 128, 128, torch.bfloat16, SM90)  # by default


@pytest.mark.parametrize(
    "seqlens,Hv,expected",
    [
        ((32768,), 32, True),  # training step measured 2760 split vs 3086 µs whole
        ((8192,), 32, True),  # measured 786 vs 805 µs
        ((12288,), 32, True),  # the forward alone walks it whole
        ((16384, 16384), 32, False),  # measured 2757 vs 2515 µs
        ((32768,), 48, False),
        ((4096,) * 8, 32, False),
        ((32768,), 8, True),  # where the forward alone splits, training does too
        ((28672, 4096), 48, True),  # training keeps the equal-length model: 3.99 ms split (v53)
    ],
    ids=["1x32768_32_heads", "1x8192_32_heads", "1x12288_32_heads", "2x16384_32_heads", "1x32768_48_heads",
         "8x4096_32_heads", "1x32768_8_heads", "28672+4096_48_heads"],  # fmt: skip
)
def test_training_forward_splits_where_its_backward_gains(seqlens, Hv, expected):
    """A training forward hands its maps to the backward, which then splits without a map walk: recomputing its
    states (measured so, v49), it splits up to TRAINING_SPLIT_GAIN of the whole walk, beyond the inference margin."""
    assert splits_forward(seqlens, Hv, 128, SM90, True) == expected


@pytest.mark.parametrize(
    "seqlens,Hv,expected",
    [
        ((32768,), 8, True),  # low-level backward measured 1.223 split vs 1.650 ms whole
        ((32768,), 16, True),  # measured 1.797 vs 1.997 ms
        ((20000, 500, 12000), 8, True),  # measured 0.759 vs 0.895 ms
        ((9000,), 8, True),  # measured 0.301 vs 0.327 ms
        ((8192,), 16, False),  # measured 0.449 vs 0.409 ms
        ((32768,), 32, False),  # measured 2.624 vs 2.268 ms: where the forward splits, this backward does not
        ((8192,), 32, False),  # measured 0.725 vs 0.592 ms
        ((2048,), 8, False),  # one piece
    ],
    ids=["1x32768_8_heads", "1x32768_16_heads", "20000+500+12000_8_heads", "1x9000_8_heads", "1x8192_16_heads",
         "1x32768_32_heads", "1x8192_32_heads", "1x2048"],  # fmt: skip
)
def test_backward_forms_its_own_maps_only_where_that_pays(seqlens, Hv, expected):
    """A backward handed no maps (the low-level backward) splits with a narrower margin than the forward:
    it walks the maps and the end walk itself (splits_backward)."""
    assert splits_backward(seqlens, Hv, 128, SM90) == expected


@pytest.mark.parametrize(
    "n_seqs,T,Hv,expected",
    [
        (1, 32768, 32, 128),  # 16 pieces x 32 heads: 4 waves of 128 columns beat 8 of 64
        (1, 32768, 8, 128),  # 16 x 8: one wave of 128 columns beats two of 64
        (1, 8192, 32, 128),
        (36, 36 * 1024, 8, 128),  # 36 pieces x 8 heads: 3 waves of 128 columns beat 5 of 64
    ],
)
def test_recompute_over_pieces_runs_wide_tiles(n_seqs, T, Hv, expected):
    """The state recompute's two chains at 128 columns cost 1.5x one at 64, not 2x (measured)."""
    pieces = checkpoint_pieces_expected(n_seqs, T, SM90)
    assert choose_block_v(pieces, Hv, 128, SM90, RECOMPUTE_CHUNK_US) == expected


@pytest.mark.parametrize(
    "seqlens,Hv,expected",
    [
        ((4096,) * 8, 8, (64, 128)),  # apart (64, 64): 128 + 128 blocks, one grid after the other
        ((1024,) * 8, 8, (64, 128)),
        ((2048,), 32, (64, 64)),  # apart (32, 32): 128 + 128 blocks; at 64 both fit at once
        ((4096,) * 8, 16, (128, 128)),  # as apart: neither grid fits beside the other at any width
        ((4096,) * 8, 32, (128, 128)),
        ((2048,), 16, (64, 32)),  # the walk at 32 columns: 64 blocks
        ((2048,), 24, (64, 64)),  # at 32 columns 96 blocks, each chunk slower in the fuller grid (GRID_LOAD)
        ((2048,) * 3, 8, (64, 64)),
        ((8192,), 24, (64, 64)),
    ],
)
def test_backward_walk_beside_the_recompute(seqlens, Hv, expected):
    """The recompute's and the backward walk's widths, chosen together (measured best of the pairs tried on the
    H200, benchmark/NOTES.md v47, v58 and v59)."""
    N, chunks = len(seqlens), -(-sum(seqlens) // (64 * len(seqlens)))
    assert beside_widths(N, chunks, N, chunks, Hv, 128, SM90) == expected


@pytest.mark.parametrize(
    "n_chunks,Hqk,Hv,expected",
    [
        (32, 2, 8, 2),  # 2/8 at 2048 tokens: 64 items of 4 v-heads on 64 of 132 SMs; in parts of 2, 128 items of 2
        (32, 2, 16, 2),
        (16, 4, 16, 2),  # 4/16 at 1024 tokens: 64 items too
        (32, 4, 16, 1),  # 128 items: one round either way, 4 v-heads or 2 rounds of 2 (a tie: whole items)
        (32, 16, 32, 1),
        (512, 2, 8, 1),  # many rounds: the same v-heads a block either way
        # 8/32, 16/32 and 16/64 at 32768 tokens: 126 v-heads a block in parts against 128 whole (rounds rounded
        # up), but an exchange every round
        (512, 8, 32, 1),
        (512, 16, 32, 1),
        (512, 16, 64, 1),
        (96, 2, 8, 1),  # 2/8 2048x3: 3 rounds of 2 v-heads against 2 of 4, the exchanges more than the 2 saved
        (3, 16, 16, 1),  # one v-head a qk-head: nothing to split
    ],
)
def test_chunk_grads_splits_items_only_where_sms_idle(n_chunks, Hqk, Hv, expected):
    """chunk_grads splits a (chunk, qk-head) item's v-heads into parts where that walks fewer v-heads a block, by
    more than the parts' exchanges cost."""
    assert grads_parts(n_chunks, Hqk, Hv, 132) == expected


def _pieces_by_hand(seqlens, chunk, every):
    """(token start, first global chunk, checkpoint row) of every piece, walking the sequences."""
    slots = sum(seqlens) // chunk + len(seqlens)
    pieces, token, j = [], 0, 0
    for n, length in enumerate(seqlens):
        for c in range(-(-length // chunk)):
            if c == 0:
                pieces.append((token, j, slots // every + 1 + n))
            elif j % every == 0:
                pieces.append((token + c * chunk, j, j // every))
            j += 1
        token += length
    return pieces, slots


@pytest.mark.parametrize(
    "seqlens,every",
    [((32768,), 32), ((0, 1, 63, 64, 65, 0, 130, 1), 4), ((5000, 70, 0, 3000), 32), ((256, 320, 0), 4)],
    ids=["one_long", "edges_every_4", "varlen", "trailing_empty"],
)
def test_checkpoint_pieces(seqlens, every):
    """Pieces start at every non-empty sequence's first chunk and at every global chunk m · every
    inside a sequence; their start states are checkpoint rows m, or the sequence's initial state."""
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    want, slots = _pieces_by_hand(seqlens, SM90.chunk, every)
    bounds, first_chunks, rows = checkpoint_pieces(cu, SM90.chunk, slots, every)
    n = len(want)
    assert rows.shape[0] == bounds.shape[0] - 1 == first_chunks.shape[0] - 1 >= n
    assert [(b, f, r) for b, f, r in zip(bounds.tolist(), first_chunks.tolist(), rows.tolist())][:n] == want
    # the pieces end where the next starts; those past the last are empty, at T
    assert set(bounds[n:].tolist()) == {sum(seqlens)}
    assert rows.max() < slots // every + 1 + len(seqlens)
    # each sequence's first piece, the count last; the count again from the lengths alone
    starts = [b for b, _, _ in want]
    firsts = [sum(s < start for s in starts) for start in cu.tolist()]
    assert first_pieces(cu, SM90.chunk, slots, every).tolist() == firsts
    assert count_pieces(seqlens, SM90.chunk, every) == n
    # the rows a split walk gathers each sequence's final state (last piece) and dh0 (first piece) from,
    # in range for every sequence; a zero-length sequence takes its passthrough instead of its row
    first, last = (x.tolist() for x in sequence_pieces(cu, SM90.chunk, slots, every))
    rows_in = bounds.shape[0] - 1
    assert all(0 <= r < rows_in for r in first + last)
    for seq, length in enumerate(seqlens):
        if length:
            assert (first[seq], last[seq]) == (firsts[seq], firsts[seq + 1] - 1)
    assert checkpoint_rows(slots, len(seqlens), SM90) == slots // SM90.checkpoint_chunks + 1 + len(seqlens)


def test_kernel_support_reasons():
    bf16 = torch.bfloat16
    assert kernel_unsupported_reason(bf16, 128, 128, 1, 1) is None
    assert "float32" in kernel_unsupported_reason(torch.float32, 128, 128, 1, 1)
    assert "head dims" in kernel_unsupported_reason(bf16, 64, 64, 1, 1)
    # kkt_solve's grid has a row per chunk slot: at most 65535 (CUDA's y extent)
    assert kernel_unsupported_reason(bf16, 128, 128, 64 * 65534, 1) is None
    assert "at most 65535 chunk slots" in kernel_unsupported_reason(bf16, 128, 128, 64 * 65534, 2)


def test_plans_raise_where_the_kernels_cannot_run(monkeypatch):
    """A forward or backward the kernels cannot run raises a ValueError naming q before anything is planned (the
    profile is not looked up: an unsupported dtype on an unsupported GPU names the dtype)."""
    from flash_qla.ops import backward, forward

    for module in (forward, backward):
        monkeypatch.setattr(module, "get_profile", lambda device: pytest.fail("planned"))
    cuda, seqlens = torch.device("cuda", 0), (64, 64)
    with pytest.raises(ValueError, match="^q: the GPU kernels take bfloat16 or float16"):
        forward.forward_plan(cuda, 128, seqlens, 2, 8, 128, 128, torch.float32, torch.float32, False, False, True,
                             False, None)  # fmt: skip
    with pytest.raises(ValueError, match="^q: the GPU kernels support head dims"):
        backward.backward_plan(cuda, 128, seqlens, 2, 8, 64, 64, torch.bfloat16, torch.bfloat16, True, False, False,
                               False, False, False, True)  # fmt: skip


@pytest.mark.parametrize("empty,pieces", [(4000, True), (65001, False)])
def test_walks_over_pieces_only_where_their_grid_fits(empty, pieces):
    """A walk over pieces launches a block row per piece, N + slots // checkpoint_chunks (empty sequences count):
    one sequence of 9000 tokens at 2/8 splits and keeps checkpoints beside 4000 empty ones, and walks whole beside
    65001 (67037 pieces, over CUDA's 65535; the slots, 65142, are within it)."""
    seqlens = (9000,) + (0,) * empty
    slots = 9000 // SM90.chunk + len(seqlens)
    assert kernel_unsupported_reason(torch.bfloat16, 128, 128, 9000, len(seqlens)) is None
    assert pieces_fit_the_grid(seqlens, SM90) == pieces == (len(seqlens) + slots // SM90.checkpoint_chunks <= 65535)
    for training in (False, True):
        assert splits_forward(seqlens, 8, 128, SM90, training) == pieces
        assert planned_walk(seqlens, 8, training)[0] == pieces
    assert splits_backward(seqlens, 8, 128, SM90) == pieces
    assert keeps_checkpoints(seqlens, 8, 128, SM90) == pieces


def test_unknown_arch_name():
    with pytest.raises(ValueError, match="unknown arch"):
        profile_by_name("sm75")


@pytest.mark.parametrize("heads", ["16", "16/0", "3/16", "a/b"])
def test_precompile_rejects_bad_heads(heads, capsys):
    with pytest.raises(SystemExit) as exc:
        precompile_main(["--heads", heads])
    assert exc.value.code == 2
    assert "--heads" in capsys.readouterr().err


@pytest.mark.parametrize(
    "lengths", [(64,), (0, 1, 63, 64, 65, 0, 130, 1), (1000, 0, 0, 3), (0, 0, 5)], ids=lambda x: "-".join(map(str, x))
)
def test_chunk_table_skips_empty_sequences(lengths):
    """Every global chunk's (first token, tokens), in order; the launcher's extra slots hold 0 tokens."""
    C = SM90.chunk
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    expected = [
        [start + c * C, min(C, length - c * C)]
        for start, length in zip(cu.tolist(), lengths)
        for c in range(-(-length // C))
    ]
    slots = sum(lengths) // C + len(lengths)  # the launcher's upper bound
    got = chunk_table(cu, C, slots)
    assert got.dtype == torch.int32 and got.shape == (slots, 2)
    assert got[: len(expected)].tolist() == expected
    assert (got[len(expected):, 1] == 0).all()
    # the layers of a step share cu_seqlens: the table is built once
    assert chunk_table(cu, C, slots) is got
    # and looked up with the offsets in one call on a forward's path
    offsets, table = chunk_tables(cu, C, slots)
    assert table is got and offsets is chunk_offsets_of(cu, C) and chunk_tables(cu, C, slots)[1] is got


def test_chunk_offsets_recomputed_after_in_place_edit():
    cu = torch.tensor([0, 64, 128], dtype=torch.int32)
    assert chunk_offsets_of(cu, SM90.chunk).tolist() == [0, 1, 2]
    assert chunk_offsets_of(cu, SM90.chunk).tolist() == [0, 1, 2]  # cached
    cu[2] = 200
    assert chunk_offsets_of(cu, SM90.chunk).tolist() == [0, 1, 4]


@pytest.mark.parametrize(
    "lengths", [(8, 0, 64, 65, 128, 0), (200, 1), (0, 0, 5)], ids=lambda x: "-".join(map(str, x))
)
def test_chunk_rows_describe_every_chunk(lengths):
    """chunk_rows: chunk_table's (first token, tokens), then each chunk's sequence and flags (1: the sequence's first
    chunk, 2: its last), empty sequences skipped; zeros past the last chunk; built once per cu_seqlens."""
    C = SM90.chunk
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    expected = []
    for n, (start, length) in enumerate(zip(cu.tolist(), lengths)):
        count = -(-length // C)
        for c in range(count):
            expected.append([start + c * C, min(C, length - c * C), n, (c == 0) + 2 * (c == count - 1)])
    slots = sum(lengths) // C + len(lengths)
    got = chunk_rows(cu, C, slots)
    assert got.dtype == torch.int32 and got.shape == (slots, 4) and got.is_contiguous()
    assert got[: len(expected)].tolist() == expected and (got[len(expected):] == 0).all()
    assert chunk_rows(cu, C, slots) is got


@pytest.mark.parametrize("n_seqs,per_block,expected", [(10, 4, [0, 4, 8, 10]), (8, 4, [0, 4, 8]), (3, 5, [0, 3])])
def test_sequence_groups(n_seqs, per_block, expected):
    like = torch.zeros(1)
    got = sequence_groups(n_seqs, per_block, like)
    assert got.dtype == torch.int32 and got.tolist() == expected
    assert sequence_groups(n_seqs, per_block, like) is got  # kept per shape, device and stream


@pytest.mark.parametrize(
    "seqlens,Hv,per_block",
    [
        ((8,) * 1024, 8, 32),  # 8192 blocks of one sequence each: 32 a block, 256 blocks (31: 272, a third wave)
        ((64,) * 512, 32, 64),  # 8 blocks a v-head, 256 in all (62: 9 a v-head, 288)
        ((128,) * 256, 8, 8),  # two chunks a sequence
        ((1, 64, 65, 128, 0) * 40, 8, 7),  # 1600 blocks (empty sequences too): 232
        ((8,) * 66, 8, 2),  # 528 blocks: four waves
        ((8,) * 33, 8, 1),  # 264 blocks: two waves
        ((8,) * 32, 8, 1),  # 256 blocks: two waves, nothing to pack
        ((129,) * 1024, 8, 1),  # three chunks a sequence (one a block at 128 columns: PACK_CHUNKS)
        ((8,) * 1023 + (200,), 8, 1),  # one sequence of four chunks
    ],
)
def test_short_sequences_share_blocks(seqlens, Hv, per_block, monkeypatch):
    """The inference forward's walk over many short sequences (at most PACK_CHUNKS chunks) takes several a block
    (sequences_per_block): as many as leave PACK_WAVES waves of blocks at 128 columns; the plan then builds the
    PACKED walk, whose blocks then run in at most PACK_WAVES waves. A training forward or one with output_h walks one
    sequence a block."""
    from flash_qla.ops import forward

    chunks = [-(-n // SM90.chunk) for n in seqlens]
    split, BV, opath = planned_walk(seqlens, Hv)
    assert sequences_per_block(chunks, Hv, 128, BV, SM90) == (1 if split or opath else per_block)
    if per_block > 1:  # the walk's blocks at 128 columns
        assert -(-len(seqlens) // per_block) * Hv <= forward.PACK_WAVES * SM90.num_sms

    def plan(training=False, output_h=False):
        bf16 = torch.bfloat16
        return forward.forward_plan(
            torch.device("cuda", 0), sum(seqlens), seqlens, 2, Hv, 128, 128, bf16, bf16, False, output_h, True,
            training, False,
        )  # fmt: skip

    built = []
    monkeypatch.setattr(forward, "get_profile", lambda device: SM90)
    monkeypatch.setattr(forward, "executable", lambda kernel: kernel)
    for name in ("kkt_solve", "fused_fwd", "fused_fwd_opath"):
        monkeypatch.setattr(forward, f"{name}_kernel", lambda *args, **kwargs: None)
    monkeypatch.setattr(forward, "fused_fwd_wide_kernel", lambda *args, **kwargs: built.append(kwargs.get("PACKED")))
    forward.forward_plan.cache_clear()
    assert plan().per_block == per_block and plan(training=True).per_block == plan(output_h=True).per_block == 1
    assert (True in built) == (per_block > 1)
    forward.forward_plan.cache_clear()


# the forward routes the GPU tests must run, per dtype and mode: a V-tile width, the O path, the split, the walk
# taking several sequences a block
WALKS_COVERED = {
    (torch.bfloat16, "inference"): {"split", "opath", 16, "packed"},
    (torch.bfloat16, "output_h"): {"split", 16, 32, 64, 128},
    (torch.bfloat16, "training"): {"split", 16, 32, 64, 128},
    (torch.float16, "inference"): {"opath", 16},
    (torch.float16, "output_h"): {16, 32, 64, 128},
    (torch.float16, "training"): {16, 32, 64, 128},
}


@pytest.mark.parametrize("dtype,mode", WALKS_COVERED, ids=lambda x: str(x).removeprefix("torch."))
def test_gpu_cases_reach_every_forward_walk(dtype, mode):
    """The GPU tests (their tables in tests/gpu_cases.py) run each forward route the planner can take, per dtype
    and mode, as walk_plan decides today: a planner change that moves a case off the walk it was written for
    fails here, without a GPU. CASES run as inference and training forwards; with output_h run OUTPUT_H_CASES
    (the low-level forward) and SPLIT_CASES (the split forced on, and off: then walked whole)."""
    if mode == "output_h":  # (case, auto_cp)
        runs = [(case, True) for case in OUTPUT_H_CASES] + [(case, False) for case in SPLIT_CASES]
    else:
        runs = [(case, True) for case in CASES]
    reached = {"split"} if mode == "output_h" and any(case.dtype == dtype for case in SPLIT_CASES) else set()
    for case, auto_cp in runs:
        if case.dtype != dtype:
            continue
        seqlens = (case.dense[1],) * case.dense[0] if case.dense else case.seqlens
        split, BV, opath = planned_walk(
            seqlens, case.heads[1], mode == "training", mode == "output_h", auto_cp, case.dtype
        )  # fmt: skip
        reached.add("split" if split else "opath" if opath else BV)
        if mode == "inference" and not (split or opath):
            reached.add("packed" if sequences_per_block([-(-n // 64) for n in seqlens], case.heads[1], 128, BV, SM90) > 1 else BV)
    assert WALKS_COVERED[dtype, mode] <= reached, reached


def test_chunk_tables_are_kept_per_stream_and_not_for_a_captured_graph(monkeypatch):
    """A table is reused on the stream it was built on only (its memory is then reused in that stream's
    order); while a CUDA graph is captured the tables are built afresh (from the graph's memory pool, alive
    as long as the graph is) and not cached: a graph holding cached ones would read freed memory once a
    call with another cu_seqlens replaced them. Streams and capture simulated (no GPU here)."""
    from flash_qla import tensor_cache

    C = SM90.chunk
    cu = torch.tensor([0, 64, 200], dtype=torch.int32)
    stream = {"key": 1}
    monkeypatch.setattr(tensor_cache, "stream_key", lambda tensor: stream["key"])
    first = chunk_table(cu, C, 5)
    assert chunk_table(cu, C, 5) is first
    stream["key"] = 2  # another stream
    second = chunk_table(cu, C, 5)
    assert second is not first and torch.equal(second, first) and chunk_table(cu, C, 5) is second
    stream["key"] = None  # capturing
    captured = chunk_table(cu, C, 5)
    assert captured is not second and torch.equal(captured, second)
    stream["key"] = 2
    assert chunk_table(cu, C, 5) is second  # the eager entry stayed


def test_chunk_tables_of_an_inference_tensor():
    """A cu_seqlens made under torch.inference_mode has no version counter to key the cache on: its tables
    are built on every call, the same ones."""
    with torch.inference_mode():
        cu = torch.tensor([0, 64, 200], dtype=torch.int32)
        first = chunk_table(cu, SM90.chunk, 5)
        assert chunk_table(cu, SM90.chunk, 5) is not first
    assert torch.equal(chunk_table(cu, SM90.chunk, 5), first)


def test_cpu_device_is_not_a_kernel_device():
    assert "CUDA device" in unsupported_reason(torch.device("cpu"))


def test_profiles_found_once_per_device(monkeypatch):
    """get_profile reads a device's capability once; an unsupported one raises on every call, and
    "cuda" without an index (the current device, which may change) is looked up each time."""
    from flash_qla import arch

    capabilities = {0: (9, 0), 1: (8, 0)}
    reads = []
    monkeypatch.setattr(arch, "_profile_of", {})
    monkeypatch.setattr(arch, "_capability_of_index", lambda index: (reads.append(index), capabilities[index])[1])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert arch.get_profile(torch.device("cuda", 0)) is SM90
    assert arch.get_profile(torch.device("cuda", 0)) is SM90
    assert reads == [0, 0]  # unsupported_reason's read and the profile's, on the first call only
    for _ in range(2):
        with pytest.raises(RuntimeError, match="compute capability 8.0 .*FLA_FLASH_QLA=0"):
            arch.get_profile(torch.device("cuda", 1))
    assert reads == [0, 0, 1, 1]
    assert arch.get_profile(torch.device("cuda")) is SM90
    assert arch.get_profile(torch.device("cuda")) is SM90
    assert reads == [0, 0, 1, 1, 0, 0, 0, 0]


def test_precompile_builds_every_listed_kernel(monkeypatch, tmp_path, capsys):
    """The CLI compiles the cross product of --dtype x --heads into --cache-dir (builds stubbed)."""
    from flash_qla.ops import backward, forward

    built = []

    def fake_builds(stage):
        def builds(profile, Hqk, Hv, dtype):
            return [(lambda *args: built.append(args), (stage, Hqk, Hv, dtype))]

        return builds

    monkeypatch.setattr(forward, "forward_kernel_builds", fake_builds("fwd"))
    monkeypatch.setattr(backward, "backward_kernel_builds", fake_builds("bwd"))
    monkeypatch.setattr(forward, "kept_states_kernel_builds", fake_builds("keep"))
    # set first so that monkeypatch records it and undoes what precompile sets (else every later test compiles
    # into this test's temporary directory, and no run reuses TileLang's cache)
    monkeypatch.setenv("TILELANG_CACHE_DIR", "unset")
    monkeypatch.delenv("TILELANG_CACHE_DIR")
    argv = ["--heads", "16/32", "--heads", "4/8", "--dtype", "bfloat16", "--dtype", "float16", "--cache-dir", str(tmp_path)]
    assert precompile_main(argv) == 0
    layouts = [(h, v, d) for d in ("bfloat16", "float16") for h, v in ((16, 32), (4, 8))]
    assert sorted(built) == sorted((stage, *x) for stage in ("fwd", "bwd", "keep") for x in layouts)
    assert os.environ["TILELANG_CACHE_DIR"] == str(tmp_path)
    assert "12 kernels for sm90" in capsys.readouterr().out

    built.clear()
    assert precompile_main(["--heads", "4/8", "--forward-only", "--cache-dir", str(tmp_path)]) == 0
    assert built == [("fwd", 4, 8, "bfloat16")]

    with pytest.raises(SystemExit):  # training compiles the kept states' walks anyway (keep_states=None keeps them)
        precompile_main(["--heads", "4/8", "--keep-states"])
    for bad in (["--arch", "sm_90a"], ["--jobs", "0"], ["--jobs", "x"]):  # argparse errors, before any import of TileLang
        with pytest.raises(SystemExit):
            precompile_main(["--heads", "4/8", *bad])


def test_precompile_compiles_a_shared_kernel_once(monkeypatch, tmp_path, capsys):
    """A layout given twice, and a kernel two layouts share (compose_maps depends on Hv alone), compile once."""
    from flash_qla.ops import forward

    built = []

    def kernel(*args):  # one factory, as the real ones are
        built.append(args)

    def builds(profile, Hqk, Hv, dtype):
        return [(kernel, ("shared", Hv)), (kernel, ("own", Hqk, Hv))]

    monkeypatch.setattr(forward, "forward_kernel_builds", builds)
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    assert precompile_main(["--heads", "2/8", "--heads", "4/8", "--heads", "2/8", "--forward-only"]) == 0
    assert sorted(built) == [("own", 2, 8), ("own", 4, 8), ("shared", 8)]
    assert "3 kernels for sm90" in capsys.readouterr().out


def _recording_factory(built):
    """factory(name): a stand-in kernel factory that appends name to built on each build and returns name."""

    def factory(name):
        def build(*args, **kwargs):
            built.append(name)
            return name

        return build

    return factory


def test_forward_plan_decided_once_per_shapes_and_options(monkeypatch):
    """forward_plan decides the route and looks its kernels up on the first forward over given shapes and
    options, and hands every later one the same plan; other shapes or options are planned afresh."""
    from flash_qla.ops import forward

    built = []
    factory = _recording_factory(built)
    monkeypatch.setattr(forward, "get_profile", lambda device: SM90)
    for name in ("kkt_solve", "fused_fwd_opath", "fused_fwd", "fused_fwd_wide", "compose_maps"):
        monkeypatch.setattr(forward, f"{name}_kernel", factory(name))
    monkeypatch.setattr(forward, "executable", lambda kernel: f"launch {kernel}")

    def plan(seqlens, Hv, training=False):
        bf16 = torch.bfloat16
        return forward.forward_plan(
            torch.device("cuda", 0), sum(seqlens), seqlens, 2, Hv, 128, 128, bf16, bf16, False, False, True, training,
            False,
        )  # fmt: skip

    inference = plan((4096,) * 8, 8)  # 2/8 8x4096: the O-path walk, kkt_solve without P
    assert plan((4096,) * 8, 8) is inference and built == ["kkt_solve", "fused_fwd_opath"]
    assert (inference.split, inference.opath, inference.BV) == (False, True, 64)
    assert inference.kkt == "launch kkt_solve" and inference.walk == "launch fused_fwd_opath"
    assert inference.slots == 8 * 4096 // 64 + 8 and len(inference.specs) == 4
    training = plan((4096,) * 8, 8, training=True)  # P kept for the backward
    assert built[2:] == ["kkt_solve", "fused_fwd_wide"] and len(training.specs) == 6 and not training.opath
    # split: the walk over the pieces (o alone: the O path, kkt_solve without P but with the bounds), the MAPS and
    # offsets walks at 128 columns (16 pieces x 8 v-heads: one wave), compose_maps, and the pieces' buffers: D, b,
    # starts and ends, one row per piece
    pieces = plan((32768,), 8)
    assert pieces.split and (pieces.BV, pieces.BV_maps) == (64, 128) and pieces.opath
    assert built[4:] == ["kkt_solve", "fused_fwd_opath", "fused_fwd_wide", "fused_fwd_wide", "compose_maps"]
    assert pieces.walk == "launch fused_fwd_opath"
    assert (pieces.map_walk, pieces.offsets) == ("launch fused_fwd_wide",) * 2
    assert pieces.compose == "launch compose_maps" and len(pieces.specs) == 5
    # a training forward's pieces: kkt_solve's P kept for the backward, the pieces at 128 columns
    pieces_training = plan((32768,), 8, training=True)
    assert (pieces_training.BV, pieces_training.opath, len(pieces_training.specs)) == (128, False, 6)
    assert built[9:] == ["kkt_solve", "fused_fwd_wide", "fused_fwd_wide", "fused_fwd_wide", "compose_maps"]
    n = 1 + pieces.slots // SM90.checkpoint_chunks  # checkpoint_pieces' rows: a piece per sequence and per 32 slots
    assert pieces.split_specs == (
        ((n, 8, 128, 256), torch.bfloat16), *(((n, 8, 128, 128), torch.float32),) * 3
    ) and inference.split_specs == ()


def test_backward_plan_decided_once_per_shapes_and_options(monkeypatch):
    """backward_plan decides the route and looks its kernels up on the first backward over given shapes and
    what the forward handed over, and hands every later one the same plan; other keys are planned afresh."""
    from flash_qla.ops import backward

    built = []
    factory = _recording_factory(built)
    monkeypatch.setattr(backward, "get_profile", lambda device: SM90)
    monkeypatch.setattr(backward, "multiprocessors", lambda device: 132)
    for name in ("kkt_solve", "fused_bwd", "fused_bwd_wide"):
        monkeypatch.setattr(backward, f"{name}_kernel", factory(name))
    # chunk_grads recorded with the dtype it stores dβ in and its parts, its last two arguments
    monkeypatch.setattr(backward, "chunk_grads_kernel", lambda *args: factory(f"chunk_grads {args[-2]} {args[-1]}")())
    monkeypatch.setattr(backward, "walk_kernel", lambda BV: factory(f"walk{BV}"))
    monkeypatch.setattr(backward, "backward_walk_kernel", lambda BV: factory(f"backward_walk{BV}"))
    monkeypatch.setattr(backward, "compose_maps_kernel", factory("compose_maps"))
    monkeypatch.setattr(backward, "executable", lambda kernel: f"launch {kernel}")
    backward.backward_plan.cache_clear()

    def plan(seqlens, Hv, kept_terms=True, kept_states=False, checkpoints=False, maps=False, auto_cp=True,
             beta_dtype=torch.bfloat16):  # fmt: skip
        return backward.backward_plan(
            torch.device("cuda", 0), sum(seqlens), seqlens, 2, Hv, 128, 128, torch.bfloat16, beta_dtype, kept_terms,
            kept_states, checkpoints, maps, False, True, auto_cp,
        )  # fmt: skip

    training = plan((4096,) * 8, 8)  # 2/8 8x4096 after a training forward: recompute, whole walk, chunk_grads
    # the walk at 128 columns beside the recompute at 64 (beside_widths)
    assert plan((4096,) * 8, 8) is training and built == ["backward_walk128", "walk64", "chunk_grads bfloat16 1"]
    assert training.kkt is None and training.recompute == "launch walk64" and training.BV_h == 64
    assert (training.split, training.BV, training.walk) == (False, 128, "launch backward_walk128")
    assert training.grads == "launch chunk_grads bfloat16 1" and training.blocks == 132 and training.ends_walk is None
    assert training.slots == 8 * 4096 // 64 + 8
    del built[:]
    low_level = plan((4096,) * 8, 8, kept_terms=False)  # the low-level backward forms P, γ and gates
    assert low_level.kkt == "launch kkt_solve" and built[0] == "kkt_solve"
    del built[:]
    kept = plan((4096,) * 8, 8, kept_states=True)  # every state kept: nothing to recompute
    assert kept.recompute is None and kept.BV_h is None and "walk64" not in built
    assert kept.BV == 64 and "backward_walk64" in built  # the walk alone: its own width (choose_block_v)
    del built[:]
    pieces = plan((32768,), 8, checkpoints=True, maps=True)  # a forward that split: its maps, no MAPS walk
    assert pieces.split and pieces.map_walk is None and pieces.ends_walk is not None
    assert pieces.compose == "launch compose_maps" and "compose_maps" in built
    del built[:]
    own_maps = plan((32768,), 8, checkpoints=False)  # the backward's own split: its MAPS walk forms the maps
    assert own_maps.split and own_maps.map_walk is not None and own_maps.BV_maps in BLOCK_V_CHOICES
    assert not plan((32768,), 8, auto_cp=False).split  # auto_cp off walks whole
    del built[:]
    fp32_beta = plan((4096,) * 8, 8, beta_dtype=torch.float32)  # chunk_grads stores dβ in β's dtype
    assert fp32_beta is not training and built == ["backward_walk128", "walk64", "chunk_grads float32 1"]
    short = plan((2048,), 8)  # 2/8 at 2048 tokens: 64 items of 4 v-heads in two parts of 2
    assert short.grads == "launch chunk_grads bfloat16 2" and short.parts == 2
    assert short.blocks == short.slots * 2 * 2 == 132  # the slots' bound: 33 slots (the last empty) x 2 qk-heads x 2


@pytest.mark.parametrize(
    "n_seqs,Hv,BV,waves",
    [(1, 8, 16, 1), (1, 32, 16, 2), (8, 32, 128, 2), (8, 32, 64, 4), (4, 33, 128, 1), (1, 132, 128, 1), (1, 133, 128, 2)],
)
def test_chunk_step_time_is_waves_times_a_chunk(n_seqs, Hv, BV, waves):
    """Blocks (sequences x heads x V-tiles) over 132 SMs, rounded up to whole waves, times the µs of a chunk
    at that width (the waves counted by hand)."""
    cost = {128: 2.0, 64: 1.5, 32: 1.25, 16: 1.0}
    assert chunk_step_time(n_seqs, Hv, 128, BV, SM90, cost) == waves * cost[BV]


@pytest.mark.parametrize("Hv", [8, 16, 32, 48, 64])
@pytest.mark.parametrize("BV", [128, 64, 32, 16])
@pytest.mark.parametrize("seqlens", [(2048,), (4096,) * 8, (32768,), (1024,) * 40])
def test_whole_walk_time_of_equal_lengths_counts_whole_waves(seqlens, BV, Hv):
    """Equal lengths: the walk's waves times its chunks (chunk_step_time), as the split and width models had it."""
    chunks = [n // SM90.chunk for n in seqlens]
    expected = chunk_step_time(len(seqlens), Hv, 128, BV, SM90) * chunks[0]
    assert whole_walk_time(chunks, Hv, 128, BV, SM90) == pytest.approx(expected)


def test_whole_walk_time_of_unequal_lengths_lets_short_blocks_fill_the_sms():
    """16/48 28672+4096 at 64 columns: 192 blocks, but the short sequence's 96 follow each other beside the long
    one's: one walk of 448 chunks, not two waves; a zero-length sequence adds nothing."""
    one_wave = 448 * FORWARD_CHUNK_US[64]
    assert whole_walk_time([448, 64], 48, 128, 64, SM90) == pytest.approx(one_wave)
    assert whole_walk_time([448, 64, 0], 48, 128, 64, SM90) == pytest.approx(one_wave)
    assert whole_walk_time([0, 0], 48, 128, 64, SM90) == 0.0
    # past the SMs' room in one long walk the average load decides: 28672 x 3 at 48 v-heads, 64 columns
    assert whole_walk_time([448, 448, 448, 64], 48, 128, 64, SM90) > 2 * one_wave


def test_precompile_lists_every_forward_kernel():
    builds = forward_kernel_builds(SM90, 16, 32, "bfloat16")
    assert {f.__name__ for f, _ in builds} == {
        "kkt_solve_kernel", "fused_fwd_kernel", "fused_fwd_wide_kernel", "fused_fwd_opath_kernel", "compose_maps_kernel"
    }
    # kkt_solve for β in q's dtype and in fp32: with P, and without it (the O-path walk's, with and without h0)
    # with and without the bounds (the O path over a split's pieces); every V-tile width the launcher can choose,
    # with and without h0 / h, and the two walks of a split walk's maps (M and b), over pieces of checkpoint_chunks and
    # of twice that (an inference split on the O path); the composition of the maps with and without an initial
    # state, over either; the walk taking several short sequences a block, at 128 columns, with and without h0
    assert len(builds) == 2 * 3 + 2 + len(BLOCK_V_CHOICES) * (2 * 2 + 2 + 2) + 2 + 2 + 2
    assert len(set(builds)) == len(builds)


def test_precompile_lists_every_backward_kernel():
    builds = backward_kernel_builds(SM90, 16, 32, "bfloat16")
    assert {f.__name__ for f, _ in builds} == {
        "kkt_solve_kernel",
        "fused_fwd_kernel",
        "fused_fwd_wide_kernel",
        "fused_bwd_kernel",
        "fused_bwd_wide_kernel",
        "compose_maps_kernel",
        "chunk_grads_kernel",
    }
    # kkt_solve in backward mode forming the bounds (β in q's dtype and in fp32) and not; for every V-tile width the states-only walk with and without h0
    # (from the checkpoints or the sequences' starts), the forward walk keeping checkpoints with
    # and without h0, the backward walk with and without dht / dh0 and the split backward's
    # offsets walk; the reverse composition with and without dht; chunk_grads storing dβ in q's dtype and in fp32,
    # with whole items and in halves (two v-heads a qk-head; one v-head: whole items only)
    assert len(builds) == 3 + len(BLOCK_V_CHOICES) * (2 + 2) + len(BLOCK_V_CHOICES) * (2 * 2 + 1) + 2 + 2 * 2
    assert not set(builds) & set(forward_kernel_builds(SM90, 16, 32, "bfloat16"))
    assert len(backward_kernel_builds(SM90, 16, 16, "bfloat16")) == len(builds) - 2


def test_precompile_lists_the_kept_states_walks():
    """Training's precompile adds the forward walks that keep every state (each width, with and without h0)."""
    builds = kept_states_kernel_builds(SM90, 16, 32, "bfloat16")
    assert len(builds) == len(set(builds)) == len(BLOCK_V_CHOICES) * 2
    others = forward_kernel_builds(SM90, 16, 32, "bfloat16") + backward_kernel_builds(SM90, 16, 32, "bfloat16")
    assert not set(builds) & set(others)


# A layout for each GVA ratio (1, 2, 3, 4, 8) and few v-heads (the narrow walks), over patterns that reach every
# route: varlen edges, many short sequences (packed walks), one sequence of 32 chunks and of 33 (a piece of one
# chunk), pieces with a partial last one, one and two long sequences (split), eight of 4096, long and short ones
# with an empty one
PLANNED_LAYOUTS = [(4, 4), (16, 32), (8, 24), (4, 16), (2, 16), (2, 8)]
PLANNED_SEQLENS = [
    (0, 1, 63, 64, 65, 129), (89,) * 150, (2048,), (2049,), (9000,), (32768,), (4096,) * 8, (16384, 16384),
    (5000, 0, 70, 9000),
]  # fmt: skip
KERNEL_FACTORIES = (
    "kkt_solve_kernel", "fused_fwd_kernel", "fused_fwd_wide_kernel", "fused_fwd_opath_kernel", "compose_maps_kernel",
    "fused_bwd_kernel", "fused_bwd_wide_kernel", "chunk_grads_kernel",
)  # fmt: skip


def plans_ask_for(monkeypatch, seqlens_list, Hqk, Hv, dtype):
    """(kernels, builds): the kernels forward_plan and backward_plan ask for over these patterns with every option a
    caller can pass (β in q's dtype or fp32, h0, dht, auto_cp; inference, the low-level forward with output_h and its
    backward; training with keep_states None, True or False and the backward it hands over to), and the kernels
    precompile builds for the layout; each as (factory name, its build's arguments bound, defaults filled in). The
    factories record instead of compiling; the plans made here are dropped after."""
    import inspect

    from gpu_cases import drop_plans

    from flash_qla.ops import backward, forward

    asked = set()

    def recording(factory):
        signature = inspect.signature(factory.__wrapped__)

        def record(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            key = (factory.__name__, tuple(bound.arguments.values()))
            asked.add(key)
            return key

        return record

    for module in (forward, backward):
        for name in KERNEL_FACTORIES:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, recording(getattr(module, name)))
        monkeypatch.setattr(module, "executable", lambda kernel: kernel)
        monkeypatch.setattr(module, "get_profile", lambda device: SM90)
    monkeypatch.setattr(backward, "multiprocessors", lambda device: SM90.num_sms)
    name = forward.DTYPE_NAMES[dtype]
    jobs = forward_kernel_builds(SM90, Hqk, Hv, name) + kept_states_kernel_builds(SM90, Hqk, Hv, name)
    builds = {factory(*args) for factory, args in jobs + backward.backward_kernel_builds(SM90, Hqk, Hv, name)}
    asked.clear()
    device = torch.device("cuda", 0)
    runs = [(False, False, None), (False, True, None)]  # (training, output_h, keep_states)
    runs += [(True, False, keep) for keep in (None, True, False)]
    drop_plans()
    try:
        for seqlens in seqlens_list:
            T = sum(seqlens)
            for beta_dtype, h0, auto_cp, (training, output_h, keep) in itertools.product(
                (dtype, torch.float32), (False, True), (True, False), runs
            ):
                plan = forward.forward_plan(
                    device, T, seqlens, Hqk, Hv, 128, 128, dtype, beta_dtype, h0, output_h, auto_cp, training, keep
                )  # fmt: skip
                # what the forward hands the backward over (flash_qla.ops.forward._forward_kernels' returns)
                checkpoints = training and (plan.keeps_checkpoints or (plan.split and not plan.keep_states))
                for dht in (False, True):
                    backward.backward_plan(
                        device, T, seqlens, Hqk, Hv, 128, 128, dtype, beta_dtype, training, plan.keep_states,
                        checkpoints, training and plan.split, h0, dht, auto_cp,
                    )  # fmt: skip
    finally:
        drop_plans()
    return asked, builds


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", PLANNED_LAYOUTS, ids=lambda h: f"{h[0]}/{h[1]}")
def test_precompile_builds_every_kernel_the_plans_ask_for(monkeypatch, heads, dtype):
    """A precompiled cache serves every call of its layout: no kernel the planners can pick (any route, width,
    flag or dβ dtype) is missing from precompile's lists, so a deployment does not stall on a compile."""
    asked, builds = plans_ask_for(monkeypatch, PLANNED_SEQLENS, *heads, dtype)
    assert {name for name, _ in asked} == set(KERNEL_FACTORIES)  # every stage's routes planned here
    assert asked <= builds, sorted(asked - builds)
