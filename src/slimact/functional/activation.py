"""Pointwise activations with a compressed saved input (GELU, its tanh and sigmoid forms, SiLU) and ReLU
with a 1-bit mask.

Math, per form, with ``s(z) = 1 / (1 + e^-z)``, ``Phi``/``phi`` the normal cdf/pdf, ``c = sqrt(2/pi)``::

    gelu        y = x Phi(x)                          y' = Phi(x) + x phi(x)
    gelu_tanh   y = x/2 (1 + tanh(u)), u = c (x + 0.044715 x^3)
                                                      y' = (1 + t)/2 + x/2 (1 - t^2) c (1 + 3 * 0.044715 x^2)
    quick_gelu  y = x s(1.702 x)                      y' = s + 1.702 x s (1 - s)
    silu        y = x s(x)                            y' = s + x s (1 - s)
    relu        y = max(x, 0)                         y' = [x > 0]

The forward is the replaced module's own code (identical output, whatever formula it spells the
activation with: GPT-2's tanh GELU written as five elementwise ops keeps five full-size tensors in plain
PyTorch, here one 8-bit tensor). The backward evaluates ``y'`` in fp32 at the restored ``x_hat``.

What it keeps: ``x`` at ``b`` bits per element plus 8 bytes per scale group (GELU, SiLU forms); for ReLU
the mask ``x > 0``, 1 bit per element (exact). Error: ``|x - x_hat| <= step/2``, so the derivative's error
is at most ``step/2 * max|y''|`` (``max|y''|`` is 0.80 for GELU, 0.50 for SiLU); tests assert SQNR >= 30 dB.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from slimact.functional._saving import Mask, load, save
from slimact.quant import QuantConfig, RunningRange, pack

__all__ = ["FORMS", "activation", "derivative", "reference"]

FORMS = ("gelu", "gelu_tanh", "quick_gelu", "silu", "relu")

_C = math.sqrt(2.0 / math.pi)
_K = 0.044715


def reference(form: str, x: Tensor) -> Tensor:
    """The activation ``form`` computed in ``x``'s dtype (used to recognise modules by what they compute)."""
    if form == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if form == "gelu_tanh":
        return 0.5 * x * (1.0 + torch.tanh(_C * (x + _K * x.pow(3))))
    if form == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if form == "silu":
        return x * torch.sigmoid(x)
    if form == "relu":
        return x.clamp_min(0)
    raise ValueError(f"unknown activation form {form!r}; known: {FORMS}")


def derivative(form: str, x: Tensor) -> Tensor:
    """``y'(x)`` of ``form``, in ``x``'s dtype (call with fp32)."""
    if form == "gelu":
        return 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    if form == "gelu_tanh":
        t = torch.tanh(_C * (x + _K * x.pow(3)))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _C * (1.0 + 3.0 * _K * x * x)
    if form in ("quick_gelu", "silu"):
        a = 1.702 if form == "quick_gelu" else 1.0
        s = torch.sigmoid(a * x)
        return s + a * x * s * (1.0 - s)
    raise ValueError(f"no smooth derivative for activation form {form!r}")


class _ActivationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, form, cfg, state):
        y = fn(x)
        ctx.form = form
        save(ctx, Mask.of(y > 0) if form == "relu" else pack(x, cfg, state))
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (saved,) = load(ctx)
        if ctx.form == "relu":
            return grad_y * saved, None, None, None, None
        grad_x = grad_y.float() * derivative(ctx.form, saved.float())
        return grad_x.to(grad_y.dtype), None, None, None, None


def activation(
    x: Tensor,
    form: str,
    cfg: QuantConfig,
    state: RunningRange | None = None,
    fn: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Apply the activation ``form`` (computed by ``fn``, default :func:`reference`) keeping ``x`` compressed.

    Falls back to ``fn(x)`` with PyTorch's own saving when no gradient will flow through ``x``.
    """
    if form not in FORMS:
        raise ValueError(f"unknown activation form {form!r}; known: {FORMS}")
    fn = fn or (lambda t: reference(form, t))
    if not torch.is_grad_enabled() or not x.requires_grad:
        return fn(x)
    return _ActivationFunction.apply(x, fn, form, cfg, state)
