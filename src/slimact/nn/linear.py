"""``slimact.nn.Linear``: an ``nn.Linear`` whose saved input is 8-bit (see :mod:`slimact.functional.linear`).

Also the mixins that make the same of Hugging Face's ``Conv1D`` (GPT-2's projections, weight ``[in, out]``) and of
PyTorch Geometric's ``Linear`` (its convs' projections).
In eval mode, under ``no_grad``/``inference_mode``, or when nothing needs a gradient, forward is exactly the
parent's.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import Tensor, nn

from slimact.functional.linear import linear
from slimact.nn._base import SlimModule, slim_class, standalone

__all__ = ["Linear", "conv1d_class", "linear_class", "pyg_linear_class"]


class _LinearMixin(SlimModule):
    _transposed = False

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        if not self._slimact_one_input(args, kwargs):
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        x = args[0]
        self._slimact_begin()
        return linear(
            x, self.weight, self.bias, self._slimact_cfg(x), self._slimact_state(), transposed=self._transposed
        )


class _Conv1DMixin(_LinearMixin):
    _transposed = True

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        x = args[0] if args else kwargs.get("x")
        if isinstance(x, Tensor) and x.dim() and not x.is_contiguous() and not _flattens(x):
            # Hugging Face's Conv1D computes on ``x.view(-1, in)``, which refuses an input no view can flatten (a
            # transposed ``[B, T, C]``): its own code, and its error, where slimact's product computed (a fuzzer)
            return super(_LinearMixin, self).forward(*args, **kwargs)  # type: ignore[misc]
        return super().forward(*args, **kwargs)


class _PyGLinearMixin(_LinearMixin):
    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        # PyTorch Geometric releases that define Linear.__deepcopy__ (for its lazy parameters; 2.8.1 does not) build a
        # fresh torch_geometric Linear there: the copy of a converted model would hold plain Linears. A converted one
        # has its parameters: a module's copy.
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        twin.__setstate__(copy.deepcopy(self.__dict__, memo))
        return twin


def _flattens(x: Tensor) -> bool:
    """Whether ``x.view(-1, x.size(-1))`` succeeds (a contiguous ``x``'s always does: not asked, on the hot path)."""
    try:
        x.view(-1, x.size(-1))
    except RuntimeError:
        return False
    return True


Linear = standalone(
    _LinearMixin, nn.Linear, "linear", "Linear",
    """Drop-in ``nn.Linear`` keeping its input for the backward as b-bit codes.

    Args: those of ``nn.Linear``, and ``policy`` (keyword): preset name, :class:`slimact.Policy` or file.
    """,
)


def linear_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The slimact class for an ``nn.Linear`` (sub)class."""
    return Linear if cls is nn.Linear else slim_class(_LinearMixin, cls)


def conv1d_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The slimact class for Hugging Face's ``Conv1D`` (or a subclass)."""
    return slim_class(_Conv1DMixin, cls)


def pyg_linear_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The slimact class for PyTorch Geometric's ``Linear`` (or a subclass)."""
    return slim_class(_PyGLinearMixin, cls)
