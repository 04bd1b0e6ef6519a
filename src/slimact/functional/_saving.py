"""How slimact Functions keep tensors: everything through ``ctx.save_for_backward``, metadata on ``ctx``.

``save(ctx, *items)`` takes, in order, :class:`~slimact.quant.Packed` tensors (their codes and scales are
saved), :class:`Mask` bit masks, plain tensors (exact statistics such as a norm's mean and rstd, or a
weight), and ``None``; ``load(ctx)`` gives them back in the same order, packed ones restored to their
shape and dtype and masks to booleans. Keeping every tensor in ``save_for_backward`` means
``saved_tensors_hooks`` (the profiler, CPU offloading) and checkpointing see all of them.

A Function that computes gradients during its forward (the LM loss) saves them as :class:`Gradient` items,
so that :func:`slimact.profile` reports them apart from activations (:func:`is_gradient`), and a parameter's
gradient (the head's weight gradient) as the parameter gradient it is (:func:`is_parameter_gradient`).

Every slimact Function subclasses :class:`SlimFunction`, which holds what all of them must do alike: refuse a
backward that records a graph (``create_graph=True``: second-order gradients would be wrong) and never return a
view (an in-place op on it, as wav2vec2's masking does, would be refused by autograd).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from slimact.quant import Packed, pack_mask, unpack, unpack_mask
from slimact.quant.state import note_backward

__all__ = ["Gradient", "Mask", "SlimFunction", "is_gradient", "is_parameter_gradient", "load", "save", "transformed"]


class Mask(NamedTuple):
    """A boolean tensor kept as bits, 8 per byte."""

    bits: Tensor
    shape: torch.Size

    @classmethod
    def of(cls, mask: Tensor) -> Mask:
        return cls(pack_mask(mask), mask.shape)


class Gradient(NamedTuple):
    """A gradient computed ahead, in the forward, and kept until the backward hands it on (scaled); ``parameter``:
    a parameter's gradient (it becomes that parameter's ``.grad``), not an activation's."""

    tensor: Tensor
    parameter: bool = False


# id -> (weak reference, a parameter's gradient?), dropped with the tensor (a WeakSet would compare with ``==``).
_gradients: dict[int, tuple[weakref.ref, bool]] = {}


def _mark_gradient(t: Tensor, parameter: bool) -> None:
    key = id(t)
    _gradients[key] = (weakref.ref(t, lambda _r, key=key: _gradients.pop(key, None)), parameter)


def _gradient_entry(t: Tensor) -> tuple[weakref.ref, bool] | None:
    entry = _gradients.get(id(t))
    return entry if entry is not None and entry[0]() is t else None


def is_gradient(t: Tensor) -> bool:
    """Whether ``t`` was saved as a :class:`Gradient` (a gradient computed ahead, not an activation)."""
    return _gradient_entry(t) is not None


def is_parameter_gradient(t: Tensor) -> bool:
    """Whether ``t`` was saved as a parameter's :class:`Gradient` (``parameter=True``)."""
    entry = _gradient_entry(t)
    return entry is not None and entry[1]


def save(ctx: Any, *items: Packed | Mask | Gradient | Tensor | None) -> None:
    flat: list[Tensor | None] = []
    layout: list[tuple[str, int, Any]] = []
    for item in items:
        if isinstance(item, Packed):
            flat.extend(item.tensors)
            layout.append(("packed", len(item.tensors), item.meta))
        elif isinstance(item, Mask):
            flat.append(item.bits)
            layout.append(("mask", 1, item.shape))
        elif isinstance(item, Gradient):
            _mark_gradient(item.tensor, item.parameter)
            flat.append(item.tensor)
            layout.append(("tensor", 1, None))
        else:
            flat.append(item)
            layout.append(("tensor", 1, None))
    ctx.save_for_backward(*flat)
    ctx.slimact_layout = layout


def load(ctx: Any, restore: bool = True) -> list[Any]:
    """The items :func:`save` kept, in order; with ``restore=False`` packed ones stay :class:`Packed` (for a
    backward that restores them inside its own loop: :func:`slimact.quant.unpack_map`)."""
    saved = ctx.saved_tensors
    out: list[Any] = []
    i = 0
    for kind, n, meta in ctx.slimact_layout:
        if kind == "packed":
            packed = Packed(tuple(saved[i : i + n]), meta)
            out.append(unpack(packed) if restore else packed)
        elif kind == "mask":
            out.append(unpack_mask(saved[i], meta))
        else:
            out.append(saved[i])
        i += n
    return out


def transformed() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ``jacrev``...) or forward-mode AD
    (``torch.autograd.forward_ad.dual_level``) is active. slimact Functions support neither (no
    ``setup_context``/``vmap``/``jvp``, and their forwards read the storage of the tensors they pack): callers run
    PyTorch's own computation instead, exact, keeping what PyTorch keeps."""
    if torch.compiler.is_compiling():
        return False  # dynamo traces transforms itself; a compiled graph never runs a SlimFunction's Python
    return torch._C._functorch.peek_interpreter_stack() is not None or torch.autograd.forward_ad._current_level >= 0


