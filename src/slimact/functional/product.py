"""Elementwise products written in model code: a gate's ``y = a * b`` with ``a`` an activation's output, and a
broadcast ``y = a * b`` with ``a`` a norm's output (adaLN's modulation).

Gated units that are no module slimact can fuse compute their product in model code: T5's gated GELU
(``act(wi_0(h)) * wi_1(h)``, then a dropout before ``wo``), Mamba's ``y * act(gate)``, a SwiGLU written inline in a
block's forward. Math::

    y = a * b,   grad_a = grad_y * b,   grad_b = grad_y * a

Plain PyTorch keeps both factors, ``[..., F]`` each in their dtype (8 bytes per element in fp32). This Function
keeps what each gradient needs with the policy's codes: ``b`` where ``a`` needs a gradient, ``a`` where ``b`` does.
A pack of the same tensor made already is reused (:func:`slimact.quant.pack`): an 8-bit activation's output is
rebuilt from its input's codes (``share_derived``), so ``a`` costs no bytes of its own and the product keeps 1 byte
per element where plain keeps 8. The forward is PyTorch's ``a * b``.

Error: each restored factor is within half a quantisation step of its group (``|b - b_hat| <= step / 2``; an
activation's output rebuilt from its input's codes within ``max|f'| * step / 2``), so each gradient element is
within ``|grad_y| * step / 2``; the tests assert cosine >= 0.99 with PyTorch's gradients.

Broadcast products (:func:`broadcast_product`): the adaLN modulation of DiT, SD3, Flux and PixArt,
``norm(h) * (1 + scale[:, None]) + shift[:, None]``, multiplies a large factor ``a`` (``[B, T, C]``, the output of a
``LayerNorm(elementwise_affine=False)``) by a small one ``b`` that broadcasts to it (``[B, 1, C]``). Math::

    y = a * b,   grad_a = grad_y * b,   grad_b = sum_to_size(grad_y * a, b.shape)

(the sum over the broadcast dims, as autograd's ``sum_to_size``, then the cast to ``b``'s dtype: PyTorch's order).
Plain PyTorch keeps ``a`` in full precision (4 bytes per element in fp32) for ``grad_b``, and ``b`` for ``grad_a``.
This Function keeps ``b`` exact (it is small) and ``a`` with the policy's codes, which for a norm's output is the
norm's own pack (the norm keeps its output's codes, one scale per channel: ``pack`` hands the product that very
pack), so ``a`` costs 0 bytes of its own where plain keeps 4 per element; where the norm keeps its input instead
(its guard), ``a`` is packed here, 1 byte per element (+ 8 per group). ``grad_a`` is exact, as PyTorch's;
``grad_b``'s error is ``|sum_t grad_y * (a - a_hat)| <= sum_t |grad_y| * step_c / 2`` (``step_c``: the step of
channel ``c``'s group), which for a weightless LayerNorm's output is ``range(xn_c) / 510``: the same error as a
LayerNorm weight's gradient from its 8-bit output (with stochastic rounding within a step, unbiased; under a running
estimate a value beyond it saturates, as in the norm's own backward). The tests assert cosine >= 0.999 and SQNR >=
30 dB (DiT's scale gradients: 42-46 dB under ``"int8"``, 39-42 dB under ``"mesa"``). The forward is PyTorch's ``a *
b`` (or ``b * a``, as written), its dtype promotion included.

Routed (:mod:`slimact.nn.routing`) only where ``a`` is the output of a slimact norm, unchanged since, that keeps its
output's codes (0 bytes for ``a``) or its input (1 byte per element here, where plain keeps 4), ``b`` spans the
norm's channels (``[B, 1, C]``, ``[C]``; GroupNorm's ``[N, C, 1, 1]``: its gradient sums over rows per channel, as a
norm weight's) and needs a gradient (else plain keeps only ``b``). Not where the norm keeps ``a`` exact (a lossless
policy: autograd's ``a`` is the norm's own tensor, no second copy, nothing to save); not for a ``b`` constant along
the channels (a per-token ``[B, T, 1]`` scale, a mix's ``[B, T, K, 1]`` weights: its gradient sums along the
normalised row, a cancellation wherever a norm follows, which 8-bit codes swamp: a learned mix of normed streams
into an RMSNorm had its weights' gradients at cosine 0.73 routed); not for other large factors (a gate times a
linear layer's output, ``probs * mask``); not where which factor is the large one is not clear-cut
(:func:`broadcast_big`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimact.functional._saving import SlimFunction, load, save
from slimact.quant import QuantConfig, pack

__all__ = ["broadcast_big", "broadcast_product", "product"]


class _ProductFunction(SlimFunction):
    layer = "product"

    @staticmethod
    def forward(ctx, a, b, cfg):
        need_a, need_b = ctx.needs_input_grad[:2]
        save(ctx, pack(b, cfg) if need_a else None, pack(a, cfg) if need_b else None)
        return a * b

    @staticmethod
    def backward(ctx, grad_y):
        b, a = load(ctx)
        return None if b is None else grad_y * b, None if a is None else grad_y * a, None


def product(a: Tensor, b: Tensor, cfg: QuantConfig) -> Tensor:
    """``a * b`` of two tensors of one shape and dtype, keeping the factors the gradients need packed with ``cfg``.

    Args:
        a, b: ``[...]`` factors, alike in shape and dtype (no broadcasting: a broadcast factor's gradient is a sum).
        cfg: their compression (a lossless policy keeps the factors as PyTorch does and has no use for this).
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"product takes factors of one shape and dtype, got {tuple(a.shape)} {a.dtype} and "
                         f"{tuple(b.shape)} {b.dtype}")
    return _ProductFunction.apply(a, b, cfg)


