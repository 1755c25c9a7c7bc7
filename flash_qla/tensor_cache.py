"""A one-entry cache keyed on a tensor's identity and version, for work derived from cu_seqlens.

All layers of a model step usually share one cu_seqlens tensor: what is derived from it
(its validation, which reads it to the host, and the chunk tables) is then done once.
The version counter catches in-place edits by PyTorch ops (not those that bypass it: through .data,
.numpy() or DLPack, torch.distributed collectives, kernels writing through the pointer); the weak
reference lets the tensor go.
A tensor made under torch.inference_mode has no version counter: work on it is not cached
(done again on every call, a read to the host included); what is cached is made as a normal tensor
even under inference_mode (a later call with a gradient may save it for its backward).
"""

import functools
import weakref

import torch


def cache_last(fn=None, *, device_result=False):
    """Decorate fn(tensor, *args): repeat calls with the same, unmodified tensor and args reuse the result.

    device_result: fn returns device tensors that kernels read. Such a result is kept per stream (it is
    reused on the stream it was made on: when the next result replaces it, the allocator reuses its memory
    in that stream's order, after the kernels that read it), and while a CUDA graph is being captured a
    call neither takes the cached result nor leaves its own: the graph then reads tables of its own, from
    its memory pool and alive as long as it is, not cached ones that the next call with another tensor
    would free under it (and no later eager call reads tables that the graph fills only when it replays).
    """
    if fn is None:
        return functools.partial(cache_last, device_result=device_result)
    last = {"key": None, "ref": lambda: None, "result": None}

    @functools.wraps(fn)
    def wrapper(tensor, *args):
        if tensor.is_inference():
            return fn(tensor, *args)
        stream = stream_key(tensor) if device_result else 0
        if stream is None:
            return fn(tensor, *args)
        key = (id(tensor), tensor._version, args, stream)
        if last["ref"]() is tensor and last["key"] == key:
            return last["result"]
        with torch.inference_mode(False):  # a result kept for later calls is a normal tensor, whatever mode this one
            result = fn(tensor, *args)
        last.update(key=key, ref=weakref.ref(tensor), result=result)
        return result

    return wrapper


def stream_key(tensor):
    """The current stream of a CUDA tensor's device (its raw handle: torch.cuda.current_stream() costs ~5 µs),
    None while a CUDA graph is being captured there; 0 for a CPU tensor."""
    if not tensor.is_cuda:
        return 0
    if torch.cuda.is_current_stream_capturing():
        return None
    return torch._C._cuda_getCurrentRawStream(tensor.device.index)
