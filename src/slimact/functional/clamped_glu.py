"""The clamped gated unit of mixture-of-experts layers (gpt-oss's), keeping its one input instead of six tensors.

Math, on ``x: [S, 2I]`` (the up projection's output, ``S`` routed tokens), split into ``g`` and ``u`` (interleaved
columns ``x[:, ::2]``, ``x[:, 1::2]``, or the two halves), with a limit ``L``, a slope ``a`` and an offset ``c``::

    g' = min(g, L)                     u' = clamp(u, -L, L)
    y  = g' * sigmoid(a * g') * (u' + c)           (gpt-oss, its kin: a = 1.702, L = 7, c = 1)
    y  = silu(g') * u'                             (Hunyuan V4, GLM-5 Next, DeepSeek V4: c = 0, PyTorch's silu)

The backward recomputes ``y`` from the kept ``x`` (PyTorch's own ops under autograd, one ``[S, I]`` pass at a time)
and differentiates it: at the exact ``x`` that is plain's gradient, bit for bit.

What it keeps: ``x`` alone, with the policy's codes (1 byte per element at 8 bits, plus 8 bytes per scale group)
and which elements the clamps cut (1 bit per element: a restored element within half a step of a limit could lie on
its other side, where the clamp passes the other gradient), or exactly under a lossless policy. PyTorch keeps, per
routed token, ``x`` (both clamps save their input, a view of it), ``sigmoid``'s output, ``g'``, ``u' + c`` and the
product ``g' * sigmoid`` (each ``[S, I]``), and the unit's output kept by the down projection: ``6I`` elements
(``2I + 4I``; for the ``silu`` form ``g'``, ``u'`` and ``x``, ``4I``), against ``2.25 I`` bytes at 8 bits or ``2I``
elements exactly.

Error: the forward is the model's, exactly. The gradient is the gradient at ``x_hat``, ``|x - x_hat| <= step/2`` per
element (``step = range / 255`` of its scale group), with the clamps' gradients at ``x``: the smooth factors move
by their derivative times that (``sigmoid``, ``silu``: Lipschitz 1/4 and 1.1 per unit of ``a * g``); the tests
assert SQNR >= 30 dB on the input gradient at 8 bits, with 6% of the elements clamped, and equality without
compression.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from slimact.functional._saving import Mask, SlimFunction, load, save
from slimact.quant import QuantConfig, pack

__all__ = ["GateForm", "clamped_glu"]


@dataclass(frozen=True)
class GateForm:
    """Which clamped gated unit: ``interleaved`` gate and up columns (else halves), the clamps' ``limit``, the gate's
    slope ``alpha`` (``None``: PyTorch's ``silu``), the up factor's ``offset``."""

    interleaved: bool
    limit: float
    alpha: float | None
    offset: float

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x``'s gate and up columns (views)."""
        return (x[..., ::2], x[..., 1::2]) if self.interleaved else x.chunk(2, dim=-1)

    def __call__(self, x: Tensor, clamped: Tensor | None = None) -> Tensor:
        """The unit, with the ops and in the order the models write it (the same bits). ``clamped`` (bool, ``x``'s
        shape): the elements the clamps cut, which pass no gradient whatever ``x`` holds; the others pass it."""
        gate, up = self.split(x)
        if clamped is None:
            gate = gate.clamp(min=None, max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
        else:
            cut_gate, cut_up = self.split(clamped)
            gate = _clamp_known(gate, cut_gate, None, self.limit)
            up = _clamp_known(up, cut_up, -self.limit, self.limit)
        glu = F.silu(gate) if self.alpha is None else gate * torch.sigmoid(gate * self.alpha)
        return (up + self.offset) * glu if self.offset else glu * up

    def clamped(self, x: Tensor) -> Tensor:
        """Where the clamps cut ``x`` (bool, ``x``'s shape): a gate above the limit, an up beyond it either side
        (PyTorch's clamp passes the gradient at the limit itself)."""
        cut = x > self.limit
        _, cut_up = self.split(cut)
        cut_up |= self.split(x)[1] < -self.limit  # (in place, through the view)
        return cut


def _clamp_known(x: Tensor, cut: Tensor, lo: float | None, hi: float) -> Tensor:
    """``x.clamp(lo, hi)``'s values, its gradient 0 where ``cut`` and 1 elsewhere (wherever ``x`` lies)."""
    kept = x.clamp(min=lo, max=hi)
    return torch.where(cut, kept.detach(), x + (kept - x).detach())


class _ClampedGLU(SlimFunction):
    layer = "clamped gated unit (experts)"

    @staticmethod
    def forward(ctx, x, form, cfg):
        y = form(x)
        # (compressed: which elements the clamps cut, as bits; a restored element near a limit may lie on its other
        # side, where the clamp's gradient is the other one)
        save(ctx, pack(x, cfg), None if cfg is None else Mask.of(form.clamped(x)))
        ctx.form = form
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_hat, clamped = load(ctx)
        with torch.enable_grad():
            x_hat = x_hat.detach().requires_grad_()
            y = ctx.form(x_hat, clamped)
        (grad_x,) = torch.autograd.grad(y, x_hat, grad_y)
        return grad_x, None, None


def clamped_glu(x: Tensor, form: GateForm, cfg: QuantConfig | None) -> Tensor:
    """``form(x)`` (``x: [..., 2I]`` -> ``[..., I]``) keeping only ``x``, compressed with ``cfg`` (``None``: exact),
    and where compressed which elements the clamps cut."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return form(x)
    return _ClampedGLU.apply(x, form, cfg)
