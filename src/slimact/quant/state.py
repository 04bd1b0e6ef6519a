"""Running-estimate state (Mesa's ``scale="running"``): an EMA of each group's min and range.

Held by the caller in two non-persistent buffers of its module (so ``state_dict`` is unchanged and
checkpoints load both ways), named ``<prefix>_lo`` and ``<prefix>_range``, ``[groups]`` fp32 each::

    lo    <- decay * lo    + (1 - decay) * min(x_g)
    range <- decay * range + (1 - decay) * (max(x_g) - min(x_g))

initialised from the first tensor seen (or re-initialised when the group count changes), updated only
when asked (training mode). :meth:`RunningRange.update` returns fresh tensors, never views of the buffers:
the scale a tensor was packed with is snapshotted with it, so a second call of the same module that
moves the estimate cannot change how the first call's codes are restored.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["RunningRange"]


class RunningRange:
    """Accessor for the running-estimate buffers ``<prefix>_lo`` / ``<prefix>_range`` of ``module``."""

    def __init__(self, module: nn.Module, prefix: str) -> None:
        self.module = module
        self.lo_name = f"{prefix}_lo"
        self.range_name = f"{prefix}_range"
        for name in (self.lo_name, self.range_name):
            if name not in module._buffers:
                module.register_buffer(name, None, persistent=False)

    def update(self, lo: Tensor, hi: Tensor, decay: float, training: bool = True) -> tuple[Tensor, Tensor]:
        """Fold this tensor's per-group ``(lo, hi)`` into the estimate; return the estimate to pack with.

        When ``training`` is False the estimate is used as it is (initialised from ``lo, hi`` if empty).
        """
        old_lo, old_rng = self.module._buffers[self.lo_name], self.module._buffers[self.range_name]
        lo, rng = lo.detach().float(), (hi - lo).detach().float()
        if old_lo is None or old_rng is None or old_lo.shape != lo.shape:
            new_lo, new_rng = lo.clone(), rng.clone()
        elif training:
            new_lo = old_lo * decay + lo * (1.0 - decay)
            new_rng = old_rng * decay + rng * (1.0 - decay)
        else:
            new_lo, new_rng = old_lo, old_rng
        if training or old_lo is None:
            self.module._buffers[self.lo_name] = new_lo
            self.module._buffers[self.range_name] = new_rng
        return new_lo.clone(), new_lo + new_rng
