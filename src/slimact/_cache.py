"""Memoised helpers that ``torch.compile`` traces without a warning, and entries that die with their tensor.

Dynamo does not run a ``functools`` cache: it traces the function under it and warns, once per call site, that
"silent incorrectness is a *potential* risk" (five such warnings met a user compiling a converted GPT-2). The caches
here hold pure functions of hashable constants (a frozen policy, a kind, a dtype), so tracing the function is right;
:func:`cache` calls it directly while compiling, as dynamo would, and through the cache otherwise.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, MutableMapping
from typing import Any, TypeVar

import torch

__all__ = ["cache", "dropping", "storage_key"]

_F = TypeVar("_F", bound=Callable[..., Any])


def cache(fn: _F | None = None, *, maxsize: int | None = None) -> Any:
    """``functools.lru_cache(maxsize)`` (unbounded by default) of ``fn``, bypassed while ``torch.compile`` traces or
    a ``TorchDispatchMode`` is on (``FakeTensorMode``: its results are no values to keep);
    used bare (``@cache``) or with ``maxsize`` (``@cache(maxsize=64)``). ``cache_clear`` clears it."""
    if fn is None:
        return functools.partial(cache, maxsize=maxsize)
    cached = functools.lru_cache(maxsize=maxsize)(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        # (nor kept while a dispatch mode is on: under FakeTensorMode the activations' tables were built as fake
        # tensors and kept, and every later converted model in the process got fake gradients, which optimizers
        # skip: its first layers never moved)
        if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
            return fn(*args, **kwargs)
        return cached(*args, **kwargs)

    call.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    return call


def dropping(t: object, table: MutableMapping, key: object) -> weakref.ref:
    """A weak reference to ``t`` whose death drops ``table[key]``: the entry a table keyed by a live tensor (its
    ``id``, its storage view) holds for it, gone with it before its key can name another."""
    return weakref.ref(t, lambda _ref: table.pop(key, None))


def storage_key(t: torch.Tensor) -> tuple:
    """Where ``t``'s elements are and how they are read: its device, storage address, offset, shape, strides and
    dtype. A table keyed by it (the shared packs, attention masks' bits) serves a view made anew of the same elements
    (transformers slices its mask per layer); its entry must check that its own tensor still sits there (a tensor's
    memory can be released while the tensor lives on, and the allocator gives the address to another)."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
