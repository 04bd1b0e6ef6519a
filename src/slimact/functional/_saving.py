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

import contextlib
import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from slimact._cache import dropping
from slimact.quant import Packed, pack_mask, unpack, unpack_mask
from slimact.quant.core import forget_shared_packs
from slimact.quant.state import note_backward

__all__ = ["IN_PLACE", "KEPT_OUTPUTS", "Gradient", "Mask", "SlimFunction", "copy_on_write", "faking",
           "foreign_saved_hooks", "foreign_weight", "holds_its_values", "is_dtensor", "is_gradient",
           "is_parameter_gradient", "keep_output", "kept_or_view_of_kept", "load", "observer", "opaque", "save",
           "transformed"]


class Mask(NamedTuple):
    """A boolean tensor kept as bits, 8 per byte. With ``fill`` (a 0-dim tensor), the float tensor that is ``fill``
    where the bits are set and 0 elsewhere (an additive attention mask of one fill value), restored exactly. With
    ``full``, the bits are of a broadcast tensor's own elements (``shape``, its size-1 dims where it was expanded)
    and it is restored expanded to ``full``."""

    bits: Tensor
    shape: torch.Size
    fill: Tensor | None = None
    full: torch.Size | None = None

    @classmethod
    def of(cls, mask: Tensor) -> Mask:
        return cls(pack_mask(mask), mask.shape)

    def restore(self, bits: Tensor, fill: Tensor | None) -> Tensor:
        mask = unpack_mask(bits, self.shape)
        if fill is not None:
            mask = torch.zeros(self.shape, dtype=fill.dtype, device=fill.device).masked_fill_(mask, fill)
        return mask if self.full is None else mask.expand(self.full)


class Gradient(NamedTuple):
    """A gradient computed ahead, in the forward, and kept until the backward hands it on (scaled); ``parameter``:
    a parameter's gradient (it becomes that parameter's ``.grad``), not an activation's."""

    tensor: Tensor
    parameter: bool = False


# id -> (weak reference, a parameter's gradient?), dropped with the tensor (a WeakSet would compare with ``==``).
_gradients: dict[int, tuple[weakref.ref, bool]] = {}


def _mark_gradient(t: Tensor, parameter: bool) -> None:
    key = id(t)
    _gradients[key] = (dropping(t, _gradients, key), parameter)


def _gradient_entry(t: Tensor) -> tuple[weakref.ref, bool] | None:
    entry = _gradients.get(id(t))
    return entry if entry is not None and entry[0]() is t else None


#: id -> [weak reference, moved to a copy yet]: outputs a Function keeps as they are where PyTorch's own layer keeps
#: its input (Tempo's norms and activations); see :func:`copy_on_write`. Read-only outside this module.
KEPT_OUTPUTS: dict[int, list] = {}

#: In-place ops :func:`copy_on_write` runs on a kept output's copy itself: none of them keeps its own result for its
#: backward (``exp_``, ``relu_`` do: those run on a clone).
IN_PLACE = frozenset({Tensor.__iadd__, Tensor.__isub__, Tensor.__imul__, Tensor.__itruediv__, Tensor.add_,
                      Tensor.sub_, Tensor.mul_, Tensor.div_, Tensor.masked_fill_, Tensor.addcmul_, Tensor.addcdiv_,
                      Tensor.copy_, Tensor.zero_, Tensor.fill_})


def observer(pack_hook: Callable) -> Callable:
    """Mark ``pack_hook`` (or an unpack hook) as one of slimact's own saved-tensor hooks that only look
    (:func:`slimact.profile`'s count, a recognition probe's), which :func:`foreign_saved_hooks` does not count."""
    pack_hook._slimact_observer = True  # type: ignore[attr-defined]
    return pack_hook


def foreign_saved_hooks() -> bool:
    """Whether saved-tensor hooks are in place now other than slimact's observers: activation checkpointing's (which
    drops the saved tensors and recomputes them, model code included), offloading's, a user's.

    Autograd checks no tensor that such hooks took for an in-place change, and the copy :func:`copy_on_write` makes
    cannot reach what they hold, so a Function that would keep its output where PyTorch's layer keeps its input
    keeps the input instead under them: checkpointing's recompute ran ``h = norm(x); h += r`` on the very output
    the norm had kept, and "tempo"'s gradients came out wrong, silently (a LayerNorm weight's 2.3 off). What those
    hooks keep is then what they keep of PyTorch's own layer: nothing (checkpointing), the same bytes elsewhere."""
    if torch.compiler.is_compiling():
        return False
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return hooks is not None and not getattr(hooks[0], "_slimact_observer", False)


