"""``slimact.nn.Dropout``: keeps its mask as bits (exact), never the dropped output."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from slimact.functional.dropout import dropout
from slimact.nn._base import SlimModule, slim_class, standalone

__all__ = ["Dropout", "dropout_class"]


class _DropoutMixin(SlimModule):
    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        if not self._slimact_one_input(args, kwargs) or self.inplace:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        x = args[0]
        return dropout(x, self.p, True)


Dropout = standalone(
    _DropoutMixin, nn.Dropout, "dropout", "Dropout",
    "Drop-in ``nn.Dropout`` keeping its mask as bits. Args: those of ``nn.Dropout``, and keyword ``policy``.",
)


def dropout_class(cls: type[nn.Module]) -> type[nn.Module]:
    return Dropout if cls is nn.Dropout else slim_class(_DropoutMixin, cls)
