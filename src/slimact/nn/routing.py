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
* ``F.layer_norm``/``torch.layer_norm``, ``F.rms_norm``/``torch.rms_norm`` over the last dim (OLMo's weightless
  LayerNorm, any norm class ``convert`` does not recognise) -> :func:`slimact.functional.norm`, its output
  kept (kinds ``layernorm``, ``rmsnorm``).
* ``F.scaled_dot_product_attention`` on ``[B, H, T, D]`` tensors (Falcon's attention, timm's, any model that
  calls it itself) -> :func:`slimact.functional.scaled_dot_product_attention`, keeping q, k, v 8-bit per head
  (exact under a lossless policy) and no ``[T, S]`` tensor.

Calls made inside a module the user left alone (the policy's ``exclude`` patterns, ``convert``'s ``filter_fn``)
or inside a module ``convert`` would replace but the policy leaves alone (an excluded index, a norm kept as
written) run as written: a pre-hook and a forward hook on each such module count how deep the forward is in one.

Each route is on when its kind (``dropout``, ``relu``, ``gelu``, ``silu``, ``lmloss``, ...) is enabled by the
policy and no ``include`` pattern restricts the policy to named modules (a call has no module name).
Functional calls have no module to hold a running estimate, so they use each tensor's own range under
``scale = "running"`` policies too. Calls that would not save anything (no gradient, eval mode, in-place)
run as written; the forward result is PyTorch's own in every case. A layer that activation checkpointing
recomputes in the backward (outside the model's forward) enters the mode for its own call: it routes as it did
in the forward. A mode sees the calls of Python code
only, not those made inside another torch function (the attention dropout inside
``F.multi_head_attention_forward``, which slimact's ``nn.MultiheadAttention`` replaces anyway).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from slimact.functional.activation import activation
from slimact.functional.attention import scaled_dot_product_attention
from slimact.functional.dropout import dropout
from slimact.functional.norm import norm, rms_default_eps
from slimact.nn.lm_loss import LossTracker
from slimact.policy import Policy
from slimact.quant.reference import COMPRESSIBLE_DTYPES

__all__ = ["FUNCTIONAL_NAME", "Routing"]

#: The name policies see for calls in model code (for ``exclude`` patterns and ``summary``).
FUNCTIONAL_NAME = "(functional)"

# The arguments after the input of F.layer_norm/torch.layer_norm (centered) and F.rms_norm/torch.rms_norm, in order.
_NORM_ARGS = {True: ("normalized_shape", "weight", "bias", "eps"), False: ("normalized_shape", "weight", "eps")}
_LAYER_NORM_EPS = 1e-5  # F.layer_norm's default


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
            **self._norm_routes(),
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
        self._layer: nn.Module | None = None
        self.handles += self._enter_in_layers(model)

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

    # Functional norms: F.layer_norm / torch.layer_norm ("layernorm"), F.rms_norm / torch.rms_norm ("rmsnorm"),
    # as a model's own norm class calls them (OLMo's weightless LayerNorm, a user's norm module).

    def _norm_routes(self) -> dict:
        routes = {}
        for centered, kind, funcs in ((True, "layernorm", (F.layer_norm, torch.layer_norm)),
                                      (False, "rmsnorm", (F.rms_norm, torch.rms_norm))):
            for func in funcs:
                routes[func] = (kind, functools.partial(self._norm, func, centered, kind))
        return routes

    def _norm(self, func, centered, kind, x, *args, **kwargs):
        """``func(x, *args, **kwargs)`` through :func:`slimact.functional.norm` (its forward is this very call),
        or ``None`` to run it as written: when nothing would be saved, in a dtype slimact does not pack, or over
        more than the last dim."""
        names = _NORM_ARGS[centered]
        # Fewer positional arguments than names (defaults), or more (torch.layer_norm's cudnn_enable).
        bound = {**dict(zip(names, args, strict=False)), **{k: v for k, v in kwargs.items() if k in names}}
        shape, weight, bias = bound.get("normalized_shape"), bound.get("weight"), bound.get("bias")
        params = [t for t in (weight, bias) if t is not None]
        if (not isinstance(x, Tensor) or x.dtype not in COMPRESSIBLE_DTYPES
                or not torch.is_grad_enabled() or not (x.requires_grad or any(t.requires_grad for t in params))):
            return None
        channels = (x.shape[-1],) if x.dim() else None
        if tuple([shape] if isinstance(shape, int) else shape) != channels or any(
            not isinstance(t, Tensor) or tuple(t.shape) != channels for t in params
        ):
            return None
        eps = bound.get("eps", _LAYER_NORM_EPS if centered else None)
        eps = rms_default_eps(x.dtype) if eps is None else float(eps)
        return norm(x, weight, bias, eps, self._cfg(kind, x), centered=centered,
                    fn=lambda t: func(t, *args, **kwargs))

    # Layers recomputed by activation checkpointing (torch.utils.checkpoint on a module, Hugging Face's
    # gradient_checkpointing): the recompute runs the layer again in the backward, outside the model's forward
    # and so outside the mode, where its calls would keep other tensors than the forward's routed ones
    # (CheckpointError: "a different number of tensors was saved"). A submodule that runs in training with
    # grad on while the mode is off enters it for its own call, so both passes route alike. (The loss route
    # stays off there: the head's output is tracked only from the model's own forward.)

    def _enter_in_layers(self, model: nn.Module) -> list:
        handles = []
        for module in model.modules():
            if module is not model:
                handles += [module.register_forward_pre_hook(self._enter_layer),
                            module.register_forward_hook(self._exit_layer, always_call=True)]
        return handles

    def _enter_layer(self, module, args):
        if (self._mode is None and self.handlers and module.training and torch.is_grad_enabled()
                and not torch.compiler.is_compiling()):
            self._mode, self._layer = _Mode(self), module
            self._mode.__enter__()

    def _exit_layer(self, module, args, output):
        if self._layer is module and self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode, self._layer = None, None

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
            self._mode, self._layer = None, None
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
            self._mode, self._layer = None, None