def keep_output(y: Tensor, node: Any) -> None:
    """Note that the Function being run keeps its output ``y`` as it is (saved by :func:`save`), where the layer it
    replaces keeps its input, so that an in-place op on ``y`` in model code does not fail (:func:`copy_on_write`).
    ``node``: the Function's node (its ``ctx``), held weakly: ``y``'s own ``grad_fn`` is another once ``y`` is a view
    written in place (autograd's rebased one) or an op moved it (:func:`_move`)."""
    if not torch.compiler.is_compiling():
        key = id(y)
        # [the output, moved to a copy yet, the Function's node, the storage its saved output is on once moved]
        KEPT_OUTPUTS[key] = [dropping(y, KEPT_OUTPUTS, key), False, weakref.ref(node), None]
        if y._is_view():  # (an in-place activation's output on a 3-d Linear's, a view of its [B * T, N] product)
            base = id(y._base)

            def drop(ref: weakref.ref, base: int = base) -> None:
                if _KEPT_VIEW_BASES.get(base) is ref:
                    del _KEPT_VIEW_BASES[base]

            _KEPT_VIEW_BASES[base] = weakref.ref(y, drop)


#: id of a base -> the kept output (:data:`KEPT_OUTPUTS`) that is a view of it, weakly: another view of that base is
#: on the kept output's storage though no view of it by ``_base`` (PyTorch's is the root).
_KEPT_VIEW_BASES: dict[int, weakref.ref] = {}


def copy_on_write(func: Callable, args: tuple, kwargs: dict) -> Any:
    """Run ``func(*args, **kwargs)``, an op that changes its input in place, so that an output a Function keeps as it
    is (:func:`keep_output`) stays as it was, if that input is one and nothing else holds it; else return
    ``NotImplemented`` (the caller runs the call as written: any call that is no in-place op on a kept output).

    PyTorch's layer keeps its input, so model code may change its output in place (vit-pytorch's SimpleViT and
    CaiT: ``x = patch_embedding(img)``, ending in a LayerNorm, then ``x += pos_embedding``; XLM: ``tensor *= mask``
    after a LayerNorm; ``F.relu(norm(x), inplace=True)``; an ``nn.Dropout(inplace=True)`` after a GELU); a Function
    keeping that output found it changed in the backward, and autograd refused it. Here the tensor the model holds
    moves to a copy of its storage (``.data``), the op changes the copy, and the version counter it shares with the
    Function's saved tensor (whose storage no op changed) is set back, so the backward reads the output as the
    forward made it. The copy costs what PyTorch's layer keeps, for that call.

    The ops of :data:`IN_PLACE` keep nothing of their own result for their backward and run on the copy itself.
    Any other (``relu_``, ``exp_``, ``clamp_``, ``h[i] = v``, an ``inplace=True`` functional: see
    :func:`_in_place_on`) may keep its result, which setting the counter back would make stale: it runs on a clone
    of the tensor (its own graph and counter), which is then copied into the moved tensor (``copy_``, which keeps
    nothing). An op that turns out to change the clone's shape, not its values (``unsqueeze_``), then runs as written.

    Only where nothing but the tensor the model holds refers to it: an op here sets the version counter back, which
    hides the op from every other holder. A node that saved the tensor itself (the next Linear's input, a product's
    factor: the same ``TensorImpl``, which the storage count does not show, ``Tensor._use_count`` does) would read
    the changed copy with no error, where PyTorch's backward refuses (the op changed what that node saved); a view
    taken of the copy since the first op would keep the ``grad_fn`` it had before the op (autograd renews a view's
    only when the counter moved), and the gradient through it would skip the op (a parameter added in place: 0.77
    of its gradient missing), where PyTorch's is right. Such an op, a view or any other tensor on the first storage,
    and an op made outside the converted model's forward run as written: autograd's error in the backward
    (slimact's, naming the ways out)."""
    listed = func in IN_PLACE
    target = args[0] if args else None
    if not listed:
        target = _in_place_on(func, args, kwargs)
    view = isinstance(target, Tensor) and target._is_view()
    if view and _overlaps(target):
        # A view whose elements share memory (`h.unfold(1, 4, 1)`): an op on it is PyTorch's to refuse or run as it
        # does; moved to a copy, its gradient was 51 off plain's (a review). As written: autograd's version check.
        return NotImplemented
    kept = target._base if view else target
    entry = KEPT_OUTPUTS.get(id(kept))
    holder = kept
    if view and (entry is None or entry[0]() is not kept):
        # A kept output that is itself a view: an in-place activation's output is its input, a view where that is
        # one (F.instance_norm's output, a view of its batch_norm's): the view is moved as a view of its base is
        # (`InstanceNorm1d -> F.silu(h, inplace=True)`, then `h.add_(x)`: autograd's error where PyTorch trains).
        entry, holder = KEPT_OUTPUTS.get(id(target)), target
        if entry is None:
            # A view of such a kept view (`nn.SiLU(inplace=True)` on a 3-d Linear's output, then `h[..., :4] *= 2`):
            # its base is the output's base, no move places it; the Function keeps a copy of its own and the op runs
            # as written (autograd's error in the backward where PyTorch trains, before).
            ref = _KEPT_VIEW_BASES.get(id(kept))
            outer = ref() if ref is not None else None
            entry = KEPT_OUTPUTS.get(id(outer))
            if entry is None or entry[0]() is not outer or not outer.requires_grad or (
                    func not in _KEEPS_NO_ARGUMENT and _takes_itself(args, kwargs, target, outer)):
                return NotImplemented
            return func(*args, **kwargs) if _release(outer, entry) else NotImplemented
    if entry is None or entry[0]() is not holder or not kept.requires_grad:
        return NotImplemented
    if func not in _KEEPS_NO_ARGUMENT and _takes_itself(args, kwargs, target, kept):
        return NotImplemented
    if func is Tensor.__setitem__ and _assigns_itself(args, kept):
        return None
    if not (_view_alone(target, kept, entry) if view else _alone(target, entry)):
        # Other views of the output live (torchtune's CLIP: `x = ln_post(x).reshape(...)`, then
        # `x[b, :n] += pos` per image; `v = h[:, :4]; h += r`): they would stay on the storage the Function keeps,
        # so the output cannot move. The Function's own saved tensor takes a copy instead, and the op runs as
        # written on what the model holds (where another node saved the output, its version check stands).
        return func(*args, **kwargs) if _release(kept, entry) else NotImplemented
    return _on_copy(func, args, kwargs, listed, target, kept, entry)


