"""Grouped matrix product of mixture-of-experts layers with a compressed saved input.

Math: ``y = grouped_mm(x, W, offs)`` with ``x: [S, K]`` the tokens routed to the experts, sorted by expert,
``W: [E, K, N]`` one matrix per expert, ``offs: [E]`` the cumulative row counts (rows ``offs[e-1]:offs[e]`` of ``x``
go to expert ``e``): ``y[rows_e] = x[rows_e] @ W[e]``. This is what Hugging Face's experts (Mixtral, Qwen-MoE,
OLMoE, DeepSeek, ... under ``config._experts_implementation = "grouped_mm"``, the default) compute for their up and
down projections, through ``torch._grouped_mm`` or transformers' ``grouped_mm_fallback`` op. The backward::

    grad_x = grouped_mm(grad_y, W^T, offs)           # needs W (a parameter: nothing extra kept)
    grad_W[e] = x[rows_e]^T @ grad_y[rows_e]         # needs x: kept as b-bit codes, restored to x_hat

What it keeps: ``x`` packed by :func:`slimact.quant.pack` (1 byte per element at 8 bits instead of 4 in fp32 or 2 in
bf16, plus 8 bytes per scale group), ``offs``, and a reference to ``W``; ``x`` only if ``W`` needs a gradient, ``W``
only if ``x`` needs one. PyTorch keeps ``x`` as it is: for the up projection the hidden states repeated once per
expert a token is routed to (``S = tokens * top_k``), for the down projection the gated ``[S, intermediate]``
activation.

The forward is the op the model called (PyTorch's ``torch._grouped_mm``, or transformers' fallback), so the routed
call's output is bit for bit the model's; the backward's products are the same op (the weight gradient through
``torch._grouped_mm``'s ragged-``K`` form where the model used it, else one ``mm`` per expert, as transformers'
fallback backward).

Error: ``grad_x`` is exact. ``grad_W`` uses ``x_hat`` with ``|x - x_hat| <= step/2`` per element, ``step =
range_g / 255`` for the element's channel group; the tests assert SQNR >= 30 dB against the exact ``grad_W``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from slimact.functional._saving import SlimFunction, load, save
from slimact.quant import QuantConfig, pack

__all__ = ["grouped_mm"]


def _weight_grad(native: bool, x: Tensor, grad: Tensor, offs: Tensor, experts: int) -> Tensor:
    """``[E, K, N]``: ``x[rows_e]^T @ grad[rows_e]`` for each expert ``e`` (zero for an expert with no rows)."""
    if native:
        return torch._grouped_mm(x.t(), grad, offs=offs)
    out = torch.zeros(experts, x.shape[1], grad.shape[1], dtype=grad.dtype, device=grad.device)
    start = 0
    for e, end in enumerate(offs.tolist()):  # (one host read for all the experts)
        if end > start:
            torch.mm(x[start:end].t(), grad[start:end], out=out[e])
        start = end
    return out


class _GroupedMM(SlimFunction):
    layer = "grouped matmul (experts)"

    @staticmethod
    def forward(ctx, x, weight, offs, cfg, op):
        y = op(x, weight, offs=offs)
        need_x_grad, need_w_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        save(ctx, pack(x, cfg) if need_w_grad else None, weight if need_x_grad else None, offs)
        ctx.op, ctx.experts = op, weight.shape[0]
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_hat, weight, offs = load(ctx)
        grad_y = grad_y.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = ctx.op(grad_y, weight.transpose(-2, -1), offs=offs)
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(ctx.op is torch._grouped_mm, x_hat.to(grad_y.dtype), grad_y, offs, ctx.experts)
        return grad_x, grad_w, None, None, None


def grouped_mm(x: Tensor, weight: Tensor, offs: Tensor, cfg: QuantConfig | None,
               op: Callable[..., Tensor] = torch._grouped_mm) -> Tensor:
    """``op(x, weight, offs=offs)`` (``torch._grouped_mm`` by default) whose saved ``x`` is compressed with ``cfg``.

    Args:
        x: ``[S, K]``, rows sorted by expert.
        weight: ``[E, K, N]``.
        offs: ``[E]`` int32, cumulative row counts.
        cfg: how ``x`` is compressed (``None``: kept exact).
        op: the grouped product the model called (``torch._grouped_mm`` or transformers' fallback op), run forward
            and backward.
    """
    if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad):
        return op(x, weight, offs=offs)
    return _GroupedMM.apply(x, weight, offs, cfg, op)
