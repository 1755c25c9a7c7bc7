"""Architecture dispatch: the device's compute capability -> a kernel profile.

One table maps the major/minor compute capability to a frozen :class:`ArchProfile`
that every kernel stage reads (chunk size, threads, pipeline depth, TileLang
target). Detection happens at call time, never at import; ahead-of-time compilation
names a profile instead (``profile_by_name``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ArchProfile:
    """Kernel configuration shared by all stages on one architecture."""

    name: str  # short name used on the command line, e.g. "sm90"
    arch: str  # TileLang/NVCC arch, e.g. "sm_90a"
    chunk: int  # tokens per chunk (C)
    threads: int  # threads per block of the chunk-parallel stages
    fused_threads: int  # consumer threads of fused_fwd / fused_bwd (the wide walks: a warpgroup per 64 columns)
    grads_threads: int  # threads per block of the chunk-parallel backward (chunk_grads)
    kkt_blocks_per_sm: int  # kkt_solve blocks kept resident per SM (caps its registers)
    num_stages: int  # depth of the shared-memory ring in the fused kernels
    num_sms: int  # multiprocessors of the reference part (V-tile choice)
    max_shared_memory: int  # bytes of shared memory one block may opt in to
    checkpoint_chunks: int  # chunks between the states a training forward keeps (flash_qla.ops.backward)

    @property
    def target(self) -> dict:
        """The TileLang target: built identically here and in precompile."""
        return {"kind": "cuda", "arch": self.arch}


SM90 = ArchProfile(
    name="sm90",
    arch="sm_90a",
    chunk=64,
    threads=128,
    # One consumer warpgroup at every V-tile width: two (N = BV / 2 each) read every A operand
    # (q, k, A, P tiles) twice from shared memory, the walks' bound; at BV = 64 one is 12 %
    # faster (fused_fwd 16/32 8x4096 0.528 -> 0.465 ms, benchmark/NOTES.md v7 step 1).
    fused_threads=128,
    grads_threads=256,
    kkt_blocks_per_sm=5,  # <= 102 registers a thread (at 6, 80 registers, ptxas spills: 19 % slower)
    num_stages=2,
    num_sms=132,
    max_shared_memory=227 * 1024,
    # 2048 tokens: a single sequence of 32768 splits into 16 pieces for the state recompute,
    # 16 x Hv (sequence piece, head) pairs, which fill the SMs at 8 heads and more
    checkpoint_chunks=32,
)

# compute capability -> profile; SM100 / SM120 are added here as new profiles.
PROFILES = {(9, 0): SM90}
BY_NAME = {p.name: p for p in PROFILES.values()}


def profile_by_name(name: str) -> ArchProfile:
    if name not in BY_NAME:
        raise ValueError(f"unknown arch {name!r}: expected one of {sorted(BY_NAME)}")
    return BY_NAME[name]


def unsupported_reason(device: torch.device) -> str | None:
    """Why the kernels cannot run on ``device``, or None when they can."""
    if device.type != "cuda":
        return f"kernels need a CUDA device, got {device.type!r}"
    cap = _capability(device)
    if cap not in PROFILES:
        supported = ", ".join(f"sm_{a}{b}" for a, b in PROFILES)
        return (
            f"no flash_qla kernels for compute capability {cap[0]}.{cap[1]} (supported: {supported}); "
            "called through flash-linear-attention, which forwards to flash_qla on SM90, SM100 and SM120, "
            "set FLA_FLASH_QLA=0 to keep FLA's own kernels"
        )
    return None


_profile_of: dict = {}  # torch.device with an index -> its profile, once found (every call asks)


def get_profile(device: torch.device) -> ArchProfile:
    """The profile for ``device``; raises RuntimeError naming the capability if unsupported."""
    profile = _profile_of.get(device)
    if profile is None:
        reason = unsupported_reason(device)
        if reason is not None:
            raise RuntimeError(reason)
        profile = PROFILES[_capability(device)]
        if device.index is not None:  # "cuda" alone means the current device, which may change
            _profile_of[device] = profile
    return profile


def _capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device, read once per device (it is on every call's path)."""
    return _capability_of_index(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _capability_of_index(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def multiprocessors(device: torch.device) -> int:
    """The SMs of a CUDA device (persistent kernels launch one block each), read once per device."""
    return _multiprocessors_of_index(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _multiprocessors_of_index(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
