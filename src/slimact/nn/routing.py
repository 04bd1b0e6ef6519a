"""Routing what a model computes in its own code, not in modules, through slimact.

Much of what a model keeps for the backward is computed by calls in its ``forward`` methods rather than by
modules ``convert`` can swap: ``nn.functional.dropout`` in OPT's, BART's and Whisper's layers;
``F.relu``/``F.gelu`` as the ``activation`` of ``nn.TransformerEncoderLayer``;
``gelu(x)`` in RoBERTa's LM head; ``F.cross_entropy`` on the logits in every Hugging Face LM. While a converted
model runs a training forward, a ``TorchFunctionMode`` (entered by a pre-hook on the model, left by its
forward hook) sends those calls to slimact:

* ``F.dropout`` -> :func:`slimact.functional.dropout` (the same draws; the mask kept as bits, exact);
* ``F.relu``/``torch.relu`` -> a 1-bit mask (exact); ``F.gelu`` (both forms), ``F.silu`` -> the input kept
  with the policy's codes (or, lossless, the output and a branch mask) as their modules are; the square
  (``square``, ``pow(2)``, ``** 2``) of a routed ReLU's output, unchanged since -> squared ReLU on it (nanochat's
  MLP): the ReLU's output kept with the policy's codes, or, lossless, nothing beyond the square's output;
* ``a * b`` (``torch.mul``, ``Tensor.mul``) of two tensors of one shape and dtype, one of them the output of an
  activation slimact computed (routed or a converted module; unchanged since) of a kind the policy compresses: a
  gate's product written in model code (T5's gated GELU, Mamba's ``y * act(gate)``, a SwiGLU inline) ->
  :func:`slimact.functional.product.product`, both factors kept with the policy's codes (the activation's output
  through its input's: no bytes of its own), not in full precision; ``a * b`` with ``a`` the output of a norm slimact
  computed (unchanged since) and ``b`` a smaller factor that broadcasts to it, spans its channels and needs a
  gradient (adaLN's ``norm(h) * (1 + scale[:, None])`` in DiT, SD3, Flux, PixArt, also in a norm module's own code,
  diffusers' ``AdaLayerNormZero``; either order, PyTorch's dtype promotion) ->
  :func:`slimact.functional.product.broadcast_product`, ``b`` kept exact and ``a`` through the norm's own pack (no
  bytes of its own); any other product runs as written, and so does a same-shape one in a norm module's own code (a
  gated norm: the normalisation that follows removes every scale of the factors, and the gradient to such a scale
  is a cancellation 8-bit factors swamp);
* ``F.cross_entropy`` on the head's logits -> the chunked LM loss, its gradients computed ahead
  (:mod:`slimact.nn.lm_loss`);
* ``F.layer_norm``/``torch.layer_norm``, ``F.rms_norm``/``torch.rms_norm`` over the last dim (OLMo's weightless
  LayerNorm, any norm class ``convert`` does not recognise) -> :func:`slimact.functional.norm`, its output
  kept (kinds ``layernorm``, ``rmsnorm``); ``F.group_norm``/``torch.group_norm`` (a norm class of a model's own
  that calls it) likewise, kind ``groupnorm``.
* ``F.scaled_dot_product_attention`` on ``[B, H, T, D]`` tensors (Falcon's attention, timm's, any model that
  calls it itself) -> :func:`slimact.functional.scaled_dot_product_attention`, keeping q, k, v 8-bit per head
  (exact under a lossless policy) and no ``[T, S]`` tensor.
* ``torch._grouped_mm`` (and transformers' ``grouped_mm_fallback`` op) of ``[S, K]`` tokens by ``[E, K, N]`` expert
  weights that need a gradient: the up and down projections of mixture-of-experts layers (transformers' experts
  under their default ``grouped_mm`` implementation: Mixtral, Qwen-MoE, OLMoE, DeepSeek, ...) ->
  :func:`slimact.functional.grouped_mm.grouped_mm`, the tokens kept with the linear kind's codes, the weights as they
  are (kind ``linear``; a lossless policy has no saving for it).
* inside attention modules that compute attention in their own code (Bloom's ALiBi ``baddbmm``, DeBERTa-v2's
  disentangled scores, MPNet, GPT-Neo, a user's ``q @ k.transpose(-1, -2)``, ``softmax``, ``@ v``; ``convert``
  names them): ``torch.matmul``/``@``, ``torch.bmm``, ``torch.baddbmm``, two-operand ``torch.einsum`` ->
  :mod:`slimact.functional.matmul`, ``F.softmax``/``torch.softmax``/``Tensor.softmax`` (``dtype=`` too) ->
  :mod:`slimact.functional.softmax`, as Mesa's MatMul and Softmax modules keep them: 8-bit, one scale per head
  (per ``[B, H]`` index of a ``[B * H, T, S]`` operand), the probabilities packed once for the softmax and the
  product reading them (through a view too, and across a dropout: the product keeps the softmax's pack and the
  dropout's mask as bits). Only operands that need a gradient are packed; a parameter (or a view of one) is
  kept as it is. ``torch.gather`` there (DeBERTa-v2's relative scores) -> :mod:`slimact.functional.gather`:
  only the index is kept, where PyTorch keeps the gathered-from scores (exact; kind ``attention``).

Calls made in the forward of another converted model (a teacher, a model held in a list) are that model's:
its own mode routes them as its policy says, or they run as written (its excluded modules, its eval mode).
Calls made inside a module the user left alone (the policy's ``exclude`` patterns, ``convert``'s ``filter_fn``)
or inside a module ``convert`` would replace but the policy leaves alone (an excluded index, a norm kept as
written) run as written: a pre-hook and a forward hook on each such module count how deep the forward is in one.

Each route is on when its kind (``dropout``, ``relu``, ``gelu``, ``silu``, ``lmloss``) is enabled by the
policy and no ``include`` pattern restricts the policy to named modules (a call has no module name). The
attention routes (``matmul``, ``softmax``, and ``attention`` for the gather) are decided per attention module by
its qualified name (kinds, ``include``/``exclude`` patterns); a lossless policy has no saving for the products
and softmaxes and leaves them as written.
Functional calls have no module to hold a running estimate, so they use each tensor's own range under
``scale = "running"`` policies too. Calls that would not save anything (no gradient, eval mode, in-place) and
calls on nested tensors run as written; the forward result is PyTorch's own in every case. A layer that
activation checkpointing recomputes in the backward (outside the model's forward) enters the mode for its own
call: it routes as it did in the forward. Calls made directly in checkpointed code that is not a module's call (a
checkpointed method, the ``forward`` that transformers' gradient checkpointing wraps) run as written in both
passes. A mode sees the calls of Python code only, not those made inside another torch function (the attention
dropout inside ``F.multi_head_attention_forward``, which slimact's ``nn.MultiheadAttention`` replaces anyway).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
import sys
import threading
import types
import weakref
from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from slimact._cache import dropping
from slimact._kinds import _FORM_KIND, _foreign, kind_of, named_norm
from slimact.functional._saving import (
    IN_PLACE,
    KEPT_OUTPUTS,
    Mask,
    copy_on_write,
    faking,
    kept_or_view_of_kept,
    opaque,
    transformed,
)
from slimact.functional.activation import activation, output_form
from slimact.functional.attention import scaled_dot_product_attention
from slimact.functional.attention_guard import guarded
from slimact.functional.clamped_glu import GateForm
from slimact.functional.dropout import dropout, scale_of
from slimact.functional.dropout import native_dropout as slim_native_dropout
from slimact.functional.gather import gather
from slimact.functional.grouped_mm import grouped_mm
from slimact.functional.matmul import Dropped, baddbmm, bmm, einsum, einsum_terms, matmul, packing_source
from slimact.functional.norm import _group_norm_applies, group_norm, norm, output_kept_as, rms_default_eps
from slimact.functional.product import broadcast_big, broadcast_product, product
from slimact.functional.softmax import keep_exact, softmax
from slimact.nn.clamped_glu import GATE_ATTR, Gate
from slimact.nn.lm_loss import _ALIASES, NOT_LAZY, LossTracker, labels_position, lazy_call
from slimact.policy import Policy
from slimact.quant.reference import COMPRESSIBLE_DTYPES, QuantConfig

__all__ = ["FUNCTIONAL_NAME", "Routing", "drop_routing_hooks", "routings_around"]

#: The name policies see for calls in model code (for ``exclude`` patterns and ``summary``).
FUNCTIONAL_NAME = "(functional)"

# The arguments after the input of F.layer_norm/torch.layer_norm (centered) and F.rms_norm/torch.rms_norm, in order.
_NORM_ARGS = {True: ("normalized_shape", "weight", "bias", "eps"), False: ("normalized_shape", "weight", "eps")}
_LAYER_NORM_EPS = 1e-5  # F.layer_norm's default
# The arguments of F.group_norm/torch.group_norm after the input, in order (torch's: then cudnn_enabled); its eps.
_GROUP_NORM_ARGS = ("num_groups", "weight", "bias", "eps")
_GROUP_NORM_EPS = 1e-5

_R = TypeVar("_R")


def routings_around(module: nn.Module) -> list[Routing]:
    """The routings of the converted models ``module`` is a submodule of (found through the hooks each put on it)."""
    hooks = module._forward_pre_hooks.values()
    return list({id(r): r for hook in hooks if isinstance(r := getattr(hook, "__self__", None), Routing)
                 and getattr(hook, "__func__", None) is Routing._enter_layer and not r.removed}.values())


def drop_routing_hooks(model: nn.Module, keep: Sequence[Routing] = ()) -> None:
    """Remove from ``model``'s modules the forward hooks and experts gates (:class:`~slimact.nn.clamped_glu.Gate`) of
    every routing but ``keep`` (those of the converted models ``model`` is a block of, :func:`routings_around`):
    ``revert`` makes ``model``'s modules plain in every model that holds them, as it restores their classes, which
    are theirs alone. Left there, such hooks routed calls after ``revert``: a copy of a converted module put into
    the model after ``convert`` (peft's ``modules_to_save``) holds the routing's hooks in tables of its own, which
    the routing's handles, made for the original's, never reach (an 8-bit LayerNorm, a gated unit packed 8-bit, in a
    model ``revert`` had made plain); a block loaded with its converted model and put into another; a block two
    converted models share, its classes restored by ``revert`` of one, its calls routed by the other's hooks (half
    converted)."""
    kept = {id(r) for r in keep}
    for module in model.modules():
        for table, extras in _hook_tables(module):
            for key in [key for key, hook in table.items() if _dropped(_routing_of(hook), kept)]:
                del table[key]
                for extra in extras:
                    extra.pop(key, None)
        gate = module.__dict__.get(GATE_ATTR)
        if isinstance(gate, Gate) and _dropped(_routing_of(gate.cfg), kept):
            del module.__dict__[GATE_ATTR]


def _dropped(routing: Routing | None, kept: set[int]) -> bool:
    return routing is not None and id(routing) not in kept


def _hook_tables(module: nn.Module) -> tuple[tuple[dict, tuple[dict, ...]], ...]:
    """``module``'s forward pre-hook and forward hook tables, each with the tables keyed alike beside it."""
    return ((module._forward_pre_hooks, (module._forward_pre_hooks_with_kwargs,)),
            (module._forward_hooks, (module._forward_hooks_with_kwargs, module._forward_hooks_always_called)))


