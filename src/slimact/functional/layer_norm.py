"""LayerNorm keeping its 8-bit output, the tensor the next layer keeps anyway (one shared copy).

Math, per row over the normalised trailing dims (``M`` elements), ``xn = (x - mean) * rstd``::

    y      = xn * w + b
    grad_x = rstd * (gw - mean(gw) - xn * mean(gw * xn)),   gw = grad_y * w
    grad_w = sum_rows(grad_y * xn),   grad_b = sum_rows(grad_y)

The backward needs only ``xn`` and ``rstd``, and ``xn = (y - b) / w`` comes back from the output. So the
layer keeps ``y`` packed with one scale per channel, plus the exact ``rstd`` (4 bytes per row); the next
Linear (or any slimact layer) that keeps ``y`` reuses that very pack. Per-channel scales make the error in
``xn`` independent of ``w``: ``y_c``'s step is ``|w_c| * range(xn_c) / 255``, so ``xn``'s error is at most
``range(xn_c) / 510`` per element.

Guard (Tempo had none): where a weight is zero, ``xn`` cannot be rebuilt; where ``|w_c|`` is tiny against
``|b_c|``, the output's own float rounding (``eps * |b_c| / |w_c|``) would swamp ``xn``. If any channel
fails ``eps_dtype * |b_c| <= |w_c| / 512`` (or ``w_c == 0``), the layer keeps its 8-bit *input* and the exact
``mean``/``rstd`` instead (Mesa's scheme), and PyTorch's own ``native_layer_norm_backward`` runs on the
restored input. The forward is PyTorch's ``native_layer_norm`` either way: identical output.

Bytes kept: ``b/8`` per element plus 4 per row (plus 8 per channel or scale group), instead of 4 per element
plus 8 per row in fp32. Tests assert SQNR >= 30 dB for the input, weight and bias gradients.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from slimact.functional._saving import load, save
from slimact.quant import QuantConfig, RunningRange, pack

__all__ = ["layer_norm", "output_recoverable"]


def output_recoverable(weight: Tensor | None, bias: Tensor | None, dtype: torch.dtype) -> bool:
    """Whether ``xn = (y - b) / w`` is well conditioned for every channel (one host sync)."""
    if weight is None:
        return True
    w = weight.detach().float().abs()
    b = bias.detach().float().abs() if bias is not None else torch.zeros_like(w)
    return bool(((w > 0) & (torch.finfo(dtype).eps * b * 512 <= w)).all())


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps, cfg, state):
        y, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.normalized_shape = normalized_shape
        ctx.from_output = len(normalized_shape) == 1 and output_recoverable(weight, bias, x.dtype)
        if ctx.from_output:
            per_channel = dataclasses.replace(cfg, group_dim=-1, groups=0)
            save(ctx, pack(y, per_channel, state), rstd, weight, bias)
        else:
            save(ctx, pack(x, cfg, state), mean, rstd, weight, bias)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        need = ctx.needs_input_grad  # x, normalized_shape, weight, bias, ...
        if not ctx.from_output:
            x_hat, mean, rstd, weight, bias = load(ctx)
            grad_x, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
                grad_y, x_hat, ctx.normalized_shape, mean, rstd, weight, bias, [need[0], need[2], need[3]]
            )
            return grad_x, None, grad_w, grad_b, None, None, None
        y_hat, rstd, weight, bias = load(ctx)
        g = grad_y.float()
        xn = y_hat.float()
        if bias is not None:
            xn = xn - bias.float()
        gw = g
        if weight is not None:
            xn = xn / weight.float()
            gw = g * weight.float()
        grad_x = grad_w = grad_b = None
        if need[0]:
            mean_gw = gw.mean(-1, keepdim=True)
            mean_gwx = (gw * xn).mean(-1, keepdim=True)
            grad_x = (rstd.float() * (gw - mean_gw - xn * mean_gwx)).to(grad_y.dtype)
        rows = g.reshape(-1, g.shape[-1])
        if weight is not None and need[2]:
            grad_w = (rows * xn.reshape(rows.shape)).sum(0).to(weight.dtype)
        if bias is not None and need[3]:
            grad_b = rows.sum(0).to(bias.dtype)
        return grad_x, None, grad_w, grad_b, None, None, None


def layer_norm(
    x: Tensor,
    normalized_shape: list[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    cfg: QuantConfig,
    state: RunningRange | None = None,
) -> Tensor:
    """``F.layer_norm`` keeping its output (or, when a weight is near zero, its input) compressed."""
    params = [t for t in (weight, bias) if t is not None]
    if not torch.is_grad_enabled() or not (x.requires_grad or any(t.requires_grad for t in params)):
        return torch.nn.functional.layer_norm(x, normalized_shape, weight, bias, eps)
    return _LayerNormFunction.apply(x, list(normalized_shape), weight, bias, eps, cfg, state)