def _release(kept: Tensor, entry: list) -> bool:
    """Give the Function that keeps ``kept`` (not yet moved to a copy) a copy of its own in place of it, so that
    in-place ops on ``kept`` and its views run as written, as in PyTorch (whose layer kept its input): each saved
    tensor of that Function's node on ``kept``'s storage is handed to saved-tensor hooks of its own (``pack``: a
    clone, made now; autograd checks no version of a tensor saved through hooks), and ``kept`` is no longer a kept
    output. Its values are the forward's: the node's saved tensors are unpacked first, which raises if anything
    it saved changed since. The copy costs what PyTorch's layer keeps (none where the output moved to a copy
    already: the saved tensor's storage is then its own). Whether it could: not under saved-tensor hooks (those the
    Function saved through take no others: slimact's profile count), nor for a node that is no slimact Function's
    (the output changed in place since its forward, as written: autograd's check stands)."""
    # The Function's node is the one keep_output noted (the output's grad_fn is another once it is a view written in
    # place, or moved: a review found the move's noted grad_fn, a CopySlices, refused). Moved already (``h += r`` ran
    # on a copy, :func:`_move`): the storage its saved output is on is the one the move noted, the saved tensor's
    # alone, so the hooks keep it as it is (no copy). Its version counter is still the one the model's tensor shares:
    # an op on a view of the copy while other views live (`h += r; v, w = h[:, :4], h[:, 4:]; v += 1`) failed the
    # backward where PyTorch's trains.
    node, storage = entry[2](), entry[3] if entry[1] else kept.untyped_storage().data_ptr()
    forward_cls = getattr(node, "_forward_cls", None)
    if not (isinstance(forward_cls, type) and issubclass(forward_cls, SlimFunction)):
        return False
    pack = _as_is if entry[1] else _own_copy
    try:
        saved, raw = node.saved_tensors, node._raw_saved_tensors
        ours = [r for t, r in zip(saved, raw, strict=True)
                if isinstance(t, Tensor) and t.untyped_storage().data_ptr() == storage]
        if not ours:
            return False
        for r in ours:
            r.register_hooks(pack, _as_is)
    except (RuntimeError, ValueError):  # (hooks there already; a changed tensor: the backward's error stands)
        return False
    KEPT_OUTPUTS.pop(id(kept), None)
    return True


