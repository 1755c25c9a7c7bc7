"""Input checks for the public API: each failure names the argument, what was expected and what came.

Only seqlens_of reads tensor values (cu_seqlens, to the host: a device sync on GPU), and
it remembers the last tensor it passed, so the layers of one step that share a cu_seqlens
tensor pay that sync once; every other check looks at shapes, dtypes and devices only (check_shapes
without values: what a call that torch.compile traces can check, flash_qla.api's operator), and
check_inputs remembers the last arguments it passed by those (their signature): the layers of
a step repeat them, and the checks cost more host time than the signature (~13 against ~4 µs
on the H200's host, benchmark/NOTES.md v25).
"""

import math
import numbers

import torch

from flash_qla.reference.chunked import CHUNK_SIZE
from flash_qla.tensor_cache import cache_last

QKV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
CU_SEQLENS_DTYPES = (torch.int32, torch.int64)


def _check_tensor(name, x, layout):
    """x is a tensor of len(layout) dims, layout like ("B", "T", "Hv")."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != len(layout):
        raise ValueError(f"{name}: expected {len(layout)} dims [{', '.join(layout)}], got shape {tuple(x.shape)}")


def _check_shape(name, x, layout, expected):
    if tuple(x.shape) != tuple(expected):
        raise ValueError(
            f"{name}: expected shape [{', '.join(layout)}] = {tuple(expected)}, got {tuple(x.shape)}"
        )


def _check_float(name, x):
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point dtype, got {x.dtype}")


def _check_device(name, x, device):
    if x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of q), got {x.device}")


def _signature(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first):
    """Everything check_inputs reads but cu_seqlens' values: each tensor's shape, dtype and device,
    scale and its type, state_v_first; None when a tensor argument is not a torch.Tensor."""
    parts = [type(scale), scale, state_v_first]
    for x in (q, k, v, g, beta, initial_state, cu_seqlens):
        if isinstance(x, torch.Tensor):
            parts.append((x.shape, x.dtype, x.device))
        elif x is None:
            parts.append(None)
        else:
            return None
    return parts


_passed = {"signature": None}  # the signature of the last arguments check_inputs passed


def check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first) -> tuple:
    """Check the inputs every entry point shares; g may be the raw gate or g_cum.

    Returns the sequence lengths as host ints: cu_seqlens' (seqlens_of), or B of T."""
    signature = _signature(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
    if signature is None or signature != _passed["signature"]:  # else the same checks passed last time
        check_shapes(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
        _passed["signature"] = signature
    B, T = q.shape[:2]
    return (T,) * B if cu_seqlens is None else seqlens_of(cu_seqlens, T)  # values: remembered per tensor


def check_shapes(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, values=True):
    """check_inputs' checks: types, shapes, dtypes, devices and, with values, cu_seqlens' values (before the
    initial state's shape, which follows their count: a bad cu_seqlens is named as the cause). Without values
    it reads nothing, for a call that torch.compile traces (flash_qla.api's operator)."""
    _check_tensor("q", q, ("B", "T", "Hqk", "K"))
    _check_tensor("k", k, ("B", "T", "Hqk", "K"))
    _check_tensor("v", v, ("B", "T", "Hv", "V"))
    _check_tensor("g", g, ("B", "T", "Hv"))
    _check_tensor("beta", beta, ("B", "T", "Hv"))

    if q.dtype not in QKV_DTYPES:
        raise TypeError(f"q: expected one of {', '.join(map(str, QKV_DTYPES))}, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected the dtype of q, {q.dtype}, got {x.dtype}")
    _check_float("g", g)
    _check_float("beta", beta)

    B, T, Hqk, K = q.shape
    Hv, V = v.shape[2:]
    for name, x in (("q", q), ("v", v)):
        if 0 in x.shape:
            raise ValueError(f"{name}: expected no empty dimension, got shape {tuple(x.shape)}")
    _check_shape("k", k, ("B", "T", "Hqk", "K"), q.shape)
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v: expected [B, T] = {tuple(q.shape[:2])} as in q, got shape {tuple(v.shape)}")
    if Hv % Hqk != 0:
        raise ValueError(f"v: expected a head count Hv divisible by Hqk = {Hqk} (q's heads), got Hv = {Hv}")
    _check_shape("g", g, ("B", "T", "Hv"), (B, T, Hv))
    _check_shape("beta", beta, ("B", "T", "Hv"), (B, T, Hv))
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_device(name, x, q.device)

    if scale is not None:  # a Python or NumPy number (numbers.Real), not a bool or a tensor
        if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
            raise TypeError(f"scale: expected None or a float, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"scale: expected a finite value, got {scale}")

    N = B
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, q)
        if values:
            seqlens_of(cu_seqlens, T)
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        check_state("initial_state", initial_state, q, N, Hv, K, V, state_v_first)


def check_cu_seqlens(cu_seqlens, q):
    """cu_seqlens [N + 1] int32/int64 on q's device, B == 1; its values: seqlens_of."""
    _check_tensor("cu_seqlens", cu_seqlens, ("N + 1",))
    if cu_seqlens.dtype not in CU_SEQLENS_DTYPES:
        raise TypeError(f"cu_seqlens: expected int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected at least 2 entries [0, ..., T], got {cu_seqlens.numel()}")
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens: expected batch size B == 1 with packed sequences, got B = {q.shape[0]}")
    _check_device("cu_seqlens", cu_seqlens, q.device)


@cache_last
def seqlens_of(cu_seqlens, T):
    """The sequence lengths (a tuple) of a valid cu_seqlens for T tokens, 0 = c_0 <= c_1 <= ... <= c_N = T; raises
    a ValueError naming cu_seqlens otherwise. Reads the values to the host (a device sync on GPU) unless this very
    tensor, unmodified, passed last time against the same T."""
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != T or any(b < a for a, b in zip(bounds, bounds[1:])):
        shown = ", ".join(map(str, bounds[:16])) + (", ..." if len(bounds) > 16 else "")
        raise ValueError(f"cu_seqlens: expected non-decreasing values from 0 to T = {T}, got [{shown}]")
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def check_state(name, state, q, N, Hv, K, V, state_v_first):
    """A state [N, Hv, K, V] ([N, Hv, V, K] if state_v_first), floating point, on q's device."""
    layout = ("N", "Hv", "V", "K") if state_v_first else ("N", "Hv", "K", "V")
    _check_tensor(name, state, layout)
    _check_float(name, state)
    _check_shape(name, state, layout, (N, Hv, V, K) if state_v_first else (N, Hv, K, V))
    _check_device(name, state, q.device)


def check_backward_inputs(q, v, A, do, dht, cu_seqlens, state_v_first):
    """Check what the backward takes beyond check_inputs: A, do and dht."""
    B, T, Hv, V = v.shape
    K = q.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    for name, x, layout, shape in (
        ("A", A, ("B", "T", "Hv", "64"), (B, T, Hv, CHUNK_SIZE)),
        ("do", do, ("B", "T", "Hv", "V"), (B, T, Hv, V)),
    ):
        _check_tensor(name, x, layout)
        _check_float(name, x)
        _check_shape(name, x, layout, shape)
        _check_device(name, x, q.device)
    if dht is not None:
        check_state("dht", dht, q, N, Hv, K, V, state_v_first)


def check_options(head_first):
    """Options of the high-level call that this library does not support."""
    if head_first:
        raise ValueError("head_first: expected False ([B, T, H, D] inputs), got True; transpose the inputs instead")
