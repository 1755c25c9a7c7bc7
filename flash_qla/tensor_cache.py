"""A one-entry cache keyed on a tensor's identity and version, for work derived from cu_seqlens.

All layers of a model step usually share one cu_seqlens tensor: what is derived from it
(its validation, which reads it to the host, and the chunk tables) is then done once.
The version counter catches in-place edits; the weak reference lets the tensor go.
A tensor made under torch.inference_mode has no version counter: work on it is not cached
(done again on every call, a read to the host included).
"""

import functools
import weakref

import torch


def cache_last(fn=None, *, device_result=False):
    """Decorate fn(tensor, *args): repeat calls with the same, unmodified tensor and args reuse the result.

    device_result: fn returns device tensors that kernels read. While a CUDA graph is being captured such a
    call neither takes the cached result nor leaves its own: the graph then reads tables of its own, from
    its memory pool and alive as long as it is, not the cached ones, which the next call with another
    tensor would free under it (and a later eager call does not read tables that the graph fills only
    when it replays).
    """
    if fn is None:
        return functools.partial(cache_last, device_result=device_result)
    last = {"key": None, "ref": lambda: None, "result": None}

    @functools.wraps(fn)
    def wrapper(tensor, *args):
        if tensor.is_inference() or (device_result and _capturing(tensor)):
            return fn(tensor, *args)
        key = (id(tensor), tensor._version, args)
        if last["ref"]() is tensor and last["key"] == key:
            return last["result"]
        result = fn(tensor, *args)
        last.update(key=key, ref=weakref.ref(tensor), result=result)
        return result

    return wrapper


def _capturing(tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of a CUDA tensor's device."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()