def _routing_of(fn: object) -> Routing | None:
    """The routing a hook or callback is a bound method of (or a ``functools.partial`` of one), if any."""
    owner = getattr(fn.func if isinstance(fn, functools.partial) else fn, "__self__", None)
    return owner if isinstance(owner, Routing) else None


def _bound_to(fn: object, routing: Routing) -> object:
    """``fn`` (a bound method of another routing, or a ``functools.partial`` of one) bound to ``routing`` instead."""
    if isinstance(fn, functools.partial):
        return functools.partial(_bound_to(fn.func, routing), *fn.args, **fn.keywords)
    return types.MethodType(fn.__func__, routing)


def _top_saved_hook() -> object:
    """The innermost saved-tensors pack hook in place now (``torch.autograd.graph.saved_tensors_hooks``), or None."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return None if hooks is None else hooks[0]


#: The kinds of norm modules, in whose own code a product runs as written (``Routing._product``; also a module whose
#: class is named a norm and holds no submodules, ``_kinds.named_norm``: a gated or grouped norm,
#: ``MambaRMSNormGated``, is no form slimact knows).
_NORM_KINDS = frozenset({"layernorm", "rmsnorm", "groupnorm", "batchnorm"})


def _recording() -> bool:
    """Whether ``torch.jit.trace`` records or a ``FakeTensorMode`` is on: the mode stays off, the calls as written (a
    trace is the plain model's program, and its check, re-tracing with the mode off, raised "Graphs differed across
    invocations" on a converted model in training mode; under FakeTensorMode the mode's calls read fake tensors'
    data pointers)."""
    return torch._C._is_tracing() or faking()


def _nested(args: tuple, kwargs: dict) -> bool:
    """Whether a call takes a nested or sparse tensor (:func:`~slimact.functional._saving.opaque`: a jagged
    F.scaled_dot_product_attention, F.gelu or F.dropout, a sparse adjacency's product in a graph attention raised
    where the plain call ran), so it runs as written."""
    return any(isinstance(a, Tensor) and opaque(a) for a in (*args, *kwargs.values()))


def _wants_grad(x: object) -> bool:
    """Whether a call on ``x`` keeps something slimact compresses: a gradient will flow, in a dtype it packs."""
    return isinstance(x, Tensor) and x.dtype in COMPRESSIBLE_DTYPES and x.requires_grad and torch.is_grad_enabled()


def _packed_if_needed(x: Tensor, cfg: QuantConfig | None) -> QuantConfig | None:
    """``cfg`` for an operand that needs a gradient, ``None`` (kept as it is) for one that does not or for a
    parameter (or a view of one: ``weight.t()``): PyTorch keeps those as they are, at no cost; ``None`` too for a
    running sum (:func:`_running_sum`)."""
    if not x.requires_grad or isinstance(x, nn.Parameter) or isinstance(x._base, nn.Parameter) or _running_sum(x):
        return None
    return cfg


#: Nodes that reshape, re-type, pad or slice a tensor, or (with one input needing a gradient, the other a constant:
#: ``+ eps``, ``* 1.0``) shift or scale it, without undoing a growth of its rows along a dim.
_RESHAPING = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "UnsqueezeBackward0",
                        "SqueezeBackward0", "SqueezeBackward1", "ExpandBackward0", "TransposeBackward0",
                        "PermuteBackward0", "ToCopyBackward0", "CloneBackward0", "ConstantPadNdBackward0",
                        "SliceBackward0", "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1",
                        "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1"})


def _running_sum(x: Tensor) -> bool:
    """Whether ``x`` is a cumulative sum (or product), seen through reshapes, pads, slices and shifts or scales by a
    constant: causal linear attention's normaliser ``k.cumsum(-2)`` (lucidrains' linear-attention-transformer;
    performer-pytorch's ``k_cumsum.type_as(q) + eps``), whose rows grow along the
    sequence, so that one 8-bit scale per head gave its first positions a few codes and q's gradient (a difference
    of two such products) was off: ``to_q.weight`` at 16.5-24 dB under ``"int8"``, cosine 0.96 under ``"mesa"``.
    Such an operand is kept as PyTorch keeps it."""
    return _running_sum_node(x.grad_fn, 8)


def _running_sum_node(node: object, depth: int) -> bool:
    name = type(node).__name__ if node is not None else ""
    if name in ("CumsumBackward0", "CumprodBackward0", "LogcumsumexpBackward0"):
        return True
    if depth == 0 or name not in _RESHAPING:
        return False
    inputs = [n for n, _ in node.next_functions if n is not None]
    # (a sum of tensors grows with its running sum, a product of two need not: followed where one input alone needs
    # a gradient)
    if len(inputs) != 1 and not name.startswith(("Add", "Sub")):
        return False
    return any(_running_sum_node(n, depth - 1) for n in inputs)


#: The products and softmaxes routed inside attention modules, by kind.
_ATTENTION_CALLS = {
    "matmul": (torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm, Tensor.bmm, torch.baddbmm,
               Tensor.baddbmm, torch.einsum),
    # native_dropout: where it drops a routed softmax's output (slimact's dropout calls its own, which modes see
    # as itself), its mask is noted, so that the product reading the dropped probabilities keeps the softmax's
    # pack and the mask (Dropped).
    "softmax": (F.softmax, torch.softmax, Tensor.softmax, torch.native_dropout, slim_native_dropout),
    # Exact (the index kept, not the gathered tensor), so on under lossless policies too.
    "attention": (torch.gather, Tensor.gather),
}


class _Notes:
    """Something noted about live tensors, by identity: an entry holds its tensor weakly and dies with it, and
    an in-place change of the tensor since (its version counter) voids it. A note must not hold its own
    tensor (it would never die)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, int, object]] = {}

    def put(self, x: Tensor, note: object) -> None:
        key, entries = id(x), self._entries
        entries[key] = (dropping(x, entries, key), x._version, note)

    def __deepcopy__(self, memo) -> _Notes:  # notes about this model's live tensors are not a copy's
        return _Notes()

    def get(self, x: Tensor):
        entry = self._entries.get(id(x))
        if entry is None or entry[0]() is not x or entry[1] != x._version:
            return None
        return entry[2]


class _Running(threading.local):
    """The routings whose model's forward runs now in this thread, innermost last. A mode routes the calls of its
    own model's code only: a converted model called in another's forward (a teacher, a model held in a list)
    decides its own calls (its policy, its excluded modules, its eval mode), which the outer mode would
    otherwise route when the inner one leaves them as written."""

    def __init__(self) -> None:
        self.routings: list[Routing] = []


