"""Activation modules keeping their input 8-bit (GELU forms, SiLU) or a 1-bit mask (ReLU).

``convert`` turns any module that computes one of the known forms (see :mod:`slimact._kinds`) into its
slimact subclass; the forward stays the module's own code. ``slimact.nn.GELU``/``SiLU``/``ReLU`` are the
named classes for direct use.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from slimact._kinds import activation_form
from slimact.functional._saving import kept_or_view_of_kept
from slimact.functional.activation import activation
from slimact.nn._base import SlimModule, slim_class, standalone

__all__ = ["GELU", "ReLU", "SiLU", "activation_class"]


class _ActivationMixin(SlimModule):
    _slimact_form: str

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        if not self._slimact_one_input(args, kwargs):
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        x = args[0]
        if (getattr(self, "inplace", False) or getattr(self, "_slimact_writes_input", False)) and not (
                torch.compiler.is_compiling()) and kept_or_view_of_kept(x, through_bases=False):
            # An output another slimact Function keeps as it is ("tempo"'s LayerNorm before nn.ReLU(inplace=True)):
            # the module's own code, whose in-place call (F.relu(x, inplace=True)) the routing mode runs on a copy
            # (functional._saving.copy_on_write), else as written. Slimact's Function wrote into it directly: the
            # norm's backward found its output changed (slimact's error) where PyTorch's trains. Also for a module
            # that writes into its input with no `inplace` attribute saying so (its forward calls
            # F.relu(x, inplace=True) or x.relu_(): seen by recognition, _kinds._writes_its_input), which had failed
            # so after a channels-last LayerNorm permuted back. (Not for another view of a kept view's base: two
            # in-place activations on two slices of one Linear output would make the first keep a copy, 24% more.)
            return super().forward(x)  # type: ignore[misc]
        self._slimact_begin()
        cfg = self._slimact_cfg(x)
        form = self._slimact_form
        if self._slimact_orig_cls.forward is nn.GELU.forward:  # read live (set after convert too), as nn.GELU does
            form = "gelu_tanh" if self.approximate == "tanh" else "gelu"
        return activation(x, form, cfg, self._slimact_state(), fn=super().forward,  # type: ignore[misc]
                          inplace=bool(getattr(self, "inplace", False)))


_DOC = "Drop-in ``nn.{0}`` keeping {1} for the backward. Args: those of ``nn.{0}``, and keyword ``policy``."
_INPUT = "its input 8-bit (exact under a lossless policy)"
GELU = standalone(_ActivationMixin, nn.GELU, "gelu", "GELU", _DOC.format("GELU", _INPUT),
                  form=activation_form)
SiLU = standalone(_ActivationMixin, nn.SiLU, "silu", "SiLU", _DOC.format("SiLU", _INPUT),
                  form=activation_form)
ReLU = standalone(_ActivationMixin, nn.ReLU, "relu", "ReLU", _DOC.format("ReLU", "a 1-bit mask"),
                  form=activation_form)


def activation_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The slimact class for an activation module class."""
    return {nn.GELU: GELU, nn.SiLU: SiLU, nn.ReLU: ReLU}.get(cls) or slim_class(_ActivationMixin, cls)