class _BroadcastProductFunction(SlimFunction):
    layer = "product (broadcast)"

    @staticmethod
    def forward(ctx, a, b, cfg, swapped):
        need_a, need_b = ctx.needs_input_grad[:2]
        ctx.b_shape, ctx.b_dtype = b.shape, b.dtype
        save(ctx, b if need_a else None, pack(a, cfg) if need_b else None)
        return b * a if swapped else a * b

    @staticmethod
    def backward(ctx, grad_y):
        b, a = load(ctx)
        # (autograd casts grad_a to a's dtype; grad_b is summed in the product's dtype, then cast, as autograd does)
        grad_a = None if b is None else grad_y * b
        grad_b = None if a is None else (grad_y * a).sum_to_size(ctx.b_shape).to(ctx.b_dtype)
        return grad_a, grad_b, None, None


def broadcast_big(x: Tensor, y: Tensor) -> int | None:
    """Which factor of ``x * y`` is the large one the other broadcasts to: 0 (``x``), 1 (``y``), or ``None`` where
    that is not clear-cut. The large factor has the product's shape, and the other is expanded along at least one of
    its dims (a size-1 or missing dim where the product's is not 1: so it has fewer elements, but in an empty batch).
    Not clear-cut: a 0-dim factor, shapes that do not broadcast, both broadcast (``[B, 1, C] * [1, T, C]``), equal
    shapes, shapes that differ only by leading size-1 dims (``[1, C] * [C]``: the same element count)."""
    if x.dim() == 0 or y.dim() == 0 or x.shape == y.shape:
        return None
    try:
        shape = torch.broadcast_shapes(x.shape, y.shape)
    except RuntimeError:
        return None
    for big, (large, small) in enumerate(((x, y), (y, x))):
        padded = (1,) * (len(shape) - small.dim()) + tuple(small.shape)  # (a missing leading dim broadcasts too)
        if large.shape == shape and any(s == 1 and n != 1 for s, n in zip(padded, shape, strict=True)):
            return big
    return None


def broadcast_product(x: Tensor, y: Tensor, cfg: QuantConfig) -> Tensor:
    """``x * y`` where one factor (``a``) is large and the other (``b``) broadcasts to it (:func:`broadcast_big`),
    keeping ``b`` exact and ``a`` packed with ``cfg`` (a pack of ``a`` made already, a norm's, is reused: see the
    module docstring). The forward is ``x * y`` itself, dtype promotion included.

    Args:
        x, y: the factors as written, floating point.
        cfg: ``a``'s compression (a lossless policy keeps the factors as PyTorch does and has no use for this).
    """
    big = broadcast_big(x, y)
    if big is None:
        raise ValueError(f"broadcast_product takes a factor that broadcasts to the other, got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")
    a, b = (x, y) if big == 0 else (y, x)
    return _BroadcastProductFunction.apply(a, b, cfg, big == 1)
