"""Language-model head and cross-entropy in one Function that never keeps the logits.

Math, per token ``i`` with hidden state ``h_i`` (``[C]``), logits ``z_i = W h_i + b`` (``[V]``), label
``t_i`` and label smoothing ``eps``::

    lse_i  = log sum_j exp(z_ij)
    loss_i = (1 - eps) (lse_i - z_i,t_i) + eps (lse_i - mean_j z_ij)        (0 where t_i = ignore_index)
    loss   = sum_i loss_i / n      (n = tokens not ignored for "mean"; 1 for "sum"; or a given divisor)
    dz_i   = (softmax(z_i) - (1 - eps) onehot(t_i) - eps / V) * s_i,   s_i = [t_i != ignore] / n
    grad_h = dz W,   grad_W = dz^T h,   grad_b = sum_i dz_i

This is ``F.cross_entropy(h @ W^T + b, t, ignore_index=..., label_smoothing=...)``. Plain PyTorch keeps the
``[tokens, vocab]`` log-softmax output (and an fp32 copy of the logits under mixed precision): for GPT-2 at
batch 4 x 512 that is 393 MiB in fp32. This Function runs over the tokens in chunks and computes the
gradients during the forward, as Liger-Kernel's fused linear cross-entropy does: per chunk the logits (given,
when the model's head has computed them already, else ``h_chunk W^T + b``), ``lse``, the loss, ``dz`` and
its products with ``W`` and ``h``. It keeps ``grad_h`` (``[tokens, C]`` in ``h``'s dtype), ``grad_W``
(``[V, C]``, fp32 while accumulating, then ``W``'s dtype, scaled by a power of two where fp16 would overflow)
and ``grad_b``; the backward multiplies them by the
incoming gradient of the loss. Nothing of the logits and no copy of ``h`` is kept.

Why ahead rather than recomputing the logits in the backward: the recomputation is one more
``[tokens, C] x [C, V]`` product per step (a third more of the head's work; for GPT-2 with 4 layers the head
is half of all the matmul work, so 19% of the step), whereas ``grad_W`` is a tensor autograd would allocate
at the very start of the backward anyway (the loss is the last op of the forward), so holding it from the
end of the forward does not raise the step's peak. ``slimact.profile`` reports these tensors as
``gradient_bytes``, apart from activations. The one pattern where they cost memory is several forwards before
one backward (each forward holds its own ``grad_W`` until then).

Under autocast the two gradient products of each chunk (``dz W`` and ``dz^T h``) run in autocast's dtype, on
``dz`` cast once, as PyTorch's own head's backward runs them; the chunks' weight gradients are summed in fp32.

Exact up to float rounding: the weight gradient is a sum of per-chunk products (fp32 accumulation), and the
loss a float64 sum of the tokens' losses.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from slimact.functional._saving import Gradient, SlimFunction, load, save

__all__ = ["linear_cross_entropy"]

#: Logit elements computed at once (per chunk of tokens): 64 MiB in fp32. Each chunk's weight-gradient product
#: reads and writes the whole ``[V, C]`` accumulator (147 MiB for GPT-2), so larger chunks are faster (GPT-2's
#: head and loss at 2048 tokens on 2 CPU cores: 1.02x plain PyTorch's time at 64 MiB, 0.97x at 128 MiB, 0.90x
#: at 256 MiB, interleaved medians) but raise the step's peak where the loss is its highest point (GPT-2, 12
#: layers, 4 x 512, "int8": the forward's high point is in the loss from 128 MiB chunks on, 620 MiB against
#: 557 MiB in the blocks).
CHUNK_ELEMENTS = 1 << 24

#: Under autocast, the weight gradient's half-precision products are made by slices of the vocabulary of this many
#: elements (:func:`_add_product`): a quarter of a chunk's logits.
SLICE_ELEMENTS = CHUNK_ELEMENTS // 4


def _chunks(n: int, vocab: int, dtype: torch.dtype = torch.float32):
    """``(start, end)`` rows of the chunks: :data:`CHUNK_ELEMENTS` logits each, and never all ``n`` tokens at
    once (at least two chunks from two tokens on), so that no ``[tokens, vocab]`` tensor is ever built. Where the
    gradient products run in a half-precision ``dtype`` (autocast), the chunk's fp32 gradient and its cast to
    ``dtype`` are alive together for a moment: the chunks are smaller by ``4 / (4 + itemsize)`` (2/3 for bf16),
    so that the two take what the fp32 chunk alone takes."""
    budget = CHUNK_ELEMENTS * 4 // (4 + dtype.itemsize) if dtype != torch.float32 else CHUNK_ELEMENTS
    rows = max(1, min(budget // max(vocab, 1), -(-n // 2)))
    for start in range(0, n, rows):
        yield start, min(n, start + rows)


def _narrow(g: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """``(g / scale).to(dtype), scale``: a power of two (exact) where ``g`` would overflow ``dtype``, else 1.

    An fp16 weight gradient summed over many tokens may exceed 65504 before the loss's own gradient scales it
    down (``reduction="sum"`` over 200k tokens: 66000, times an upstream 0.66 in PyTorch's order); the backward
    multiplies by ``grad_loss * scale``. For fp16 only (and not while dynamo traces), ``scale`` is a 0-d fp32
    tensor on ``g``'s device, decided there (no host sync); ``None`` (no scaling) otherwise."""
    if dtype != torch.float16 or torch.compiler.is_compiling():
        return g.to(dtype), None
    limit = torch.finfo(dtype).max
    peak = (g.abs().amax() if g.numel() else g.new_zeros(())).double()
    # 2 ** ceil(log2(2 * peak / limit)) where limit / 2 < peak < inf, else 1; exactly: x = m * 2**e with m in
    # [0.5, 1) has ceil(log2(x)) = e, or e - 1 where m = 0.5 (x a power of two).
    mantissa, exponent = torch.frexp(2 * peak / limit)
    power = torch.ldexp(torch.ones_like(peak), exponent - (mantissa == 0.5).to(exponent.dtype))
    scale = torch.where((peak > limit / 2) & (peak < math.inf), power, 1.0).float()
    return (g / scale).to(dtype), scale


def _product_dtype(device: torch.device) -> torch.dtype:
    """Autocast's dtype where autocast is on for ``device``'s type, else fp32."""
    kind = device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else torch.float32


def _autocast_caches(weight: Tensor, dtype: torch.dtype) -> bool:
    """Whether autocast casts ``weight`` to ``dtype`` once and caches the copy (for the autocast region), as it
    does for an fp32 leaf tensor that requires grad (a parameter): then an autocast op reading ``weight`` reuses the
    copy the model's head made instead of making one more."""
    kind = weight.device.type
    return (dtype != torch.float32 and weight.dtype == torch.float32 and torch.is_autocast_enabled(kind)
            and torch.is_autocast_cache_enabled() and torch.get_autocast_dtype(kind) == dtype
            and weight.requires_grad and weight.is_leaf and not weight._is_view())


def _add_product(grad_w: Tensor | None, dz_c: Tensor, h_c: Tensor) -> Tensor:
    """``grad_w + dz_c^T h_c`` (``[V, C]`` fp32; the first chunk's where ``grad_w`` is ``None``) from half-precision
    ``dz_c`` (``[rows, V]``) and ``h_c`` (``[rows, C]``): the product in their dtype (fp32 accumulation inside, as
    PyTorch's own head's backward) over slices of the vocabulary, so that the half-precision product is never a
    whole ``[V, C]`` temporary (there is no mixed-dtype in-place ``addmm_``). A slice (:data:`SLICE_ELEMENTS`) is
    a quarter of a chunk's logits: its product and the fp32 copy the CPU's mixed-dtype ``add_`` makes of it (6
    bytes an element), with the chunk's ``dz_c``, take less than the fp32 chunk did."""
    vocab, width = dz_c.shape[1], h_c.shape[1]
    first = grad_w is None
    if first:
        grad_w = torch.empty(vocab, width, dtype=torch.float32, device=h_c.device)
    step = max(1, SLICE_ELEMENTS // width)
    for v in range(0, vocab, step):
        part = dz_c[:, v:v + step].t() @ h_c  # [step, C] in dz_c's dtype
        if first:
            grad_w[v:v + step].copy_(part)
        else:
            grad_w[v:v + step].add_(part)
    return grad_w


def _exp_and_lse(z: Tensor, *, in_place: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(exp(z - max), sum, lse)`` over the last dim: ``softmax = exp / sum`` and ``lse = log(sum) + max``, as
    ``F.cross_entropy``'s log-softmax computes them (shifted by the row's max), so a row holding +inf (or only
    -inf) gives NaN, as there. (``torch.logsumexp`` gives inf: the loss was inf where PyTorch's is NaN.) The
    exponentials, which become the gradient, overwrite ``z`` where ``in_place`` (``z`` is then the chunk's one
    ``[rows, V]`` temporary), else are one more."""
    m = z.amax(-1, keepdim=True)
    e = (z.sub_(m) if in_place else z - m).exp_()
    total = e.sum(-1, keepdim=True)
    return e, total, (total.log() + m).squeeze(-1)


class _LinearCrossEntropy(SlimFunction):
    layer = "LM head and loss"

    @staticmethod
    def forward(ctx, h_in, weight, bias, target, ignore_index, smoothing, divisor, logits, transform):
        h = h_in.reshape(-1, h_in.shape[-1])  # [N, C]
        n, vocab = h.shape[0], weight.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        need_grad = need_h or need_w or need_b
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = grad_b = None  # [V, C] and [V] fp32: the first chunk's, then the others' added
        # The gradient products' dtype: autocast's (bf16/fp16) under autocast, as PyTorch's own head's backward
        # runs them (on the autocast copies of W and h), else fp32. (In fp32 the chunked weight gradient was 24
        # fp32 SIMT GEMMs, 14.4 ms of GPT-2's bf16 8 x 1024 step on an H200.)
        dtype = _product_dtype(h.device)
        # [V, C] in dtype for grad_h's product. Where autocast caches W's cast (the model's head, or the first
        # chunk's F.linear, has made it), torch.mm under autocast reads that copy: a second one held through the
        # whole loss raised GPT-2's bf16 step peak by its 74 MiB. Else W is cast once per call, not per chunk.
        w_c = (weight if _autocast_caches(weight, dtype) else weight.to(dtype)) if need_h else None
        # What depends on the labels only, for all N tokens at once (not once per chunk: each is a kernel launch).
        keep = target != ignore_index  # [N]
        t_safe = target.clamp(0, vocab - 1).unsqueeze(1)  # [N, 1]
        # Each token's loss (0 where ignored), summed once at the end in float64 (PyTorch sums all tokens' losses
        # at once, pairwise; a sum per chunk added one after another drifted by a rounding each).
        losses = torch.empty(n, dtype=torch.float32, device=h.device)
        zero = losses.new_zeros(())  # (where's out= form takes no Python scalar)
        loss_dtype = h.dtype  # (no tokens, no chunk: else set from the chunks' logits)
        if need_grad:
            # s = [kept] / divisor per token (1 / divisor rounded once to fp32, inf for 0; divisor is a 0-d float64
            # tensor on h's device: no host sync), and the one-hot term's weight -(1 - eps) s.
            s_all = torch.where(keep, (1.0 / divisor).float(), 0.0).unsqueeze(1)  # [N, 1]
            onehot_all = (smoothing - 1.0) * s_all
        for a, b in _chunks(n, vocab, dtype):
            # The previous chunk's [rows, V] tensors are freed before this one's are built (one chunk alive).
            z = e = dz = dz_c = raw = h_c = None
            # [rows, C]: under autocast cast once, for the head's product (what autocast would cast) and grad_W's
            h_c = h[a:b] if dtype == torch.float32 or (logits is not None and not need_w) else h[a:b].to(dtype)
            if logits is not None:
                z = logits[a:b]
            elif transform is None:
                z = F.linear(h_c, weight, bias)  # [rows, V], ours
            else:  # the model's own elementwise ops on its logits (a cast, a soft cap), differentiated locally
                raw = F.linear(h_c, weight, bias).requires_grad_(need_grad)
                with torch.enable_grad():
                    z = transform(raw)
            if a == 0:  # (the logits F.cross_entropy would see: their dtype; every chunk's is the first's)
                loss_dtype = torch.promote_types(h.dtype, z.dtype)
            with torch.enable_grad() if raw is not None else contextlib.nullcontext():
                z = z.float()  # [rows, V]; the caller's own tensor where it is fp32
            t_rows = t_safe[a:b]
            # What the loss needs of z before z becomes exp(z - max) in place (where z is ours to overwrite).
            picked = z.gather(1, t_rows).squeeze(1)
            mean = z.mean(-1) if smoothing else None
            # z is overwritten only where it is ours and nothing else reads it (not a caller's logits, not the output
            # of the model's ops, which their local graph may keep).
            e, norm, lse = _exp_and_lse(z.detach(), in_place=logits is None and raw is None)
            loss = lse - picked
            if smoothing:
                loss = (1 - smoothing) * loss + smoothing * (lse - mean)
            torch.where(keep[a:b], loss, zero, out=losses[a:b])
            if not need_grad:
                continue
            # dz = (softmax - (1 - eps) onehot - eps / V) * s
            s = s_all[a:b]  # [rows, 1]
            dz = e.mul_(s / norm)  # [rows, V]
            dz.scatter_add_(1, t_rows, onehot_all[a:b])
            if smoothing:
                dz -= (smoothing / vocab) * s
            if raw is not None:  # through the model's ops back to the head's product
                dz = torch.autograd.grad(z, raw, dz)[0].float()
                del z, raw
            if need_b:
                grad_b = dz.sum(0) if grad_b is None else grad_b.add_(dz.sum(0))
            dz_c = dz.to(dtype)  # [rows, V]; dz itself where dtype is fp32
            z = e = dz = None  # (under autocast the fp32 [rows, V] is freed before the products)
            if need_h:
                rows = grad_h[a:b]  # [rows, C], contiguous
                if rows.dtype == dtype == w_c.dtype:
                    torch.mm(dz_c, w_c, out=rows)
                else:
                    rows.copy_(torch.mm(dz_c, w_c))
            if need_w:
                h_c = h_c.to(dtype)  # (fp32: h's rows as they are, or their fp32 copy for a half-precision h)
                if dtype == torch.float32:
                    grad_w = dz_c.t() @ h_c if grad_w is None else grad_w.addmm_(dz_c.t(), h_c)
                else:
                    grad_w = _add_product(grad_w, dz_c, h_c)
        if need_w and grad_w is None:  # no tokens
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if need_b and grad_b is None:
            grad_b = torch.zeros(vocab, dtype=torch.float32, device=weight.device)
        total = losses.sum(dtype=torch.float64)
        # The loss in its logits' dtype, at least h's: fp32 where the model casts them first, as Hugging Face's loss
        # does (rounding it to a half-precision h's dtype moved it by up to half a bf16 step from plain's), and fp32
        # under autocast (cross_entropy is on its fp32 list).
        if torch.is_autocast_enabled(h.device.type):
            loss_dtype = torch.float32
        ctx.in_shape = h_in.shape
        grad_w, scale_w = _narrow(grad_w, weight.dtype) if grad_w is not None else (None, None)
        grad_b, scale_b = _narrow(grad_b, bias.dtype) if grad_b is not None else (None, None)
        # The scales are tensors (decided on the device): saved, not ctx attributes.
        save(ctx, *(Gradient(g, parameter) if g is not None else None
                    for g, parameter in ((grad_h, False), (grad_w, True), (grad_b, True))), scale_w, scale_b)
        return (total / divisor).to(loss_dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, grad_b, scale_w, scale_b = load(ctx)
        # grad_loss * scale rounded to grad_loss's dtype, as a Python float scale gave it.
        grads = [None if g is None else (g * (grad_loss if s is None else (grad_loss * s).to(grad_loss.dtype))).to(
                 g.dtype) for g, s in zip((grad_h, grad_w, grad_b), (None, scale_w, scale_b), strict=True)]
        if grads[0] is not None:
            grads[0] = grads[0].reshape(ctx.in_shape)
        return *grads, None, None, None, None, None, None


def _check_targets(target: Tensor, ignore_index: int, vocab: int) -> None:
    """Refuse a target outside ``[0, vocab)`` that is not ``ignore_index`` (a ``-1`` pad with the default
    ``ignore_index=-100``), as ``F.cross_entropy`` does: the loss clamps targets to index its chunks and would
    silently train on the nearest class. An asynchronous assert, as PyTorch's own CUDA kernel raises there: no
    read back to the host (on the CPU it raises at once)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))  # [N]
    torch._assert_async(~bad.any(), f"slimact: a target is out of bounds: neither in [0, {vocab}) nor ignore_index "
                        f"({ignore_index}), which F.cross_entropy refuses")


def linear_cross_entropy(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    divisor: float | Tensor | None = None,
    logits: Tensor | None = None,
    transform: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """``F.cross_entropy(transform(F.linear(h, weight, bias)), target, ...)`` without keeping (or, unless
    ``logits`` are given, ever building) ``[tokens, vocab]``.

    Args:
        h: ``[..., C]`` hidden states (``N`` tokens in all); ``weight``: ``[V, C]``; ``bias``: ``[V]`` or ``None``;
            ``target``: ``[N]``.
        reduction: ``"mean"`` (over tokens not ignored) or ``"sum"``.
        divisor: divide the summed loss by this instead (Hugging Face's ``num_items_in_batch``).
        logits: ``[N, V]``, ``F.linear(h, weight, bias)`` if the caller has it already (the model's own head
            output, rows in ``h``'s token order): the loss and gradients are computed from it, as
            ``F.cross_entropy`` on it would, and the head's product is not done twice.
        transform: elementwise ops of the model's between its head and the loss (``.float()``, Gemma 2's soft
            cap ``c * tanh(z / c)``), applied to each chunk of the head's product and differentiated through
            (a function of its tensor argument only: no parameters of its own). Not with ``logits``.
    """
    if logits is not None and transform is not None:
        raise ValueError("give logits or a transform of the head's product, not both")
    if logits is not None and logits.shape != (target.shape[0], weight.shape[0]):
        want = [target.shape[0], weight.shape[0]]
        raise ValueError(f"logits must be [tokens, vocab] = {want}, got {list(logits.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    _check_targets(target, ignore_index, weight.shape[0])
    # The divisor stays on the device (a 0-d float64 tensor): counting the kept tokens, or a tensor divisor
    # (Hugging Face's num_items_in_batch), needs no read back to the host.
    if divisor is None:
        divisor = (target != ignore_index).sum() if reduction == "mean" else 1.0
    divisor = torch.as_tensor(divisor, dtype=torch.float64).to(h.device)
    if reduction == "mean":
        divisor = torch.where(divisor == 0, math.nan, divisor)  # as F.cross_entropy: the mean over no tokens
    return _LinearCrossEntropy.apply(
        h, weight, bias, target, ignore_index, label_smoothing, divisor, None if logits is None else logits.detach(),
        transform,
    )
