"""The chunk tables derived from cu_seqlens, on the device (no host synchronisation).

Sequences are cut into chunks of C tokens, restarting at each sequence start. The kernels
index chunks globally (all sequences' chunks in order), over a grid of `slots` = T // C + N,
an upper bound of the number of chunks that the host knows without reading cu_seqlens.
All layers of a model step usually share one cu_seqlens tensor: both tables are built
once per tensor (flash_qla.tensor_cache).
"""

import functools

import torch

from flash_qla.tensor_cache import cache_last, stream_key


@cache_last(device_result=True)
def chunk_offsets_of(cu_seqlens: torch.Tensor, chunk: int) -> torch.Tensor:
    """[N+1] int32: index of each sequence's first chunk among all chunks (the walks' table)."""
    n_chunks = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk - 1) // chunk
    return torch.nn.functional.pad(torch.cumsum(n_chunks, 0), (1, 0)).to(torch.int32)


def slot_sequences(offsets: torch.Tensor, slots: int) -> tuple:
    """(slot, seq): every chunk slot [slots] int32 and the sequence it belongs to [slots] int64, from chunk_offsets:
    the last n with offsets[n] <= slot (skips empty sequences); slots past the last chunk land on the last sequence,
    past its end."""
    slot = torch.arange(slots, dtype=torch.int32, device=offsets.device)
    seq = torch.searchsorted(offsets, slot, right=True, out_int32=True).sub_(1).clamp_(0, offsets.numel() - 2).long()
    return slot, seq


@cache_last(device_result=True)
def chunk_table(cu_seqlens: torch.Tensor, chunk: int, slots: int) -> torch.Tensor:
    """[slots, 2] int32: (first token, tokens) of every global chunk; (_, 0) for slots past the last.

    The chunk-parallel kernels (kkt_solve, chunk_grads) read their chunk's row with one load
    instead of searching chunk_offsets. Zero-length sequences hold no chunk.
    """
    offsets = chunk_offsets_of(cu_seqlens, chunk)
    slot, seq = slot_sequences(offsets, slots)
    start = cu_seqlens[seq] + (slot - offsets[seq]) * chunk
    tokens = (cu_seqlens[seq + 1] - start).clamp_(0, chunk)
    return torch.stack((start, tokens), dim=1).to(torch.int32)


# the fields of a chunk_rows row: 16 bytes, one TMA box
ROW_FIELDS = 4


@cache_last(device_result=True)
def chunk_rows(cu_seqlens: torch.Tensor, chunk: int, slots: int) -> torch.Tensor:
    """[slots, ROW_FIELDS] int32: (first token, tokens, sequence, flags) of every global chunk, flags 1 where it is its
    sequence's first chunk, 2 where its last (3: both); zeros for slots past the last. What the packed walk
    (flash_qla.ops.fused_fwd_wide, PACKED) reads of each chunk it walks, one row through its ring."""
    offsets = chunk_offsets_of(cu_seqlens, chunk)
    slot, seq = slot_sequences(offsets, slots)
    inside = slot < offsets[-1]
    flags = (slot == offsets[seq]).int() + 2 * (slot + 1 == offsets[seq + 1]).int()
    rows = torch.stack((*chunk_table(cu_seqlens, chunk, slots).unbind(1), seq.int(), flags), dim=1)
    return torch.where(inside.view(-1, 1), rows, 0).to(torch.int32).contiguous()


@cache_last(device_result=True)
def chunk_tables(cu_seqlens: torch.Tensor, chunk: int, slots: int) -> tuple:
    """(chunk_offsets_of's, chunk_table's): what every forward and backward reads, in one lookup (each costs ~1 µs
    of host time on a call's path)."""
    return chunk_offsets_of(cu_seqlens, chunk), chunk_table(cu_seqlens, chunk, slots)


