"""Eager attention's softmax, dropout and ``probs @ v`` in one Function (Tempo's attention technique).

Math, with ``s`` the scores ``[B, H, T, S]`` (``q k^T * scale + mask``), ``m`` a Bernoulli(1 - p) mask::

    P = softmax(s),   D = P * m / (1 - p),   o = D v
    grad_v = D^T grad_o,   grad_D = grad_o v^T,   grad_P = grad_D * m / (1 - p),
    grad_s = P * (grad_P - sum(grad_P * P, -1))

Plain PyTorch keeps ``P`` (for the softmax backward), the dropout mask (a bool, or on CPU an fp32 noise
tensor) and ``D`` (for the matmul backward): two full ``[B, H, T, S]`` tensors and a mask. This Function keeps
``P`` once (exact, or 8-bit with one scale per head), the mask as bits, and ``v``, and recomputes ``D`` in the
backward. No dropout in eval mode (``p`` is then 0), as PyTorch.

Grouped-query attention: ``v`` is ``[B, H_kv, S, D]`` with ``H = H_kv * n_rep``; the product runs on grouped
views, so the ``n_rep``-times repeated ``v`` is never kept (nor built).

The forward is PyTorch's own ops (``softmax`` in fp32 as Hugging Face computes it, ``native_dropout``, the same
random draws as ``F.dropout``, ``matmul``). Error: exact when ``P`` and ``v`` are kept exact; at 8 bits each
is within half a step per element (tests assert SQNR >= 30 dB).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimact.functional._saving import Mask, load, save
from slimact.quant import QuantConfig, RunningRange, pack

__all__ = ["softmax_dropout_matmul"]


def _grouped(probs: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``[B, H, T, S]`` and ``[B, H_kv, S, D]`` as ``[B, H_kv, n_rep, T, S]`` and ``[B, H_kv, 1, S, D]``."""
    b, h, t, s = probs.shape
    h_kv = v.shape[1]
    return probs.reshape(b, h_kv, h // h_kv, t, s), v.unsqueeze(2)


class _SoftmaxDropoutMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, v, p, cfg_p, cfg_v, state_p, state_v):
        probs = torch.softmax(scores, -1, dtype=torch.float32).to(scores.dtype)
        mask = None
        dropped = probs
        if p > 0:
            dropped, mask = torch.native_dropout(probs, p, True)
        pg, vg = _grouped(dropped, v)
        out = torch.matmul(pg, vg).reshape(*probs.shape[:-1], v.shape[-1])  # [B, H, T, D]
        ctx.scale = 1.0 / (1.0 - p) if 0 < p < 1 else (0.0 if p >= 1 else 1.0)
        ctx.dtype = scores.dtype
        save(ctx, pack(probs, cfg_p, state_p), None if mask is None else Mask.of(mask), pack(v, cfg_v, state_v))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        probs, mask, v = load(ctx)
        dropped = probs if mask is None else probs * mask * ctx.scale
        grad_scores = grad_v = None
        b, h, t, d = grad_out.shape
        gg = grad_out.reshape(b, v.shape[1], h // v.shape[1], t, d)  # [B, H_kv, n_rep, T, D]
        if ctx.needs_input_grad[1]:
            pg, _ = _grouped(dropped.to(grad_out.dtype), v)
            grad_v = pg.transpose(-1, -2).matmul(gg).sum(2)  # [B, H_kv, S, D]
        if ctx.needs_input_grad[0]:
            grad_d = gg.matmul(v.to(grad_out.dtype).unsqueeze(2).transpose(-1, -2)).reshape(probs.shape)
            grad_p = grad_d if mask is None else grad_d * mask * ctx.scale
            grad_scores = torch._softmax_backward_data(grad_p.to(probs.dtype), probs, -1, ctx.dtype)
        return grad_scores, grad_v, None, None, None, None, None


def softmax_dropout_matmul(
    scores: Tensor,
    v: Tensor,
    p: float,
    cfg_p: QuantConfig | None = None,
    cfg_v: QuantConfig | None = None,
    state_p: RunningRange | None = None,
    state_v: RunningRange | None = None,
) -> Tensor:
    """``dropout(softmax(scores, -1), p) @ v`` (``v`` may have fewer heads: grouped-query attention).

    Args:
        scores: ``[B, H, T, S]``; ``v``: ``[B, H_kv, S, D]`` with ``H`` a multiple of ``H_kv``.
        p: dropout probability (0 in eval mode).
        cfg_p, cfg_v: compression of the kept probabilities and values; ``None`` keeps them exact.
        state_p, state_v: their running estimates, for ``scale="running"``.
    """
    if not torch.is_grad_enabled() or not (scores.requires_grad or v.requires_grad):
        probs = torch.softmax(scores, -1, dtype=torch.float32).to(scores.dtype)
        probs = torch.nn.functional.dropout(probs, p, p > 0)
        pg, vg = _grouped(probs, v)
        return torch.matmul(pg, vg).reshape(*probs.shape[:-1], v.shape[-1])
    return _SoftmaxDropoutMatmul.apply(scores, v, p, cfg_p, cfg_v, state_p, state_v)
