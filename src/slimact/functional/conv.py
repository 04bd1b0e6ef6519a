"""Convolution (1-, 2- and 3-d; patch embeddings, convolutional stems) keeping its input compressed.

Math: ``y = conv(x, W) + b``; ``grad_x`` needs only ``W`` and ``grad_W`` needs ``x``: PyTorch's own
``convolution_backward`` computes both, from the restored ``x_hat``.

What it keeps: ``x`` at ``b`` bits per element plus 8 bytes per scale group (groups along the channel dim
of ``[N, C, ...]``), only if ``W`` needs a gradient; a frozen ``W`` needs only ``x``'s shape.

Error: ``grad_x`` is exact; ``grad_W`` uses ``x_hat`` (``step/2`` per element); tests assert SQNR >= 30 dB.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from slimact.functional._saving import SlimFunction, load, save
from slimact.quant import QuantConfig, RunningRange, pack

__all__ = ["conv"]


class _ConvFunction(SlimFunction):
    layer = "convolution"

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, fn, cfg, state):
        y = fn(x, weight, bias)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        save(ctx, pack(x, cfg, state) if need_w else None, weight if need_x else None)
        ctx.args = (stride, padding, dilation, groups)
        ctx.x_meta = (x.shape, x.dtype, x.device)
        ctx.weight_meta = weight.shape
        ctx.bias_sizes = list(bias.shape) if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_hat, weight = load(ctx)
        stride, padding, dilation, groups = ctx.args
        if x_hat is None:  # frozen weight: only x's shape is needed
            shape, dtype, device = ctx.x_meta
            x_hat = torch.empty(shape, dtype=dtype, device=device)
        if weight is None:
            weight = torch.empty(ctx.weight_meta, dtype=grad_y.dtype, device=grad_y.device)
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        dtype = grad_y.dtype
        # PyTorch's bf16 CPU convolution backward (torch 2.13) reads uninitialised memory: its weight gradient
        # changes from call to call on the same inputs, by up to 1e38, on about 2% of small 1-d to 3-d shapes
        # (tests/functional/test_conv.py). On the CPU a bf16 backward runs in fp32 and is rounded to bf16 once.
        work = torch.float32 if dtype == torch.bfloat16 and grad_y.device.type == "cpu" else dtype
        grads = torch.ops.aten.convolution_backward(
            grad_y.to(work), x_hat.to(work), weight.to(work), ctx.bias_sizes, stride, padding, dilation,
            False, [0] * len(stride), groups, mask,
        )
        grad_x, grad_w, grad_b = (None if t is None else t.to(dtype) for t in grads)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


def conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
    groups: int,
    cfg: QuantConfig,
    state: RunningRange | None = None,
    fn: Callable[[Tensor, Tensor, Tensor | None], Tensor] | None = None,
) -> Tensor:
    """A convolution with zero padding ``padding`` (ints) keeping ``x`` compressed for the backward.

    ``fn(x, weight, bias)`` computes the forward (default ``torch.convolution``; a module passes its own).
    """
    if fn is None:
        def fn(x, w, b):
            return torch.convolution(x, w, b, stride, padding, dilation, False, [0] * len(stride), groups)
    if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad):
        return fn(x, weight, bias)
    return _ConvFunction.apply(x, weight, bias, list(stride), list(padding), list(dilation), groups, fn, cfg, state)
