"""Dropout keeping its mask as bits.

Math: ``y = x * m / (1 - p)`` with ``m ~ Bernoulli(1 - p)``; ``grad_x = grad_y * m / (1 - p)``. The
forward is PyTorch's ``native_dropout`` (same random draws, same output as ``F.dropout``). On the CPU, where
``F.dropout`` multiplies by a noise tensor, ``1 / (1 - p)`` rounded through the input's dtype (:func:`cpu_scale`),
forward and backward both scale by that value (bit for bit ``F.dropout``'s, in fp16/bf16 gradients too).

What it keeps: the mask at 1 bit per element (exact), where PyTorch keeps a one-byte ``bool`` mask: 8x
less, and never the dropped output. Only in training; in eval mode dropout is the identity, as in PyTorch.

On the CPU, fp32 (:func:`native_dropout`): the CPU kernel draws its mask into a bool tensor, converts it to
fp32 (a pass and 4 bytes per element) and multiplies twice, ``(x * mask) * scale``; its backward converts and
multiplies the same way. Here the mask is the same draw (``bernoulli_`` into bool), and ``(x * mask) * scale``
runs as one compiled loop both ways (the same values bit for bit): 2 passes instead of 4 forward, 1 instead of
3 backward. The draw itself is :func:`slimact.functional._bernoulli.bernoulli_`: the generator's same stream and
mask, by a vectorised kernel (3-5x the speed of the CPU's serial ``bernoulli_``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function_unary

from slimact._cache import cache
from slimact.functional._bernoulli import bernoulli_
from slimact.functional._saving import Mask, SlimFunction, load, save
from slimact.quant import inductor

__all__ = ["cpu_scale", "dropout", "native_dropout", "scale_of"]


def _masked(x: Tensor, keep: Tensor, scale: float) -> Tensor:
    """``(x * keep) * scale``: the CPU ``native_dropout``'s output from its bool mask (and its backward's, for a
    gradient), the same two roundings."""
    return x * keep * scale


def _apply_mask(x: Tensor, keep: Tensor, scale: float) -> Tensor:
    """:func:`_masked` as one compiled loop where that pays off (else the eager ops: the same values)."""
    return inductor.fused_or_eager(_masked, ("dropout", x.dtype), x, keep, scale)


@cache
def cpu_scale(p: float, dtype: torch.dtype) -> float:
    """The factor F.dropout multiplies kept elements by on the CPU (``0 < p < 1``): its noise, ``bernoulli_(1 - p)``
    in the input's dtype divided in place by ``1 - p``, which rounds through that dtype: in fp32 ``1 / float32(1 -
    p)``, not ``float32(1 / (1 - p))`` (1 ulp apart for p = 0.04, 0.15, 0.42, ...: 15 of p = 0.01, ..., 0.99), in
    fp16/bf16 the dtype's value (native_dropout's backward scales in fp32: 1 ulp off F.dropout's gradient)."""
    return torch.ones(1, dtype=dtype).div_(1.0 - p).item()


def _cpu_factor(device: torch.device, p: float) -> bool:
    """Whether slimact's dropout scales by :func:`cpu_scale` (F.dropout's factor): on the CPU, ``0 < p < 1``, eagerly
    (under torch.compile ``cpu_scale`` would read a tensor, a graph break, and inductor draws its own dropout)."""
    return device.type == "cpu" and 0.0 < p < 1.0 and not torch.compiler.is_compiling()


def scale_of(device: torch.device, p: float, dtype: torch.dtype) -> float:
    """The factor slimact's dropout (:func:`native_dropout`, :func:`dropout`, attention's replayed dropout) scales
    kept elements of ``dtype`` by, forward and backward: F.dropout's own on the CPU (:func:`cpu_scale`), else
    ``1 / (1 - p)`` (0 for ``p = 1``)."""
    if _cpu_factor(device, p):
        return cpu_scale(p, dtype)
    return 1.0 / (1.0 - p) if p < 1 else 0.0


def _fast(x: Tensor, p: float) -> bool:
    """Whether :func:`native_dropout` draws and applies the mask itself: CPU, fp32, ``0 < p < 1``, eagerly (under
    torch.compile inductor fuses ``native_dropout`` itself; a uint8 mask seen as bool did not compile there)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and 0.0 < p < 1.0 and not torch.compiler.is_compiling()


def native_dropout(x: Tensor, p: float, train: bool = True) -> tuple[Tensor, Tensor]:
    """``torch.native_dropout(x, p, train)``: the output and the bool mask, the same draw (and generator
    advance) and, but on the CPU's fp32 path, the same values; see the module docstring for that path, whose output
    is F.dropout's (its factor rounded as :func:`cpu_scale`). Torch function modes see this function itself
    (slimact's routing notes a dropout of a routed softmax's output by it)."""
    if has_torch_function_unary(x):
        return handle_torch_function(native_dropout, (x,), x, p, train)
    if not (train and _fast(x, p)):
        return torch.native_dropout(x, p, train)
    # The kernel's own draw: bernoulli_ on a tensor laid out as x (empty_like), whose draw is the same whatever
    # its dtype (tests/functional/test_attention.py checks it bit for bit); into uint8, which the compiled loop
    # reads vectorised (a bool mask: element by element, twice its time), then seen as the bool it is.
    keep = bernoulli_(torch.empty_like(x, dtype=torch.uint8), 1.0 - p)
    return _apply_mask(x, keep, cpu_scale(p, x.dtype)), keep.view(torch.bool)


class _DropoutFunction(SlimFunction):
    layer = "dropout"
    routed = True  # its native_dropout is noted by the routing mode where it drops a routed softmax's output

    @staticmethod
    def forward(ctx, x, p):
        y, mask = native_dropout(x, p, True)
        # On the CPU, F.dropout's backward multiplies by its noise (cpu_scale), which native_dropout_backward's fp32
        # scale is not (fp16/bf16 gradients 1 ulp off plain's).
        ctx.cpu = _cpu_factor(x.device, p)
        ctx.scale = scale_of(x.device, p, x.dtype)
        ctx.fast = _fast(x, p)
        save(ctx, Mask.of(mask))
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (mask,) = load(ctx)
        if ctx.fast and grad_y.dtype == torch.float32:  # F.dropout's grad * noise, as (grad * mask) * scale
            return _apply_mask(grad_y, mask.view(torch.uint8), ctx.scale), None
        if ctx.cpu:  # F.dropout's grad * noise
            return grad_y * mask.to(grad_y.dtype).mul_(ctx.scale), None
        return torch.ops.aten.native_dropout_backward(grad_y, mask, ctx.scale), None


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``F.dropout(x, p, training)`` keeping the mask as bits."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, got {p}")
    # (p = 1: F.dropout's `x * 0`, which keeps nothing of x and draws nothing; a mask drawn here advanced the
    # generator PyTorch's does not, and every later dropout of the step dropped other elements than plain's)
    if not training or p in (0.0, 1.0) or not torch.is_grad_enabled() or not x.requires_grad:
        return torch.nn.functional.dropout(x, p, training)
    return _DropoutFunction.apply(x, p)
