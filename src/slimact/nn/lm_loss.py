"""Routing a model's language-model loss through :func:`slimact.functional.lm_loss.linear_cross_entropy`.

Models compute ``F.cross_entropy(head(h), labels)`` in code slimact does not own (Hugging Face's
``ForCausalLMLoss``, BERT's inline ``CrossEntropyLoss``). While a converted model runs its forward, the
``TorchFunctionMode`` of :mod:`slimact.nn.routing` follows the head's output to the loss, in one of two ways.

**Called with labels** (a ``labels`` argument of the model's ``forward``, else ``targets`` as nanoGPT names it, that
is not ``None``, in training with grad on, ``Policy.keep_logits`` off): the head does not compute its product. It
returns a :class:`LazyLogits`, a tensor of the logits' shape, dtype and device that holds no data, only the head's
input ``h``, weight and bias, and the model's elementwise ops applied to it since (``float``, a cast, ``/ c``,
``tanh``, ``* c``: Gemma 2's soft cap, Cohere's and Granite's logit scales) and its views that keep the token order
(``view``, ``reshape``, ``flatten``, ``contiguous``). ``F.cross_entropy`` on it runs the head's product and the loss
together over chunks of tokens (:mod:`slimact.functional.lm_loss`): no ``[tokens, vocab]`` tensor is ever allocated,
in the forward or the backward. Any other use computes the logits then and there, exactly as the head would have
(``F.linear`` under the autocast state of the head's call, then the recorded ops), with their autograd graph to
``h``, the weight and the bias (in grad mode, as the forward would have, whatever the mode of the read): reading
``output.logits`` after the step works and costs the head's product once. That read raises if the head's weight or
bias was changed in place since (an optimizer step, a write through ``.data``, which a fingerprint of the weight
taken in the forward shows): the logits it would give are not the ones the forward had. A custom autograd Function
handed the lazy tensor itself (DDP's ``_DDPSink`` with ``find_unused_parameters``) gets a node that recomputes the
logits in its backward, so gradients through it are exact too.

**Without labels** (or ``keep_logits``): the head computes its logits as usual; if ``F.cross_entropy`` then
gets them, or an alias of them in the same token order (``float``, ``view``/``reshape``/``flatten``,
``contiguous``), the loss and its gradients are computed from those logits, the head's input and weight,
keeping the gradients instead of the logits.

Anything else (class weights, ``reduction="none"``, logits cast to float64, a logits tensor the head did not
produce, ops that reorder tokens, logits or the head's input changed in place since the head's call, logits whose
own gradient is asked for with ``retain_grad`` or a hook) runs exactly as written; a lazy head's input changed in
place before the loss raises (the logits it stood for are gone). So does a hook or ``retain_grad`` on the logits a
loss was fused from, asked for after that loss (``output.logits.register_hook(...)`` once a model called with labels
returns): no gradient of the loss ever passes through them, and plain PyTorch would apply the hook (lazy logits
refuse it at once, computed ones when the loss's backward starts). Exclude ``"(loss)"`` in the policy to compute the
loss as written. The hooks PyTorch's own wrappers put on every output of a forward (FSDP2's pre-backward unshard)
are let through: they change no gradient and expect none from an output outside the loss's graph.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import numbers
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.hooks import RemovableHandle

from slimact._cache import dropping
from slimact._kinds import _runs_hooks
from slimact.functional._saving import SlimFunction, foreign_weight
from slimact.functional.lm_loss import linear_cross_entropy
from slimact.quant.reference import COMPRESSIBLE_DTYPES

__all__ = ["NOT_LAZY", "LazyLogits", "LossTracker", "labels_position", "lazy_call"]

# What a LazyLogits answers without computing anything: its metadata.
_METADATA = {
    Tensor.size, Tensor.dim, Tensor.numel, Tensor.__len__, Tensor.is_floating_point, Tensor.is_complex,
    Tensor.element_size, Tensor.is_contiguous, Tensor.stride, Tensor.get_device, Tensor.__hash__, Tensor._is_view,
}
_METADATA_PROPERTIES = {
    "shape", "dtype", "device", "ndim", "requires_grad", "grad_fn", "is_leaf", "layout", "is_cuda", "is_cpu",
    "is_meta", "is_sparse", "is_quantized", "is_nested", "itemsize", "nbytes", "_version", "_base",
}
# Views in token order (the last dim stays the vocabulary), and elementwise ops with numbers (a cast, a soft
# cap, a logit scale), applied to each chunk of the head's product by the fused loss.
_VIEWS = {Tensor.view, Tensor.reshape, torch.reshape, Tensor.flatten, torch.flatten, Tensor.contiguous}
_ELEMENTWISE = {
    Tensor.float, Tensor.half, Tensor.bfloat16, Tensor.to, Tensor.__truediv__, Tensor.div, torch.div,
    Tensor.__mul__, Tensor.__rmul__, Tensor.mul, torch.mul, torch.tanh, Tensor.tanh,
}
# Ops whose output has the same elements in the same row-major order as their input (followed from computed
# logits to the loss).
_ALIASES = _VIEWS | {Tensor.float, Tensor.to}


def _is_metadata(func: Callable) -> bool:
    if func in _METADATA:
        return True
    owner = getattr(func, "__self__", None)  # Tensor.shape.__get__: its getset descriptor
    return getattr(func, "__name__", "") == "__get__" and getattr(owner, "__name__", None) in _METADATA_PROPERTIES


def _step(func: Callable, rest: tuple, kwargs: dict, t: Tensor) -> Tensor:
    return func(t, *rest, **kwargs)


class _Spec:
    """What a :class:`LazyLogits` stands for: ``steps(F.linear(h, weight, bias))`` viewed as ``shape``, with
    ``F.linear`` under the autocast state ``autocast`` (``(device type, dtype)`` or ``None``). ``head``: the
    head module's own call on ``h``, for computing the logits in the graph (a converted head keeps its input
    as the policy says, as it would have in the forward)."""

    __slots__ = ("autocast", "contents", "dtype", "head", "shape", "steps", "versions")

    def __init__(self, shape, dtype, steps, autocast, versions, head, contents=(None, None)) -> None:
        self.shape, self.dtype, self.steps, self.autocast, self.versions = shape, dtype, steps, autocast, versions
        self.head, self.contents = head, contents

    def _with(self, shape, dtype, steps) -> _Spec:
        return _Spec(shape, dtype, steps, self.autocast, self.versions, self.head, self.contents)

    def derived(self, func: Callable, rest: tuple, kwargs: dict) -> _Spec | None:
        """The spec of ``func(lazy, *rest, **kwargs)`` where that is a view in token order or an elementwise op
        with numbers; ``None`` where it is not (the logits are then computed)."""
        flat, _ = tree_flatten((rest, kwargs))
        if any(isinstance(x, Tensor) for x in flat) or (func in (torch.div, Tensor.div) and "rounding_mode" in kwargs):
            return None
        if func in _ELEMENTWISE and not all(
            isinstance(x, (numbers.Real, torch.dtype)) and not isinstance(x, bool) for x in flat
        ):
            return None  # .to(device), .to(other_tensor), ...: computed
        try:
            out = func(torch.empty(self.shape, dtype=self.dtype, device="meta"), *rest, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            return None
        if not isinstance(out, Tensor) or out.dim() < 1 or out.shape[-1] != self.shape[-1]:
            return None
        if func in _VIEWS:
            # (``view(torch.int32)`` reinterprets the logits' bits: computed, as a view in another dtype)
            return self._with(out.shape, self.dtype, self.steps) if out.dtype == self.dtype else None
        if not out.dtype.is_floating_point or out.shape != self.shape:
            return None
        step = functools.partial(_step, func, rest, kwargs)
        return self._with(self.shape, out.dtype, (*self.steps, step))

    def transform(self, raw: Tensor) -> Tensor:
        for step in self.steps:
            raw = step(raw)
        return raw

    @contextlib.contextmanager
    def autocast_state(self):
        if self.autocast is None:
            yield
        else:
            with torch.autocast(self.autocast[0], dtype=self.autocast[1]):
                yield

    def check(self, h: Tensor, weight: Tensor, bias: Tensor | None, *, contents: bool = False) -> None:
        """Raise if the head's input, weight or bias was changed in place since the head's call: the logits it
        stands for can no longer be computed (``versions``: theirs at that call). With ``contents``, also a weight
        or bias written through ``.data`` (``p.data -= lr * p.grad``: no version moves), by their fingerprints."""
        if h._version != self.versions[0]:
            raise RuntimeError(
                "slimact: the LM head's input was changed in place after the head's call (the logits were not "
                "computed then: the fused LM loss did not need them), so the logits the forward had can no longer "
                "be computed. Write that operation out of place, or convert with Policy(keep_logits=True)."
            )
        if any(t is not None and t._version != v for t, v in zip((weight, bias), self.versions[1:], strict=True)) or (
            contents and any(f is not None and not torch.equal(_fingerprint(t), f)
                             for t, f in zip((weight, bias), self.contents, strict=True))
        ):
            raise RuntimeError(
                "slimact: these logits were never computed (the fused LM loss did not need them) and the head's "
                "weight has been changed in place since the forward (an optimizer step? a write through .data?), so "
                "they can no longer be computed as the forward had them. Read output.logits before the step, or "
                "convert with Policy(keep_logits=True)."
            )

    def compute(self, h: Tensor, weight: Tensor, bias: Tensor | None, *, by_head: bool = False) -> Tensor:
        """The logits: ``F.linear`` on the given tensors, or (``by_head``) the head module's call on ``h``."""
        self.check(h, weight, bias, contents=True)
        with self.autocast_state():
            z = self.head(h, weight, bias) if by_head and self.head is not None else None
            z = self.transform(F.linear(h, weight, bias) if z is None else z)
        return z.reshape(self.shape)


