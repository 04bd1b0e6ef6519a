"""Batch normalisation (training mode) keeping its input compressed and its batch statistics exact.

Math: ``y = (x - mean_c) * invstd_c * w_c + b_c`` over all dims but the channel dim 1; PyTorch's own
``native_batch_norm`` computes the forward (and updates the running statistics) and
``native_batch_norm_backward`` the backward, from the restored ``x_hat`` and the exact batch ``mean`` and
``invstd``.

What it keeps: ``x`` at ``b`` bits per element plus 8 bytes per channel (one scale per channel, whatever the
config's group count), and the per-channel ``mean``/``invstd``.

Error: the backward normalises ``x_hat`` with the batch's exact statistics, so ``xn``'s error is
``invstd_c * step/2``. With one scale per channel that is ``range(xn_c) / 510``, whatever the channel's spread;
a scale shared by a channel group made it ``range_group / (510 sigma_c)``, unbounded for a channel whose batch
variance is small next to its group's range (a constant channel: ``invstd = 1/sqrt(eps)``), and the input
gradient, which grows with ``invstd``, followed it (13-26 dB where channel scales spanned 100x; inf in fp16).
Tests assert SQNR >= 30 dB for the input, weight and bias gradients. The range is this batch's own under
every policy, Mesa's running estimates included: an estimate follows earlier batches' ranges, and where a
channel's offset moves from batch to batch (few values per channel: small images, deep stages, small batches)
it spans the offsets while this batch spans only its spread, so ``step * invstd_c`` was again unbounded (tiny
ResNet under ``"mesa"`` at 2 images: BatchNorm weight gradients at cosine -0.80, 2500x their size off; 30 dB
with the batch's own range).

Invariants: in training mode BatchNorm removes a per-channel shift, so the exact gradient reaching anything
that only shifts a channel (a conv bias right before it) is zero: ``grad_x`` sums to zero over each channel.
That holds in the backward only if ``x_hat`` is centred by its own mean; centred by the exact batch mean, the
restored input's rounding errors (their per-channel average) leave ``grad_x`` a per-channel sum of about
``invstd * step * mean|g|``, which a preceding bias picked up as a gradient of 10% of the model's typical one
(Parakeet's depthwise conv bias; SwiftFormer's, MobileNetV2's). So when ``x`` was quantised, the backward
normalises ``x_hat`` with ``x_hat``'s own batch mean and variance: ``grad_x`` sums to zero (up to float
rounding) as PyTorch's does, and ``sum(grad_x * x_hat) = 0`` likewise. Unquantised, the saved statistics are
the exact ones and are used as they are.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from slimact.functional._saving import SlimFunction, load, save
from slimact.quant import QuantConfig, RunningRange, pack

__all__ = ["batch_norm"]


class _BatchNormFunction(SlimFunction):
    layer = "BatchNorm"

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, cfg, state):
        y, mean, invstd = torch.native_batch_norm(x, weight, bias, running_mean, running_var, True, momentum, eps)
        ctx.eps = eps
        ctx.quantized = cfg is not None
        # one scale per channel, from this batch's own range: see the module docstring, Error
        per_channel = None if cfg is None else dataclasses.replace(cfg, group_dim=1, groups=0, scale="dynamic")
        # reuse=False: a pack of x made already by another consumer (a conv reading the same tensor first; an
        # activation's codes standing behind its output) has that consumer's layout and range (a scale shared by a
        # channel group, a running estimate): restored here it brought back the error above (alternating channel
        # spreads of 10 and 0.01 read by a 1x1 conv, then this BatchNorm: input gradient at cosine 0.82, weight
        # gradient at 0.69 under "int8"). This pack still serves a later consumer.
        save(ctx, pack(x, per_channel, state, reuse=False), weight, mean, invstd)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_hat, weight, mean, invstd = load(ctx)
        if ctx.quantized:
            # The statistics of the restored input itself (see the module docstring, Invariants).
            dims = [0, *range(2, x_hat.dim())]
            var, mean = torch.var_mean(x_hat.float(), dim=dims, correction=0)
            invstd = torch.rsqrt(var + ctx.eps).to(invstd.dtype)
            mean = mean.to(invstd.dtype)
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        grad_x, grad_w, grad_b = torch.ops.aten.native_batch_norm_backward(
            grad_y, x_hat, weight, None, None, mean, invstd, True, ctx.eps, mask
        )
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def batch_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    momentum: float,
    eps: float,
    cfg: QuantConfig,
    state: RunningRange | None = None,
) -> Tensor:
    """``F.batch_norm(..., training=True)`` keeping ``x`` compressed for the backward."""
    # F.batch_norm's own check: with one value per channel the batch variance is 0 and the unbiased one written
    # to running_var is 0/0, NaN (native_batch_norm does not check; this Function used to write the NaN).
    if math.prod(x.shape[:1] + x.shape[2:]) == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {x.size()}")
    params = [t for t in (weight, bias) if t is not None]
    # An empty batch keeps nothing (and native_batch_norm refuses it): PyTorch's own leaves the statistics alone.
    grads = torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in params))
    if not grads or x.numel() == 0:
        return torch.nn.functional.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
    return _BatchNormFunction.apply(x, weight, bias, running_mean, running_var, momentum, eps, cfg, state)
