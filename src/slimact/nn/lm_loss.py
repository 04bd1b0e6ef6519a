"""Routing a model's language-model loss through :func:`slimact.functional.lm_loss.linear_cross_entropy`.

Models compute ``F.cross_entropy(head(h), labels)`` in code slimact does not own (Hugging Face's
``ForCausalLMLoss``, BERT's inline ``CrossEntropyLoss``). While a converted model runs its forward, a
``TorchFunctionMode`` watches for the output of its head (the output-embedding Linear) and for aliases of it
that keep the token order (``float``, ``view``/``reshape``, ``contiguous``); when ``F.cross_entropy`` gets one
of those with plain arguments, it computes the loss from the head's input instead, without keeping the
logits. Anything else (class weights, ``reduction="none"``, a logits tensor the head did not produce, ops
that reorder tokens) runs exactly as written.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from slimact.functional.lm_loss import linear_cross_entropy

__all__ = ["LossRouting"]

# Ops whose output has the same elements in the same row-major order as their input.
_ALIASES = {Tensor.float, Tensor.view, Tensor.reshape, Tensor.contiguous, torch.reshape, Tensor.to}


class _Mode(TorchFunctionMode):
    def __init__(self, routing: LossRouting) -> None:
        super().__init__()
        self.routing = routing

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        routing = self.routing
        if func is F.cross_entropy and args:
            fused = routing.fused_loss(*args, **kwargs)
            if fused is not None:
                return fused
        out = func(*args, **kwargs)
        if func in _ALIASES and args and isinstance(out, Tensor) and routing.source(args[0]) is not None:
            if func is not Tensor.to or out.dtype.is_floating_point:
                routing.alias(out, args[0])
        return out


class LossRouting:
    """Installed on a converted model by ``convert``: hooks on the model and its head, and the mode."""

    def __init__(self, model: nn.Module, head: nn.Linear, policy) -> None:
        self.head = head
        self.policy = policy  # how the kept hidden states are compressed (kind "lmloss")
        self._sources: dict[int, tuple[weakref.ref, Tensor]] = {}
        self._mode: _Mode | None = None
        self.handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._exit, always_call=True),
            head.register_forward_hook(self._head_output),
        ]

    def _enter(self, module, args):
        if module.training and torch.is_grad_enabled() and self._mode is None:
            self._mode = _Mode(self)
            self._mode.__enter__()

    def _exit(self, module, args, output):
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self._sources.clear()

    def _head_output(self, module, args, output):
        if self._mode is not None and isinstance(output, Tensor) and args:
            self._track(output, args[0])

    def _track(self, t: Tensor, h: Tensor) -> None:
        key = id(t)
        self._sources[key] = (weakref.ref(t, lambda _r, key=key: self._sources.pop(key, None)), h)

    def source(self, t: object) -> Tensor | None:
        """The head input that ``t`` (the head output or a tracked alias of it) was computed from."""
        entry = self._sources.get(id(t)) if isinstance(t, Tensor) else None
        return entry[1] if entry is not None and entry[0]() is t else None

    def alias(self, out: Tensor, of: Tensor) -> None:
        self._track(out, self.source(of))

    def fused_loss(self, logits, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
        h = self.source(logits)
        head = self.head
        if (
            h is None or weight is not None or size_average is not None or reduce is not None
            or reduction not in ("mean", "sum") or logits.dim() != 2 or target.dim() != 1
            or target.dtype not in (torch.int64, torch.int32) or logits.shape[-1] != head.weight.shape[0]
        ):
            return None
        if h.numel() // h.shape[-1] != logits.shape[0]:
            return None
        loss = linear_cross_entropy(
            h, head.weight, head.bias, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
            reduction=reduction, cfg=self.policy.quant_config("lmloss", h.dim()),
        )
        return loss.to(logits.dtype)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
