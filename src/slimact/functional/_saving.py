"""How slimact Functions keep tensors: everything through ``ctx.save_for_backward``, metadata on ``ctx``.

``save(ctx, *items)`` takes, in order, :class:`~slimact.quant.Packed` tensors (their codes and scales are
saved), :class:`Mask` bit masks, plain tensors (exact statistics such as a norm's mean and rstd, or a
weight), and ``None``; ``load(ctx)`` gives them back in the same order, packed ones restored to their
shape and dtype and masks to booleans. Keeping every tensor in ``save_for_backward`` means
``saved_tensors_hooks`` (the profiler, CPU offloading) and checkpointing see all of them.

A Function that computes gradients during its forward (the LM loss) saves them as :class:`Gradient` items,
so that :func:`slimact.profile` reports them apart from activations (:func:`is_gradient`).
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
from torch import Tensor

from slimact.quant import Packed, pack_mask, unpack, unpack_mask

__all__ = ["Gradient", "Mask", "is_gradient", "load", "save"]


class Mask(NamedTuple):
    """A boolean tensor kept as bits, 8 per byte."""

    bits: Tensor
    shape: torch.Size

    @classmethod
    def of(cls, mask: Tensor) -> Mask:
        return cls(pack_mask(mask), mask.shape)


class Gradient(NamedTuple):
    """A gradient computed ahead, in the forward, and kept until the backward hands it on (scaled)."""

    tensor: Tensor


# id -> weak reference, dropped with the tensor (a WeakSet would compare tensors with ``==``).
_gradients: dict[int, weakref.ref] = {}


def _mark_gradient(t: Tensor) -> None:
    key = id(t)
    _gradients[key] = weakref.ref(t, lambda _r, key=key: _gradients.pop(key, None))


def is_gradient(t: Tensor) -> bool:
    """Whether ``t`` was saved as a :class:`Gradient` (a gradient computed ahead, not an activation)."""
    ref = _gradients.get(id(t))
    return ref is not None and ref() is t


def save(ctx: Any, *items: Packed | Mask | Gradient | Tensor | None) -> None:
    flat: list[Tensor | None] = []
    layout: list[tuple[str, int, Any]] = []
    for item in items:
        if isinstance(item, Packed):
            flat.extend(item.tensors)
            layout.append(("packed", len(item.tensors), item.meta))
        elif isinstance(item, Mask):
            flat.append(item.bits)
            layout.append(("mask", 1, item.shape))
        elif isinstance(item, Gradient):
            _mark_gradient(item.tensor)
            flat.append(item.tensor)
            layout.append(("tensor", 1, None))
        else:
            flat.append(item)
            layout.append(("tensor", 1, None))
    ctx.save_for_backward(*flat)
    ctx.slimact_layout = layout


def load(ctx: Any, restore: bool = True) -> list[Any]:
    """The items :func:`save` kept, in order; with ``restore=False`` packed ones stay :class:`Packed` (for a
    backward that restores them inside its own loop: :func:`slimact.quant.unpack_map`)."""
    saved = ctx.saved_tensors
    out: list[Any] = []
    i = 0
    for kind, n, meta in ctx.slimact_layout:
        if kind == "packed":
            packed = Packed(tuple(saved[i : i + n]), meta)
            out.append(unpack(packed) if restore else packed)
        elif kind == "mask":
            out.append(unpack_mask(saved[i], meta))
        else:
            out.append(saved[i])
        i += n
    return out
