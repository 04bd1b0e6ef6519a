"""``slimact.nn.Softmax``: keeps only its output, 8-bit (per head for attention maps)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from slimact.functional.softmax import softmax
from slimact.nn._base import SlimModule, slim_class, standalone

__all__ = ["Softmax", "softmax_class"]


class _SoftmaxMixin(SlimModule):
    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        if not self._slimact_one_input(args, kwargs) or self.dim is None:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        x = args[0]
        self._slimact_begin()
        return softmax(x, self.dim, self._slimact_cfg(x), self._slimact_state())


Softmax = standalone(
    _SoftmaxMixin, nn.Softmax, "softmax", "Softmax",
    "Drop-in ``nn.Softmax`` keeping its output 8-bit (exact under a lossless policy). Args: those of "
    "``nn.Softmax``, and keyword ``policy``.",
)


def softmax_class(cls: type[nn.Module]) -> type[nn.Module]:
    return Softmax if cls is nn.Softmax else slim_class(_SoftmaxMixin, cls)
