"""``slimact.nn.LayerNorm``: keeps its input 8-bit and its per-row statistics exact."""

from __future__ import annotations

from torch import Tensor, nn

from slimact.functional.layer_norm import layer_norm
from slimact.nn._base import SlimModule, slim_class, standalone

__all__ = ["LayerNorm", "layer_norm_class"]


class _LayerNormMixin(SlimModule):
    def forward(self, x: Tensor) -> Tensor:
        if not self._slimact_active():
            return super().forward(x)  # type: ignore[misc]
        self._slimact_begin()
        return layer_norm(
            x, list(self.normalized_shape), self.weight, self.bias, self.eps, self._slimact_cfg(x),
            self._slimact_state(),
        )


LayerNorm = standalone(
    _LayerNormMixin, nn.LayerNorm, "layernorm", "LayerNorm",
    "Drop-in ``nn.LayerNorm`` keeping its input 8-bit. Args: those of ``nn.LayerNorm``, and keyword ``policy``.",
)


def layer_norm_class(cls: type[nn.Module]) -> type[nn.Module]:
    return LayerNorm if cls is nn.LayerNorm else slim_class(_LayerNormMixin, cls)
