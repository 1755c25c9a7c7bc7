"""A one-entry cache keyed on a tensor's identity and version, for work derived from cu_seqlens.

All layers of a model step usually share one cu_seqlens tensor: what is derived from it
(its validation, which reads it to the host, and the chunk table) is then done once.
The version counter catches in-place edits; the weak reference lets the tensor go.
"""

import functools
import weakref


def cache_last(fn):
    """Decorate fn(tensor, *args): repeat calls with the same, unmodified tensor and args reuse the result."""
    last = {"key": None, "ref": lambda: None, "result": None}

    @functools.wraps(fn)
    def wrapper(tensor, *args):
        key = (id(tensor), tensor._version, args)
        if last["ref"]() is tensor and last["key"] == key:
            return last["result"]
        result = fn(tensor, *args)
        last.update(key=key, ref=weakref.ref(tensor), result=result)
        return result

    return wrapper