class _Lazy(SlimFunction):
    """Makes a :class:`LazyLogits`; its backward (reached only where a custom Function took the lazy tensor
    itself) recomputes the logits and differentiates them (first order only, as every slimact Function)."""

    layer = "LM head (lazy logits)"

    @staticmethod
    def forward(ctx, h, weight, bias, spec):
        # The inputs are held on ctx, not saved: nothing here is kept for a backward that normally never runs
        # (the LazyLogits holds them anyway, for reading the logits).
        ctx.inputs, ctx.spec = (h, weight, bias), spec
        return LazyLogits(h, weight, bias, spec)

    @staticmethod
    def backward(ctx, grad):
        leaves = [None if t is None else t.detach().requires_grad_(n) for t, n in
                  zip(ctx.inputs, ctx.needs_input_grad[:3], strict=True)]
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        with torch.enable_grad():
            z = ctx.spec.compute(*leaves)
        grads = iter(torch.autograd.grad(z, wanted, grad))
        return *(next(grads) if t is not None and t.requires_grad else None for t in leaves), None


class LazyLogits(Tensor):
    """A language-model head's logits that were not computed: the fused LM loss did not need them.

    A tensor of their shape, dtype and device with no data; metadata (``shape``, ``dtype``, ``requires_grad``,
    ...) answers at once, the views and elementwise ops listed in :mod:`slimact.nn.lm_loss` give another
    ``LazyLogits``, and any other use (printing, ``argmax``, ``.cpu()``, a loss of your own) computes them
    then, with their autograd graph, exactly as the head would have: a ``[tokens, vocab]`` tensor, once per
    ``LazyLogits`` (cached). Convert with ``Policy(keep_logits=True)`` to have the head compute them in the
    forward instead.
    """

    @staticmethod
    def __new__(cls, h: Tensor, weight: Tensor, bias: Tensor | None, spec: _Spec):
        t = Tensor._make_wrapper_subclass(cls, spec.shape, dtype=spec.dtype, device=h.device)
        t._inputs, t._spec, t._value = (h, weight, bias), spec, None
        # The LazyLogits this one was derived from (a view, a cast), and the fused losses taken through this one or
        # one derived from it (weak references to their graph nodes): no gradient of those losses passes through it
        # (lazy_call refuses its hooks, and autograd.grad of them with respect to it).
        t._parent, t._taken = None, []
        # Where this one is a view of its parent (``view``, ``reshape``, ``flatten``): that view, applied to the
        # parent's logits. As in PyTorch the two then share their elements: a write through either (``lg.div_(T)``
        # after ``flat = lg.view(-1, V)``) shows in the other, where each computed its own logits before.
        t._view = None
        # Whether it was made in grad mode from logits that were (the head's in a training forward are): one made
        # under no_grad (a distillation target ``lg / T``) is a constant, as in PyTorch, whenever it is computed.
        t._made_in_grad = True
        # The innermost saved-tensors hooks in place at the head's call (:func:`_hooks_of`), which the logits are
        # computed under, as the head would have computed them there.
        t._hooks = None
        return t

    @classmethod
    def make(cls, h: Tensor, weight: Tensor, bias: Tensor | None, spec: _Spec) -> LazyLogits:
        return _Lazy.apply(h, weight, bias, spec)

    def materialise(self) -> Tensor:
        """The logits, computed on first use (cached), as the forward would have computed them: with their graph
        where they were made in grad mode, whatever the mode of the first read (a metric under ``no_grad`` read before
        a loss term: cached without a graph, the later term had no gradient at all), without one where they were made
        under ``no_grad`` (a gradient flowed into a distillation target ``lg / T`` taken there)."""
        if self._value is None:
            value = self._parent.materialise() if self._view is not None else None
            with (torch._C.DisableTorchFunctionSubclass(), torch.inference_mode(False), _hooks_of(self._hooks),
                  torch.enable_grad() if self._made_in_grad else torch.no_grad()):
                if self._view is not None:
                    self._value = self._view(value)
                else:
                    self._value = self._spec.compute(*self._inputs, by_head=True)
        return self._value

    def computed(self) -> bool:
        """Whether these logits, or those they are a view of, exist (and may have been written in place since): they
        are then what any further use reads, not the head's product."""
        t = self
        while t is not None:
            if t._value is not None:
                return True
            t = t._parent if t._view is not None else None
        return False

    def fused(self) -> tuple[Tensor, Tensor, Tensor | None, _Spec] | None:
        """``(h, weight, bias, spec)`` for the fused loss, or ``None`` once the logits exist (use them) or where they
        carry no gradient (made under ``no_grad``)."""
        return None if self.computed() or not self._made_in_grad else (*self._inputs, self._spec)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out, args, kwargs = lazy_call(func, args, kwargs or {})
        return func(*args, **kwargs) if out is NOT_LAZY else out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"slimact: {func} reached a LazyLogits below torch functions; please report this")

    def __repr__(self, *, tensor_contents=None) -> str:
        return repr(self.materialise())


