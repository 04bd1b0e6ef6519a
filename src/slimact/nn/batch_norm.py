"""``slimact.nn.BatchNorm2d`` (and 1-d/3-d through ``convert``): keeps its input 8-bit in training."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from slimact.functional.batch_norm import batch_norm
from slimact.nn._base import SlimModule, slim_class, standalone

__all__ = ["BatchNorm2d", "batch_norm_class"]


class _BatchNormMixin(SlimModule):
    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        if not self._slimact_one_input(args, kwargs):
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        x = args[0]
        self._check_input_dim(x)
        # The running-statistics bookkeeping of nn.modules.batchnorm._BatchNorm.forward, in training mode.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self._slimact_begin()
        # Running statistics only where tracked: a module whose track_running_stats was turned off after it was
        # built still holds its buffers, which PyTorch's forward then neither passes nor updates.
        track = self.track_running_stats
        return batch_norm(
            x, self.running_mean if track else None, self.running_var if track else None, self.weight, self.bias,
            factor, self.eps, self._slimact_cfg(x), self._slimact_state(),
        )


BatchNorm2d = standalone(
    _BatchNormMixin, nn.BatchNorm2d, "batchnorm", "BatchNorm2d",
    "Drop-in ``nn.BatchNorm2d`` keeping its input 8-bit (exact under a lossless policy). Args: those of "
    "``nn.BatchNorm2d``, and keyword ``policy``.",
)


def batch_norm_class(cls: type[nn.Module]) -> type[nn.Module]:
    return BatchNorm2d if cls is nn.BatchNorm2d else slim_class(_BatchNormMixin, cls)