def _own_copy(t: Tensor) -> Tensor:
    return t.clone()


def _as_is(t: Tensor) -> Tensor:
    return t


def _alone(target: Tensor, entry: list) -> bool:
    """Whether an in-place op on the kept output ``target`` itself may run on a copy (:func:`_on_copy`)."""
    # The tensor object the model holds is the only holder of its TensorImpl (no node saved it, no view's base).
    # Its storage: not moved yet, the tensor the model holds, the Function's saved one (a tensor of its own on the
    # same storage: a saved output does not hold the output object) and the storage object made here to count;
    # moved, the tensor the model holds and the storage object made here, no view.
    return target._use_count() == 1 and torch._C._storage_Use_Count(target.untyped_storage()._cdata) == (
        2 if entry[1] else 3)


def _view_alone(view: Tensor, base: Tensor, entry: list) -> bool:
    """Whether an in-place op on ``view``, a view of the kept output ``base``, may run on a copy
    (:func:`_on_copy`; torchvision's MViT: ``x = norm(x)[:, 0]`` into an ``nn.Dropout(inplace=True)``;
    ``h[:, 0] += cls``): the output moves to a copy of its storage, the view to the same place in the copy, and the
    op runs there (autograd records it on the output as for any view).

    Only where the view and the output are all that hold each other: the output's ``TensorImpl`` held by the view and
    the object asked here alone (no node saved it, no other view of it), the view by no node, and their storage by
    them and the Function's saved tensor (not moved yet) or by them alone (moved: the view made of the copy). The
    output dense from the start of its storage, so that its copy keeps the view's place."""
    if view._use_count() != 1 or base._use_count() != 2 or not _dense(base) or base.storage_offset() != 0:
        return False
    storage = view.untyped_storage()
    return (storage.data_ptr() == base.untyped_storage().data_ptr()
            and torch._C._storage_Use_Count(storage._cdata) == (3 if entry[1] else 4))