NOT_LAZY = object()

#: What asks for a tensor's own gradient, which logits a fused loss was taken through never get.
_GRAD_HOOKS = {Tensor.register_hook, Tensor.retain_grad}
_HOOKED_AFTER_LOSS = (
    "slimact: a gradient hook, retain_grad or autograd.grad(inputs=...) on logits an LM loss was computed from, after "
    "that loss: slimact fused the loss with the head in the forward (its gradients computed there, {}), so no "
    "gradient of that loss ever passes through these logits, and the hook would silently see none of it (plain "
    "PyTorch gives it them). Register the hook on the head's input, or convert with exclude=('(loss)',) in the policy "
    "(or the 'lmloss' kind off) to have the loss computed as written."
)
#: How the fused loss went past the logits, for :data:`_HOOKED_AFTER_LOSS`: lazy ones, computed ones (keep_logits).
_NEVER_BUILT = "the [tokens, vocab] logits never built"
_NOT_THROUGH = "from the head's input and weight: the logits were computed, but that gradient skips them"


#: Where PyTorch's own wrappers live that hook every output of a module's forward for their bookkeeping (FSDP2's
#: pre-backward unshard): such a hook asks for no gradient of its own and expects none from an output outside the
#: loss's graph, which logits a fused loss was taken from are.
_BOOKKEEPING_MODULES = ("torch.distributed.", "torch.nn.parallel.")


