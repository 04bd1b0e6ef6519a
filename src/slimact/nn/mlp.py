"""Gated MLP blocks (``down(act(gate(x)) * up(x))``) computed by :func:`slimact.functional.mlp.gated_mlp`.

``convert`` recognises a block by its parts (``gate_proj``, ``up_proj``, ``down_proj`` Linears and an
``act_fn`` of a known smooth form, as Llama, Mistral, Qwen and Gemma name them) and checks on a probe that the
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


def gated_mlp_form(module: nn.Module) -> str | None:
    """The activation form if ``module`` is a gated MLP slimact can fuse, else ``None``."""
    parts = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(module, "act_fn", None)
    if not all(isinstance(p, nn.Linear) for p in parts) or not isinstance(act, nn.Module):
        return None
    if type(parts[2]) is not nn.Linear and not isinstance(parts[2], SlimModule):
        return None  # an adapter or quantised layer in the down projection: leave the block as written
    form = activation_form(act)
    if form in (None, "relu"):
        return None
    gate, up, down = parts
    cls = getattr(module, "_slimact_orig_cls", type(module))
    x = torch.randn(2, gate.in_features, generator=torch.Generator().manual_seed(0)).to(gate.weight.dtype)
    with torch.no_grad():
        try:
            y = cls.forward(module, x)
        except Exception:  # needs more than one tensor argument: not this kind of block
            return None
        expected = nn.functional.linear(act(nn.functional.linear(x, gate.weight, gate.bias))
                                        * nn.functional.linear(x, up.weight, up.bias), down.weight, down.bias)
    return form if torch.allclose(y, expected, rtol=1e-4, atol=1e-5) else None


class _GatedMLPMixin(SlimModule):
    _slimact_form: str

    def forward(self, x: Tensor) -> Tensor:
        if not self._slimact_active():
            return super().forward(x)  # type: ignore[misc]
        self._slimact_begin()
        g, u = self.gate_proj(x), self.up_proj(x)
        down = self.down_proj
        return gated_mlp(g, u, down.weight, down.bias, self._slimact_form, self._slimact_cfg(g), act=self.act_fn,
                         state_g=self._slimact_state("g"), state_u=self._slimact_state("u"))


def gated_mlp_class(cls: type[nn.Module]) -> type[nn.Module]:
    return slim_class(_GatedMLPMixin, cls)