class SlimFunction(torch.autograd.Function):
    """Base class of every slimact ``torch.autograd.Function``; a subclass names its ``layer`` (for errors).

    * Its backward refuses to run with ``create_graph=True`` (in a backward, grad mode is on exactly then):
      it computes from compressed codes or from tensors rebuilt from the output, which autograd cannot
      differentiate back to the inputs, so a second-order gradient (a gradient penalty, a Hessian-vector
      product) through it would be silently wrong. A checkpoint's recomputation runs forwards, never this.
    * Its forward's outputs are never views: a view made inside a custom Function (``F.linear`` of a 3-d input
      with a bias is a view of a 2-d product) cannot be modified in place, which model code does (wav2vec2's
      ``hidden_states[mask] = ...``). A view of an intermediate is returned as a non-view alias of the same
      memory (``detach``: no copy, the same version counter); an empty one as a new empty tensor.
    """

    layer: ClassVar[str]
    #: Whether the forward's own ops stay visible to the routing mode (the dropout's ``native_dropout``, which the
    #: mode notes where it drops a routed softmax's output); otherwise the forward runs with that mode off.
    routed: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "layer" not in cls.__dict__:
            raise TypeError(f"{cls.__name__} must name its layer (class attribute `layer`)")
        cls.forward = staticmethod(_own_outputs(_plain(cls.__dict__["forward"]), cls.routed))
        cls.backward = staticmethod(_first_order(_plain(cls.__dict__["backward"]), cls))


def _plain(fn: Any) -> Callable:
    return fn.__func__ if isinstance(fn, staticmethod) else fn


def _first_order(backward: Callable, cls: type[SlimFunction]) -> Callable:
    @functools.wraps(backward)
    def checked(ctx: Any, *grads: Any) -> Any:
        # Under torch.compile the check is skipped: compiled graphs support no double backward anyway.
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            raise RuntimeError(
                f"slimact's {cls.layer} Function ({cls.__name__}) cannot be differentiated twice: a backward with "
                "create_graph=True (a gradient penalty, a Hessian-vector product, double backward) reached it, "
                "and its backward computes from compressed or rebuilt tensors, so second-order gradients through "
                "it would be wrong. Leave such modules out of the conversion (slimact.convert(model, "
                "filter_fn=...)), call slimact.revert(model) for these passes, or use plain modules there."
            )
        note_backward()  # (the calls after this backward are another step's: slimact.nn._base.begin_call)
        try:
            return backward(ctx, *grads)
        except RuntimeError as error:
            if "modified by an inplace operation" not in str(error):
                raise
            raise RuntimeError(
                f"slimact's {cls.layer} Function ({cls.__name__}) keeps a tensor of the forward that was then modified "
                "in place. Where a policy keeps a layer's output instead of its input (\"tempo\"'s norms and "
                "activations: the output is rebuilt into the gradient), an in-place op on that output in model code "
                "(`h = norm(x); h += r`, `h.mul_(s)`, `h.masked_fill_(m, 0)`) leaves PyTorch's own layer, which kept "
                "its input, unaffected but not slimact's. Write that operation out of place (`h = h + r`), or leave "
                "the layer out of the conversion (convert's filter_fn, a policy exclude pattern). PyTorch's message: "
                f"{error}"
            ) from error

    return checked


def _routing_mode() -> Any:
    """The innermost torch-function mode if it routes model code (``_slimact_routes_model_code``: the mode of
    :mod:`slimact.nn.routing`, on during a converted model's training forward), else ``None``."""
    depth = torch._C._len_torch_function_stack()
    mode = torch._C._get_function_stack_at(depth - 1) if depth else None
    return mode if getattr(mode, "_slimact_routes_model_code", False) else None


def _own_outputs(forward: Callable, routed: bool) -> Callable:
    @functools.wraps(forward)
    def owned(ctx: Any, *args: Any) -> Any:
        if torch.compiler.is_compiling():  # traced graphs have no views to speak of (functionalised)
            return forward(ctx, *args)
        # The forward runs with the routing mode off (unless ``routed``): its ops (the pack's, the kernels') are
        # slimact's own, not the model's, and each would otherwise pass through the mode's Python handler, which
        # declines them all in a grad-disabled forward (tiny GPT-2 at 8 bits: 2721 calls per step, 344 after).
        mode = None if routed else _routing_mode()
        if mode is None:
            return _owned(forward(ctx, *args), ctx, args)
        torch._C._pop_torch_function_stack()
        try:
            return _owned(forward(ctx, *args), ctx, args)
        finally:
            torch._C._push_on_torch_function_stack(mode)

    return owned


def _owned(out: Any, ctx: Any, args: tuple) -> Any:
    dirty = getattr(ctx, "dirty_tensors", None) or ()
    if isinstance(out, tuple):
        return tuple(_not_a_view(o, args, dirty) for o in out)
    return _not_a_view(out, args, dirty)


def _not_a_view(out: Any, inputs: tuple, dirty: tuple) -> Any:
    """``out``, as a tensor that is no view (see :class:`SlimFunction`); an input written in place (marked dirty:
    autograd tracks that itself) as it is. An input returned unchanged, or a view of one, stays as it is too
    (autograd refuses an in-place op on it: loud, not wrong), unless it is empty (PyTorch's ops return their
    empty input unchanged: ``native_dropout``)."""
    if not isinstance(out, Tensor) or any(out is t for t in dirty):
        return out
    an_input = any(out is t for t in inputs)
    if out.numel() == 0 and (an_input or out._is_view()):
        return out.new_empty(out.shape)
    if an_input or not out._is_view():
        return out
    base = out._base
    if any(isinstance(t, Tensor) and (base is t or base is t._base) for t in inputs):
        return out
    return out.detach()