_RUNNING = _Running()


class _Mode(TorchFunctionMode):
    # slimact's Functions run their forwards with this mode off (functional._saving): their ops are no model code.
    _slimact_routes_model_code = True

    def __init__(self, routing: Routing) -> None:
        super().__init__()
        self.routing = routing

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # A submodule compiled on its own (block.compile(), torch.compile(block)) runs in the mode its model's eager
        # forward entered, and dynamo traces the mode: the calls there run as written, as in a compiled model (the
        # routes read tensor bases and live notes that a traced graph cannot; Bloom's routed bmm failed in inductor).
        if torch.compiler.is_compiling():
            return func(*args, **(kwargs or {}))
        routing = self.routing
        loss = routing.loss
        # Most calls (the ops inside slimact's own Functions, tensor attribute reads: ~1,200 per "int8" GPT-2 block
        # forward) are nothing the mode routes or follows: run as written, with no further look-up.
        if func not in routing.handlers and (loss is None or not (loss.lazy_made or func in _ALIASES)):
            if args and KEPT_OUTPUTS and kept_or_view_of_kept(args[0]):  # (an in-place op on it: copy_on_write)
                out = copy_on_write(func, args, kwargs or {})
                if out is not NotImplemented:
                    return out
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        running = _RUNNING.routings
        if running and running[-1] is not routing:  # another converted model's code
            return func(*args, **kwargs)
        # A head's LazyLogits: answered lazily where it can be, else computed here, before any handler sees it
        # (F.cross_entropy, the fused loss's own handler, takes it as it is).
        if loss is not None and loss.lazy_made and func is not F.cross_entropy:
            out, args, kwargs = lazy_call(func, args, kwargs)
            if out is not NOT_LAZY:
                return out
        # An in-place op on an output a slimact Function keeps as it is (copy_on_write): `+=` and the like (IN_PLACE,
        # which the handlers list for the look-up above), F.relu(h, inplace=True).
        out = copy_on_write(func, args, kwargs)
        if out is not NotImplemented:
            return out
        if func in IN_PLACE:
            return func(*args, **kwargs)
        handler = routing.handlers.get(func)
        # The call's arguments as the handler names them (None: a keyword it does not take, bmm's out_dtype); the call
        # itself, where it runs as written, keeps PyTorch's (F.gelu's approximate is keyword-only there).
        call = (None if handler is None else _as_handler_call(func, handler, args, kwargs) if kwargs
                else _fits(func, handler, args))
        # The head's product is the LM loss's, which is on wherever the head itself is left alone. Under a torch.func
        # transform or forward-mode AD, which slimact's Functions do not support, every call runs as written.
        if (handler is not None and call is not None and call[0] and (not routing.excluded_depth or func is F.linear)
                and not transformed() and routing.in_scope() and not _nested(*call)):
            out = handler(*call[0], **call[1])
            if out is not None:
                return out
        if loss is not None:
            if loss.lazy_made and func is F.cross_entropy:  # one the fused loss did not take: computed now
                _, args, kwargs = lazy_call(func, args, kwargs)
            out = func(*args, **kwargs)
            loss.seen(func, args, out)
            return out
        return func(*args, **kwargs)


#: What :func:`_call_params` found for a handler (keyed by its code: handlers are bound per routing).
_PARAMS: dict[tuple, tuple[tuple[str, ...], frozenset[str], bool]] = {}


def _code_of(handler: object) -> object:
    if isinstance(handler, functools.partial):
        return _code_of(handler.func), handler.args, tuple(handler.keywords.items())
    return getattr(handler, "__func__", handler)


@functools.cache
def _torch_names(func: object) -> tuple[str, ...]:
    """``func``'s parameter names as PyTorch names them (its ``torch.overrides`` testing signature), in order."""
    import inspect

    ref = _overrides().get(func)
    try:
        return tuple(inspect.signature(ref).parameters) if ref is not None else ()
    except (TypeError, ValueError):
        return ()


@functools.cache
def _overrides() -> dict:
    from torch.overrides import get_testing_overrides

    return get_testing_overrides()  # (built once: PyTorch builds the whole table on each call)


def _call_params(func: object, handler: object) -> tuple[tuple[str, ...], frozenset[str], bool, float]:
    """A handler's positional parameter names, every name it takes, whether it takes any keyword, and the most
    positional arguments it takes (``inf`` with ``*args``)."""
    key = (func, _code_of(handler))
    if key not in _PARAMS:
        params = inspect.signature(handler).parameters.values()
        positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        _PARAMS[key] = (positional, frozenset(p.name for p in params if p.kind != p.VAR_POSITIONAL),
                        any(p.kind == p.VAR_KEYWORD for p in params),
                        math.inf if any(p.kind == p.VAR_POSITIONAL for p in params) else len(positional))
    return _PARAMS[key]


def _fits(func: object, handler: object, args: tuple) -> tuple[tuple, dict] | None:
    """A call without keywords as ``handler`` takes it, or ``None`` where it passes more positional arguments than the
    handler takes: PyTorch's deprecated forms with the scalars first (``torch.baddbmm(beta, x, alpha, b1, b2)``,
    ``x.baddbmm(beta, b1, b2)``) run as written (the handler had raised a TypeError where PyTorch ran)."""
    return (args, {}) if len(args) <= _call_params(func, handler)[3] else None


