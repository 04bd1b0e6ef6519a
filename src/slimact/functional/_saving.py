"""How slimact Functions keep tensors: everything through ``ctx.save_for_backward``, metadata on ``ctx``.

``save(ctx, *items)`` takes, in order, :class:`~slimact.quant.Packed` tensors (their codes and scales are
saved), :class:`Mask` bit masks, plain tensors (exact statistics such as a norm's mean and rstd, or a
weight), and ``None``; ``load(ctx)`` gives them back in the same order, packed ones restored to their
shape and dtype and masks to booleans. Keeping every tensor in ``save_for_backward`` means
``saved_tensors_hooks`` (the profiler, CPU offloading) and checkpointing see all of them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from slimact.quant import Packed, pack_mask, unpack, unpack_mask

__all__ = ["Mask", "load", "save"]


class Mask(NamedTuple):
    """A boolean tensor kept as bits, 8 per byte."""

    bits: Tensor
    shape: torch.Size

    @classmethod
    def of(cls, mask: Tensor) -> Mask:
        return cls(pack_mask(mask), mask.shape)


def save(ctx: Any, *items: Packed | Mask | Tensor | None) -> None:
    flat: list[Tensor | None] = []
    layout: list[tuple[str, int, Any]] = []
    for item in items:
        if isinstance(item, Packed):
            flat.extend(item.tensors)
            layout.append(("packed", len(item.tensors), item.meta))
        elif isinstance(item, Mask):
            flat.append(item.bits)
            layout.append(("mask", 1, item.shape))
        else:
            flat.append(item)
            layout.append(("tensor", 1, None))
    ctx.save_for_backward(*flat)
    ctx.slimact_layout = layout


def load(ctx: Any) -> list[Any]:
    saved = ctx.saved_tensors
    out: list[Any] = []
    i = 0
    for kind, n, meta in ctx.slimact_layout:
        if kind == "packed":
            out.append(unpack(Packed(tuple(saved[i : i + n]), meta)))
        elif kind == "mask":
            out.append(unpack_mask(saved[i], meta))
        else:
            out.append(saved[i])
        i += n
    return out
