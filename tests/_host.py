"""A mode that sees every read of tensor values back to the host made by slimact's own code."""

from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode

_READS = frozenset({
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero,
    torch.bincount, torch.Tensor.bincount, torch.masked_select, torch.Tensor.masked_select, torch.unique,
})


class HostReads(TorchFunctionMode):
    """Counts the calls from slimact's code that read tensor values back to the host (what makes a CUDA stream
    wait, and what a CUDA graph cannot capture); with ``fail=True`` the first one raises. Calls from elsewhere
    (the Triton interpreter's own copies) are not counted."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if func in _READS and caller.startswith("slimact"):
            if self.fail:
                raise AssertionError(f"host sync: {getattr(func, '__name__', func)} called from {caller}")
            self.count += 1
        return func(*args, **(kwargs or {}))
