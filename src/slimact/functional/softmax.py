"""Softmax keeping only its output, compressed.

Math: ``y = softmax(x, dim)``; ``grad_x = y * (grad_y - sum(grad_y * y, dim))`` needs only ``y``.

What it keeps: ``y`` at ``b`` bits per element plus 8 bytes per scale group. An attention map
``[B, H, T, T]`` is grouped per head. When the next layer keeps the same ``y`` (``probs @ v`` through a
slimact MatMul with the same config), both keep one packed copy (Mesa kept the map three times).

Error: ``|y - y_hat| <= step/2`` with ``step = max_g(y) / 255`` (softmax outputs lie in [0, 1]); the
backward is PyTorch's own softmax backward evaluated at ``y_hat``; tests assert SQNR >= 30 dB.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimact.functional._saving import load, save
from slimact.quant import QuantConfig, RunningRange, pack

__all__ = ["softmax"]


class _SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, cfg, state):
        y = torch.softmax(x, dim)
        ctx.dim, ctx.in_dtype = dim, x.dtype
        save(ctx, pack(y, cfg, state))
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (y_hat,) = load(ctx)
        return torch._softmax_backward_data(grad_y, y_hat, ctx.dim, ctx.in_dtype), None, None, None


def softmax(x: Tensor, dim: int, cfg: QuantConfig, state: RunningRange | None = None) -> Tensor:
    """``torch.softmax(x, dim)`` keeping its output compressed for the backward."""
    if not torch.is_grad_enabled() or not x.requires_grad:
        return torch.softmax(x, dim)
    return _SoftmaxFunction.apply(x, dim, cfg, state)
