"""Matrix product of two activations (``q @ k^T``, ``probs @ v``) keeping both operands compressed.

Math: ``y = a @ b`` (``torch.matmul`` semantics for rank >= 2, batch dims broadcast);
``grad_a = grad_y @ b^T`` and ``grad_b = a^T @ grad_y``, each summed back over broadcast dims.

What it keeps: ``a`` (only if ``b`` needs a gradient) and ``b`` (only if ``a`` does), each at ``b`` bits
per element plus 8 bytes per scale group; rank-4 attention operands ``[B, H, T, D]`` are grouped per head
(heads' ranges differ by orders of magnitude), with their own range by blocks of 16 along the dim the product
contracts within each head (:mod:`slimact.functional._heads`: heads concatenating parts of different sizes). An
operand that another layer keeps too (the softmax output feeding ``probs @ v``) is packed once, also when the product
reads it through a view that folds its batch dims (``probs.view(B * H, T, S)`` into ``torch.bmm``:
:func:`packing_source`).

:func:`bmm` and :func:`baddbmm` are the same for ``torch.bmm`` and ``torch.baddbmm`` (Bloom's ALiBi scores:
``beta * input + alpha * (a @ b)``), each forward PyTorch's own op, so that a routed call computes bit for bit
what the model wrote. :func:`einsum` covers a two-operand ``torch.einsum`` (``"bhid,bhjd->bhij"``) whose
gradients are einsums again (:func:`einsum_terms`).

Error: each restored operand is within ``step/2`` of the original per element; tests assert SQNR >= 30 dB
for both gradients.
"""

from __future__ import annotations

import string
from typing import NamedTuple

import torch
from torch import Tensor

from slimact.functional._heads import from_head_blocks, head_blocks
from slimact.functional._saving import Mask, SlimFunction, load, save
from slimact.quant import Packed, QuantConfig, RunningRange, pack
from slimact.quant.core import is_shared, kept_whole

__all__ = ["Dropped", "baddbmm", "bmm", "einsum", "einsum_terms", "matmul", "packing_source"]


def packing_source(x: Tensor) -> Tensor:
    """The tensor a pack of ``x`` is made of: ``x``'s base where ``x`` is a contiguous view of it that only folds
    or unfolds batch dims (the same matrices: ``[B, H, T, S]`` seen as ``[B * H, T, S]``, or as
    ``[B, H_kv, G, T, S]``), else ``x``. The pack cache matches a tensor by its exact view, so the softmax's pack of
    its ``[B, H, T, S]`` output serves a product reading it as ``probs.view(B * H, T, S)`` only this way. A config
    for packing ``x`` must be chosen for this tensor's rank."""
    base = x._base
    if (
        base is None or not x.is_contiguous() or not base.is_contiguous() or base.dtype != x.dtype
        or x.dim() < 2 or base.dim() < 2 or base.shape[-2:] != x.shape[-2:] or base.numel() != x.numel()
        or base.storage_offset() != x.storage_offset()
    ):
        return x
    return base


class Dropped(NamedTuple):
    """An operand that is ``native_dropout(probs, p)``: kept as the pack of ``probs`` (the softmax's own, shared)
    and the dropout's mask as bits, restored as ``probs_hat * mask * scale``: the probabilities are kept once
    for the softmax and the product, with the dropout between them."""

    probs: Tensor
    mask: Mask
    scale: float
    version: int  # ``probs._version`` at the dropout: the operand is rebuilt from ``probs`` only while it is unchanged


def _pack_operand(x: Tensor, cfg: QuantConfig | None, state: RunningRange | None,
                  contracted: int | None) -> tuple[Packed, tuple[int, int] | None]:
    """``pack(x, cfg, state)``, for a ``[B, H, R, C]`` operand contracted along ``contracted`` (-1 or -2) by blocks of
    that dim within each head (:func:`slimact.functional._heads.head_blocks`: ``q`` of ``q @ k^T`` along its
    channels, ``k^T`` along its rows, the same channels) where there is no pack of ``x`` to share (the softmax's of
    the probabilities of ``probs @ v``); with ``(heads, contracted)`` where it did (:func:`_restored` undoes it), else
    ``None`` (also for ``contracted`` ``None``: no one dim of the last two)."""
    # Only where the contracted dim is the operand's contiguous one, its channels as laid out (q's last dim; k^T's
    # rows, a view of k): probs @ v contracts v's rows, its tokens, where blocks would only copy v. A shared pack is
    # asked for before the view is made (the probabilities are [B, H, T, S]-contiguous: it would copy them).
    if contracted is None or x.stride(contracted) != 1 or is_shared(x, cfg) or kept_whole(x):
        return pack(x, cfg, state), None
    blocked, blocked_cfg = head_blocks(x if contracted == -1 else x.transpose(-1, -2), cfg)
    if blocked_cfg is cfg:
        return pack(x, cfg, state), None
    return pack(blocked, blocked_cfg, state), (x.shape[1], contracted)


