"""Gated MLP blocks (``down(act(gate(x)) * up(x))``) computed by :func:`slimact.functional.mlp.gated_mlp`.

``convert`` recognises a block by its parts (``gate_proj``, ``up_proj``, ``down_proj`` Linears and an
``act_fn`` of a known smooth form, as Llama, Mistral, Qwen and Gemma name them; or Phi-3's fused
``gate_up_proj`` with ``activation_fn``) and checks on a probe that the
block computes exactly that; the gate and up Linears stay the block's own (converted) modules, the down
projection's weight is used directly (its module is not called).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from slimact._kinds import activation_form
from slimact.functional.mlp import gated_mlp
from slimact.nn._base import SlimModule, slim_class

__all__ = ["gated_mlp_class", "gated_mlp_form"]


def _parts(module: nn.Module) -> tuple[nn.Module | None, nn.Module | None, nn.Module | None, nn.Module | None]:
    """``(gate_up, gate, up, down)`` projections and the activation module of a gated MLP's layout: separate
    ``gate_proj``/``up_proj`` (Llama, Mistral, Qwen2, Gemma) or one fused ``gate_up_proj`` (Phi-3)."""
    gate_up = getattr(module, "gate_up_proj", None)
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    act = getattr(module, "act_fn", None) or getattr(module, "activation_fn", None)
    return (gate_up if isinstance(gate_up, nn.Linear) else None), gate, up, act


def _gate_up(module: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """The gate and up projections of ``x`` (``[..., F]`` each; halves of one product when fused)."""
    gate_up, gate, up, _ = _parts(module)
    if gate_up is not None:
        g, u = gate_up(x).chunk(2, dim=-1)
        return g, u
    return gate(x), up(x)


def gated_mlp_form(module: nn.Module) -> str | None:
    """The activation form if ``module`` is a gated MLP slimact can fuse, else ``None``."""
    gate_up, gate, up, act = _parts(module)
    down = getattr(module, "down_proj", None)
    projections = (gate_up,) if gate_up is not None else (gate, up)
    if not all(isinstance(p, nn.Linear) for p in (*projections, down)) or not isinstance(act, nn.Module):
        return None
    if type(down) is not nn.Linear and not isinstance(down, SlimModule):
        return None  # an adapter or quantised layer in the down projection: leave the block as written
    form = activation_form(act)
    if form in (None, "relu"):
        return None
    cls = getattr(module, "_slimact_orig_cls", type(module))
    first = projections[0]
    x = torch.randn(2, first.in_features, generator=torch.Generator().manual_seed(0)).to(first.weight.dtype)
    with torch.no_grad():
        try:
            y = cls.forward(module, x)
        except Exception:  # needs more than one tensor argument: not this kind of block
            return None
        g, u = (nn.functional.linear(x, p.weight, p.bias) for p in projections) if gate_up is None else (
            nn.functional.linear(x, gate_up.weight, gate_up.bias).chunk(2, dim=-1))
        expected = nn.functional.linear(act(g) * u, down.weight, down.bias)
    return form if torch.allclose(y, expected, rtol=1e-4, atol=1e-5) else None


class _GatedMLPMixin(SlimModule):
    _slimact_form: str

    def forward(self, x: Tensor) -> Tensor:
        if not self._slimact_active(x):
            return super().forward(x)  # type: ignore[misc]
        self._slimact_begin()
        g, u = _gate_up(self, x)
        down, act = self.down_proj, _parts(self)[3]
        return gated_mlp(g, u, down.weight, down.bias, self._slimact_form, self._slimact_cfg(g), act=act,
                         state_g=self._slimact_state("g"), state_u=self._slimact_state("u"))


def gated_mlp_class(cls: type[nn.Module]) -> type[nn.Module]:
    return slim_class(_GatedMLPMixin, cls)
