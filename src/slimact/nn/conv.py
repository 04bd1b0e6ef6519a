"""``slimact.nn.Conv2d`` (and the 1-d/3-d forms through ``convert``): keeps its input 8-bit."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from slimact.functional.conv import conv
from slimact.nn._base import SlimModule, slim_class, standalone

__all__ = ["Conv2d", "conv_class"]


class _ConvMixin(SlimModule):
    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        # An unbatched input ([C, *spatial], which PyTorch's convolutions take) runs the module's own code too: the
        # backward's convolution_backward takes batched inputs only. So does a padding convert would have left alone,
        # set since (read live, as nn.Conv's _conv_forward reads it): the backward differentiates zero padding.
        # (the weight's rank from its kernel: a parametrized weight read here was computed twice a call, spectral
        # norm's power iteration run twice, a weight drawn at each access drawn twice; a sweep, 2026-12-07)
        if (not self._slimact_one_input(args, kwargs) or args[0].dim() != len(self.kernel_size) + 2
                or self.padding_mode != "zeros" or (isinstance(self.padding, str) and self.padding != "valid")):
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        x = args[0]
        self._slimact_begin()
        padding = (0,) * len(self.stride) if isinstance(self.padding, str) else self.padding
        return conv(
            x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups,
            self._slimact_cfg(x), self._slimact_state(), fn=self._conv_forward,
        )


Conv2d = standalone(
    _ConvMixin, nn.Conv2d, "conv", "Conv2d",
    "Drop-in ``nn.Conv2d`` keeping its input 8-bit (exact under a lossless policy). Args: those of "
    "``nn.Conv2d``, and keyword ``policy``.",
)


def conv_class(cls: type[nn.Module]) -> type[nn.Module]:
    return Conv2d if cls is nn.Conv2d else slim_class(_ConvMixin, cls)