def _restored(x: Tensor | None, blocks: tuple[int, int] | None) -> Tensor | None:
    """A restored operand of :func:`_pack_operand` in its own layout again."""
    if x is None or blocks is None:
        return x
    heads, contracted = blocks
    x = from_head_blocks(x, heads)
    return x if contracted == -1 else x.transpose(-1, -2)


def _save_operands(ctx, a, b, cfg_a, cfg_b, state_a, state_b, need_a: bool, need_b: bool,
                   dropped_a: Dropped | None = None, contracted: tuple[int | None, int | None] = (-1, -2)) -> None:
    """Keep ``a`` where ``b`` needs a gradient and ``b`` where ``a`` does (each through :func:`packing_source`,
    a head's channels that the product contracts in blocks: :func:`_pack_operand`; ``a`` as its probabilities and
    mask where it is ``dropped_a``). ``contracted``: the dim of each the product contracts (a matmul's: -1, -2)."""
    if dropped_a is not None and dropped_a.probs._version != dropped_a.version:
        # The probabilities were written in place after the dropout read them (``p.mul_(0.5)``): rebuilt from them,
        # the operand would be the write's, not the dropout's output the product used (v's gradient had been 0.5x).
        dropped_a = None
    ctx.dropped_scale = dropped_a.scale if dropped_a is not None and need_b else None
    blocks_a = None
    if ctx.dropped_scale is not None:
        kept_a = (pack(dropped_a.probs, cfg_a, state_a), dropped_a.mask)
    else:
        packed_a, blocks_a = _pack_operand(packing_source(a), cfg_a, state_a, contracted[0]) if need_b else (None, None)
        kept_a = (packed_a,)
    packed_b, blocks_b = _pack_operand(packing_source(b), cfg_b, state_b, contracted[1]) if need_a else (None, None)
    save(ctx, *kept_a, packed_b)
    ctx.shapes, ctx.blocks = (a.shape, b.shape), (blocks_a, blocks_b)


def _load_operands(ctx) -> tuple[Tensor | None, Tensor | None]:
    """The operands :func:`_save_operands` kept, restored (``None`` where not kept), blocked ones in their own
    layout again."""
    if ctx.dropped_scale is None:
        a_hat, b_hat = load(ctx)
    else:
        probs_hat, mask, b_hat = load(ctx)
        a_hat = torch.ops.aten.native_dropout_backward(probs_hat, mask, ctx.dropped_scale)
    blocks_a, blocks_b = ctx.blocks
    return _restored(a_hat, blocks_a), _restored(b_hat, blocks_b)


def _operand_grads(ctx, grad_y: Tensor, need_a: bool, need_b: bool) -> tuple[Tensor | None, Tensor | None]:
    """``(grad_y @ b^T, a^T @ grad_y)`` from the operands :func:`_save_operands` kept, each where needed."""
    a_hat, b_hat = _load_operands(ctx)
    a_shape, b_shape = ctx.shapes
    grad_a = grad_b = None
    if need_a:
        grad_a = _product(grad_y, b_hat.reshape(b_shape).to(grad_y.dtype).transpose(-1, -2), a_shape)
    if need_b:
        grad_b = _product(a_hat.reshape(a_shape).to(grad_y.dtype).transpose(-1, -2), grad_y, b_shape)
    return grad_a, grad_b


class _MatMulFunction(SlimFunction):
    layer = "MatMul"

    @staticmethod
    def forward(ctx, a, b, cfg_a, cfg_b, state_a, state_b, op=torch.matmul, dropped_a=None):
        y = op(a, b)
        _save_operands(ctx, a, b, cfg_a, cfg_b, state_a, state_b, *ctx.needs_input_grad[:2], dropped_a)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        return *_operand_grads(ctx, grad_y, *ctx.needs_input_grad[:2]), None, None, None, None, None, None


