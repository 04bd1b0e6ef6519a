"""Counting the aten ops a call dispatches (on CUDA each is at least one kernel launch, and each costs host time)."""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Ops that only make views or metadata (no kernel on any device); not counted as work.
VIEWS = frozenset({
    "_reshape_alias", "_unsafe_view", "alias", "as_strided", "detach", "expand", "lift_fresh", "permute", "select",
    "slice", "split", "squeeze", "t", "transpose", "unbind", "unsqueeze", "view",
})
_PRODUCTS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default,
             torch.ops.aten.bmm.default)


class Ops(TorchDispatchMode):
    """Records every aten op dispatched while active: ``counts`` by op name (views apart: :attr:`work`), and the
    dtypes of each matrix product's tensor arguments in ``products``."""

    def __init__(self, skip: Callable[[], bool] | None = None) -> None:
        """``skip``: while it returns True, ops are not recorded (a stand-in kernel's own ops)."""
        super().__init__()
        self.skip = skip
        self.counts: collections.Counter[str] = collections.Counter()
        self.products: list[tuple[torch.dtype, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.skip is not None and self.skip():
            return func(*args, **(kwargs or {}))
        self.counts[func.overloadpacket.__name__] += 1
        if func in _PRODUCTS:
            self.products.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))

    @property
    def work(self) -> dict[str, int]:
        """The counts of the ops that do work (views and metadata left out)."""
        return {k: v for k, v in sorted(self.counts.items()) if k not in VIEWS}
