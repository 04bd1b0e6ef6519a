"""``slimact.nn.MatMul``: a module for the product of two activations (``q @ k^T``, ``probs @ v``).

PyTorch has no module for ``torch.matmul``; model code that wants it compressed writes
``self.mm = slimact.nn.MatMul()`` and ``self.mm(q, k.transpose(-2, -1))`` (as with Mesa's ``ms.MatMul``).
``MatMulBase`` is the plain module it reverts to.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from slimact.functional.matmul import matmul
from slimact.nn._base import SlimModule, standalone

__all__ = ["MatMul", "MatMulBase"]


class MatMulBase(nn.Module):
    """``torch.matmul(a, b)`` as a module (what ``slimact.nn.MatMul`` is when not converted)."""

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return torch.matmul(a, b)


class _MatMulMixin(SlimModule):
    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        if not self._slimact_active(a, b):
            return super().forward(a, b)  # type: ignore[misc]
        self._slimact_begin()
        return matmul(
            a, b, self._slimact_cfg(a), self._slimact_cfg(b), self._slimact_state("a"), self._slimact_state("b")
        )


MatMul = standalone(
    _MatMulMixin, MatMulBase, "matmul", "MatMul",
    "``torch.matmul`` of two activations keeping both operands 8-bit (per head for ``[B, H, T, D]``).",
)