class _BaddbmmFunction(SlimFunction):
    layer = "baddbmm"

    @staticmethod
    def forward(ctx, x, a, b, beta, alpha, cfg_a, cfg_b):
        y = torch.baddbmm(x, a, b, beta=beta, alpha=alpha)
        _save_operands(ctx, a, b, cfg_a, cfg_b, None, None, *ctx.needs_input_grad[1:3])
        ctx.x_shape, ctx.beta, ctx.alpha = x.shape, beta, alpha
        return y

    @staticmethod
    def backward(ctx, grad_y):
        # As PyTorch's derivative: beta * grad for x (summed back over its broadcast dims), alpha * the product's.
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_y if ctx.beta == 1 else grad_y * ctx.beta).sum_to_size(ctx.x_shape)
        grad_a, grad_b = _operand_grads(ctx, grad_y, *ctx.needs_input_grad[1:3])
        if ctx.alpha != 1:
            grad_a = grad_a * ctx.alpha if grad_a is not None else None
            grad_b = grad_b * ctx.alpha if grad_b is not None else None
        return grad_x, grad_a, grad_b, None, None, None, None


def _product(x: Tensor, y: Tensor, shape: torch.Size) -> Tensor:
    """``x @ y`` summed over the batch dims the operand of ``shape`` was broadcast along.

    In fp16/bf16 a summed product is accumulated in fp32 and rounded once, as PyTorch's own matmul backward does
    (it folds the batch into one product): rounding each batch's product first, then summing them, drifted by
    several roundings where the batches cancel.
    """
    out = (*torch.broadcast_shapes(x.shape[:-2], y.shape[:-2]), x.shape[-2], y.shape[-1])
    if out == shape or x.dtype not in (torch.float16, torch.bfloat16):
        return x.matmul(y).sum_to_size(shape)
    return x.float().matmul(y.float()).sum_to_size(shape).to(x.dtype)


class _EinsumFunction(SlimFunction):
    layer = "einsum"

    @staticmethod
    def forward(ctx, equation, a, b, cfg_a, cfg_b, terms, dropped_a):
        y = torch.einsum(equation, a, b)
        _save_operands(ctx, a, b, cfg_a, cfg_b, None, None, *ctx.needs_input_grad[1:3], dropped_a,
                       (_contracted(terms[0], terms[2]), _contracted(terms[1], terms[2])))
        ctx.terms = terms
        return y

    @staticmethod
    def backward(ctx, grad_y):
        a_hat, b_hat = _load_operands(ctx)
        a_shape, b_shape = ctx.shapes
        sa, sb, out = ctx.terms
        grad_a = grad_b = None
        if ctx.needs_input_grad[1]:  # every index of a is in the output or in b (einsum_terms): an einsum again
            grad_a = torch.einsum(f"{out},{sb}->{sa}", grad_y, b_hat.reshape(b_shape).to(grad_y.dtype))
        if ctx.needs_input_grad[2]:
            grad_b = torch.einsum(f"{out},{sa}->{sb}", grad_y, a_hat.reshape(a_shape).to(grad_y.dtype))
        return None, grad_a, grad_b, None, None, None, None


def _contracted(operand: str, out: str) -> int | None:
    """The dim (-1 or -2) of an einsum operand's indices ``operand`` that the product sums over, where it is the only
    one summed (``"bhid"`` of ``"bhid,bhjd->bhij"``: -1); else ``None``."""
    summed = [i - len(operand) for i, c in enumerate(operand) if c not in out]
    return summed[0] if len(summed) == 1 and summed[0] in (-1, -2) else None


def einsum_terms(equation: str, a: Tensor, b: Tensor) -> tuple[str, str, str] | None:
    """``(a's, b's, output's subscripts)`` of a two-operand ``equation`` whose gradients :func:`einsum` computes
    as einsums (no index repeated within a term, every index of each operand in the output or in the other
    operand, shared indices of equal size: no broadcasting), else ``None``; an ellipsis and an implicit output
    written out in letters (:func:`_written_out`)."""
    eq = _written_out(equation.replace(" ", ""), a, b)
    if eq is None:
        return None
    ins, out = eq.split("->")
    sa, sb = ins.split(",")
    if any(len(set(t)) != len(t) or not t.isalpha() for t in (sa, sb)) or len(set(out)) != len(out):
        return None
    if len(sa) != a.dim() or len(sb) != b.dim() or not set(out) <= set(sa) | set(sb):
        return None
    if not (set(sa) <= set(out) | set(sb) and set(sb) <= set(out) | set(sa)):
        return None
    if any(a.shape[sa.index(c)] != b.shape[sb.index(c)] for c in set(sa) & set(sb)):
        return None
    return sa, sb, out