def _dense(t: Tensor) -> bool:
    """Whether ``t`` fills its elements' span with no gap or overlap in some order of its dims (contiguous, or
    channels-last: a conv's output on a channels-last input), so that its clone (``preserve_format``) has its very
    strides and a view keeps its place in the copy. Contiguous alone refused channels-last outputs:
    ``h[:, :4] += p`` after a GELU in a channels-last CNN failed in the backward where PyTorch trains."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _on_copy(func: Callable, args: tuple, kwargs: dict, listed: bool, target: Tensor, kept: Tensor,
             entry: list) -> Any:
    """Run the in-place op ``func`` on ``target`` (the kept output ``kept`` or a view of it) once ``kept`` moved to a
    copy of its storage (a view redirected to its place there), then set the shared version counter back. An op of
    :data:`IN_PLACE` runs there itself; any other on a clone, copied in after (``NotImplemented`` if it changed the
    clone's shape, strides or dtype: ``unsqueeze_``)."""
    changed = None
    if not listed:
        # A copy whose dims run as ``target``'s do (:func:`_compact_strides`): PyTorch's CPU kernels take another path
        # on a dense clone of a strided view (one vectorised run, not runs of the view's rows with scalar tails),
        # whose rounding differs: an in-place SiLU on half the channels of a kept LayerNorm output was 1 ulp off
        # plain's forward in 191 of 8192 elements.
        changed = torch.empty_strided(target.size(), _compact_strides(target), dtype=target.dtype,
                                      device=target.device)
        changed.copy_(target)
        stride = changed.stride()
        out = func(changed, *args[1:], **kwargs) if args and args[0] is target else func(
            *args, **{**kwargs, "input": changed})
        if changed.shape != target.shape or changed.stride() != stride or changed.dtype != target.dtype:
            return NotImplemented
    _move(kept, entry)
    if target is not kept:
        target.data = kept.data.as_strided(target.size(), target.stride(), target.storage_offset())
    version = target._version  # (shared with the output and the Function's saved tensor)
    if listed:
        out = func(*args, **kwargs)
    else:
        target.copy_(changed)
    _set_back(target, version)
    if target is not kept:
        _HANDLED_VIEW[0] = weakref.ref(target)
    return target if out is changed else out


#: The view of a kept output the last in-place op :func:`_on_copy` ran changed (a weak reference): the only value
#: :func:`_assigns_itself` may take for the closing self-assignment of ``h[idx] += x``.
_HANDLED_VIEW: list[weakref.ref | None] = [None]


def _set_back(target: Tensor, version: int) -> None:
    """Set the version counter of ``target`` (and of the tensors sharing it) back to ``version``, after an op that
    changed ``target`` in place, and forget the packs slimact's layers made of it (or of its views) for sharing:
    their version check no longer sees the change. Under an 8-bit Linear and a lossless norm or GELU (per_kind),
    ``h += a; z = lin(h); h += b; lin2(h)`` handed lin2 lin's pack of h before ``h += b``: lin2's weight gradient
    at cosine 0.47-0.75 to the exact one, silently (PyTorch's backward refuses this program: lin saved h)."""
    torch._C._autograd._unsafe_set_version_counter((target,), (version,))
    forget_shared_packs(target)


def _assigns_itself(args: tuple, kept: Tensor) -> bool:
    """Whether ``target[index] = value`` (``target`` the kept output ``kept`` or a view of it) writes into
    ``target`` the very view it names (``h[:, :4] += 1`` is
    ``v = h[:, :4]; v += 1; h[:, :4] = v``: the ``+=`` ran on the view, :func:`_on_copy`): the same
    elements, so nothing changes and autograd's graph is the same without it (the gradient of the overwritten region
    flows through the view's op either way), where running it would move the version counter the kept output shares."""
    if len(args) < 3 or not isinstance(args[2], Tensor) or not args[2]._is_view() or args[2]._base is not kept:
        return False
    target, index, value = args[:3]
    # Only the view that op ran on, as it left it: another view of the same elements may stand for another history
    # (one taken under no_grad, a custom Function's view such as a gradient reversal's `x.view_as(x)`), which
    # `h[:, :4] = grad_reverse(h[:, :4])` puts on the graph: skipped, gradients were 1.2-5 off, silently.
    handled = _HANDLED_VIEW[0]
    if (handled is None or handled() is not value or not value.requires_grad or value.retains_grad
            or value._backward_hooks):
        return False
    slot = target[index]
    # (a negative or conjugate view, torch._neg_view(h[:, :4]), reads the same memory as other values)
    return (isinstance(slot, Tensor) and slot.data_ptr() == value.data_ptr() and slot.shape == value.shape
            and slot.stride() == value.stride() and slot.dtype == value.dtype
            and (slot.is_neg(), slot.is_conj()) == (value.is_neg(), value.is_conj()))


#: In-place ops whose backward keeps none of their arguments: they may take the tensor they change as another argument.
_KEEPS_NO_ARGUMENT = frozenset({Tensor.__iadd__, Tensor.__isub__, Tensor.add_, Tensor.sub_, Tensor.copy_,
                                Tensor.__setitem__})


def _takes_itself(args: tuple, kwargs: dict, target: Tensor, kept: Tensor) -> bool:
    """Whether an in-place op on ``target`` (the kept output ``kept`` or a view of it) takes ``target`` or ``kept``
    as another argument as well (``h *= h``, ``h.addcmul_(h, w)``, ``h.lerp_(e, h)``, ``h.view(3, 8).mul_(h)``,
    ``v.hypot_(v)``): its backward may save that argument, the very tensor object the op changes (or whose storage
    :func:`_move` swaps), which setting the version counter back would hide: PyTorch's backward refuses it (the op
    changed what it saved); slimact's read the changed values with no error (``h *= h`` after a LayerNorm: input
    gradient 15 off). Such an op runs as written (slimact's clear error in the backward)."""
    others = [*args[1:], *(v for k, v in kwargs.items() if k != "input")] if args and args[0] is target else [
        *args, *(v for k, v in kwargs.items() if k != "input")]
    for other in others:
        for t in other if isinstance(other, (tuple, list)) else (other,):
            if t is target or t is kept:
                return True
    return False


def kept_or_view_of_kept(t: Any, through_bases: bool = True) -> bool:
    """Whether ``t`` is an output a Function keeps as it is (:func:`keep_output`) or a view of one: an in-place op
    on it goes through :func:`copy_on_write` (the routing mode's quick test, before it looks at the op). With
    ``through_bases``, also a view of the base of a kept output that is itself a view (which may or may not share its
    elements)."""
    return isinstance(t, Tensor) and (id(t) in KEPT_OUTPUTS or (t._is_view() and (
        id(t._base) in KEPT_OUTPUTS or (through_bases and id(t._base) in _KEPT_VIEW_BASES))))


def _overlaps(t: Tensor) -> bool:
    """Whether two elements of ``t`` share memory (an ``unfold`` or an ``expand``): each dim, taken by stride, must
    step past everything the dims inside it reach. (``torch._debug_has_internal_overlap`` answers "too hard" for
    most strided views.)"""
    if t.numel() == 0:
        return False
    reach = 0
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n > 1):
        if stride <= reach:
            # (a sufficient test only: interleaved dims, `as_strided((3, 2), (2, 3))`, step inside each other's
            # reach without meeting; their offsets, counted, tell)
            offsets = torch.as_strided(torch.arange(t.storage_offset() + 1 + sum(
                (n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))), t.shape, t.stride(),
                t.storage_offset()).flatten()
            return offsets.unique().numel() < offsets.numel()
        reach += (size - 1) * stride
    return False


