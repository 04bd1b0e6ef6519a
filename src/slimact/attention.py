"""Attention through slimact, and its registration with Hugging Face ``transformers``.

``attention_forward`` has the signature of ``transformers``' attention functions (``AttentionInterface``). It
computes eager attention with slimact's pieces: ``q @ k^T`` through :func:`slimact.functional.matmul` (8-bit
``q`` and ``k`` with one scale per head under an 8-bit policy; plain under a lossless one), then
:func:`slimact.functional.attention.softmax_dropout_matmul` (the probabilities kept once, the dropout mask as
bits, ``v`` never repeated for grouped-query attention). ``convert`` registers it as ``"slimact"`` (with
eager attention's additive masks) and selects it on the model's config; ``revert`` restores the original
setting. A module ``convert`` did not tag runs plain eager attention.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from slimact.functional.attention import softmax_dropout_matmul
from slimact.functional.matmul import matmul
from slimact.policy import Policy
from slimact.quant import RunningRange

__all__ = ["NAME", "attention_forward", "register"]

NAME = "slimact"
POLICY_ATTR = "_slimact_attention"


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """``[B, H, T, D]`` query, ``[B, H_kv, S, D]`` key and value -> ``([B, T, H, D]`` output, ``None)``."""
    policy: Policy | None = module.__dict__.get(POLICY_ATTR)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    def state(name: str) -> RunningRange | None:
        # Running estimates live in the attention module's own non-persistent buffers (cleared by revert).
        return RunningRange(module, f"_slimact_{name}") if policy is not None and policy.scale == "running" else None

    b, h, t, d = query.shape
    h_kv = key.shape[1]
    q = query.reshape(b, h_kv, h // h_kv, t, d)  # grouped: the keys are never repeated
    k_t = key.unsqueeze(2).transpose(-1, -2)  # [B, H_kv, 1, D, S]
    if policy is not None and policy.quantize and "matmul" in policy.kinds:
        cfg = policy.quant_config("matmul", 4)
        scores = matmul(q, k_t, cfg, cfg, state("q"), state("k"))
    else:
        scores = torch.matmul(q, k_t)
    scores = scores.reshape(b, h, t, -1) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros_like(attention_mask, dtype=scores.dtype).masked_fill(
                ~attention_mask, torch.finfo(scores.dtype).min
            )
        scores = scores + attention_mask[..., : scores.shape[-1]]
    p = dropout if module.training else 0.0
    if policy is None:
        probs = torch.softmax(scores, -1, dtype=torch.float32).to(scores.dtype)
        probs = nn.functional.dropout(probs, p, module.training)
        out = torch.matmul(probs.reshape(b, h_kv, h // h_kv, t, -1), value.unsqueeze(2)).reshape(b, h, t, -1)
    else:
        cfg = policy.quant_config("softmax", 4)
        out = softmax_dropout_matmul(scores, value, p, cfg, cfg, state("p"), state("v"))
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"slimact"`` with ``transformers`` (attention function and eager-style masks). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(NAME, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