@cache_last(device_result=True)
def checkpoint_pieces(cu_seqlens: torch.Tensor, chunk: int, slots: int, every: int):
    """The pieces the backward's state recompute walks from a forward's checkpoints.

    A piece starts at each non-empty sequence's first chunk and at each global chunk
    m · every inside a sequence, and runs to the next such chunk (or its sequence's end).
    Returns, for P = N + slots // every pieces (an upper bound; those past the last are empty):
    bounds [P + 1] int32 (token offsets, as cu_seqlens), first_chunks [P + 1] int32 (each
    piece's first global chunk, as chunk_offsets) and rows [P] int64: the row of the
    checkpoint buffer (flash_qla.ops.forward.checkpoint_rows) that holds its start state,
    m for a piece at chunk m · every, slots // every + 1 + n for sequence n's first piece.
    """
    n_seqs = cu_seqlens.numel() - 1
    offsets = chunk_offsets_of(cu_seqlens, chunk)
    first_token = chunk_table(cu_seqlens, chunk, slots)[:, 0]
    j, seq = slot_sequences(offsets, slots)
    inside = j < offsets[-1]  # a chunk of some sequence
    seq_start = inside & (offsets[seq] == j)
    starts = seq_start | (inside & (j % every == 0))
    n_pieces = n_seqs + slots // every
    # piece index of each starting chunk; every other chunk lands in a spare last entry
    dest = torch.where(starts, torch.cumsum(starts, 0) - 1, n_pieces + 1)
    bounds = cu_seqlens[-1:].repeat(n_pieces + 2).scatter_(0, dest, first_token)[: n_pieces + 1]
    first_chunks = torch.zeros(n_pieces + 2, dtype=torch.int32, device=j.device).scatter_(0, dest, j)
    row = torch.where(seq_start, slots // every + 1 + seq, (j // every).long())
    rows = torch.zeros(n_pieces + 2, dtype=torch.int64, device=j.device).scatter_(0, dest, row)
    return bounds, first_chunks[: n_pieces + 1], rows[:n_pieces]


@cache_last(device_result=True)
def first_pieces(cu_seqlens: torch.Tensor, chunk: int, slots: int, every: int) -> torch.Tensor:
    """[N + 1] int32: the index of each sequence's first piece of checkpoint_pieces (a zero-length
    sequence has none: the next index), the number of non-empty pieces last. On the device, no sync."""
    bounds = checkpoint_pieces(cu_seqlens, chunk, slots, every)[0]
    # piece i starts at bounds[i] (those past the last at T): sequence n's first piece is the
    # first to start at or after its first token
    return torch.searchsorted(bounds[:-1], cu_seqlens, out_int32=True)


@cache_last(device_result=True)
def sequence_pieces(cu_seqlens: torch.Tensor, chunk: int, slots: int, every: int):
    """(first, last) [N] int32: the index of each sequence's first and last piece of checkpoint_pieces,
    to gather per-sequence states from per-piece ones (a zero-length sequence has none: an index in
    range whose row it does not use). On the device, no sync."""
    seq_pieces = first_pieces(cu_seqlens, chunk, slots, every)
    n = checkpoint_pieces(cu_seqlens, chunk, slots, every)[0].numel() - 1
    return seq_pieces[:-1].clamp(max=n - 1), (seq_pieces[1:] - 1).clamp_(min=0)


def piece_chunks(seqlens, chunk: int, every: int) -> list:
    """The chunk count of each non-empty piece of checkpoint_pieces, in order, from the sequence lengths (host
    ints): a sequence's first chunk starts one, and so does each global chunk m · every after it."""
    pieces, first = [], 0
    for n in seqlens:
        end = first + -(-n // chunk)
        while first < end:
            nxt = min(end, (first // every + 1) * every)
            pieces.append(nxt - first)
            first = nxt
    return pieces


def count_pieces(seqlens, chunk: int, every: int) -> int:
    """The number of non-empty pieces of checkpoint_pieces (piece_chunks')."""
    return len(piece_chunks(seqlens, chunk, every))


def sequence_groups(n_seqs: int, per_block: int, like: torch.Tensor) -> torch.Tensor:
    """[ceil(n_seqs / per_block) + 1] int32 on like's device: 0, per_block, 2 per_block, ..., n_seqs, the first sequence
    of each block of a walk that takes per_block sequences a block (the last block the rest). Built once per shape,
    device and stream (a key only: made on the stream that reads it, as tensor_cache's), afresh while a CUDA graph
    is being captured."""
    stream = stream_key(like)
    if stream is None:
        return _sequence_groups.__wrapped__(n_seqs, per_block, like.device, 0)
    return _sequence_groups(n_seqs, per_block, like.device, stream)


@functools.lru_cache(maxsize=64)
def _sequence_groups(n_seqs: int, per_block: int, device: torch.device, stream) -> torch.Tensor:
    with torch.inference_mode(False):  # a later call with a gradient may read it too
        firsts = torch.arange(0, n_seqs + per_block, per_block, dtype=torch.int32, device=device)
        return firsts.clamp_(max=n_seqs)
