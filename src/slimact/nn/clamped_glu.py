"""Experts modules' clamped gated unit (gpt-oss's ``_apply_gate`` and its kin) computed by slimact.

transformers' experts implementations (``grouped_mm``, ``batched_mm``, the eager loop) and models' own experts
forwards call ``self._apply_gate(gate_up)`` between the up and down projections. Where a module's ``_apply_gate``
is one of the forms :class:`slimact.functional.clamped_glu.GateForm` computes (probed on random inputs, bit for bit
in fp32 and bf16, with the limit and slope read from the module: ``limit``/``swiglu_limit``,
``alpha``/``swiglu_alpha``), ``convert`` sets the module's own ``_apply_gate`` (an instance attribute over the class's
method) to a :class:`Gate`, which computes that form keeping its input alone
(:func:`slimact.functional.clamped_glu.clamped_glu`); ``revert`` removes it. Any other ``_apply_gate`` (another
formula, a subclass's own, one the probe cannot run) is left as written.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from slimact._kinds import Probed, as_probed, probed_state
from slimact.functional._saving import transformed
from slimact.functional.clamped_glu import GateForm, clamped_glu
from slimact.quant import QuantConfig
from slimact.quant.reference import COMPRESSIBLE_DTYPES

__all__ = ["GATE_ATTR", "Gate", "gate_form"]

#: The method experts modules call on their up projection's output.
GATE_ATTR = "_apply_gate"
_LIMITS = ("limit", "swiglu_limit")
_ALPHAS = ("alpha", "swiglu_alpha")


def _number(module: nn.Module, name: str) -> float | None:
    value = getattr(module, name, None)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def gate_form(module: nn.Module) -> GateForm | None:
    """The form of ``module``'s ``_apply_gate`` (its class's), or ``None`` where it is none of them, or where the
    module has an ``_apply_gate`` of its own (an instance attribute someone set)."""
    method = getattr(type(module), GATE_ATTR, None)
    if not callable(method) or GATE_ATTR in module.__dict__:
        return None
    limits = {v for n in _LIMITS if (v := _number(module, n)) is not None and v > 0}
    alphas = {v for n in _ALPHAS if (v := _number(module, n)) is not None} | {None}
    if not limits:
        return None  # (no clamp: silu(gate) * up, routed as an activation and a product)
    gen = torch.Generator().manual_seed(0)
    top = 2 * max(limits)
    x = (torch.rand(6, 32, generator=gen) * 2 - 1) * top  # [S, 2I], beyond the limits on both sides
    x[0, :8] = torch.tensor(sorted(limits) * 8)[:8]  # (at a limit exactly)
    inputs = (x, x.bfloat16())
    try:
        with torch.no_grad():
            expected = [method(module, t) for t in inputs]
    except Exception:
        return None
    found = []
    for interleaved, limit, alpha, offset in itertools.product((True, False), sorted(limits),
                                                               sorted(alphas, key=str), (0.0, 1.0)):
        form = GateForm(interleaved, limit, alpha, offset)
        with torch.no_grad():
            outs = [form(t) for t in inputs]
        pairs = zip(expected, outs, strict=True)
        if all(isinstance(e, Tensor) and e.dtype == o.dtype and torch.equal(e, o) for e, o in pairs):
            found.append(form)
    return found[0] if len(found) == 1 else None


class Gate:
    """A converted experts module's ``_apply_gate``: its :class:`GateForm`, keeping its input with ``cfg(x)``'s codes
    where a gradient will flow (else, compiled, or under a ``torch.func`` transform: the form as written)."""

    def __init__(self, form: GateForm, cfg: Callable[[Tensor], QuantConfig | None]) -> None:
        self.form = form
        self.cfg = cfg
        self.owner: nn.Module | None = None
        self.state: Probed | None = None

    def watch(self, owner: nn.Module) -> None:
        """Take the values ``owner``'s gate was probed with (:func:`slimact._kinds.probed_state`; its ``limit``
        and ``alpha`` among them): where one changes, the class's ``_apply_gate`` runs instead (the form would
        clamp at the old limit)."""
        self.owner, self.state = owner, probed_state(owner)

    def __call__(self, x: Tensor) -> Tensor:
        owner = self.owner
        if owner is not None and not torch.compiler.is_compiling() and not as_probed(
                owner, self.state, self.__dict__, "probed its _apply_gate", "the gate runs"):
            return getattr(type(owner), GATE_ATTR)(owner, x)
        if (not (torch.is_grad_enabled() and x.requires_grad) or x.dtype not in COMPRESSIBLE_DTYPES
                or torch.compiler.is_compiling() or transformed()):
            return self.form(x)
        return clamped_glu(x, self.form, self.cfg(x))
