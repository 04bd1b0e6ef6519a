"""``slimact.nn.LayerNorm`` / ``slimact.nn.RMSNorm`` / ``slimact.nn.GroupNorm``: keep their output (shared with the
next layer) and rstd.

``convert`` also turns model-specific norm classes into these by what they compute (see
:func:`slimact._kinds.norm_form`): Hugging Face's ``LlamaRMSNorm`` and its copies, ``GemmaRMSNorm`` with its
``1 + weight``, ``T5LayerNorm`` (an RMSNorm by another name); and a subclass of ``nn.GroupNorm`` with a forward of
its own that computes a GroupNorm on a probe (the fp32 ``GroupNorm32`` of guided diffusion). The forward stays the
module's own code.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import Tensor, nn
from torch.nn.utils import parametrize

from slimact._kinds import norm_eps, norm_form
from slimact.functional.norm import group_norm, norm, rms_default_eps
from slimact.nn._base import SlimModule, slim_class, standalone

__all__ = ["GroupNorm", "LayerNorm", "RMSNorm", "group_norm_class", "norm_class"]


def _runs_forward_of(cls: type, mixin: type, base: type[nn.Module]) -> bool:
    """Whether the forward ``cls`` (a slimact class: ``mixin`` first) runs after ``mixin``'s is ``base.forward``."""
    after = cls.__mro__[cls.__mro__.index(mixin) + 1:]
    return next((c.__dict__["forward"] for c in after if "forward" in c.__dict__), None) is base.forward


class _NormMixin(SlimModule):
    _slimact_centered: bool
    _slimact_offset: int  # 0, or 1 where the weight is stored as w - 1 (Gemma)
    _slimact_eps: float | None
    #: The attribute holding the norm's weight (``scale`` in torchtune's norms), as recognised.
    _slimact_weight_name: str = "weight"
    #: Whether the forward this class runs is ``nn.LayerNorm.forward`` (``F.layer_norm``): decided per class when
    #: it is made (a class attribute reads under torch.compile, where inspecting ``super().forward`` breaks the
    #: graph).
    _slimact_layer_norm_forward: bool = False
    #: Whether it is ``nn.RMSNorm.forward``, whose ``eps=None`` is the dtype's own (set after convert too).
    _slimact_rms_norm_forward: bool = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._slimact_layer_norm_forward = _runs_forward_of(cls, _NormMixin, nn.LayerNorm)
        cls._slimact_rms_norm_forward = _runs_forward_of(cls, _NormMixin, nn.RMSNorm)

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        # (a torch norm made to normalise over more than its last dim since convert: its own forward's, read live;
        # from __dict__, where nn.LayerNorm and nn.RMSNorm hold it: a norm of the model's own without one pays no
        # nn.Module.__getattr__ miss at every call)
        shape = self.__dict__.get("normalized_shape")
        if not self._slimact_one_input(args, kwargs) or (isinstance(shape, tuple) and len(shape) > 1):
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        x = args[0]
        self._slimact_begin()
        eps = norm_eps(self)  # read live (set after convert too), as the module's own forward reads it
        # (not the eps convert found, where nn.RMSNorm's is set to None since: the input gradient 5.95 off, a review)
        eps = eps if eps is not None or self._slimact_rms_norm_forward else self._slimact_eps
        eps = eps if eps is not None else rms_default_eps(x.dtype)
        forward = super().forward  # type: ignore[misc]
        # nn.LayerNorm's own forward over the last dim is F.layer_norm: norm() runs it with its kernel's
        # statistics (fn=None); any other forward (a model's own norm code) runs as written.
        native = (self._slimact_layer_norm_forward and self._slimact_centered
                  and not self._slimact_offset and tuple(self.normalized_shape) == (x.shape[-1],)
                  and eps == self.eps)
        # A weight computed at each access (a parametrization: spectral norm's power iteration, a weight drawn by
        # Bayes by backprop) is read here and again by the module's own forward (fn): once, cached, as plain reads
        # it. And the weight before the bias, in F.layer_norm's order (Pyro draws a PyroSample at each read: the
        # draws were swapped, the forward 2.8 off plain's for one seed; a sweep, 2026-12-07).
        with parametrize.cached() if "parametrizations" in self._modules and not native else contextlib.nullcontext():
            weight = getattr(self, self._slimact_weight_name, None)
            # (a `bias` that is no tensor, a flag a model's norm keeps under that name, is none: as the probe took it)
            bias = getattr(self, "bias", None)
            return norm(
                x, weight, bias if isinstance(bias, Tensor) else None, eps, self._slimact_cfg(x),
                self._slimact_state(), centered=self._slimact_centered, offset=self._slimact_offset,
                fn=None if native else forward,
            )


def _form(key: str):
    return lambda module: norm_form(module)[key]


_DOC = "Drop-in ``nn.{0}`` keeping its output and rstd. Args: those of ``nn.{0}``, and keyword ``policy``."
LayerNorm = standalone(
    _NormMixin, nn.LayerNorm, "layernorm", "LayerNorm", _DOC.format("LayerNorm"),
    centered=_form("centered"), offset=_form("offset"), eps=_form("eps"),
)
RMSNorm = standalone(
    _NormMixin, nn.RMSNorm, "rmsnorm", "RMSNorm", _DOC.format("RMSNorm"),
    centered=_form("centered"), offset=_form("offset"), eps=_form("eps"),
)


def norm_class(cls: type[nn.Module]) -> type[nn.Module]:
    return {nn.LayerNorm: LayerNorm, nn.RMSNorm: RMSNorm}.get(cls) or slim_class(_NormMixin, cls)


class _GroupNormMixin(SlimModule):
    #: Whether the forward this class runs is ``nn.GroupNorm.forward`` (``F.group_norm``; per class, as
    #: :attr:`_NormMixin._slimact_layer_norm_forward`); otherwise a subclass's own, which passed the probe.
    _slimact_group_norm_forward: bool = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._slimact_group_norm_forward = _runs_forward_of(cls, _GroupNormMixin, nn.GroupNorm)

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        if not self._slimact_one_input(args, kwargs):
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        x = args[0]
        self._slimact_begin()
        # num_groups, eps, weight and bias read live, as nn.GroupNorm.forward reads them.
        return group_norm(
            x, self.num_groups, self.weight, self.bias, self.eps, self._slimact_cfg(x), self._slimact_state(),
            fn=None if self._slimact_group_norm_forward else super().forward,  # type: ignore[misc]
        )


GroupNorm = standalone(_GroupNormMixin, nn.GroupNorm, "groupnorm", "GroupNorm", _DOC.format("GroupNorm"))


def group_norm_class(cls: type[nn.Module]) -> type[nn.Module]:
    return GroupNorm if cls is nn.GroupNorm else slim_class(_GroupNormMixin, cls)
