"""The clamped gated unit of mixture-of-experts layers (gpt-oss's), keeping its one input instead of six tensors.

Math, on ``x: [S, 2I]`` (the up projection's output, ``S`` routed tokens), split into ``g`` and ``u`` (interleaved
columns ``x[:, ::2]``, ``x[:, 1::2]``, or the two halves), with a limit ``L``, a slope ``a`` and an offset ``c``::

    g' = min(g, L)                     u' = clamp(u, -L, L)
    y  = g' * sigmoid(a * g') * (u' + c)           (gpt-oss, its kin: a = 1.702, L = 7, c = 1)
    y  = silu(g') * u'                             (Hunyuan V4, GLM-5 Next, DeepSeek V4: c = 0, PyTorch's silu)

The backward is the unit's derivative in closed form, one compiled loop over ``x`` (:mod:`slimact.quant.inductor`),
in fp32; it rounds otherwise than autograd's chain of ``[S, I]`` ops (to float rounding, lossless).

What it keeps: ``x`` alone, with the policy's codes (1 byte per element at 8 bits, plus 8 bytes per scale group)
and which elements the clamps cut (1 bit per element: a restored element within half a step of a limit could lie on
its other side, where the clamp passes the other gradient), or exactly under a lossless policy. PyTorch keeps, per
routed token, ``x`` (both clamps save their input, a view of it), ``sigmoid``'s output, ``g'``, ``u' + c`` and the
product ``g' * sigmoid`` (each ``[S, I]``): ``6I`` elements (``2I + 4I``; for the ``silu`` form ``x``, ``g'``,
``silu(g')`` and ``u'``, ``5I``), against ``2.25 I`` bytes at 8 bits or ``2I`` elements exactly.

Error: the forward is the model's, exactly. The gradient is the gradient at ``x_hat``, ``|x - x_hat| <= step/2`` per
element (``step = range / 255`` of its scale group), with the clamps' gradients at ``x``: the smooth factors move
by their derivative times that (``sigmoid``, ``silu``: Lipschitz 1/4 and 1.1 per unit of ``a * g``); the tests
assert SQNR >= 30 dB on the input gradient at 8 bits, with 6% of the elements clamped, and equality to float
rounding without compression.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from slimact.functional._saving import Mask, SlimFunction, load, save
from slimact.quant import QuantConfig, inductor, pack

__all__ = ["GateForm", "clamped_glu"]


@dataclass(frozen=True)
class GateForm:
    """Which clamped gated unit: ``interleaved`` gate and up columns (else halves), the clamps' ``limit``, the gate's
    slope ``alpha`` (``None``: PyTorch's ``silu``), the up factor's ``offset``."""

    interleaved: bool
    limit: float
    alpha: float | None
    offset: float

    def __call__(self, x: Tensor) -> Tensor:
        """The unit, with the ops and in the order the models write it (the same bits)."""
        gate, up = _split(x, self.interleaved)
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = F.silu(gate) if self.alpha is None else gate * torch.sigmoid(gate * self.alpha)
        return (up + self.offset) * glu if self.offset else glu * up

    def args(self) -> tuple[bool, float, float, float]:
        """The form as plain values (a compiled loop's constants): interleaved, limit, slope (1 for silu), offset."""
        return self.interleaved, self.limit, 1.0 if self.alpha is None else self.alpha, self.offset


def _split(x: Tensor, interleaved: bool) -> tuple[Tensor, Tensor]:
    return (x[..., ::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)


def _joined(gate: Tensor, up: Tensor, interleaved: bool) -> Tensor:
    """Inverse of :func:`_split`: ``[..., 2I]`` from the gate and up columns."""
    return torch.stack((gate, up), -1).flatten(-2) if interleaved else torch.cat((gate, up), -1)


def _cut(x: Tensor, interleaved: bool, limit: float) -> Tensor:
    """Where the clamps pass no gradient (bool, ``x``'s shape): a gate above the limit, an up beyond it either side,
    and NaN (PyTorch's clamp passes the gradient where ``min <= x <= max``, the limits included)."""
    gate, up = _split(x, interleaved)
    return _joined(~(gate <= limit), ~((up >= -limit) & (up <= limit)), interleaved)


def _gradient(x: Tensor, cut: Tensor | None, grad: Tensor, interleaved: bool, limit: float, alpha: float,
              offset: float) -> Tensor:
    """``d y / d x`` of the unit at ``x`` (``[..., 2I]``) for ``grad`` (``[..., I]``), with the clamps' gradients
    where ``cut`` says (``None``: where ``x`` says), in fp32. With ``s = sigmoid(a g')``, ``glu = g' s``::

        d g = grad * (u' + c) * (s + a g' s (1 - s))      (0 where the gate is cut)
        d u = grad * glu                                  (0 where the up is cut)
    """
    if cut is None:
        cut = _cut(x, interleaved, limit)
    gate, up = (t.float() for t in _split(x, interleaved))
    cut_gate, cut_up = _split(cut, interleaved)
    grad = grad.float()
    gate = gate.clamp(max=limit)
    s = torch.sigmoid(gate * alpha)
    d_gate = grad * (up.clamp(-limit, limit) + offset) * (s + alpha * gate * s * (1 - s))
    d_up = grad * (gate * s)
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    return _joined(torch.where(cut_gate, zero, d_gate), torch.where(cut_up, zero, d_up), interleaved).to(x.dtype)


class _ClampedGLU(SlimFunction):
    layer = "clamped gated unit (experts)"

    @staticmethod
    def forward(ctx, x, form, cfg):
        y = form(x)
        cut = None
        if cfg is not None:
            # (compressed: which elements the clamps cut, as bits; a restored element near a limit may lie on its
            # other side, where the clamp's gradient is the other one)
            interleaved, limit = form.interleaved, form.limit
            cut = Mask.of(inductor.fused_or_eager(_cut, ("clamped-glu-cut", x.dtype, interleaved, limit), x,
                                                  interleaved, limit))
        save(ctx, pack(x, cfg), cut)
        ctx.form = form
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_hat, cut = load(ctx)
        key = ("clamped-glu", x_hat.dtype, grad_y.dtype, cut is None, ctx.form.args())
        # (one compiled loop where the tensors are large: about 20 eager passes over [S, I] otherwise)
        grad_x = inductor.fused_or_eager(_gradient, key, x_hat, cut, grad_y.contiguous(), *ctx.form.args())
        return grad_x, None, None


def clamped_glu(x: Tensor, form: GateForm, cfg: QuantConfig | None) -> Tensor:
    """``form(x)`` (``x: [..., 2I]`` -> ``[..., I]``) keeping only ``x``, compressed with ``cfg`` (``None``: exact),
    and where compressed which elements the clamps cut."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return form(x)
    return _ClampedGLU.apply(x, form, cfg)