def _compact_strides(t: Tensor) -> tuple[int, ...]:
    """Strides for a copy of ``t`` whose elements are iterated as ``t``'s are: a dim that continues the one inside it
    in ``t`` (its stride that one's extent) does in the copy, one that does not gets a gap of one element (so that
    the kernel does not merge them either), and an innermost stride other than 1 stays other than 1. Within about
    twice ``t``'s elements (a view's own span, its gaps, could be the whole output: ``h[:, 0]`` of ``[B, T, D]``)."""
    strides, order = [0] * t.dim(), sorted(range(t.dim()), key=lambda i: (t.stride(i), t.shape[i]))
    extent, continues, first = 1, 1, True
    for i in order:
        if t.shape[i] == 1:
            strides[i] = extent
            continue
        if first:
            strides[i] = 1 if t.stride(i) == 1 else 2
        else:
            strides[i] = extent if t.stride(i) == continues else extent + 1
        first = False
        extent, continues = strides[i] * t.shape[i], t.stride(i) * t.shape[i]
    return tuple(strides)


def _move(target: Tensor, entry: list) -> None:
    """Move the tensor the model holds to a storage of its own (once), away from the one its Function keeps."""
    if not entry[1]:
        # (a normal tensor even under torch.inference_mode(): a clone made there was an inference tensor, which the
        # next layer could not save, "Inference tensors cannot be saved for backward", where PyTorch's model ran)
        # (the storage its saved output stays on, for _release)
        entry[3] = target.untyped_storage().data_ptr()
        with torch.inference_mode(False):
            target.data = target.data.clone()
        entry[1] = True


#: The augmented assignments (``h += r``: ``Tensor.__iadd__``) and item assignment, which change their tensor.
_ASSIGNMENTS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                          "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                          "__imatmul__"})
#: Methods named as in-place ops that change a tensor's shape, flags or placement, not its values.
_NOT_VALUES = frozenset({"requires_grad_", "share_memory_", "detach_", "resize_", "resize_as_", "set_", "squeeze_",
                         "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "as_strided_", "rename_",
                         "refine_names_", "align_to_", "record_stream_"})
# func -> True (changes its first argument: relu_, __setitem__), an int (the position of its ``inplace`` argument:
# F.relu, F.dropout) or False.
_HOW: dict[Callable, bool | int] = {}


def _in_place_on(func: Callable, args: tuple, kwargs: dict) -> Tensor | None:
    """The tensor ``func(*args, **kwargs)`` changes in place, if it is such a call: a method or function named with a
    trailing underscore (``relu_``, ``clamp_``, ``index_fill_``, ``torch.relu_``), an augmented or item assignment,
    or a function given ``inplace=True`` (``F.relu``, ``F.dropout``, ``F.leaky_relu``)."""
    how = _HOW.get(func)
    if how is None:
        how = _HOW[func] = _how_in_place(func)
    if how is False:
        return None
    if how is not True and not (kwargs["inplace"] if "inplace" in kwargs else len(args) > how and args[how]):
        return None
    target = args[0] if args else kwargs.get("input")
    return target if isinstance(target, Tensor) else None


def _how_in_place(func: Callable) -> bool | int:
    name = getattr(func, "__name__", "")
    if name in _ASSIGNMENTS or (name.endswith("_") and not name.startswith("_") and name not in _NOT_VALUES):
        return True
    try:
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # (a builtin without a signature)
        return False
    return params.index("inplace") if "inplace" in params[1:] else False


def is_gradient(t: Tensor) -> bool:
    """Whether ``t`` was saved as a :class:`Gradient` (a gradient computed ahead, not an activation)."""
    return _gradient_entry(t) is not None


def is_parameter_gradient(t: Tensor) -> bool:
    """Whether ``t`` was saved as a parameter's :class:`Gradient` (``parameter=True``)."""
    entry = _gradient_entry(t)
    return entry is not None and entry[1]


