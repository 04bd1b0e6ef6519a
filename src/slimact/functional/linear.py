"""Linear (and Hugging Face's ``Conv1D``) with a compressed saved input.

Math: ``y = x W^T + b`` with ``x: [..., in]``, ``W: [out, in]`` (``Conv1D`` stores ``W^T: [in, out]``;
``transposed=True``). The forward is PyTorch's own, exact. The backward needs::

    grad_x = grad_y W              # needs W (a parameter: nothing extra kept)
    grad_W = grad_y^T x            # needs x: kept as b-bit codes, restored to x_hat
    grad_b = sum(grad_y)

What it keeps: ``x`` packed by :func:`slimact.quant.pack` (1 byte per element at 8 bits, instead of 4 in
fp32 or 2 in bf16, plus 8 bytes per scale group; shared with any other layer that keeps the same ``x``)
and a reference to ``W``. ``x`` is packed only if ``W`` needs a gradient; ``W`` is kept only if ``x``
needs one (a frozen weight needs no saved input).

Under autocast both backward products run in the forward's dtype (bf16/fp16), as PyTorch's do; the weight
gradient comes back in that dtype and autograd casts it to the weight's.

Error: ``grad_x`` is exact. ``grad_W`` uses ``x_hat`` with ``|x - x_hat| <= step/2`` per element
(round-to-nearest; ``< step`` and unbiased with stochastic rounding), ``step = range_g / 255`` for the
element's channel group; the tests assert SQNR >= 30 dB against the exact ``grad_W``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from slimact.functional._saving import SlimFunction, foreign_weight, load, save
from slimact.quant import QuantConfig, RunningRange, pack, reference

__all__ = ["linear"]


def _viewed(x: Tensor) -> tuple[list[int], list[int]] | None:
    """Where ``x`` is a permuted view of contiguous memory with its last dim last, the permutations to that memory's
    layout and back (:func:`slimact.quant.reference.memory_permutation`); else ``None``."""
    found = reference.memory_permutation(x)
    return found if found is not None and found[0][-1] == x.dim() - 1 else None


class _LinearFunction(SlimFunction):
    layer = "Linear"

    @staticmethod
    def forward(ctx, x, weight, bias, cfg, state, transposed):
        y = F.linear(x, weight.t() if transposed else weight, bias)
        need_x_grad, need_w_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # A permuted view (nn.MultiheadAttention projects a batch-first input through its [T, B, E] view) is packed
        # as laid out, the tensor it views: one pack with the layer that keeps that tensor (a LayerNorm's output).
        # The channel groups are along the last dim either way.
        viewed = _viewed(x) if need_w_grad else None
        kept, ctx.back = (x, None) if viewed is None else (x.permute(viewed[0]), viewed[1])
        save(ctx, pack(kept, cfg, state) if need_w_grad else None, weight if need_x_grad else None)
        ctx.transposed = transposed
        ctx.has_bias = bias is not None
        # The dtype the product ran in (autocast's: bf16 for an fp32 x, such as a LayerNorm's output): the
        # backward's products run in it too, as PyTorch's do (its weight gradient is the product of the
        # autocast copies; an fp32 x_hat made it an fp32 SIMT GEMM on an H200: 40 of GPT-2's 191 ms int8 step).
        ctx.compute_dtype = y.dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_hat, weight = load(ctx)
        if ctx.back is not None:  # the view the forward was given
            x_hat = x_hat.permute(ctx.back)
        grad_x = grad_w = grad_b = None
        out_features = grad_y.shape[-1]
        rows = grad_y.shape[:-1].numel()  # (not -1 in the reshapes: ambiguous for 0 in or out features)
        if ctx.needs_input_grad[0]:
            w = weight.t() if ctx.transposed else weight  # [out, in]
            grad_x = grad_y.matmul(w.to(grad_y.dtype))
        if ctx.needs_input_grad[1]:
            dtype = ctx.compute_dtype
            x2 = x_hat.reshape(rows, x_hat.shape[-1]).to(dtype)  # [N, in]
            g2 = grad_y.reshape(rows, out_features).to(dtype)  # [N, out]
            grad_w = x2.t().matmul(g2) if ctx.transposed else g2.t().matmul(x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_y.reshape(rows, out_features).sum(0)
        return grad_x, grad_w, grad_b, None, None, None


def linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    cfg: QuantConfig,
    state: RunningRange | None = None,
    *,
    transposed: bool = False,
) -> Tensor:
    """``F.linear`` whose saved input is compressed with ``cfg``.

    Falls back to ``F.linear`` (PyTorch's own saving) where compression has nothing to do: gradients off
    (``no_grad``/``inference_mode``), or neither ``x`` nor ``weight`` requiring grad; and where the weight is a
    tensor subclass (:func:`~slimact.functional._saving.foreign_weight`), which ``F.linear`` reaches as its class
    implements it (torchao's quantised weights implement ``F.linear``, not the ``matmul`` this backward would call: a
    NotImplementedError where PyTorch trained, LoRA over an int8 weight-only base). (Not for every frozen weight:
    under autocast, ``F.linear`` keeps the weight's low-precision cast, where this Function keeps the weight itself.)

    Args:
        x: ``[..., in]``.
        weight: ``[out, in]``, or ``[in, out]`` with ``transposed=True`` (Hugging Face ``Conv1D``).
        bias: ``[out]`` or ``None``.
        cfg: how the input is compressed.
        state: the running estimate when ``cfg.scale == "running"``.
    """
    if (not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad)
            or foreign_weight(weight) is not None):
        return F.linear(x, weight.t() if transposed else weight, bias)
    return _LinearFunction.apply(x, weight, bias, cfg, state, transposed)
