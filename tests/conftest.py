"""Test-session settings and shared fixtures."""

import pytest
import torch

# The CPU tests use tiny tensors: intra-op threads only add overhead, and on a busy machine
# their spin-waiting made the suite 20x slower.
torch.set_num_threads(1)


@pytest.fixture
def poisoned(monkeypatch):
    """Every output the kernels allocate (flash_qla.ops.buffers.new) starts as NaN."""
    from flash_qla.ops import buffers

    def new(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(buffers, "new", new)
