"""Gated MLP blocks (``down(act(gate(x)) * up(x))``) computed by :func:`slimact.functional.mlp.gated_mlp`.

``convert`` recognises a block by its parts (``gate_proj``, ``up_proj``, ``down_proj`` Linears and an
``act_fn`` of a known smooth form, as Llama, Mistral, Qwen and Gemma name them; or Phi-3's fused
``gate_up_proj`` with ``activation_fn``) and checks on a probe that the
block computes exactly that; the gate and up Linears stay the block's own (converted) modules, the down
projection's weight is used directly (its module is not called). A block whose down projection or activation
changed since (an adapter swapped in, a hook registered, another activation) runs its own forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from slimact._kinds import gated_mlp_form, gated_mlp_intact, gated_mlp_parts
from slimact.functional.mlp import gated_mlp
from slimact.nn._base import SlimModule, slim_class

__all__ = ["gated_mlp_class", "gated_mlp_form"]


def _gate_up(module: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """The gate and up projections of ``x`` (``[..., F]`` each; halves of one product when fused)."""
    gate_up, gate, up, _, _ = gated_mlp_parts(module)
    if gate_up is not None:
        g, u = gate_up(x).chunk(2, dim=-1)
        return g, u
    return gate(x), up(x)


class _GatedMLPMixin(SlimModule):
    _slimact_form: str

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        # (Under torch.compile the parts are taken as converted: dynamo cannot guard on the recogniser's weak cache.)
        if not self._slimact_one_input(args, kwargs) or not (
            torch.compiler.is_compiling() or gated_mlp_intact(self, self._slimact_form)
        ):
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        x = args[0]
        self._slimact_begin()
        g, u = _gate_up(self, x)
        *_, down, act = gated_mlp_parts(self)
        form = self._slimact_form
        if type(act).forward is nn.GELU.forward:  # read live (set after convert too), as nn.GELU does
            form = "gelu_tanh" if act.approximate == "tanh" else "gelu"
        return gated_mlp(g, u, down.weight, down.bias, form, self._slimact_cfg(g), act=act,
                         state_g=self._slimact_state("g"), state_u=self._slimact_state("u"))


def gated_mlp_class(cls: type[nn.Module]) -> type[nn.Module]:
    return slim_class(_GatedMLPMixin, cls)