# id -> weak reference: the tensors slimact's Functions saved (:func:`save`) while a :func:`marking_saved` block runs
# (slimact.profile's count, which tells them from what ops left as written keep inside a converted module).
_saved_by_slimact: dict[int, weakref.ref] = {}
_marking: list[int] = [0]


@contextlib.contextmanager
def marking_saved() -> Iterator[None]:
    """Note, in the block, each tensor :func:`save` hands to autograd (:func:`saved_by_slimact`)."""
    _marking[0] += 1
    try:
        yield
    finally:
        _marking[0] -= 1
        if not _marking[0]:
            _saved_by_slimact.clear()


def saved_by_slimact(t: Tensor) -> bool:
    """Whether ``t`` is a tensor one of slimact's Functions saved in a :func:`marking_saved` block (its codes, masks,
    a tensor it keeps as it is), not one an op slimact leaves as written saved."""
    ref = _saved_by_slimact.get(id(t))
    return ref is not None and ref() is t


def _mark_saved(t: Tensor) -> None:
    _saved_by_slimact[id(t)] = dropping(t, _saved_by_slimact, id(t))


def save(ctx: Any, *items: Packed | Mask | Gradient | Tensor | None) -> None:
    flat: list[Tensor | None] = []
    layout: list[tuple[str, int, Any]] = []
    for item in items:
        if isinstance(item, Packed):
            flat.extend(item.tensors)
            layout.append(("packed", len(item.tensors), item.meta))
        elif isinstance(item, Mask):
            flat.extend((item.bits,) if item.fill is None else (item.bits, item.fill))
            layout.append(("mask", 1 if item.fill is None else 2, item._replace(bits=None, fill=None)))
        elif isinstance(item, Gradient):
            _mark_gradient(item.tensor, item.parameter)
            flat.append(item.tensor)
            layout.append(("tensor", 1, None))
        else:
            flat.append(item)
            layout.append(("tensor", 1, None))
    if _marking[0]:
        for t in flat:
            if t is not None:
                _mark_saved(t)
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
            packed = Packed((_present(saved[i], ctx),) if meta.raw else tuple(saved[i : i + n]), meta)
            out.append(unpack(packed) if restore else packed)
        elif kind == "mask":
            out.append(meta.restore(saved[i], saved[i + 1] if n == 2 else None))
        else:
            out.append(_present(saved[i], ctx))
        i += n
    return out


def holds_its_values(t: Any) -> bool:
    """Whether ``t``'s memory still holds its elements (see :func:`_present`); true of anything but a strided tensor
    with elements."""
    if type(t) is not Tensor or not t.numel() or t.layout is not torch.strided:
        return True
    room = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    # (the first test, enough for a dense tensor, costs a tenth of the second)
    return room >= t.numel() or room > sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))


def _present(t: Any, ctx: Any) -> Any:
    """``t``, a tensor a Function kept as it is, if its memory still holds it. A tensor's memory can be released
    while the tensor lives on, with no version change: memcnn's invertible wrapper (``keep_input=False``, its
    default) frees its input's with ``untyped_storage().resize_(0)`` and rebuilds the values in its own backward.
    PyTorch's layer before it kept its own input, untouched; a policy keeping that layer's output instead (``"tempo"``'s
    norms and activations) read the freed memory: the process died (SIGSEGV) or the gradient was garbage."""
    if torch.compiler.is_compiling() or holds_its_values(t):
        return t
    cls = type(ctx)._forward_cls
    raise RuntimeError(
        f"slimact's {cls.layer} Function ({cls.__name__}) keeps a tensor of the forward whose memory was released "
        "after it (`untyped_storage().resize_(0)`, as memcnn's InvertibleModuleWrapper with keep_input=False does to "
        "its input): its backward cannot read it. Where a policy keeps a layer's output instead of its input "
        "(\"tempo\"'s norms and activations), PyTorch's own layer did not need that memory. Keep it (memcnn: "
        "keep_input=True), or leave the layer before it out of the conversion (convert's filter_fn, a policy exclude "
        "pattern)."
    )


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it: where it is not imported,
    none exist)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def foreign_weight(weight: Tensor) -> str | None:
    """The class of a weight slimact's own products cannot compute with, or ``None``: a tensor subclass other than
    DTensor (torchao's quantised weights implement ``F.linear``, not the ``mm`` of a fused block or of the LM loss's
    chunks: "Int8Tensor dispatch: ... aten.mm" where PyTorch trained)."""
    if type(weight) in (Tensor, torch.nn.Parameter) or is_dtensor(weight):
        return None
    return type(weight).__name__


