"""``torch.gather`` keeping only its index (exact).

Math: ``y = gather(x, dim, index)``; ``grad_x = zeros(x.shape).scatter_add(dim, index, grad_y)``: the backward
needs the index and ``x``'s shape, never ``x``'s values. PyTorch's gather keeps ``x`` itself (its derivative
formula takes ``self``), which in DeBERTa-v2's disentangled attention is the full fp32 ``[B * H, T, 2 * span]``
content-to-position score tensor, twice per layer.

What it keeps: the index, as PyTorch does (an expanded index keeps its small storage). The forward is
``torch.gather`` and the gradient PyTorch's own ``gather_backward`` (dense), so both are exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimact.functional._saving import SlimFunction

__all__ = ["gather"]


class _GatherFunction(SlimFunction):
    layer = "gather"

    @staticmethod
    def forward(ctx, x, dim, index):
        ctx.dim, ctx.shape = dim, x.shape
        ctx.save_for_backward(index)
        return torch.gather(x, dim, index)

    @staticmethod
    def backward(ctx, grad_y):
        (index,) = ctx.saved_tensors
        return grad_y.new_zeros(ctx.shape).scatter_add(ctx.dim, index, grad_y), None, None


def gather(x: Tensor, dim: int, index: Tensor) -> Tensor:
    """``torch.gather(x, dim, index)`` keeping only ``index`` for the backward."""
    if not torch.is_grad_enabled() or not x.requires_grad:
        return torch.gather(x, dim, index)
    return _GatherFunction.apply(x, dim, index)
