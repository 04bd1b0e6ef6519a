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
batch 4 x 512 that is 393 MiB in fp32. This Function runs over the tokens in chunks, keeps ``h`` (which the
head's Linear keeps anyway: one storage, or one shared 8-bit pack under an 8-bit policy), the labels and
``lse`` (4 bytes per token), and recomputes each chunk's logits in the backward. Exact up to float rounding
when ``h`` is kept exact; with ``h`` at 8 bits, ``grad_W`` sees ``h_hat`` and ``grad_h``'s softmax sees
``z(h_hat)``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from slimact.functional._saving import load, save
from slimact.quant import QuantConfig, pack

__all__ = ["linear_cross_entropy"]

#: Logit elements materialised at once (per chunk of tokens), forward and backward.
CHUNK_ELEMENTS = 1 << 22


def _chunks(n: int, vocab: int):
    rows = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, n, rows):
        yield start, min(n, start + rows)


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(h, weight, bias).float()


def _logsumexp(z: Tensor) -> Tensor:
    """``log(sum(exp(z)))`` over the last dim as ``F.cross_entropy``'s log-softmax computes it: shifted by the
    row's max, so a row holding +inf (or only -inf) gives NaN, as there. ``torch.logsumexp`` gives inf: the loss
    was inf where PyTorch's is NaN, and gradient entries stayed finite where PyTorch's are NaN. Finite rows are
    unchanged: ``torch.logsumexp`` computes ``log(sum(exp(z - max))) + max`` too."""
    m = z.amax(-1, keepdim=True)
    return ((z - m).exp().sum(-1, keepdim=True).log() + m).squeeze(-1)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_in, weight, bias, target, ignore_index, smoothing, divisor, cfg):
        h = h_in.reshape(-1, h_in.shape[-1])  # [N, C]; h_in itself is what gets kept (and shared)
        n, vocab = h.shape[0], weight.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        # The chunks' sums are added one after another: in float64, so that many chunks do not drift by a
        # rounding each (PyTorch sums all tokens' losses at once, pairwise).
        total = torch.zeros((), dtype=torch.float64, device=h.device)
        for a, b in _chunks(n, vocab):
            z = _chunk_logits(h[a:b], weight, bias)  # [rows, V]
            lse[a:b] = _logsumexp(z)
            t = target[a:b]
            keep = t != ignore_index
            z_t = z.gather(1, t.clamp(0, vocab - 1).unsqueeze(1)).squeeze(1)
            loss = (1 - smoothing) * (lse[a:b] - z_t)
            if smoothing:
                loss = loss + smoothing * (lse[a:b] - z.mean(-1))
            total += torch.where(keep, loss, 0).sum()
        ctx.ignore_index, ctx.smoothing, ctx.divisor = ignore_index, smoothing, divisor
        ctx.has_bias = bias is not None
        ctx.in_shape = h_in.shape
        save(ctx, pack(h_in, cfg), weight, bias, target, lse)
        return (total / divisor).to(h.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        h_in, weight, bias, target, lse = load(ctx)
        h = h_in.reshape(-1, h_in.shape[-1])
        n, vocab = h.shape[0], weight.shape[0]
        scale = grad_loss.float() / ctx.divisor
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if need_b and ctx.has_bias else None
        for a, b in _chunks(n, vocab):
            z = _chunk_logits(h[a:b], weight, bias)
            dz = torch.exp(z - lse[a:b, None])  # softmax, [rows, V]
            t = target[a:b]
            keep = t != ctx.ignore_index
            dz.scatter_add_(1, t.clamp(0, vocab - 1).unsqueeze(1),
                            torch.full((b - a, 1), ctx.smoothing - 1.0, device=dz.device))
            if ctx.smoothing:
                dz -= ctx.smoothing / vocab
            dz *= torch.where(keep, scale, 0).unsqueeze(1)
            if need_h:
                grad_h[a:b] = (dz @ weight.float()).to(h.dtype)
            if need_w:
                grad_w += dz.t() @ h[a:b].float()
            if grad_b is not None:
                grad_b += dz.sum(0)
        grad_h = grad_h.reshape(ctx.in_shape) if grad_h is not None else None
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


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
    cfg: QuantConfig | None = None,
) -> Tensor:
    """``F.cross_entropy(F.linear(h, weight, bias), target, ...)`` without keeping ``[tokens, vocab]``.

    Args:
        h: ``[..., C]`` hidden states (``N`` tokens in all); ``weight``: ``[V, C]``; ``bias``: ``[V]`` or ``None``;
            ``target``: ``[N]``.
        reduction: ``"mean"`` (over tokens not ignored) or ``"sum"``.
        divisor: divide the summed loss by this instead (Hugging Face's ``num_items_in_batch``).
        cfg: compression of the kept ``h``; ``None`` keeps it exact. A running scale has no state here and
            is treated as dynamic (usually ``h`` is already packed by the head's Linear and that pack is reused).
    """
    if cfg is not None and cfg.scale == "running":
        cfg = dataclasses.replace(cfg, scale="dynamic")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if divisor is None:
        divisor = (target != ignore_index).sum().item() if reduction == "mean" else 1.0
    divisor = float(divisor)
    if reduction == "mean" and divisor == 0:
        divisor = float("nan")  # as F.cross_entropy: the mean over no tokens
    return _LinearCrossEntropy.apply(h, weight, bias, target, ignore_index, label_smoothing, divisor, cfg)