def _as_handler_call(func: object, handler: object, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A call's arguments as ``handler`` takes them, or ``None`` where it takes one of them under no name.

    Model code passes arguments by PyTorch's names (``torch.matmul(a, other=b)``, ``torch.bmm(a, mat2=b)``,
    diffusers' ``F.scaled_dot_product_attention(query=q, key=k, value=v)``); a handler may name them otherwise
    (``_matmul(a, b)``: the call raised "unexpected keyword argument 'other'" where PyTorch ran) and reads its
    leading tensors positionally (a call with keywords only ran as written, keeping plain's bytes). A keyword at a
    position where the handler's name differs takes the handler's name; leading ones become positional."""
    positional, names, any_keyword, most = _call_params(func, handler)
    if len(args) > most:
        return None
    torch_names, kwargs = _torch_names(func), dict(kwargs)
    for i in range(len(args), min(len(positional), len(torch_names))):
        theirs, ours = torch_names[i], positional[i]
        if theirs != ours and theirs in kwargs and theirs not in names and ours not in kwargs:
            kwargs[ours] = kwargs.pop(theirs)
    while len(args) < len(positional) and positional[len(args)] in kwargs:
        args = (*args, kwargs.pop(positional[len(args)]))
    if not any_keyword and not kwargs.keys() <= names:
        return None
    return args, kwargs


class _NoteDropout(TorchFunctionMode):
    """Only ``native_dropout`` routed (noted): for a dropout that a handler of :class:`_Mode` runs itself."""

    def __init__(self, routing: Routing) -> None:
        super().__init__()
        self.routing = routing

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = None
        if not torch.compiler.is_compiling():
            if func is torch.native_dropout:
                out = self.routing._native_dropout(*args, **kwargs)
            elif func is slim_native_dropout:
                out = self.routing._slim_native_dropout(*args, **kwargs)
        return func(*args, **kwargs) if out is None else out


#: Routed functions pickle cannot name (``Tensor.__pow__`` is a Python wrapper in ``torch._tensor``), by a name
#: that stands for them in a pickled model (``torch.save`` of a whole converted model).
_PICKLED_AS = {Tensor.__pow__: "Tensor.__pow__"}


def _op_name(func: object) -> str | None:
    """``"torch.ops.<namespace>.<name>"`` for a custom op's packet (which pickle cannot name), else ``None``."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        return f"torch.ops.{func._qualified_op_name.replace('::', '.')}"
    return None


def _op_named(name: str) -> object | None:
    """The op :func:`_op_name` names, if registered in this process."""
    if not name.startswith("torch.ops."):
        return None
    namespace, _, op = name.removeprefix("torch.ops.").partition(".")
    try:
        return getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return None


def _transformers_grouped_mm() -> object | None:
    """transformers' ``grouped_mm_fallback`` op (its experts' grouped product where ``torch._grouped_mm`` cannot run:
    CUDA before sm80, CPU before torch 2.10, compiling in fp32), if registered in this process."""
    if "transformers.integrations.moe" not in sys.modules:
        return None
    return _op_named("torch.ops.transformers.grouped_mm_fallback")


# nn.TransformerEncoderLayer's eval forward runs one fused kernel (torch._transformer_encoder_layer_fwd) (and
# nn.MultiheadAttention's torch._native_multi_head_attention), and nn.TransformerEncoder's hands its layers nested
# tensors for a padding mask (padded positions' outputs zero), only where nothing needs a gradient and no
# TorchFunctionMode is on, and the layer's kernel only where none of its modules has a forward hook. slimact's routing
# hooks every module (the routing context), and the mode it enters for a training forward was on in an eval-mode encoder
# inside a training model: a converted layer (or MultiheadAttention) ran module by module (PyTorch's Python path), its
# output not bit for bit plain's (a layer's up to 7e-7 apart where a mask is given; an attention's 9e-8), slower
# (benchmarks/results/encoder_eval.md), and under a training model the encoder's padded positions not zeroed (up to 1.2
# apart; a loss over them, a gradient off by 12). Neither the hooks nor the mode do anything there: the fused paths run
# none of the layer's modules, and no gradient flows. So, for a call of such a block in eval mode where no gradient can
# flow (none of its parameters, nor its input, needs one: PyTorch's own condition, or stricter), the mode steps aside,
# and the layer's ``self.modules()`` called from nn.TransformerEncoderLayer.forward (its fast-path check: told by the
# caller's code) gives the modules' hooks without slimact's; a hook of the user's still refuses the fused path, as on
# the plain layer. Any other caller of the layer's ``modules()`` meanwhile gets the modules themselves.

_LAYER_FORWARD = inspect.unwrap(nn.TransformerEncoderLayer.forward).__code__
_CHECK_ATTR = "modules"  # (an instance attribute during such a call: shadows nn.Module.modules)
_CHECK_LOCK = threading.Lock()
#: Held while a routing's training forward is claimed by a thread (:meth:`Routing._enter`).
_OWNER_LOCK = threading.Lock()


class _Unhooked:
    """What the fast-path check reads of a module: its forward hooks and pre-hooks, slimact's left out."""

    __slots__ = ("_forward_hooks", "_forward_pre_hooks")

    def __init__(self, module: nn.Module) -> None:
        self._forward_hooks = [h for h in module._forward_hooks.values() if _foreign(h)]
        self._forward_pre_hooks = [h for h in module._forward_pre_hooks.values() if _foreign(h)]


class _FastPathCheck:
    """A layer's ``modules`` while calls of it that can take the fused path run (counted: threads, a forward that
    calls the layer's own twice)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer, self.calls = layer, 0

    def __reduce__(self):  # (a copy made during a call is in no call: its next call's end removes it)
        return _FastPathCheck, (self.layer,)

    def __call__(self) -> Iterator:
        if sys._getframe(1).f_code is _LAYER_FORWARD:
            return iter([_Unhooked(m) for m in nn.Module.modules(self.layer)])
        return nn.Module.modules(self.layer)

    @staticmethod
    def enter(layer: nn.Module) -> None:
        with _CHECK_LOCK:
            check = layer.__dict__.get(_CHECK_ATTR)
            if not isinstance(check, _FastPathCheck) or check.layer is not layer:
                check = layer.__dict__[_CHECK_ATTR] = _FastPathCheck(layer)
            check.calls += 1

    @staticmethod
    def exit(layer: nn.Module) -> None:
        with _CHECK_LOCK:
            check = layer.__dict__.get(_CHECK_ATTR)
            if isinstance(check, _FastPathCheck):
                check.calls -= 1
                if check.calls <= 0:
                    del layer.__dict__[_CHECK_ATTR]


#: The modules whose eval forward has a fused path of PyTorch's that slimact's mode (and hooks) would refuse.
_FUSED_IN_EVAL = (nn.TransformerEncoderLayer, nn.TransformerEncoder, nn.MultiheadAttention)


def _fused_possible(block: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether a call of ``block`` (:data:`_FUSED_IN_EVAL`) can take PyTorch's fused eval path: in eval mode (an
    encoder's first layer's), with no gradient to flow through its parameters or tensor arguments."""
    first = block.layers[0] if isinstance(block, nn.TransformerEncoder) and len(block.layers) else block
    if first.training or torch.compiler.is_compiling():
        return False
    if not torch.is_grad_enabled():
        return True
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)]
    return not any(t.requires_grad for t in tensors) and not any(p.requires_grad for p in block.parameters())


