"""Matrix product of two activations (``q @ k^T``, ``probs @ v``) keeping both operands compressed.

Math: ``y = a @ b`` (``torch.matmul`` semantics for rank >= 2, batch dims broadcast);
``grad_a = grad_y @ b^T`` and ``grad_b = a^T @ grad_y``, each summed back over broadcast dims.

What it keeps: ``a`` (only if ``b`` needs a gradient) and ``b`` (only if ``a`` does), each at ``b`` bits
per element plus 8 bytes per scale group; rank-4 attention operands ``[B, H, T, D]`` are grouped per head
(heads' ranges differ by orders of magnitude). An operand that another layer keeps too (the softmax output
feeding ``probs @ v``) is packed once.

Error: each restored operand is within ``step/2`` of the original per element; tests assert SQNR >= 30 dB
for both gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimact.functional._saving import SlimFunction, load, save
from slimact.quant import QuantConfig, RunningRange, pack

__all__ = ["matmul"]


class _MatMulFunction(SlimFunction):
    layer = "MatMul"

    @staticmethod
    def forward(ctx, a, b, cfg_a, cfg_b, state_a, state_b):
        y = torch.matmul(a, b)
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        save(ctx, pack(a, cfg_a, state_a) if need_b else None, pack(b, cfg_b, state_b) if need_a else None)
        ctx.shapes = (a.shape, b.shape)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        a_hat, b_hat = load(ctx)
        a_shape, b_shape = ctx.shapes
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = _product(grad_y, b_hat.to(grad_y.dtype).transpose(-1, -2), a_shape)
        if ctx.needs_input_grad[1]:
            grad_b = _product(a_hat.to(grad_y.dtype).transpose(-1, -2), grad_y, b_shape)
        return grad_a, grad_b, None, None, None, None


def _product(x: Tensor, y: Tensor, shape: torch.Size) -> Tensor:
    """``x @ y`` summed over the batch dims the operand of ``shape`` was broadcast along.

    In fp16/bf16 a summed product is accumulated in fp32 and rounded once, as PyTorch's own matmul backward does
    (it folds the batch into one product): rounding each batch's product first, then summing them, drifted by
    several roundings where the batches cancel.
    """
    out = (*torch.broadcast_shapes(x.shape[:-2], y.shape[:-2]), x.shape[-2], y.shape[-1])
    if out == shape or x.dtype not in (torch.float16, torch.bfloat16):
        return x.matmul(y).sum_to_size(shape)
    return x.float().matmul(y.float()).sum_to_size(shape).to(x.dtype)


def matmul(
    a: Tensor,
    b: Tensor,
    cfg_a: QuantConfig,
    cfg_b: QuantConfig,
    state_a: RunningRange | None = None,
    state_b: RunningRange | None = None,
) -> Tensor:
    """``torch.matmul(a, b)`` keeping both operands compressed (rank >= 2; otherwise plain ``matmul``)."""
    if not torch.is_grad_enabled() or not (a.requires_grad or b.requires_grad) or a.dim() < 2 or b.dim() < 2:
        return torch.matmul(a, b)
    return _MatMulFunction.apply(a, b, cfg_a, cfg_b, state_a, state_b)
