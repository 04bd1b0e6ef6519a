"""Routing a model's language-model loss through :func:`slimact.functional.lm_loss.linear_cross_entropy`.

Models compute ``F.cross_entropy(head(h), labels)`` in code slimact does not own (Hugging Face's
``ForCausalLMLoss``, BERT's inline ``CrossEntropyLoss``). While a converted model runs its forward, the
``TorchFunctionMode`` of :mod:`slimact.nn.routing` watches for the output of its head (the output-embedding
Linear) and for aliases of it that keep the token order (``float``, ``view``/``reshape``/``flatten``,
``contiguous``); when ``F.cross_entropy`` gets one of those with plain arguments, it computes the loss and
its gradients from those logits, the head's input and weight, keeping the gradients instead of the logits.
Anything else (class weights, ``reduction="none"``, a logits tensor the head did not produce, ops that
reorder tokens) runs exactly as written.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from slimact.functional.lm_loss import linear_cross_entropy
from slimact.quant.reference import COMPRESSIBLE_DTYPES

__all__ = ["LossTracker"]

# Ops whose output has the same elements in the same row-major order as their input.
_ALIASES = {
    Tensor.float, Tensor.view, Tensor.reshape, Tensor.contiguous, torch.reshape, Tensor.to, Tensor.flatten,
    torch.flatten,
}


class LossTracker:
    """Tracks the output of a model's head (and its aliases) during a forward, and computes
    ``F.cross_entropy`` on them from the head's input. Driven by :class:`slimact.nn.routing.Routing`."""

    def __init__(self, head: nn.Linear) -> None:
        self.head = head
        self._sources: dict[int, tuple[weakref.ref, Tensor]] = {}
        self.active = False
        self.handle = head.register_forward_hook(self._head_output)

    def seen(self, func, args, out) -> None:
        """Follow ``out = func(*args)`` if it is an alias of a tracked tensor in the same token order."""
        if func in _ALIASES and args and isinstance(out, Tensor) and self.source(args[0]) is not None:
            if func is not Tensor.to or out.dtype.is_floating_point:
                self.alias(out, args[0])

    def clear(self) -> None:
        self._sources.clear()

    def _head_output(self, module, args, output):
        if self.active and isinstance(output, Tensor) and args:
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
        if not (h.requires_grad or head.weight.requires_grad) or h.dtype not in COMPRESSIBLE_DTYPES:
            return None  # nothing will be kept (or float64, kept exact): the loss as written
        loss = linear_cross_entropy(
            h, head.weight, head.bias, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
            reduction=reduction, logits=logits,
        )
        # Autocast runs cross_entropy in fp32 (its fp32 op list): the loss is fp32 whatever the logits' dtype.
        return loss.float() if torch.is_autocast_enabled(logits.device.type) else loss.to(logits.dtype)

    def remove(self) -> None:
        self.handle.remove()
        self._sources.clear()
