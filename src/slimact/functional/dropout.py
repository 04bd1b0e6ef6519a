"""Dropout keeping its mask as bits.

Math: ``y = x * m / (1 - p)`` with ``m ~ Bernoulli(1 - p)``; ``grad_x = grad_y * m / (1 - p)``. The
forward is PyTorch's ``native_dropout`` (same random draws, same output as ``F.dropout``).

What it keeps: the mask at 1 bit per element (exact), where PyTorch keeps a one-byte ``bool`` mask: 8x
less, and never the dropped output. Only in training; in eval mode dropout is the identity, as in PyTorch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimact.functional._saving import Mask, SlimFunction, load, save

__all__ = ["dropout"]


class _DropoutFunction(SlimFunction):
    layer = "dropout"
    routed = True  # its native_dropout is noted by the routing mode where it drops a routed softmax's output

    @staticmethod
    def forward(ctx, x, p):
        y, mask = torch.native_dropout(x, p, True)
        ctx.scale = 1.0 / (1.0 - p) if p < 1 else 0.0
        save(ctx, Mask.of(mask))
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (mask,) = load(ctx)
        return torch.ops.aten.native_dropout_backward(grad_y, mask, ctx.scale), None


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``F.dropout(x, p, training)`` keeping the mask as bits."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, got {p}")
    if not training or p == 0.0 or not torch.is_grad_enabled() or not x.requires_grad:
        return torch.nn.functional.dropout(x, p, training)
    return _DropoutFunction.apply(x, p)
