"""Calling a compiled TileLang kernel with the least host work.

A JITKernel's `__call__` goes through TileLang's torch adapter, which rebuilds the argument
list and looks for outputs to allocate on every launch. Our kernels allocate nothing (every
output is passed in), so the adapter's work is pure overhead: calling the TVM-FFI
executable directly launches the same kernel on the current stream with the same argument
checks (dtype, shape, device, contiguity), 2-4 µs sooner per launch on the H200's host
(benchmark/NOTES.md).
"""

import contextlib
import functools

import torch

_NOTHING = contextlib.nullcontext()


def on_device(device: torch.device):
    """A context that makes device current for the launches: torch.cuda.device(device), or nothing
    to enter when it is current already (the usual case; ~1.5 µs of host time less)."""
    return _NOTHING if device.index == torch.cuda.current_device() else torch.cuda.device(device)


@functools.lru_cache(maxsize=None)
def executable(kernel):
    """The TVM-FFI callable of a compiled kernel: executable(kernel)(*args) == kernel(*args)."""
    assert not kernel.adapter.result_idx, "kernels of this library take every output as an argument"
    return kernel.adapter.get_exportable_executable()
