"""The elementwise product of a gate written in model code: ``y = a * b`` with ``a`` an activation's output.

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
"""

from __future__ import annotations

from torch import Tensor

from slimact.functional._saving import SlimFunction, load, save
from slimact.quant import QuantConfig, pack

__all__ = ["product"]


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
