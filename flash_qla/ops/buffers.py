"""Output buffers of the kernels: one allocation point, so tests can poison every output."""

import torch


def new(shape, dtype, device) -> torch.Tensor:
    """Allocate a buffer the kernels write in full (tests swap this for a NaN-poisoned fill)."""
    return torch.empty(shape, dtype=dtype, device=device)


_placeholders: dict = {}


def placeholder(device: torch.device, Hv: int, K: int, V: int) -> torch.Tensor:
    """A state-shaped buffer passed where a kernel flag says the tensor is neither read nor written."""
    key = (device, Hv, K, V)
    if key not in _placeholders:
        _placeholders[key] = torch.empty(1, Hv, K, V, dtype=torch.float32, device=device)
    return _placeholders[key]