class Routing:
    """Installed on a converted model by ``convert``; ``remove()`` uninstalls it."""

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["handlers"] = {_PICKLED_AS.get(func, _op_name(func) or func): fn for func, fn in self.handlers.items()}
        # Only the handles of modules still alive: a submodule outlives its converted model (put in another model,
        # the first one dropped) with this routing's hooks on it, and torch's RemovableHandle cannot be copied once
        # the module it was registered on is gone (its always-called hook table: "cannot create weak reference to
        # 'NoneType' object", from a deepcopy of the other model).
        state["handles"] = [h for h in self.handles if h.hooks_dict_ref() is not None]
        state["_contexts"] = None  # (about this model's module calls, by weak reference: not a copy's)
        state["_eval_blocks"] = {}  # (calls under way: not a copy's)
        state["_owner"] = None  # (the thread whose training forward runs now: not a copy's)
        state["_root"] = None  # (a weak reference: set again by a copy of the model, see __deepcopy__)
        return state

    def __deepcopy__(self, memo: dict) -> Routing:
        root = self._root() if self._root is not None else None
        if root is not None and id(root) not in memo:
            # A converted module copied without its model (peft's modules_to_save, a block's EMA copy): its hooks,
            # copied with it, are this routing's still. A copy of the routing took with it everything the routing
            # holds (the LM head, the excluded and experts modules: weights and all), routed the copy's calls on its
            # own, and outlived revert (the copy's hooks are not in the tables this routing's handles remove from).
            # (Not memoised: a later reach of the routing within the same copy, through the model, copies it.)
            return self
        twin = Routing.__new__(Routing)
        memo[id(self)] = twin
        twin.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        if root is not None:  # (a copy of the whole model: the copy's routing)
            twin._root = weakref.ref(memo[id(root)])
        # Modules this copy reached before the model (a list [block, model], a wrapper holding the blocks first, a
        # block holding a reference to its model) kept this routing's hooks and gates, the routing then being copied
        # alone: the copy's routing's now. Their hook tables are in memo, a module's whose copy is still being made
        # (its state not set yet) too.
        for copied in list(memo.values()):
            if isinstance(copied, dict):
                for key, hook in list(copied.items()):
                    if _routing_of(hook) is self:
                        copied[key] = _bound_to(hook, twin)
            elif isinstance(copied, Gate) and _routing_of(copied.cfg) is self:
                copied.cfg = _bound_to(copied.cfg, twin)
        return twin

    def __setstate__(self, state: dict) -> None:
        named = {name: func for func, name in _PICKLED_AS.items()}
        handlers = {named.get(func, func) if isinstance(func, str) else func: fn
                    for func, fn in state["handlers"].items()}
        # (an op of a namespace not registered in this process, its library not imported: no call can reach it)
        state["handlers"] = {_op_named(func) if isinstance(func, str) else func: fn for func, fn in handlers.items()
                             if not isinstance(func, str) or _op_named(func) is not None}
        state["_contexts"] = weakref.WeakKeyDictionary()
        state.setdefault("removed", False)  # (a routing pickled before these existed)
        state.setdefault("_root", None)
        self.__dict__.update(state)

    def __init__(self, model: nn.Module, policy: Policy, head: nn.Linear | None,
                 excluded: list[nn.Module] = (),
                 attention: Sequence[tuple[str, nn.Module]] = (),
                 gates: Sequence[tuple[nn.Module, GateForm]] = ()) -> None:
        """``attention``: ``(qualified name, module)`` of the attention modules whose own code computes attention
        (their products and softmaxes are routed as far as the policy wants them, by name). ``gates``: experts
        modules and the form of their clamped gated unit (:mod:`slimact.nn.clamped_glu`), which slimact computes
        (their ``_apply_gate`` set to a :class:`~slimact.nn.clamped_glu.Gate` until :meth:`remove`)."""
        self.policy = policy
        #: The converted model, by weak reference (a copy of one of its modules alone shares this routing).
        self._root: weakref.ref[nn.Module] | None = weakref.ref(model)
        #: Whether :meth:`remove` ran (the hooks it left on copies of the model's modules then find no outer model).
        self.removed = False
        #: Experts modules whose ``_apply_gate`` this routing set.
        self.gated = [module for module, _ in gates]
        for module, form in gates:
            gate = module.__dict__[GATE_ATTR] = Gate(form, functools.partial(self._cfg, "silu"))
            gate.watch(module)
        self.excluded_depth = 0
        self.loss = (LossTracker(head, lazy=not policy.keep_logits) if head is not None and self._on("lmloss")
                     else None)
        self._labels_at = labels_position(model)
        routes = {
            F.dropout: ("dropout", self._dropout),
            F.relu: ("relu", self._relu),
            torch.relu: ("relu", self._relu),
            # The square of a routed ReLU's output: squared ReLU (nanochat's and modded-nanogpt's MLP).
            torch.square: ("relu", self._square),
            Tensor.square: ("relu", self._square),
            torch.pow: ("relu", self._square),
            Tensor.pow: ("relu", self._square),
            Tensor.__pow__: ("relu", self._square),
            F.gelu: ("gelu", self._gelu),
            F.silu: ("silu", self._silu),
            # The product of an activation's output (T5's gated GELU, Mamba's gate, a SwiGLU written inline).
            torch.mul: ("product", self._product),
            Tensor.mul: ("product", self._product),
            F.scaled_dot_product_attention: ("attention", self._sdpa),
            # Mixture-of-experts layers' grouped products (transformers' grouped_mm experts implementation).
            torch._grouped_mm: ("linear", functools.partial(self._grouped_mm, native=True)),
            **self._norm_routes(),
        }
        if (fallback := _transformers_grouped_mm()) is not None:
            routes[fallback] = ("linear", functools.partial(self._grouped_mm, native=False))
        self.handlers = {func: fn for func, (kind, fn) in routes.items() if self._on(kind)}
        self.kinds = sorted({kind for kind, _ in routes.values() if self._on(kind)})
        if self.loss is not None:
            self.handlers[F.cross_entropy] = self.loss.fused_loss
            self.handlers[F.linear] = self.loss.lazy_head
        if self.handlers:  # (the mode runs: it also sees in-place ops on the outputs slimact keeps)
            self.handlers.update(dict.fromkeys(IN_PLACE, copy_on_write))
        self._mode: _Mode | None = None
        self.handles = [
            model.register_forward_pre_hook(self._enter, with_kwargs=True),
            model.register_forward_hook(self._exit, always_call=True),
        ]
        self._watch(attention)
        #: Modules whose own calls (and their children's) run as written.
        self.excluded = tuple(excluded)
        self.reverted: tuple[nn.Module, ...] = ()  # (excluded by revert of a block after convert: summary says so)
        self._count_depth("excluded_depth", excluded if self.handlers else ())
        #: How deep the forward is in norm modules' own code, where products run as written (see _product).
        self.norm_depth = 0
        self._count_depth("norm_depth", [m for m in model.modules() if kind_of(m) in _NORM_KINDS or named_norm(m)]
                          if Tensor.mul in self.handlers else ())
        self._layer: nn.Module | None = None
        # The innermost saved-tensors pack hook where the innermost module call began (see _enter_layer), and the
        # (module, outer scope) of the module calls that opened one.
        self._scope: object = None
        self._scopes: list[tuple[nn.Module, object]] = []
        # Per module called in a scope of its own (a checkpointed one), where the forward called it from (see
        # _enter_layer); and, while a recompute runs such a call, the context it replaced.
        self._contexts: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()
        self._outer: tuple | None = None
        #: Modules whose fused eval paths slimact's mode and hooks step aside for (:data:`_FUSED_IN_EVAL`).
        self.encoders: list[nn.Module] = []
        # Per thread, the blocks whose eval call runs now, innermost last, and the mode each stepped aside, if any.
        self._eval_blocks: dict[int, list[tuple[nn.Module, _Mode | None]]] = {}
        self.handles += self._enter_in_layers(model)

    def _watch(self, attention: Sequence[tuple[str, nn.Module]]) -> None:
        #: Watched attention module name -> the kinds routed in its code.
        self.watched: dict[str, frozenset[str]] = {}
        #: Watched modules in which a call was routed (at least once since convert).
        self.routed: set[str] = set()
        #: Watched modules in whose code an F.scaled_dot_product_attention call was routed (summary's evidence that a
        #: module reported converted for the call its forward mentions made one).
        self.attended: set[str] = set()
        #: Of those, the modules in which such a call kept q, k, v exact for the score error guard (summary's note).
        self.guarded: set[str] = set()
        # (name, kinds) of the watched modules running now, innermost last (empty kinds: in eval mode).
        self._inside: list[tuple[str, frozenset[str]]] = []
        # Outputs of routed softmaxes, and dropouts of them (by id; each entry dies with its tensor).
        self._probs = _Notes()
        # Outputs of routed ReLUs (non-negative: their square is squared ReLU).
        self._relus = _Notes()
        # Outputs of routed grouped products (an experts layer's: weighed by the routing weights next)
        self._grouped = _Notes()
        self._dropped = _Notes()
        for name, module in attention:
            kinds = frozenset(k for k in _ATTENTION_CALLS if self.policy.skip_reason(k, name) is None)
            if not kinds or isinstance(module, torch.jit.ScriptModule):
                continue
            self.watched[name] = kinds
            self.handles += [
                module.register_forward_pre_hook(functools.partial(self._push, name, kinds)),
                module.register_forward_hook(self._pop, always_call=True),
            ]
        on = set().union(*self.watched.values())
        handlers = {"matmul": (self._matmul, self._matmul, self._matmul, self._bmm, self._bmm, self._baddbmm,
                               self._baddbmm, self._einsum),
                    "softmax": (self._functional_softmax, self._softmax, self._softmax, self._native_dropout,
                                self._slim_native_dropout),
                    "attention": (self._gather, self._gather)}
        for kind in sorted(on):
            self.handlers.update(zip(_ATTENTION_CALLS[kind], handlers[kind], strict=True))
        self.kinds = sorted({*self.kinds, *on})

    def _push(self, name: str, kinds: frozenset[str], module: nn.Module, args) -> None:
        self._inside.append((name, kinds if module.training else frozenset()))

    def _pop(self, module: nn.Module, args, output) -> None:
        self._inside.pop()

    def _routing(self, kind: str) -> bool:
        """Whether a ``kind`` call now runs in a watched module that routes it."""
        return bool(self._inside) and kind in self._inside[-1][1]

    def _routed(self, out: _R) -> _R:
        """``out`` (a handler's result), the module the call runs in marked routed where it is slimact's: a module
        whose calls all ran as written (in float64, on operands needing no gradient) had been marked before the
        handler decided so, and ``summary(model, inputs)`` called its attention converted."""
        if out is not None and self._inside:
            self.routed.add(self._inside[-1][0])
        return out

    def _head_cfg(self, kind: str, x: Tensor) -> QuantConfig | None:
        """The config packing ``x``: one scale per head of ``[B, H, T, D]``, per ``[B * H]`` index of a rank-3
        ``[B * H, T, D]`` (the batched form Bloom and DeBERTa use), the policy's channel groups otherwise."""
        cfg = self._cfg(kind, x)
        return dataclasses.replace(cfg, group_dim=0, groups=0) if cfg is not None and x.dim() == 3 else cfg

    def _operand_cfgs(self, a: object, b: object) -> tuple[QuantConfig | None, QuantConfig | None] | None:
        """Configs for the two operands of a product worth routing, or ``None`` to run it as written (no
        gradient, a dtype slimact does not pack, mixed dtypes, nothing to pack)."""
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.dtype != b.dtype:
            return None
        if not (_wants_grad(a) or _wants_grad(b)) or a.dim() < 2 or b.dim() < 2:
            return None
        cfg_a = _packed_if_needed(a, self._head_cfg("matmul", packing_source(a)))
        cfg_b = _packed_if_needed(b, self._head_cfg("matmul", packing_source(b)))
        if cfg_a is None and cfg_b is None:
            return None
        return cfg_a, cfg_b

    def _dropped_of(self, a: Tensor) -> Dropped | None:
        """``a`` as a dropout of a routed softmax's probabilities, if it is one (or views one)."""
        return self._dropped.get(packing_source(a))

    def _matmul(self, a, b, *, out=None):
        cfgs = self._operand_cfgs(a, b) if out is None and self._routing("matmul") else None
        return None if cfgs is None else self._routed(matmul(a, b, *cfgs, dropped_a=self._dropped_of(a)))

    def _bmm(self, a, b, *, out=None):
        cfgs = self._operand_cfgs(a, b) if out is None and self._routing("matmul") else None
        if cfgs is None or a.dim() != 3 or b.dim() != 3:
            return None
        return self._routed(bmm(a, b, *cfgs, dropped_a=self._dropped_of(a)))

    def _baddbmm(self, x, batch1, batch2, *, beta=1, alpha=1, out=None):
        if out is not None or not isinstance(x, Tensor) or not self._routing("matmul"):
            return None
        cfgs = self._operand_cfgs(batch1, batch2)
        if cfgs is None or x.dtype != batch1.dtype or batch1.dim() != 3 or batch2.dim() != 3:
            return None
        return self._routed(baddbmm(x, batch1, batch2, *cfgs, beta=beta, alpha=alpha))

    def _einsum(self, equation, *operands):
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):  # torch.einsum(eq, [a, b])
            operands = tuple(operands[0])
        if not isinstance(equation, str) or len(operands) != 2 or not self._routing("matmul"):
            return None
        cfgs = self._operand_cfgs(*operands)
        if cfgs is None or einsum_terms(equation, *operands) is None:
            return None
        return self._routed(einsum(equation, *operands, *cfgs, dropped_a=self._dropped_of(operands[0])))

    def _softmax(self, x, dim=None, dtype=None):
        if not isinstance(dim, int) or not _wants_grad(x) or not self._routing("softmax"):
            return None
        if dtype is not None and dtype not in COMPRESSIBLE_DTYPES:
            return None  # (a float64 softmax keeps float64 probabilities, as PyTorch does)
        y = softmax(x, dim, self._head_cfg("softmax", x), dtype=dtype)
        self._probs.put(y, True)
        return self._routed(y)

    def _native_dropout(self, x, p, train, fn=torch.native_dropout):
        if not train or not self._inside or "matmul" not in self._inside[-1][1] or self._probs.get(x) is None:
            return None
        y, mask = fn(x, p, train)
        scale = scale_of(x.device, p, x.dtype) if fn is slim_native_dropout else 1.0 / (1.0 - p) if p < 1 else 0.0
        self._dropped.put(y, Dropped(x, Mask.of(mask), scale, x._version))
        return y, mask

    def _slim_native_dropout(self, x, p, train=True):
        """:meth:`_native_dropout` for slimact's own (``F.dropout`` and ``nn.Dropout`` of a routed softmax's output):
        its draw and values, F.dropout's, not ``torch.native_dropout``'s (whose factor on the CPU is 1 ulp off
        F.dropout's at 15 of p = 0.01, ..., 0.99: the forward of an 8-bit attention by hand with such a dropout was)."""
        return self._native_dropout(x, p, train, fn=slim_native_dropout)

    def _functional_softmax(self, x, dim=None, _stacklevel=3, dtype=None):
        return self._softmax(x, dim, dtype)

    def _gather(self, x, dim, index, *, sparse_grad=False, out=None):
        if out is not None or sparse_grad or not isinstance(dim, int) or not isinstance(index, Tensor):
            return None
        return self._routed(gather(x, dim, index)) if _wants_grad(x) and self._routing("attention") else None

    def _on(self, kind: str) -> bool:
        if kind == "product":  # on where an activation's or a norm's kind is (each call checks its factor's)
            return any(self._on(k) for k in ("relu", "gelu", "silu", "layernorm", "rmsnorm", "groupnorm"))
        return self.policy.skip_reason(kind, FUNCTIONAL_NAME) is None and not self.policy.include

    def _cfg(self, kind: str, x: Tensor):
        cfg = self.policy.quant_config(kind, x.dim())
        return dataclasses.replace(cfg, scale="dynamic") if cfg is not None and cfg.scale == "running" else cfg

    def _grouped_mm(self, mat_a, mat_b, offs=None, bias=None, out_dtype=None, *, native: bool):
        """A mixture-of-experts layer's grouped product, ``[S, K]`` tokens by ``[E, K, N]`` expert weights
        (``torch._grouped_mm``; transformers' fallback op, ``native=False``): the tokens kept with the policy's codes
        for the linear kind (:func:`slimact.functional.grouped_mm.grouped_mm`), the weights as they are. Other forms
        (a bias, another output dtype, batched operands, weights that need no gradient) run as written."""
        if (not isinstance(mat_a, Tensor) or not isinstance(mat_b, Tensor) or offs is None or bias is not None
                or out_dtype not in (None, mat_a.dtype) or mat_a.dim() != 2 or mat_b.dim() != 3
                or mat_a.dtype != mat_b.dtype or not _wants_grad(mat_b) or isinstance(mat_a, nn.Parameter)):
            return None
        cfg = self._cfg("linear", mat_a)
        if cfg is None:
            return None
        y = grouped_mm(mat_a, mat_b, offs, cfg, torch._grouped_mm if native else _transformers_grouped_mm())
        self._grouped.put(y, True)
        return y

    def _dropout(self, x, p=0.5, training=True, inplace=False):
        if not training or inplace or not _wants_grad(x):
            return None
        if self._probs.get(x) is not None:  # a routed softmax's output: its native_dropout is to be noted, but
            with _NoteDropout(self):  # this handler runs with the mode off
                return dropout(x, p, True)
        return dropout(x, p, True)

    def _relu(self, x, inplace=False):
        if inplace or not _wants_grad(x):
            return None
        y = activation(x, "relu", self._cfg("relu", x), fn=torch.relu)
        self._relus.put(y, True)
        return y

    def _square(self, x, exponent=2, *rest, **kwargs):
        """``r.square()``, ``r.pow(2)``, ``r ** 2`` of a routed ReLU's output ``r`` (unchanged since): squared ReLU
        on ``r`` (``relu2(r) = r^2`` for ``r >= 0``), keeping ``r`` 8-bit (not the fp32 ``r`` square keeps), or,
        lossless, nothing beyond ``r^2`` (``r = sqrt(r^2)``). The ReLU keeps its mask for the gradient to its input.
        Computed by the call itself: the forward is PyTorch's."""
        if rest or kwargs or not isinstance(x, Tensor) or not (isinstance(exponent, int) and exponent == 2):
            return None  # (an exponent given by keyword, a tensor exponent, out=: as written)
        if self._relus.get(x) is None or not _wants_grad(x):
            return None
        # (square, pow(2) and ** 2 are one ATen op, pow(r, 2): the forward is PyTorch's whichever was called)
        return activation(x, "relu2", self._cfg("relu", x), fn=torch.square)

    def _product(self, a, b=None, *rest, **kwargs):
        """``a * b`` where one factor is the output of an activation slimact computed (a routed call or a converted
        module; unchanged since) whose kind the policy compresses: both factors kept with the policy's codes (the
        activation's output through its input's, no bytes of its own), not in full precision. A broadcast product
        of a norm's output: :meth:`_broadcast_product`. Factors of other shapes or dtypes (another broadcast, a
        scalar, a type promotion) multiply as written."""
        if rest or kwargs or not isinstance(a, Tensor) or not isinstance(b, Tensor):
            return None
        if a.shape != b.shape:
            # (Also in a norm module's own code: diffusers' AdaLayerNormZero and AdaLayerNormContinuous, SD3's, Flux's
            # and DiT's, modulate their norm's output there. The product follows that normalisation, and a factor
            # the route takes spans its channels: no normalisation after it removes that factor.)
            return self._broadcast_product(a, b)
        if self.norm_depth:
            # (In a norm module's own code, a gated norm's (Mamba2's ``MambaRMSNormGated``), the product is then
            # normalised per group, which removes every scale of its factors: the gradient reaching such a scale
            # (Mamba2's D) is the small remainder of a cancellation, which 8-bit factors swamp: cosine 0.90.)
            return None
        if a.dtype != b.dtype or not (_wants_grad(a) or _wants_grad(b)):
            return None
        forms = [f for f in (output_form(a), output_form(b)) if f is not None]
        kinds = [_FORM_KIND[f] for f in forms if _FORM_KIND[f] in self.kinds]  # (the routes the policy has on)
        cfg = self._cfg(kinds[0], a) if kinds else None
        return None if cfg is None else product(a, b, cfg)

    def _broadcast_product(self, x: Tensor, y: Tensor) -> Tensor | None:
        """``x * y`` where the large factor ``a`` is the output of a norm slimact computed (a converted module or a
        routed call; unchanged since) and the other, ``b``, broadcasts to it and needs a gradient: adaLN's
        ``norm(h) * (1 + scale[:, None])`` (DiT, SD3, Flux, PixArt), in either order, ``b`` spanning the norm's
        channels (``[B, 1, C]``, ``[C]``; GroupNorm's ``[N, C, 1, 1]``). ``b`` is kept exact, ``a``
        through the norm's own pack (no bytes of its own), where plain keeps ``a`` in full precision
        (:func:`slimact.functional.product.broadcast_product`). As written: where ``b`` needs no gradient (plain
        keeps only ``b``: nothing to save), where the norm keeps ``a`` itself exact (a lossless policy, a learned
        mix: the product would keep the same tensor, at no cost, in plain), where which factor is the large one is
        not clear-cut (:func:`slimact.functional.product.broadcast_big`), outside the dtypes slimact packs, and for
        any other large factor (a gate times a linear layer's output, attention's ``probs * mask``, a
        squeeze-excitation's ``x * sigmoid(s)[..., None, None]``: nothing of slimact's keeps that factor already)."""
        weighted = self._weighted_experts(x, y)
        if weighted is not None:
            return weighted
        if output_kept_as(x) is None and output_kept_as(y) is None:  # (first: most products are no norm's)
            return None
        big = broadcast_big(x, y)
        if big is None:
            return None
        a, b = (x, y) if big == 0 else (y, x)
        kept = output_kept_as(a)
        if kept is None or kept[1] == "exact" or kept[0] not in self.kinds:
            return None
        if not _wants_grad(b) or a.dtype not in COMPRESSIBLE_DTYPES:
            return None
        # b must span the norm's channel dim (the last; GroupNorm's dim 1), so that b's gradient sums over rows, per
        # channel, as a norm weight's does. A factor constant along the channels (a per-token [B, T, 1] scale, a
        # mix's [..., K, 1] weights) has a gradient summed along the normalised row, a cancellation wherever a norm
        # follows (it removes such a scale: the exact gradient is 0, or the small remainder of one when near-parallel
        # streams are mixed), which a's 8-bit codes swamp: as written. (Measured: a norm's learned mix of normed
        # streams, (w[..., None] * norm(streams)).sum(2) into an RMSNorm, had its weights' gradient at cosine 0.73
        # routed, 1.0 as written.)
        channel = 1 if kept[0] == "groupnorm" else a.dim() - 1
        at = channel - (a.dim() - b.dim())
        if at < 0 or b.shape[at] != a.shape[channel]:
            return None
        cfg = self._cfg(kept[0], a)
        return None if cfg is None else broadcast_product(x, y, cfg)

    def _weighted_experts(self, x: Tensor, y: Tensor) -> Tensor | None:
        """``out * w[:, None]``: an experts layer's routed grouped product's output (``[S, N]``, unchanged since)
        weighed by its routing weights (``[S, 1]``, needing a gradient), as transformers' experts implementations
        weigh their down projection: ``out`` kept with the linear kind's codes, ``w`` exact
        (:func:`slimact.functional.product.broadcast_product`), where plain keeps ``out`` in full precision (3 of the
        10 KiB a routed token of a 768-wide Mixtral kept). The routing weights' gradient, ``sum(grad * out)`` per row,
        then carries ``out``'s 8-bit error into the router's: tiny Mixtral, Qwen2/3-MoE, OLMoE and DeepSeek V3's
        router weights kept cosine >= 0.9999 to plain's gradients (the sweep's rows: docs/models.md). ``None``: any
        other product."""
        if self._grouped.get(x) is None and self._grouped.get(y) is None:  # (first: most products are no experts')
            return None
        big = broadcast_big(x, y)
        if big is None:
            return None
        a, b = (x, y) if big == 0 else (y, x)
        if (a.dim() != 2 or tuple(b.shape) != (a.shape[0], 1) or a.dtype not in COMPRESSIBLE_DTYPES
                or not _wants_grad(b) or self._grouped.get(a) is None):
            return None
        cfg = self._cfg("linear", a)
        return None if cfg is None else broadcast_product(x, y, cfg)

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
        (b, h), (b_kv, h_kv) = query.shape[:2], key.shape[:2]
        if key.shape[:2] != value.shape[:2] or b_kv != b or h % h_kv:
            return None  # a broadcast slimact's attention does not take: as written
        if (isinstance(attn_mask, Tensor) and attn_mask.is_floating_point() and attn_mask.dtype != query.dtype
                and (attn_mask.dtype == torch.float64 or not torch.is_autocast_enabled(query.device.type))):
            # As written: PyTorch refuses one neither float32 nor the query's dtype, and takes a float32 one with
            # 16-bit queries outside autocast too, which slimact's attention takes under autocast only (it casts it)
            return None
        if attn_mask is not None and is_causal:
            # As written: PyTorch's CPU flash kernel applies both (the mask and the causal limit), its math kernel
            # raises; slimact's attention takes one or the other (it raised where the plain call ran).
            return None
        # A single key/value head broadcasts over the query heads (Falcon's multi-query); other head counts only
        # with enable_gqa, as in PyTorch. (Not rewritten as enable_gqa: PyTorch's CPU call runs its math kernel
        # for the broadcast, and slimact's forward is that kernel's output only where it follows the same choice;
        # Falcon's logits in bf16 were 0.004 apart from plain's.)
        if h_kv not in (h, 1) and not enable_gqa:
            return None
        if self._inside:
            self.attended.add(self._inside[-1][0])
        out, tripped = guarded(scaled_dot_product_attention, query, key, value, attn_mask, dropout_p, is_causal, scale,
                               enable_gqa, cfg=self._cfg("attention", query))
        if tripped and self._inside:  # (q, k, v kept exact for the score error guard: summary says so)
            self.guarded.add(self._inside[-1][0])
        return out

    # Under torch.compile the mode is never entered (see _enter): nothing to exclude. The counter bumped in these
    # hooks would be a side effect for dynamo to replay, and around a module applying a slimact Function (Llama's
    # gated MLP, whose act_fn is excluded) it broke the trace ("an intermediate tensor ... created inside a
    # higher-order op subgraph aliases an input or output").

    def leave_as_written(self, module: nn.Module) -> None:
        """Run the calls in ``module``'s code (and its children's) as written from now on: ``revert(module)`` of a
        block of the model this routing converted as a whole."""
        if not any(m is module for m in self.excluded):
            self.excluded = (*self.excluded, module)
            self.reverted = (*getattr(self, "reverted", ()), module)
            self._count_depth("excluded_depth", [module] if self.handlers else ())

    def _count_depth(self, attr: str, modules: Sequence[nn.Module]) -> None:
        """Count in ``attr`` how deep the forward is in ``modules``' calls (a pre-hook and a forward hook each)."""
        for module in modules:
            if isinstance(module, torch.jit.ScriptModule):  # (no hooks there, and no call of its to route: as below)
                continue
            self.handles += [module.register_forward_pre_hook(functools.partial(self._step_depth, attr, 1)),
                             module.register_forward_hook(functools.partial(self._step_depth, attr, -1),
                                                          always_call=True)]

    def _step_depth(self, attr: str, step: int, module, args, output=None) -> None:
        if not torch.compiler.is_compiling():
            setattr(self, attr, getattr(self, attr) + step)

    # Functional norms: F.layer_norm / torch.layer_norm ("layernorm"), F.rms_norm / torch.rms_norm ("rmsnorm"),
    # F.group_norm / torch.group_norm ("groupnorm"),
    # as a model's own norm class calls them (OLMo's weightless LayerNorm, a user's norm module).

    def _norm_routes(self) -> dict:
        routes = {}
        for centered, kind, funcs in ((True, "layernorm", (F.layer_norm, torch.layer_norm)),
                                      (False, "rmsnorm", (F.rms_norm, torch.rms_norm))):
            for func in funcs:
                routes[func] = (kind, functools.partial(self._norm, func, centered, kind))
        for func in (F.group_norm, torch.group_norm):
            routes[func] = ("groupnorm", functools.partial(self._group_norm, func))
        return routes

    def _group_norm(self, func, x, *args, **kwargs):
        """``func(x, *args, **kwargs)`` (``F.group_norm``/``torch.group_norm``) through
        :func:`slimact.functional.group_norm`, or ``None`` to run it as written: when nothing would be saved, in a
        dtype slimact does not pack, or where the call is not a well-formed GroupNorm (PyTorch's own error then)."""
        bound = {**dict(zip(_GROUP_NORM_ARGS, args, strict=False)),
                 **{k: v for k, v in kwargs.items() if k in _GROUP_NORM_ARGS}}
        groups, weight, bias = bound.get("num_groups"), bound.get("weight"), bound.get("bias")
        params = [t for t in (weight, bias) if t is not None]
        if (not isinstance(x, Tensor) or x.dtype not in COMPRESSIBLE_DTYPES
                or not torch.is_grad_enabled() or not (x.requires_grad or any(t.requires_grad for t in params))):
            return None
        if not _group_norm_applies(x, groups, weight, bias):  # (one element per group: torch.group_norm's bias)
            return None
        eps = float(bound.get("eps", _GROUP_NORM_EPS))
        return group_norm(x, groups, weight, bias, eps, self._cfg("groupnorm", x))

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
        # (an int shape, which PyTorch refuses with a TypeError, runs as written: slimact had computed it)
        if not isinstance(shape, (tuple, list)) or tuple(shape) != channels or any(
            not isinstance(t, Tensor) or tuple(t.shape) != channels for t in params
        ):
            return None
        eps = bound.get("eps", _LAYER_NORM_EPS if centered else None)
        eps = rms_default_eps(x.dtype) if eps is None else float(eps)
        # F.layer_norm itself: run as its kernel with its statistics (fn=None), the same output
        native = func is F.layer_norm or func is torch.layer_norm
        return norm(x, weight, bias, eps, self._cfg(kind, x), centered=centered,
                    fn=None if native else (lambda t: func(t, *args, **kwargs)))

    # Layers recomputed by activation checkpointing (torch.utils.checkpoint on a module, Hugging Face's
    # gradient_checkpointing): the recompute runs the layer again in the backward, outside the model's forward
    # and so outside the mode, where its calls would keep other tensors than the forward's routed ones
    # (CheckpointError: "a different number of tensors was saved"). A submodule that runs in training with
    # grad on while the mode is off enters it for its own call, so both passes route alike. (The loss route
    # stays off there: the head's output is tracked only from the model's own forward.)

    def _enter_in_layers(self, model: nn.Module) -> list:
        handles = []
        for module in model.modules():
            if module is not model and not isinstance(module, torch.jit.ScriptModule):
                # (a scripted submodule takes no hooks, and its compiled code makes no call the mode could route)
                # (before the module's own depth and attention hooks, so that _enter_layer sees where it is called
                # from, not what it is; and after theirs on the way out)
                handles += [module.register_forward_pre_hook(self._enter_layer, prepend=True),
                            module.register_forward_hook(self._exit_layer, always_call=True)]
            if isinstance(module, _FUSED_IN_EVAL):
                self.encoders.append(module)
                handles += [module.register_forward_pre_hook(self._enter_eval_block, with_kwargs=True),
                            module.register_forward_hook(self._exit_eval_block, always_call=True)]
        return handles

    # Activation checkpointing of code that is not a module's call: transformers' GradientCheckpointingLayer
    # checkpoints the layer's ``forward``, not its ``__call__`` (the recompute fires no hook of the layer itself);
    # a user's ``checkpoint(self._inner, x)`` checkpoints a method. The calls made directly in that code (BART's,
    # OPT's, Whisper's F.dropout in their layers' forward) were routed in the forward pass (the model's mode is on)
    # and ran as written in the recompute (the mode is off there, entered only by the submodules): the non-reentrant
    # checkpoint raised CheckpointError ("Recomputed values ... have different metadata", "A different number of
    # tensors was saved"). A non-reentrant checkpoint's forward runs under its own saved-tensors hooks: where the
    # innermost saved-tensors hook is not the one in place when the innermost module call began (the scope), the
    # mode runs calls as written; a module called there opens a new scope, as its recompute enters the mode anew.

    #
    # How a call routes depends on where its module was called from, too: in a module the user left alone (calls as
    # written), in a norm's own code (products as written), in a watched attention module's code (its products and
    # softmaxes routed). A recompute calls the checkpointed module alone, outside those callers; a module called in
    # a scope of its own notes its callers' context in the forward, and its recompute runs in that context (a gated
    # MLP with a dropout, checkpointed in a block the user excluded, routed its product in the recompute only:
    # CheckpointError where PyTorch trains). A module checkpointed from two contexts recomputes in the last one's.

    def _context(self) -> tuple:
        return self.excluded_depth, self.norm_depth, tuple(self._inside)

    def _set_context(self, context: tuple) -> None:
        self.excluded_depth, self.norm_depth, inside = context
        self._inside[:] = inside

    def _enter_layer(self, module, args):
        if (not self.handlers or not module.training or not torch.is_grad_enabled() or torch.compiler.is_compiling()
                or _recording()):
            return
        if self._mode is None:
            self._mode, self._layer = _Mode(self), module
            self._scope = _top_saved_hook()
            if (context := self._contexts.get(module)) is not None:
                self._outer = self._context()
                self._set_context(context)
            self._mode.__enter__()
        else:
            top = _top_saved_hook()
            if top is not self._scope:
                self._scopes.append((module, self._scope))
                self._scope = top
                self._contexts[module] = self._context()

    def _exit_layer(self, module, args, output):
        if self._scopes and self._scopes[-1][0] is module:
            self._scope = self._scopes.pop()[1]
        if self._layer is module and self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode, self._layer, self._scope = None, None, None
            self._scopes.clear()
            if self._outer is not None:
                self._set_context(self._outer)
                self._outer = None

    def _enter_eval_block(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        """Pre-hook of an ``nn.TransformerEncoderLayer``/``TransformerEncoder``/``MultiheadAttention``: where
        PyTorch's fused eval path can run, slimact's mode and hooks step aside for it (see :class:`_FastPathCheck`)."""
        if not _fused_possible(block, args, kwargs):
            return
        # The slimact mode on top of the stack, this model's or an outer converted model's (a teacher held outside
        # the module tree, called in a student's forward); a mode leaves the stack only from its top: under a mode
        # of the user's, the fused path is refused anyway.
        top = torch.overrides._get_current_function_mode()
        paused = top if isinstance(top, _Mode) else None
        if paused is not None:
            paused.__exit__(None, None, None)
        # (per thread: threads calling one model in eval each have their own calls under way)
        self._eval_blocks.setdefault(threading.get_ident(), []).append((block, paused))
        if isinstance(block, nn.TransformerEncoderLayer):
            _FastPathCheck.enter(block)

    def _exit_eval_block(self, block: nn.Module, args: tuple, output: object) -> None:
        thread = threading.get_ident()
        calls = self._eval_blocks.get(thread)
        if not calls or calls[-1][0] is not block:
            return
        _, paused = calls.pop()
        if not calls:
            del self._eval_blocks[thread]
        if isinstance(block, nn.TransformerEncoderLayer):
            _FastPathCheck.exit(block)
        if paused is not None and paused.routing._mode is paused:  # (still its model's forward's)
            paused.__enter__()

    def in_scope(self) -> bool:
        """Whether a call now is made in code whose recompute (if it is checkpointed) routes it alike."""
        return _top_saved_hook() is self._scope

    def _enter(self, module, args, kwargs):
        if torch.compiler.is_compiling():
            return  # dynamo does not trace a mode entered in a hook: compiled models run the calls as written
        if module.training and torch.is_grad_enabled() and self.handlers:
            # The state of a training forward (its mode, the module and scope stacks) is the routing's: one thread's
            # at a time. Two threads training one converted model at once (torch.nn.DataParallel's replicas share
            # its hooks; hogwild threads) popped each other's modes ("trying to pop from empty mode stack"), left
            # calls unrouted or aborted the process: a clear error instead.
            with _OWNER_LOCK:
                owner, me = self.__dict__.get("_owner"), threading.current_thread()
                # (a thread that died inside the forward, a KeyboardInterrupt skipping the hooks that release it,
                # holds it no more)
                if owner is not None and owner is not me and owner.is_alive():
                    raise RuntimeError(
                        "slimact: this converted model's training forward is already running in another thread "
                        "(torch.nn.DataParallel, or threads training one model): slimact routes one thread's "
                        "training forward at a time. Use DistributedDataParallel (a process per device), or "
                        "convert a copy of the model per thread.")
                if owner is not None and owner is not me:  # (the dead thread's forward state: not this one's)
                    self._forget_forward()
                self._owner = me
        _RUNNING.routings.append(self)
        if self._root is None:  # (unpickled: the model is known again from its first call)
            self._root = weakref.ref(module)
        if module.training and torch.is_grad_enabled() and self._mode is None and self.handlers and not _recording():
            if self.loss is not None:
                name, at = self._labels_at
                labels = kwargs.get(name, args[at] if at is not None and at < len(args) else None)
                self.loss.start(labels is not None)
            self._mode = _Mode(self)
            self._scope = _top_saved_hook()
            self._mode.__enter__()

    def _exit(self, module, args, output):
        running = _RUNNING.routings
        if running and running[-1] is self and not torch.compiler.is_compiling():
            running.pop()
        owner = self.__dict__.get("_owner")
        if owner is not None and owner is not threading.current_thread():
            return  # (its _enter refused this thread: the state is the running thread's)
        self._owner = None
        # (off the stack where a root that is itself an encoder block in eval stepped it aside: its own forward hook,
        # which would put it back, runs after this one)
        if self._mode is not None and torch.overrides._get_current_function_mode() is self._mode:
            self._mode.__exit__(None, None, None)
        self._forget_forward()
        if module.training and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # Attention maps the model returns: the loss may divide by them (a KL to a teacher's), which a softmax's
            # 8-bit codes cannot serve (slimact.functional.softmax); plain PyTorch's softmax keeps them too.
            for t in torch.utils._pytree.tree_leaves(output):
                if type(t) is Tensor and t.grad_fn is not None:
                    keep_exact(t)
        if self.loss is not None:
            self.loss.stop()

    def _forget_forward(self) -> None:
        """Drop the state of a training forward: its mode (left by the caller), the layer that entered it, its scopes
        (the scope is a saved-tensors hook of the caller's, slimact.profile's local one say: held past the forward,
        it stopped the model from pickling, "Can't pickle local object '_step.<locals>.pack_hook'", until the next)."""
        self._mode, self._layer, self._scope = None, None, None
        self._scopes.clear()

    def remove(self) -> None:
        """Uninstall: the hooks, gates and checks this routing put on the model's modules are removed, and no call is
        routed from now on (a hook of it left where ``revert`` does not look, on a module copied out of the model,
        runs its calls as written)."""
        self.removed, self.handlers = True, {}
        for handle in self.handles:
            handle.remove()
        for module in self.encoders:  # (one copied during a call keeps its check until its next call's end)
            if isinstance(module.__dict__.get(_CHECK_ATTR), _FastPathCheck):
                del module.__dict__[_CHECK_ATTR]
        for module in self.gated:
            if isinstance(module.__dict__.get(GATE_ATTR), Gate):
                del module.__dict__[GATE_ATTR]
        if self.loss is not None:
            self.loss.remove()
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode, self._layer = None, None
