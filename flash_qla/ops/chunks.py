"""The chunk tables derived from cu_seqlens, on the device (no host synchronisation).

Sequences are cut into chunks of C tokens, restarting at each sequence start. The kernels
index chunks globally (all sequences' chunks in order), over a grid of `slots` = T // C + N,
an upper bound of the number of chunks that the host knows without reading cu_seqlens.
All layers of a model step usually share one cu_seqlens tensor: both tables are built
once per tensor (flash_qla.tensor_cache).
"""

import torch

from flash_qla.tensor_cache import cache_last


@cache_last
def chunk_offsets_of(cu_seqlens: torch.Tensor, chunk: int) -> torch.Tensor:
    """[N+1] int32: index of each sequence's first chunk among all chunks (the walks' table)."""
    n_chunks = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk - 1) // chunk
    return torch.nn.functional.pad(torch.cumsum(n_chunks, 0), (1, 0)).to(torch.int32)


@cache_last
def chunk_table(cu_seqlens: torch.Tensor, chunk: int, slots: int) -> torch.Tensor:
    """[slots, 2] int32: (first token, tokens) of every global chunk; (_, 0) for slots past the last.

    The chunk-parallel kernels (kkt_solve, chunk_grads) read their chunk's row with one load
    instead of searching chunk_offsets. Zero-length sequences hold no chunk.
    """
    offsets = chunk_offsets_of(cu_seqlens, chunk)
    slot = torch.arange(slots, dtype=torch.int32, device=cu_seqlens.device)
    # the sequence of each chunk: the last n with offsets[n] <= slot (skips empty sequences);
    # slots past the last chunk land on the last sequence, past its end
    seq = torch.searchsorted(offsets, slot, right=True, out_int32=True).sub_(1).clamp_(0, offsets.numel() - 2).long()
    start = cu_seqlens[seq] + (slot - offsets[seq]) * chunk
    tokens = (cu_seqlens[seq + 1] - start).clamp_(0, chunk)
    return torch.stack((start, tokens), dim=1).to(torch.int32)