def _written_out(eq: str, a: Tensor, b: Tensor) -> str | None:
    """``eq`` with its ellipses (``"...id,...jd->...ij"``, einops' and lucidrains' attention) and an implicit output
    written out in letters ``eq`` does not use, as ``torch.einsum`` reads them: an ellipsis stands for the dims of
    its operand the letters do not name, aligned from the right across the operands; the implicit output is the
    ellipsis' dims, then the letters that appear once, in ASCII order. ``None`` for other than two operands. (Before,
    such an einsum ran as written and kept its fp32 operands where the routed softmax before it kept its 8-bit
    probabilities as well: 1.18x plain's attention bytes under ``"int8"``.)"""
    ins, arrow, out = eq.partition("->")
    terms = ins.split(",")
    if len(terms) != 2 or any(t.replace("...", "").count(".") for t in terms):
        return None
    spans = [x.dim() - len(t.replace("...", "")) if "..." in t else 0 for t, x in zip(terms, (a, b), strict=True)]
    free = [c for c in string.ascii_letters if c not in eq]
    if min(spans) < 0 or max(spans) > len(free):
        return None
    dims = "".join(free[:max(spans)])  # the ellipsis' letters, the outermost first
    terms = [t.replace("...", dims[len(dims) - k:]) for t, k in zip(terms, spans, strict=True)]
    if not arrow:
        joined = "".join(terms)
        out = dims + "".join(sorted(c for c in set(joined) - set(dims) if joined.count(c) == 1))
    return f"{terms[0]},{terms[1]}->{out.replace('...', dims)}"


def einsum(equation: str, a: Tensor, b: Tensor, cfg_a: QuantConfig | None, cfg_b: QuantConfig | None, *,
           dropped_a: Dropped | None = None) -> Tensor:
    """``torch.einsum(equation, a, b)`` keeping the operands as :func:`matmul` does, for an equation
    :func:`einsum_terms` accepts (others run as written, plain)."""
    terms = einsum_terms(equation, a, b)
    if terms is None or not torch.is_grad_enabled() or not (a.requires_grad or b.requires_grad):
        return torch.einsum(equation, a, b)
    return _EinsumFunction.apply(equation, a, b, cfg_a, cfg_b, terms, dropped_a)


def matmul(
    a: Tensor,
    b: Tensor,
    cfg_a: QuantConfig,
    cfg_b: QuantConfig,
    state_a: RunningRange | None = None,
    state_b: RunningRange | None = None,
    *,
    dropped_a: Dropped | None = None,
) -> Tensor:
    """``torch.matmul(a, b)`` keeping both operands compressed (rank >= 2; otherwise plain ``matmul``).

    ``cfg_a``/``cfg_b`` compress :func:`packing_source` of each operand; ``None`` keeps that operand as it is.
    ``dropped_a``: ``a`` (or the tensor ``a`` views, :func:`packing_source`) is that dropout of probabilities."""
    if not torch.is_grad_enabled() or not (a.requires_grad or b.requires_grad) or a.dim() < 2 or b.dim() < 2:
        return torch.matmul(a, b)
    return _MatMulFunction.apply(a, b, cfg_a, cfg_b, state_a, state_b, torch.matmul, dropped_a)


def bmm(a: Tensor, b: Tensor, cfg_a: QuantConfig | None, cfg_b: QuantConfig | None, *,
        dropped_a: Dropped | None = None) -> Tensor:
    """``torch.bmm(a, b)`` (``[N, T, D] @ [N, D, S]``) keeping the operands as :func:`matmul` does."""
    if not torch.is_grad_enabled() or not (a.requires_grad or b.requires_grad):
        return torch.bmm(a, b)
    return _MatMulFunction.apply(a, b, cfg_a, cfg_b, None, None, torch.bmm, dropped_a)


def baddbmm(x: Tensor, a: Tensor, b: Tensor, cfg_a: QuantConfig | None, cfg_b: QuantConfig | None, *,
            beta: float = 1, alpha: float = 1) -> Tensor:
    """``torch.baddbmm(x, a, b, beta=beta, alpha=alpha)`` keeping ``a`` and ``b`` as :func:`matmul` does (``x``
    is added, nothing of it is kept)."""
    if not torch.is_grad_enabled() or not (x.requires_grad or a.requires_grad or b.requires_grad):
        return torch.baddbmm(x, a, b, beta=beta, alpha=alpha)
    return _BaddbmmFunction.apply(x, a, b, beta, alpha, cfg_a, cfg_b)
