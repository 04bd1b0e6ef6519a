"""``slimact.nn.Conv2d`` (and the 1-d/3-d forms through ``convert``): keeps its input 8-bit."""

from __future__ import annotations

from torch import Tensor, nn

from slimact.functional.conv import conv
from slimact.nn._base import SlimModule, slim_class, standalone

__all__ = ["Conv2d", "conv_class", "conv_unsupported"]


def conv_unsupported(module: nn.Module) -> str | None:
    """Why a convolution module cannot be converted, or ``None``."""
    if getattr(module, "transposed", False):
        return "transposed convolutions are not supported yet"
    if module.padding_mode != "zeros":
        return f"padding_mode {module.padding_mode!r} is not supported yet"
    if isinstance(module.padding, str) and module.padding != "valid":
        return f"padding={module.padding!r} is not supported yet"
    return None


class _ConvMixin(SlimModule):
    def forward(self, x: Tensor) -> Tensor:
        if not self._slimact_active(x):
            return super().forward(x)  # type: ignore[misc]
        self._slimact_begin()
        padding = (0,) * len(self.stride) if isinstance(self.padding, str) else self.padding
        return conv(
            x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups,
            self._slimact_cfg(x), self._slimact_state(), fn=self._conv_forward,
        )


Conv2d = standalone(
    _ConvMixin, nn.Conv2d, "conv", "Conv2d",
    "Drop-in ``nn.Conv2d`` keeping its input 8-bit. Args: those of ``nn.Conv2d``, and keyword ``policy``.",
)


def conv_class(cls: type[nn.Module]) -> type[nn.Module]:
    return Conv2d if cls is nn.Conv2d else slim_class(_ConvMixin, cls)
