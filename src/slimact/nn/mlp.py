"""Gated MLP blocks (``down(act(gate(x)) * up(x))``) computed by :func:`slimact.functional.mlp.gated_mlp`.

``convert`` recognises a block by its parts (:class:`slimact._kinds.GatedLayout`): ``gate_proj``, ``up_proj``,
``down_proj`` Linears and an ``act_fn`` of a known smooth form, as Llama, Mistral, Qwen and Gemma name them, or
Phi-3's fused ``gate_up_proj`` with ``activation_fn``; or, in other names, two or three Linear children and at
most one activation module, the activation possibly a call in the forward (``w2(F.silu(w1(x)) * w3(x))``: Meta's
Llama, torchtitan, gpt-fast; LitGPT's ``fc_1``, ``fc_2``, ``proj``; one fused projection chunked either way round).
A probe of the block's training forward decides which Linear is which and checks that the block computes exactly
that, bit for bit, with the form's gradients: what reached its down projection is the fused block's product
``act(g) * u``, in the block's dtype and, for an fp32 block, under bf16 autocast too (a forward that writes the
formula out, ``g * torch.sigmoid(g)``, or computes the product in fp32, as BEAM's does, rounds otherwise: left
unfused). The gate and up Linears stay the block's own (converted) modules, the down projection's weight is used
directly (its module is not called). The output is the block's own: its activation module, or the torch function
of the form (``F.silu``, ``F.gelu``) where the forward called one. A block whose down projection or activation
changed since (an adapter swapped in, a hook registered, another activation) runs its own forward.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from slimact._kinds import (
    _GATED_CALLS,
    activation_form,
    gated_layout,
    gated_mlp_form,
    gated_mlp_intact,
)
from slimact.functional.mlp import gated_mlp
from slimact.nn._base import SlimModule, slim_class

__all__ = ["gated_mlp_class", "gated_mlp_form"]


class _GatedMLPMixin(SlimModule):
    _slimact_form: str

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        if not self._slimact_one_input(args, kwargs) or not gated_mlp_intact(self, self._slimact_form):
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        x = args[0]
        self._slimact_begin()
        layout = gated_layout(self)
        gate_up, gate, up, down, act = layout.parts(self)
        # [..., F] each; halves of one product when fused
        g, u = layout.split(gate_up(x)) if gate_up is not None else (gate(x), up(x))
        form = self._slimact_form
        if act is None:  # the forward called the form's function
            act = _GATED_CALLS[form]
        elif type(act).forward is nn.GELU.forward:  # read live (set after convert too), as nn.GELU does
            form = "gelu_tanh" if act.approximate == "tanh" else "gelu"
        return gated_mlp(g, u, down.weight, down.bias, form, self._slimact_cfg(g), act=act,
                         state_g=self._slimact_state("g"), state_u=self._slimact_state("u"))

    def _slimact_loaded(self) -> None:
        # A block converted and saved whole before 792cb99 holds no _slimact_act_type, the class its activation
        # was recognised with (checked under torch.compile, where the recogniser cannot run): without it the
        # compiled block always ran its own forward. Its activation's class, where still of the form converted.
        if "_slimact_act_type" in self.__dict__:
            return
        layout = gated_layout(self)
        act = None if layout is None else layout.parts(self)[4]
        if act is not None and activation_form(act) == self._slimact_form:
            self._slimact_act_type = type(act)


def gated_mlp_class(cls: type[nn.Module]) -> type[nn.Module]:
    return slim_class(_GatedMLPMixin, cls)
