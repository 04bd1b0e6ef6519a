"""Routing what a model computes in its own code, not in modules, through slimact.

Much of what a model keeps for the backward is computed by calls in its ``forward`` methods rather than by
modules ``convert`` can swap: ``nn.functional.dropout`` in OPT's, BART's and Whisper's layers;
``F.relu``/``F.gelu`` as the ``activation`` of ``nn.TransformerEncoderLayer``;
``gelu(x)`` in RoBERTa's LM head; ``F.cross_entropy`` on the logits in every Hugging Face LM. While a converted
model runs a training forward, a ``TorchFunctionMode`` (entered by a pre-hook on the model, left by its
forward hook) sends those calls to slimact:

* ``F.dropout`` -> :func:`slimact.functional.dropout` (the same draws; the mask kept as bits, exact);
* ``F.relu``/``torch.relu`` -> a 1-bit mask (exact); ``F.gelu`` (both forms), ``F.silu`` -> the input kept
  with the policy's codes (or, lossless, the output and a branch mask) as their modules are;
* ``F.cross_entropy`` on the head's logits -> the chunked LM loss, its gradients computed ahead
  (:mod:`slimact.nn.lm_loss`);
* ``F.scaled_dot_product_attention`` on ``[B, H, T, D]`` tensors (Falcon's attention, timm's, any model that
  calls it itself) -> :func:`slimact.functional.scaled_dot_product_attention`, keeping q, k, v 8-bit per head
  (exact under a lossless policy) and no ``[T, S]`` tensor.

Calls made inside a module that the policy's ``exclude`` patterns or ``convert``'s ``filter_fn`` leave alone
run as written (a pre-hook and a forward hook on each such module count how deep the forward is inside one).

Each route is on when its kind (``dropout``, ``relu``, ``gelu``, ``silu``, ``lmloss``) is enabled by the
policy and no ``include`` pattern restricts the policy to named modules (a call has no module name).
Functional calls have no module to hold a running estimate, so they use each tensor's own range under
``scale = "running"`` policies too. Calls that would not save anything (no gradient, eval mode, in-place)
run as written; the forward result is PyTorch's own in every case. A mode sees the calls of Python code
only, not those made inside another torch function (the attention dropout inside
``F.multi_head_attention_forward``, which slimact's ``nn.MultiheadAttention`` replaces anyway).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from slimact.functional.activation import activation
from slimact.functional.attention import scaled_dot_product_attention
from slimact.functional.dropout import dropout
from slimact.nn.lm_loss import LossTracker
from slimact.policy import Policy
from slimact.quant.reference import COMPRESSIBLE_DTYPES

__all__ = ["FUNCTIONAL_NAME", "Routing"]

#: The name policies see for calls in model code (for ``exclude`` patterns and ``summary``).
FUNCTIONAL_NAME = "(functional)"


def _wants_grad(x: object) -> bool:
    """Whether a call on ``x`` keeps something slimact compresses: a gradient will flow, in a dtype it packs."""
    return isinstance(x, Tensor) and x.dtype in COMPRESSIBLE_DTYPES and x.requires_grad and torch.is_grad_enabled()


class _Mode(TorchFunctionMode):
    def __init__(self, routing: Routing) -> None:
        super().__init__()
        self.routing = routing

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        routing = self.routing
        handler = routing.handlers.get(func)
        if handler is not None and args and not routing.excluded_depth:
            out = handler(*args, **kwargs)
            if out is not None:
                return out
        out = func(*args, **kwargs)
        if routing.loss is not None:
            routing.loss.seen(func, args, out)
        return out


class Routing:
    """Installed on a converted model by ``convert``; ``remove()`` uninstalls it."""

    def __init__(self, model: nn.Module, policy: Policy, head: nn.Linear | None,
                 excluded: list[nn.Module] = ()) -> None:
        self.policy = policy
        self.excluded_depth = 0
        self.loss = LossTracker(head) if head is not None and self._on("lmloss") else None
        routes = {
            F.dropout: ("dropout", self._dropout),
            F.relu: ("relu", self._relu),
            torch.relu: ("relu", self._relu),
            F.gelu: ("gelu", self._gelu),
            F.silu: ("silu", self._silu),
            F.scaled_dot_product_attention: ("attention", self._sdpa),
        }
        self.handlers = {func: fn for func, (kind, fn) in routes.items() if self._on(kind)}
        self.kinds = sorted({kind for kind, _ in routes.values() if self._on(kind)})
        if self.loss is not None:
            self.handlers[F.cross_entropy] = self.loss.fused_loss
        self._mode: _Mode | None = None
        self.handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._exit, always_call=True),
        ]
        for module in excluded if self.handlers else ():
            self.handles += [module.register_forward_pre_hook(self._enter_excluded),
                             module.register_forward_hook(self._exit_excluded, always_call=True)]

    def _on(self, kind: str) -> bool:
        return self.policy.skip_reason(kind, FUNCTIONAL_NAME) is None and not self.policy.include

    def _cfg(self, kind: str, x: Tensor):
        cfg = self.policy.quant_config(kind, x.dim())
        return dataclasses.replace(cfg, scale="dynamic") if cfg is not None and cfg.scale == "running" else cfg

    def _dropout(self, x, p=0.5, training=True, inplace=False):
        if not training or inplace or not _wants_grad(x):
            return None
        return dropout(x, p, True)

    def _relu(self, x, inplace=False):
        if inplace or not _wants_grad(x):
            return None
        return activation(x, "relu", self._cfg("relu", x), fn=torch.relu)

    def _gelu(self, x, approximate="none"):
        if not _wants_grad(x):
            return None
        form = "gelu_tanh" if approximate == "tanh" else "gelu"
        return activation(x, form, self._cfg("gelu", x), fn=lambda t: F.gelu(t, approximate=approximate))

    def _silu(self, x, inplace=False):
        if inplace or not _wants_grad(x):
            return None
        return activation(x, "silu", self._cfg("silu", x), fn=F.silu)

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
        if not any(_wants_grad(t) for t in (query, key, value)) or not all(
            isinstance(t, Tensor) and t.dim() == 4 and t.dtype in COMPRESSIBLE_DTYPES for t in (query, key, value)
        ):
            return None
        return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                            cfg=self._cfg("attention", query))

    def _enter_excluded(self, module, args):
        self.excluded_depth += 1

    def _exit_excluded(self, module, args, output):
        self.excluded_depth -= 1

    def _enter(self, module, args):
        if torch.compiler.is_compiling():
            return  # dynamo does not trace a mode entered in a hook: compiled models run the calls as written
        if module.training and torch.is_grad_enabled() and self._mode is None and self.handlers:
            if self.loss is not None:
                self.loss.active = True
            self._mode = _Mode(self)
            self._mode.__enter__()

    def _exit(self, module, args, output):
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        if self.loss is not None:
            self.loss.active = False
            self.loss.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        if self.loss is not None:
            self.loss.remove()
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
