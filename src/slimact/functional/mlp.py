"""Gated MLP (SwiGLU, GeGLU: Llama, Mistral, Qwen, Gemma) keeping only its gate and up projections.

Math, with ``g = x W_g^T``, ``u = x W_u^T`` (the gate and up projections, computed by the block's own Linears)::

    a = act(g),   h = a * u,   y = h W_d^T + b_d
    grad_W_d = grad_y^T h,   grad_h = grad_y W_d,   grad_u = grad_h * a,   grad_g = grad_h * u * act'(g)

Plain PyTorch keeps four ``[tokens, intermediate]`` tensors here: ``g`` (the activation's input), ``a`` and
``u`` (the product's inputs) and ``h`` (the down projection's input). This Function keeps ``g`` and ``u`` only
(exact under a lossless policy, 1 byte per element each at 8 bits) and recomputes ``a`` and ``h`` in the
backward, ``h`` also for the down projection's weight gradient. The forward is the block's own arithmetic
(its activation module, then the product, then ``F.linear``): identical output.

Error: exact up to float rounding when ``g``, ``u`` are kept exact; at 8 bits each restored element is within
half a step, and the tests assert gradient cosine >= 0.99 with the exact block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from slimact.functional._saving import SlimFunction, load, save
from slimact.functional.activation import derivative, reference
from slimact.quant import QuantConfig, RunningRange, inductor, pack, unpack_map

__all__ = ["gated_mlp"]


class _GatedMLPFunction(SlimFunction):
    layer = "gated MLP"

    @staticmethod
    def forward(ctx, g, u, weight, bias, act, form, cfg, state_g, state_u):
        y = F.linear(act(g) * u, weight, bias)
        ctx.act, ctx.form, ctx.has_bias = act, form, bias is not None
        save(ctx, pack(g, cfg, state_g), pack(u, cfg, state_u), weight)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        g, u, weight = load(ctx, restore=False)
        need_g, need_u, need_w, need_b = ctx.needs_input_grad[:4]
        out = grad_y.shape[-1]
        grad_h = grad_y.matmul(weight.to(grad_y.dtype))  # [..., I]
        # At 8 bits g and u are restored inside the loop that uses them (one compiled loop reads both codes and
        # grad_h: the restored [..., I] tensors are never written, nor read back); else restored, then the loop.
        grad_g, grad_u, h = unpack_map((g, u), _RESTORED_BACKWARDS[ctx.form], grad_h.contiguous(),
                                       otherwise=functools.partial(_elementwise_backward, ctx.act, ctx.form))
        grad_w = grad_b = None
        if need_w:
            grad_w = grad_y.reshape(-1, out).t().matmul(h.reshape(-1, h.shape[-1]).to(grad_y.dtype))
        if ctx.has_bias and need_b:
            grad_b = grad_y.reshape(-1, out).sum(0)
        return grad_g if need_g else None, grad_u if need_u else None, grad_w, grad_b, None, None, None, None, None


def _elementwise_backward_eager(act: Callable[[Tensor], Tensor], form: str, g: Tensor, u: Tensor,
                                grad_h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # grad_g = grad_h * u * act'(g) (fp32), grad_u = grad_h * act(g), h = act(g) * u: [..., I] each
    a = act(g)
    grad_g = (grad_h.float() * u.float() * derivative(form, g.float())).to(g.dtype)
    return grad_g, grad_h * a, a * u


def _elementwise_backward(act: Callable[[Tensor], Tensor], form: str, g: Tensor, u: Tensor,
                          grad_h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_g, grad_u, h)``: one compiled loop where the tensors are large and alike (:func:`slimact.quant.
    inductor.fused`; about 12 eager passes otherwise), else eagerly with the model's own activation. The loop
    computes the activation by its form's formula (one compiled loop per form, not per model's module), which
    may round differently from the module's own code: ``h`` and ``grad_u`` to float rounding."""
    if inductor.pays_off(g) and all(t.shape == g.shape and t.is_contiguous() for t in (g, u, grad_h)):
        key = ("gated-mlp", form, g.dtype, u.dtype, grad_h.dtype)
        result = inductor.fused(_elementwise_backward_eager, key, _FORMULAS[form], form, g, u, grad_h)
        if result is not None:
            return result
    return _elementwise_backward_eager(act, form, g, u, grad_h)


#: The activation of each form by its formula, one callable per form (what the compiled loops trace).
_FORMULAS = {form: functools.partial(reference, form) for form in ("gelu", "gelu_tanh", "quick_gelu", "silu")}

#: ``(g, u, grad_h) -> (grad_g, grad_u, h)`` of each form by its formula, for the loop that restores g and u
#: (:func:`slimact.quant.unpack_map`: one compiled loop per callable).
_RESTORED_BACKWARDS = {
    form: functools.partial(_elementwise_backward_eager, formula, form) for form, formula in _FORMULAS.items()
}


def gated_mlp(
    g: Tensor,
    u: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    form: str,
    cfg: QuantConfig | None,
    act: Callable[[Tensor], Tensor] | None = None,
    state_g: RunningRange | None = None,
    state_u: RunningRange | None = None,
) -> Tensor:
    """``F.linear(act(g) * u, weight, bias)`` keeping only ``g`` and ``u``.

    Args:
        g, u: ``[..., I]`` gate and up projections; ``weight``: ``[H, I]`` (the down projection), ``bias``.
        form: the activation's form (``"silu"``, ``"gelu"``, ``"gelu_tanh"``, ``"quick_gelu"``).
        cfg: compression of ``g`` and ``u``; ``None`` keeps them exact.
        act: the activation as the model computes it (default: the form's reference).
        state_g, state_u: running estimates of ``g`` and ``u``, for ``scale="running"``.
    """
    if act is None:

        def act(t: Tensor) -> Tensor:
            return reference(form, t)

    if not torch.is_grad_enabled() or not (g.requires_grad or u.requires_grad or weight.requires_grad):
        return F.linear(act(g) * u, weight, bias)
    return _GatedMLPFunction.apply(g, u, weight, bias, act, form, cfg, state_g, state_u)