def opaque(t: Tensor) -> bool:
    """Whether ``t``'s data cannot be viewed, packed and indexed as slimact's Functions do: a nested tensor
    (``torch.nested``, jagged or strided) or a sparse one (COO, CSR), a tensor with no data (on the meta device, or a
    ``FakeTensor``), or a ``DTensor`` (tensor parallelism's activations, sharded or replicated). A module or call given
    one runs as written (they raised where the plain one ran: a jagged F.scaled_dot_product_attention, a PyG GCN on
    sparse node features, a training step on the meta device, ColwiseParallel's input read as local storage)."""
    return t.is_nested or t.layout is not torch.strided or t.is_meta or _is_fake(t) or is_dtensor(t)


def _is_fake(t: object) -> bool:
    """Whether ``t`` is a ``FakeTensor`` (without importing it: where it is not imported, none exist)."""
    fake = getattr(sys.modules.get("torch._subclasses.fake_tensor"), "FakeTensor", None)
    return fake is not None and isinstance(t, fake)


def transformed() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ``jacrev``...), forward-mode AD
    (``torch.autograd.forward_ad.dual_level``) or a TorchScript trace (``torch.jit.trace``, the TorchScript ONNX
    exporter), ``torch.export``, ``torch.fx``'s symbolic trace or a ``FakeTensorMode`` is active. slimact
    Functions support none of them (no ``setup_context``/``vmap``/
    ``jvp``; their forwards read the storage of the tensors they pack; a TorchScript trace records a Python Function as
    an opaque op, which failed with an internal assert of PyTorch's alias analysis; ``torch.export`` kept their
    forwards' ops without their backward, and without the grad mode they run in, so an exported training-mode model's
    output did not require grad and its parameters got none): callers run PyTorch's own computation instead, exact,
    keeping what PyTorch keeps, and an exported program is the plain model's."""
    if torch.compiler.is_exporting():
        return True
    if torch.compiler.is_compiling():
        return False  # dynamo traces transforms itself; a compiled graph never runs a SlimFunction's Python
    return (
        torch._C._functorch.peek_interpreter_stack() is not None
        or torch.autograd.forward_ad._current_level >= 0
        or torch._C._is_tracing()
        # (FakeTensorMode's shape and memory estimates: an 8-bit pack's compiled kernel read a fake tensor's absent
        # data, a segfault; torch.fx's symbolic trace: its proxies reached slimact's Functions, fx's TraceError)
        or faking()
        or _fx_tracing()
    )


def faking() -> bool:
    """Whether a ``FakeTensorMode`` is on (shape and memory estimates)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def _fx_tracing() -> bool:
    symbolic = sys.modules.get("torch.fx._symbolic_trace")
    return symbolic is not None and symbolic.is_fx_symbolic_tracing()


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
                "filter_fn=...)), call slimact.revert(model) for these passes, or use plain modules there. "
                "torch.autograd.set_detect_anomaly(True) prints the forward call that made it."
            )
        note_backward()  # (the calls after this backward are another step's: slimact.nn._base.begin_call)
        try:
            return backward(ctx, *grads)
        except RuntimeError as error:
            if "modified by an inplace operation" not in str(error):
                raise
            raise RuntimeError(
                f"slimact's {cls.layer} Function ({cls.__name__}) keeps a tensor of the forward that was then modified "
                "in place. Where that tensor is a weight or the layer's input, PyTorch's own layer keeps it too and "
                "refuses alike (an optimizer step between two backward passes of one graph). Where a policy keeps a "
                "layer's output instead of its input (\"tempo\"'s norms and activations: the output is rebuilt into "
                "the gradient), an in-place op on that output (memcnn's InvertibleModuleWrapper with keep_input=False "
                "frees its input and restores it with set_) leaves PyTorch's own layer, which kept its input, "
                "unaffected but not slimact's. slimact moves the output "
                "to a copy first for an in-place op on the output itself in the converted model's forward (`+=`, "
                "`mul_`, `relu_`, `h[mask] = 0`, `F.dropout(h, inplace=True)`, ...) or on a view of it (`h[:, 0] "
                "+= 1`, also while other views of it live), but not for one that changes its shape (`unsqueeze_`), "
                "one made after the forward, or one on an output another op saved or a view was taken of since. "
                "Write that operation out of place (`h = h + r`), or leave the layer out of the conversion "
                "(convert's filter_fn, a policy exclude pattern). PyTorch's message: "
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
