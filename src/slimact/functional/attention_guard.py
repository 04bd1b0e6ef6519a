"""When 8-bit ``q``/``k`` would make attention's gradients wrong: the score error guard.

The fused attention keeps ``q``, ``k``, ``v`` as codes and recomputes the scores ``s = scale * q k^T`` from the
restored tensors in the backward. The error that puts on a score is absolute, in logits, and softmax turns an
absolute logit error ``ds`` into a relative probability error ``ds``: it does not shrink with the scores' size.
Per head, with ``step`` the code step of a group (``range / (2**bits - 1)``) and a rounding error of standard
deviation ``step / sqrt(12)`` (nearest; ``step / sqrt(6)`` stochastic), the score error has standard deviation
about::

    ds = |scale| * sqrt(D) * (sd(dq) * rms(k) + rms(q) * sd(dk))

For ordinary attention (``scale = D**-0.5``, ``q``/``k`` of modest size) that is ~4e-4 logits at random
initialisation. Attention with QK normalisation and no ``1/sqrt(D)`` (Gemma 3n/4's ``scaling = 1.0`` after
``q_norm``/``k_norm``: every ``q``, ``k`` element of size ~1, the scores of size ``D``) reaches 0.05 at ``D = 16``
and 0.4 at ``D = 512``: every gradient above the attention then lost its cosine floor (0.96 for ``q_norm``,
``k_norm``, ``q_proj``, ``k_proj``, the embedding). Above :data:`MAX_SCORE_ERROR` the call keeps ``q``, ``k``, ``v``
exact (the lossless path: the exact gradient, 4x the bytes of the codes for fp32) instead of a wrong one.
The estimate is taken at 8 bits whatever the policy's width: it detects attention that amplifies the codes'
error, not a narrower width a policy chose on purpose (that trade-off is the user's, judged by ``slimact.check``).

Cost: a few reductions over ``q`` and ``k`` and one host read per training call of a compressed attention (on
CUDA the same read as the fused kernels' NaN/inf check of ``q`` and ``k``).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from slimact._cache import cache
from slimact.quant import QuantConfig, inductor

__all__ = ["GUARDED_ATTR", "MAX_SCORE_ERROR", "checked_score_error", "guarded", "note_trip", "score_error"]

#: Largest estimated score error (standard deviation, in logits) 8-bit ``q``/``k`` may put on a score. Passing
#: attentions sit at 4e-4 (Llama, GPT-2 at initialisation) to 1.2e-2-1.9e-2 (Qwen3's and OLMo-2's QK norm with
#: ``1/sqrt(D)``, rounded to nearest); Gemma's unscaled QK-normed attention at 5e-2 and above fails the cosine floor.
#: Stochastic rounding (``"mesa"``) errs ``sqrt(2)``x more: Qwen3's and OLMo-2's 1.7e-2-2.6e-2 there, mostly past
#: it, so ``"mesa"`` keeps their attention exact (``summary`` names it and counts it as not covered).
MAX_SCORE_ERROR = 0.02

_T = TypeVar("_T")


#: Set on a module one of whose attention calls kept ``q``, ``k``, ``v`` exact for the guard (:func:`guarded`).
GUARDED_ATTR = "_slimact_attention_guarded"


class _Trips(threading.local):
    count = 0


_trips = _Trips()


def guarded(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> tuple[_T, bool]:
    """``fn(*args, **kwargs)`` (an attention call) and whether the guard kept ``q``, ``k``, ``v`` exact in it (on this
    thread): the caller that knows the module marks it (:data:`GUARDED_ATTR`), and ``summary(model, inputs)`` names
    such modules (their attention bytes are not compressed on those inputs)."""
    before = _trips.count
    out = fn(*args, **kwargs)
    return out, _trips.count != before


def note_trip() -> None:
    """Count a call that kept ``q``, ``k``, ``v`` exact for the guard (:func:`guarded`)."""
    _trips.count += 1


def _minmax_norm(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # per head of x [B, H, T, D]: min and max (x's dtype, exact) and the fp32 L2 norm, [H] each
    dims = (0, 2, 3)
    return x.amin(dims), x.amax(dims), torch.linalg.vector_norm(x, dim=dims, dtype=torch.float32)


def _head_stats(x: Tensor, cfg: QuantConfig) -> tuple[Tensor, Tensor]:
    """Per head of ``x`` ``[B, H, T, D]``: (the range ``hi - lo`` of its scale group, the L2 norm of ``x``), fp32.
    The constants (``1 / (2**bits - 1)``, ``1 / sqrt(12)``, ``1 / sqrt(n)``) are :func:`score_error`'s, applied once
    to the 0-dim result (each op here is a kernel launch on CUDA, on a tensor of ``H`` elements)."""
    # Reductions over every dim but the heads, on x as it is (q, k are often [B, T, H, D] memory seen as
    # [B, H, T, D]: a per-head copy first cost 4x these reads), the three in one compiled loop where x repays it
    # (eagerly three passes: 0.49 ms against 0.18 for a Llama query at 4 x 256 on 2 CPU cores).
    x, heads = x.detach(), x.shape[1]
    lo, hi, norm = inductor.fused_or_eager(_minmax_norm, ("head-stats", x.dtype), x)
    if cfg.group_dim != 1:  # not grouped by heads: the whole tensor's range is each head's
        lo, hi = lo.amin().expand(heads), hi.amax().expand(heads)
    elif cfg.groups and cfg.groups < heads:  # head h is in group h * G // H, as the packer groups them
        index = torch.arange(heads, device=x.device) * cfg.groups // heads
        lo = torch.full((cfg.groups,), math.inf, device=x.device).scatter_reduce(0, index, lo.float(), "amin")[index]
        hi = torch.full((cfg.groups,), -math.inf, device=x.device).scatter_reduce(0, index, hi.float(), "amax")[index]
    return hi.float() - lo, norm  # (the subtraction in fp32: lo is promoted inside it)


def score_error(query: Tensor, key: Tensor, scale: float, cfg: QuantConfig) -> Tensor:
    """The largest over heads of the estimated score error (module docstring), a 0-dim fp32 tensor. ``key`` may
    have fewer heads (grouped-query attention: ``H_kv`` divides ``H``). A NaN/inf in ``query`` or ``key`` makes it
    NaN or inf (through the norms), as does a norm overflowing fp32."""
    range_q, norm_q = _head_stats(query, cfg)
    range_k, norm_k = _head_stats(key, cfg)
    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        range_k, norm_k = range_k.repeat_interleave(rep), norm_k.repeat_interleave(rep)
    # sd = range / ((2**bits - 1) sqrt(12)) (sqrt(6) stochastic), rms = norm / sqrt(n) per head, n its elements:
    # |scale| sqrt(D) (sd_q rms_k + rms_q sd_k) = c (range_q norm_k + norm_q range_k sqrt(n_k / n_q)),
    # c = |scale| sqrt(D) / ((2**bits - 1) sqrt(12) sqrt(n_k)) >= 0, which commutes with the max over heads.
    n_q, n_k = query.numel() // query.shape[1], key.numel() // key.shape[1]
    c = abs(scale) * math.sqrt(query.shape[-1]) / (
        (2**cfg.bits - 1) * math.sqrt(6.0 if cfg.stochastic else 12.0) * math.sqrt(n_k))
    return torch.add(range_q * norm_k, norm_q * range_k, alpha=math.sqrt(n_k / n_q)).amax() * c


def checked_score_error(query: Tensor, key: Tensor, scale: float | None, cfg: QuantConfig | None) -> Tensor | None:
    """:func:`score_error` at 8 bits (a 0-dim tensor on the tensors' device, not read: a caller compares it with
    :data:`MAX_SCORE_ERROR` and reads that with its other flags, in one host sync), or ``None`` where no check
    applies: without a config, without a gradient, under ``torch.compile``, or for shapes it does not take. A caller
    that also needs to know whether ``q`` or ``k`` holds a NaN/inf reads it off this tensor (non-finite then), with
    no pass of its own."""
    if cfg is None or torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return None
    if query.dim() != 4 or key.dim() != 4 or not query.numel() or not key.numel():
        return None
    if key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        return None
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    # Judged at 8 bits: the guard finds attention that amplifies the codes' error, not a policy's chosen width
    # (4- or 2-bit attention is the user's trade-off, and what ``slimact.check`` is there to judge).
    # NaN/inf in q or k make it NaN/inf: NaN compares False (the packer keeps such tensors exact anyway).
    return score_error(query, key, scale, _at_8_bits(cfg))


@cache
def _at_8_bits(cfg: QuantConfig) -> QuantConfig:
    return dataclasses.replace(cfg, bits=8)  # (once per config: dataclasses.replace costs microseconds a call)