def _bookkeeping(hook: object) -> bool:
    """Whether ``hook`` is one of PyTorch's wrappers' own (:data:`_BOOKKEEPING_MODULES`), not the user's."""
    fn = getattr(hook, "__func__", hook)  # (a bound method: FSDPState._pre_backward)
    if isinstance(fn, functools.partial):
        fn = fn.func
    return (getattr(fn, "__module__", None) or "").startswith(_BOOKKEEPING_MODULES)


def _grad_of_taken(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` is ``torch.autograd.grad`` (or ``backward``) asking for the gradient of lazy logits a fused
    loss was taken through (``inputs=[output.logits]``) of outputs that loss is part of: PyTorch would find them
    unused, or give None. Of other outputs (a z-loss on ``output.logits``, which computes them with their graph) the
    logits' gradient is plain's."""
    if func is torch.autograd.grad:
        outputs, inputs = args[0] if args else kwargs.get("outputs"), args[1] if len(args) > 1 else kwargs.get("inputs")
    elif func is torch.autograd.backward:
        outputs, inputs = args[0] if args else kwargs.get("tensors"), kwargs.get("inputs")
    else:
        return False
    losses = {id(n): n for x in tree_flatten(inputs)[0] if isinstance(x, LazyLogits) for r in x._taken
              if (n := r()) is not None}
    return bool(losses) and _reaches(tree_flatten(outputs)[0], losses)


def _reaches(outputs: list, nodes: dict[int, object]) -> bool:
    """Whether the autograd graph of ``outputs`` holds one of ``nodes`` (by id, the nodes themselves held)."""
    stack = [t.grad_fn for t in outputs if isinstance(t, Tensor) and t.grad_fn is not None]
    seen: dict[int, object] = {}  # (the nodes, held: an id is not reused while the walk runs)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        if nodes.get(id(node)) is node:
            return True
        seen[id(node)] = node
        stack.extend(n for n, _ in node.next_functions)
    return False


def _not_hooked_since(aliases: list[weakref.ref], grad_outputs) -> None:
    """A fused loss's backward pre-hook: raise where the logits it was taken from (or an alias of them) were given a
    gradient hook or ``retain_grad`` after the loss (checked then by :meth:`LossTracker._wants_own_grad`)."""
    for ref in aliases:
        t = ref()
        hooks = (t._backward_hooks or {}).values() if t is not None else ()
        if t is not None and (t.retains_grad or not all(_bookkeeping(h) for h in hooks)):
            raise RuntimeError(_HOOKED_AFTER_LOSS.format(_NOT_THROUGH))


def _materialised(tree):
    return tree_map(lambda x: x.materialise() if isinstance(x, LazyLogits) else x, tree)


def lazy_call(func: Callable, args: tuple, kwargs: dict) -> tuple[object, tuple, dict]:
    """``(result, args, kwargs)`` of a torch function whose arguments may hold :class:`LazyLogits`: the result
    where the call is answered lazily (metadata, a view in token order, an elementwise op), else
    ``NOT_LAZY`` with every ``LazyLogits`` in the arguments replaced by its computed logits."""
    cls = LazyLogits
    flat, _ = tree_flatten((args, kwargs))
    if not any(isinstance(x, cls) for x in flat):
        return NOT_LAZY, args, kwargs
    if _is_metadata(func) and args and isinstance(args[0], cls):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs), args, kwargs
    first = args[0] if args else None
    if (func in _GRAD_HOOKS and isinstance(first, cls) and first._taken) or _grad_of_taken(func, args, kwargs):
        if func is Tensor.register_hook and _bookkeeping(args[1] if len(args) > 1 else kwargs.get("hook")):
            # Never called, as on any output outside the loss's graph: a handle to nothing.
            return RemovableHandle(collections.OrderedDict()), args, kwargs
        raise RuntimeError(_HOOKED_AFTER_LOSS.format(_NEVER_BUILT))
    if isinstance(first, cls) and not first.computed() and (func in _VIEWS or func in _ELEMENTWISE):
        if func is Tensor.contiguous or (func in (Tensor.float, Tensor.to) and _same_dtype(func, first, args, kwargs)):
            return first, args, kwargs  # as PyTorch: the tensor itself
        spec = first._spec.derived(func, args[1:], kwargs)
        if spec is not None:
            h, weight, bias = first._inputs
            grad = first._made_in_grad and torch.is_grad_enabled()
            with contextlib.nullcontext() if grad else torch.no_grad():
                derived = LazyLogits.make(h, weight, bias, spec)
            derived._parent, derived._made_in_grad, derived._hooks = first, grad, first._hooks
            if not grad and func in _VIEWS and first.requires_grad:
                # As in PyTorch, a view made under no_grad of logits that require grad does too (a leaf: a constant)
                with torch._C.DisableTorchFunction():
                    derived.requires_grad_(True)
            if func in _VIEWS:
                derived._view = functools.partial(_step, func, args[1:], kwargs)
            return derived, args, kwargs
    return NOT_LAZY, _materialised(args), _materialised(kwargs)


def _same_dtype(func: Callable, t: Tensor, args: tuple, kwargs: dict) -> bool:
    if func is Tensor.float:
        return t.dtype == torch.float32
    wanted = [x for x in (*args[1:], *kwargs.values()) if isinstance(x, torch.dtype)]
    return len(wanted) == 1 and len(args) + len(kwargs) == 2 and wanted[0] == t.dtype


#: Names of a model's labels argument: Hugging Face's, and nanoGPT's, minGPT's and nanochat's.
_LABELS_NAMES = ("labels", "targets")


def labels_position(model: nn.Module) -> tuple[str, int | None]:
    """The name of ``model.forward``'s labels parameter (``labels``, else ``targets``) and its position among the
    positional arguments (``None`` where it takes it by keyword only, or has none)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return _LABELS_NAMES[0], None
    name = next((n for n in _LABELS_NAMES if any(p.name == n for p in params)), _LABELS_NAMES[0])
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return name, (positional.index(name) if name in positional else None)


class LossTracker:
    """Tracks the output of a model's head (and its aliases) during a forward, and computes
    ``F.cross_entropy`` on them from the head's input. Driven by :class:`slimact.nn.routing.Routing`.

    ``lazy``: whether, in a forward called with labels, the head returns :class:`LazyLogits`."""

    def __init__(self, head: nn.Linear, *, lazy: bool = True) -> None:
        self.head = head
        self.lazy = lazy
        # id(tracked tensor) -> (weak ref to it, the head input h, their versions when tracked, a weak ref to the
        # tracked tensor it aliases or None for the head's output)
        self._sources: dict[int, tuple[weakref.ref, Tensor, int, int, weakref.ref | None]] = {}
        self.active = False
        #: This forward was called with labels: the head is to return LazyLogits.
        self.lazy_now = False
        #: A LazyLogits was made in this forward (the mode then looks for them in every call's arguments).
        self.lazy_made = False
        self._in_head = False
        self._computing = False  # the head is called to compute a LazyLogits' values: not lazily again
        #: Losses the fused head and loss computed (``summary(model, inputs)`` tells whether one ran).
        self.fused = 0
        self.handles = [
            head.register_forward_pre_hook(self._head_input),
            head.register_forward_hook(self._head_output, always_call=True),
        ]

    def start(self, labelled: bool) -> None:
        """A forward of the model starts (in training, grad on): ``labelled`` if it got labels."""
        self.active = True
        self.lazy_now = self.lazy and labelled

    def stop(self) -> None:
        self.active = self.lazy_now = self.lazy_made = self._in_head = False
        self.clear()

    def seen(self, func, args, out) -> None:
        """Follow ``out = func(*args)`` if it is an alias of a tracked tensor in the same token order."""
        if func in _ALIASES and args and isinstance(out, Tensor) and self.source(args[0]) is not None:
            if func is not Tensor.to or out.dtype.is_floating_point:
                self.alias(out, args[0])

    def clear(self) -> None:
        self._sources.clear()

    def _head_input(self, module, args):
        # A converted (slimact) head runs its parent's forward for this call: the plain F.linear that
        # lazy_head answers. Not a head that runs hooks of someone else's (or a forward set on it): what it
        # returns is then not F.linear(h) (a hook adding a logit bias, masking the vocabulary, clamping), and the
        # logits a LazyLogits computes by calling the head would run those hooks a second time.
        if self.active and self.lazy_now and not self._computing and not _runs_hooks(module):
            self._in_head = True
            module.__dict__["_slimact_deferred"] = True

    def _head_output(self, module, args, output):
        if self._in_head:
            self._in_head = False
            module.__dict__.pop("_slimact_deferred", None)
        if (self.active and isinstance(output, Tensor) and not isinstance(output, LazyLogits) and args
                and not _runs_hooks(module)):  # (a hook's output is not F.linear(h): the loss as written)
            self._track(output, args[0])

    def lazy_head(self, x, weight, bias=None):
        """The head's ``F.linear`` in a forward called with labels: a :class:`LazyLogits` (``None``: computed)."""
        # (Under no_grad, as a head called in a `with torch.no_grad()` block of the forward is, its logits carry no
        # gradient: computed, so that no loss on them is fused with gradients the plain loss does not have.)
        if (not self._in_head or not torch.is_grad_enabled() or weight is not self.head.weight
                or foreign_weight(weight) is not None or not isinstance(x, Tensor) or x.dim() < 1
                or x.dtype not in COMPRESSIBLE_DTYPES or (weight.dtype != x.dtype and not _autocasting(x))):
            return None
        device = x.device.type
        autocast = (device, torch.get_autocast_dtype(device)) if _autocasting(x) else None
        dtype = autocast[1] if autocast is not None else torch.result_type(x, weight)
        versions = (x._version, weight._version, None if bias is None else bias._version)
        spec = _Spec((*x.shape[:-1], weight.shape[0]), dtype, (), autocast, versions, self._head_call,
                     (_fingerprint(weight), _fingerprint(bias)))
        self.lazy_made = True
        lazy = LazyLogits.make(x, weight, bias, spec)
        lazy._hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        return lazy

    def _head_call(self, h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
        """The head module's own call on ``h``, or ``None`` where the head no longer holds the ``weight`` and
        ``bias`` the forward used: a ``torch.func.functional_call`` has put its parameters back (the logits are
        then ``F.linear`` of the forward's own tensors, not of the parameters now in place)."""
        if self.head.weight is not weight or self.head.bias is not bias:
            return None
        self._computing = True
        try:
            return self.head(h)
        finally:
            self._computing = False

    def _track(self, t: Tensor, h: Tensor, h_version: int | None = None, of: Tensor | None = None) -> None:
        key = id(t)
        h_version = h._version if h_version is None else h_version
        self._sources[key] = (dropping(t, self._sources, key), h, t._version,
                              h_version, None if of is None else weakref.ref(of))

    def _entry(self, t: object) -> tuple | None:
        """The entry of ``t`` (the head output or a tracked alias of it) while it still holds ``F.linear(h, ...)``
        of the ``h`` it holds: an in-place change of either since it was tracked (``logits.div_(T)``,
        ``logits += bias``, ``h.mul_(c)``) voids it, as the loss's gradients are taken through ``h`` and the head's
        parameters, not through the logits' own graph."""
        entry = self._sources.get(id(t)) if isinstance(t, Tensor) else None
        if entry is None or entry[0]() is not t or t._version != entry[2] or entry[1]._version != entry[3]:
            return None
        return entry

    def source(self, t: object) -> Tensor | None:
        """The head input that ``t`` (the head output or a tracked alias of it) was computed from."""
        entry = self._entry(t)
        return None if entry is None else entry[1]

    def alias(self, out: Tensor, of: Tensor) -> None:
        entry = self._entry(of) if out is not of else None  # (`logits.float()` of fp32 logits is logits itself)
        if entry is not None:
            self._track(out, entry[1], entry[3], of)

    def _alias_chain(self, t: Tensor):
        """``t``, then each tracked tensor the one before aliases, each once (an op that returns its input aliases a
        tensor to itself)."""
        seen: set[int] = set()
        while t is not None and id(t) not in seen:
            seen.add(id(t))
            yield t
            entry = self._entry(t)
            t = None if entry is None or entry[4] is None else entry[4]()

    def _wants_own_grad(self, t: Tensor) -> bool:
        """Whether ``t`` or a tracked tensor it aliases asks for its own gradient (``retain_grad``, a hook),
        which a loss taken through ``h`` and the head's parameters would never give it."""
        return any(a.retains_grad or a._backward_hooks for a in self._alias_chain(t))

    def _aliases(self, t: Tensor) -> list[weakref.ref]:
        """Weak references to ``t`` and the tracked tensors it aliases (:meth:`_alias_chain`)."""
        return [weakref.ref(a) for a in self._alias_chain(t)]

    def fused_loss(self, logits, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
        lazy = logits.fused() if isinstance(logits, LazyLogits) else None
        h = lazy[0] if lazy is not None else self.source(logits)
        if lazy is None and h is not None and self._wants_own_grad(logits):
            return None  # the caller wants the logits' own gradient (retain_grad, a hook): the loss as written
        head = self.head
        if (
            h is None or weight is not None or size_average is not None or reduce is not None
            or reduction not in ("mean", "sum") or logits.dim() != 2 or target.dim() != 1
            or target.dtype != torch.int64 or logits.shape[-1] != head.weight.shape[0]
            or logits.dtype not in COMPRESSIBLE_DTYPES  # (float64 logits: the chunks would compute in fp32)
            or foreign_weight(head.weight) is not None  # (quantised after convert)
        ):
            return None
        if h.numel() // h.shape[-1] != logits.shape[0]:
            return None
        if lazy is None and (not logits.requires_grad or h.dtype not in COMPRESSIBLE_DTYPES):
            # Nothing will be kept (or float64, kept exact), or the logits carry no gradient (the head ran under
            # no_grad, its weight and input frozen): the loss as written, with none of the gradients a fused one has.
            return None
        kwargs = {"ignore_index": ignore_index, "label_smoothing": label_smoothing, "reduction": reduction}
        if lazy is None:
            loss = linear_cross_entropy(h, head.weight, head.bias, target, logits=logits, **kwargs)
        else:
            h, w, b, spec = lazy
            spec.check(h, w, b)
            with spec.autocast_state():
                loss = linear_cross_entropy(h, w, b, target, transform=spec.transform if spec.steps else None,
                                            **kwargs)
            node = loss.grad_fn
            taken = logits
            while taken is not None and node is not None:
                taken._taken.append(weakref.ref(node))
                taken = taken._parent
        if lazy is None and loss.grad_fn is not None:
            loss.grad_fn.register_prehook(functools.partial(_not_hooked_since, self._aliases(logits)))
        self.fused += 1
        # Autocast runs cross_entropy in fp32 (its fp32 op list): the loss is fp32 whatever the logits' dtype.
        return loss.float() if torch.is_autocast_enabled(logits.device.type) else loss.to(logits.dtype)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.head.__dict__.pop("_slimact_deferred", None)
        self._sources.clear()


def _fingerprint(t: Tensor | None) -> Tensor | None:
    """The sum, wrapping in the integer type of ``t``'s width (int32 where the rows allow it), of ``t``'s bit patterns:
    it moves with a write to any element of ``t``, those made through ``.data`` too, which leave its version as it
    was. One pass over the head's weight per forward, with no temporary of its size (a fraction ``1 / tokens`` of
    the product the lazy logits skip), compared only when the logits are computed."""
    if t is None or type(t) not in (Tensor, nn.Parameter) or t.dim() == 0 or t.element_size() not in (1, 2, 4, 8):
        return None  # (a tensor subclass, DTensor: not fingerprinted)
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    with torch.no_grad():
        t = t.detach()
        if t.element_size() < 4 and t.stride(-1) == 1 and t.shape[-1] * t.element_size() % 4 == 0:
            try:
                return t.view(torch.int32).sum(dtype=torch.int32)
            except RuntimeError:  # (strides or offset not aligned to 4 bytes: its own width)
                pass
        return t.view(ints[t.element_size()]).sum(dtype=ints[t.element_size()])


@contextlib.contextmanager
def _hooks_of(top: tuple | None):
    """Run with the saved-tensors hooks whose innermost was ``top`` (the pair in place at the head's call): those
    pushed since are popped for the while and pushed back after. Lazy logits first read inside a non-reentrant
    checkpoint (a loss checkpointed apart from the model) had the head's saved tensors packed by it in its forward and
    not in its recomputation, which reads the logits computed then: it raised that the two saved different numbers of
    tensors. The plain head saved its tensors in the forward, outside the checkpoint."""
    popped = []
    if torch._C._autograd._saved_tensors_hooks_is_enabled():
        while (now := torch._C._autograd._top_saved_tensors_default_hooks(True)) is not None and (
                top is None or now[0] is not top[0]):
            popped.append(now)
            torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(popped):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def _autocasting(x: Tensor) -> bool:
    device = x.device.type
    return torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != x.dtype
