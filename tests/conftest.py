"""Test-session settings and shared fixtures."""

import sys

import pytest
import torch

# The CPU tests use tiny tensors: intra-op threads only add overhead, and on a busy machine
# their spin-waiting made the suite 20x slower.
torch.set_num_threads(1)


@pytest.fixture
def poisoned(monkeypatch):
    """Every output the kernels allocate (flash_qla.ops.buffers.new, new_like) starts as NaN, and no call
    reuses an earlier one's scratch buffers (flash_qla.ops.buffers.scratch): each is new and poisoned."""
    from flash_qla.ops import buffers

    def new(shape, dtype, like):
        return torch.full(shape, float("nan"), dtype=dtype, device=like.device)

    monkeypatch.setattr(buffers, "new", new)
    monkeypatch.setattr(buffers, "new_like", lambda x: new(x.shape, x.dtype, x))
    monkeypatch.setattr(buffers, "scratch", lambda specs, like: [new(shape, dtype, like) for shape, dtype in specs])


@pytest.fixture(autouse=True)
def fresh_plans():
    """Each test plans its forwards and backwards afresh: flash_qla.ops.forward.forward_plan and
    flash_qla.ops.backward.backward_plan remember a plan per shapes and options, and one made while an
    earlier test had swapped a planner function must not be reused. (Through sys.modules: a CPU test
    does not import the GPU orchestration, and TileLang with it, to clear nothing.)"""
    for module, plan in (("flash_qla.ops.forward", "forward_plan"), ("flash_qla.ops.backward", "backward_plan")):
        if module in sys.modules:
            getattr(sys.modules[module], plan).cache_clear()
