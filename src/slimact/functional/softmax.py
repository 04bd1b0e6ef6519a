"""Softmax keeping only its output, compressed.

Math: ``y = softmax(x, dim)``; ``grad_x = y * (grad_y - sum(grad_y * y, dim))`` needs only ``y``.

What it keeps: ``sqrt(y)`` at ``b`` bits per element plus 8 bytes per scale group (:func:`pack_probabilities`);
the backward restores ``y_hat = s_hat ** 2``. An attention map ``[B, H, T, T]`` is grouped per head. When the
next layer keeps the same ``y`` (``probs @ v`` through a slimact MatMul), both keep that one packed copy (Mesa
kept the map three times).

Why the square root: a row's probabilities are ~1/length, while a group's scale is set by the largest
probability in it. Linear 8-bit codes of ``y`` give every element the same absolute error, ``max_g(y) / 510``,
which swamps the many small probabilities of a long row: the input gradient's SQNR fell with the row length
(standard-normal scores, one scale per head: 28.6 dB at 512 keys, 22.7 dB at 2048). Codes of ``s = sqrt(y)``
make the error of ``y`` grow with ``sqrt(y)`` instead (``d y = 2 s d s``): 40.1 dB and 37.2 dB there, the
same bytes. (Over a group, the mean squared error shrinks by ``max_g(y) / (4 mean(y))`` against linear codes.)

Error: with ``s_hat`` within ``e = step_s / 2`` of ``s`` (``step_s = range_g(s) / 255``, plus its cast to
``y``'s dtype), ``|y_hat - y| <= e (2 s + e)``, plus the rounding of the square in ``y``'s dtype. The backward
is PyTorch's own softmax backward evaluated at ``y_hat``; tests assert SQNR >= 30 dB at any row length.

That bound is absolute, which is what a product of the probabilities (``probs @ v``) needs: its gradient to ``y`` is
bounded. It is not relative: ``y_hat / y`` is 0 or far from 1 for the smallest probabilities, and a gradient that
grows as ``1 / y`` (a loss taking ``log(y)``: a KL divergence to a teacher's attention maps, MiniLM's distillation,
a pointer network's NLL) multiplies that ratio: the query and key weight gradients at cosine 0.92 where the smallest
probability is 2e-9 (a sweep, 2026-12-07). So the backward uses ``y`` itself, exact, where that costs nothing: where
the model returns it (:func:`keep_exact`, which the routing calls on a training forward's outputs, and slimact's
attention function where it returns probabilities: attention maps a loss may divide by; plain PyTorch's softmax
keeps them too), and where ``y`` is still held, unchanged, when the backward runs. The probabilities divided by
inside the model (a ``log`` in its code, a mask applied after the softmax and the rows renormalised), or returned
by a model's own attention only as a copy or a dropout of its own, get the codes: docs/robustness.md, where
``slimact.check`` reports them.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from slimact._cache import storage_key
from slimact.functional._saving import SlimFunction, holds_its_values, load, save
from slimact.quant import Packed, QuantConfig, RunningRange, pack
from slimact.quant.core import register_derivation, share_derived

__all__ = ["keep_exact", "normalized", "pack_probabilities", "softmax"]

register_derivation("square", torch.square)


def pack_probabilities(y: Tensor, cfg: QuantConfig | None, state: RunningRange | None = None) -> Packed:
    """Pack probabilities ``y`` (``>= 0``) as codes of ``sqrt(y)``; :func:`~slimact.quant.unpack` restores
    ``y_hat = s_hat ** 2`` (see the module docstring). A later ``pack(y)`` (the next MatMul's) reuses it. ``y``
    holding NaN/inf, or ``cfg=None``, keeps ``y`` itself, exactly."""
    if cfg is None:
        return pack(y, None)
    # share=False: the square root is a temporary; the pack is shared under y (below) instead.
    packed = pack(y.sqrt(), cfg, state, share=False)
    if packed.meta.raw:
        return pack(y, None)
    if not torch.compiler.is_compiling():  # under torch.compile packs are not shared
        share_derived(y, packed, "square")
    return Packed(packed.tensors, packed.meta._replace(derive="square"))


def normalized(y_hat: Tensor, dim: int) -> Tensor:
    """Restored probabilities ``y_hat`` scaled to sum to 1 along ``dim``, as the exact ones do: the softmax
    backward at them, ``y_hat * (g - sum(g * y_hat))``, then sums to 0 along ``dim`` as the exact gradient does
    (softmax is invariant to adding one value to a row), where at the 8-bit codes' own sums the rows summed to
    ~5e-3 of the gradient: error on anything adding one value to a whole row of scores (an attention key's bias,
    whose exact gradient is ~0). ``y_hat`` is scaled in place (a tensor the restore made for the caller: one pass
    over it, where a new quotient and a ``where`` of it took 2.4-10x the time), a row of zeros left as it is."""
    total = y_hat.sum(dim, keepdim=True, dtype=torch.float32)
    return y_hat.div_(total.masked_fill_(total == 0, 1.0))


class _Exact:
    """A lossy softmax's own output ``y`` where its backward can read it at no cost (the module docstring): a weak
    reference (alive while someone holds ``y``: another op's saved copy is released before this backward runs), or
    ``y`` itself once :func:`keep_exact` holds it. Either is used only while ``y`` is unchanged: its version, and
    where its elements are (``y.data = t`` moves no version counter: a stash of the probabilities given other data
    had its new values read, a gradient at cosine 0.06, a review), and while its memory still holds it."""

    __slots__ = ("held", "ref", "version", "where")

    def __init__(self, y: Tensor) -> None:
        self.ref, self.version, self.where, self.held = weakref.ref(y), y._version, storage_key(y), None

    def _unchanged(self, y: Tensor | None) -> Tensor | None:
        if y is None or y._version != self.version or storage_key(y) != self.where or not holds_its_values(y):
            return None
        return y

    def get(self) -> Tensor | None:
        return self._unchanged(self.held if self.held is not None else self.ref())

    def hold(self) -> bool:
        """Hold ``y`` (if it is still there, unchanged) until the backward; whether it did."""
        y = self._unchanged(self.ref())
        if y is not None:
            # (detached: the same elements and version counter, but no graph, so the node holding it makes no cycle)
            self.held = y.detach()
        return y is not None


class _SoftmaxFunction(SlimFunction):
    layer = "softmax"

    @staticmethod
    def forward(ctx, x, dim, cfg, state, dtype=None):
        y = torch.softmax(x, dim, dtype=dtype)
        ctx.dim, ctx.in_dtype = dim, x.dtype
        packed = pack_probabilities(y, cfg, state)
        ctx.lossy = packed.meta.derive is not None  # codes of sqrt(y), not y as computed
        ctx.exact = _Exact(y) if ctx.lossy and not torch.compiler.is_compiling() else None
        save(ctx, packed)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        y = ctx.exact.get() if ctx.exact is not None else None
        # (released with the backward: a graph kept past it, a logged loss, had held every step's maps; a review)
        ctx.exact = None
        if y is not None:
            y_hat = y.detach()
        else:
            (y_hat,) = load(ctx)
            if ctx.lossy:
                y_hat = normalized(y_hat, ctx.dim)
        # With ``dtype=`` the softmax ran on ``x.to(dtype)``: its backward in that dtype, then the cast's (to x's).
        grad_x = torch._softmax_backward_data(grad_y, y_hat, ctx.dim, grad_y.dtype).to(ctx.in_dtype)
        return grad_x, None, None, None, None


def softmax(
    x: Tensor, dim: int, cfg: QuantConfig, state: RunningRange | None = None, dtype: torch.dtype | None = None
) -> Tensor:
    """``torch.softmax(x, dim, dtype=dtype)`` keeping its output compressed for the backward."""
    if not torch.is_grad_enabled() or not x.requires_grad:
        return torch.softmax(x, dim, dtype=dtype)
    return _SoftmaxFunction.apply(x, dim, cfg, state, dtype)


#: Autograd nodes that pass a tensor's values on, unchanged but in place or order (views, copies, casts, dropouts):
#: :func:`keep_exact` looks through them for the softmax a returned tensor comes from (whose output it holds only if
#: it is still there: the base of a view, the input a routed dropout's note keeps, not one a copy replaced).
_PASSING = frozenset({
    "AliasBackward0", "CloneBackward0", "ExpandBackward0", "NativeDropoutBackward0", "PermuteBackward0",
    "SelectBackward0", "SliceBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "ToCopyBackward0",
    "TransposeBackward0", "TransposeBackward1", "UnsafeViewBackward0", "UnsqueezeBackward0", "ViewBackward0",
    "_DropoutFunctionBackward",
})


def keep_exact(t: Tensor) -> bool:
    """Hold the output of the lossy slimact softmax ``t`` comes from (``t`` itself, or a view, cast or dropout of it)
    for that softmax's backward, which then uses it exactly (the module docstring): for the probabilities a model
    returns. Whether it held one (the output must still be there: see :data:`_PASSING`)."""
    node = t.grad_fn
    for _ in range(16):
        if node is None:
            return False
        if type(node) is _SoftmaxFunction._backward_cls:
            return node.exact is not None and node.exact.hold()
        inputs = [n for n, _ in node.next_functions if n is not None]
        name = type(node).__name__
        # (a product or quotient by a tensor needing no gradient: PyTorch's dropout on the CPU, a head mask)
        if not (name in _PASSING or (name in ("MulBackward0", "DivBackward0") and len(inputs) == 1)):
            return False
        node = inputs[0] if inputs else None
    return False
