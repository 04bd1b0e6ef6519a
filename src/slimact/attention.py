"""Attention through slimact, and its registration with Hugging Face ``transformers``.

``attention_forward`` has the signature of ``transformers``' attention functions (``AttentionInterface``):

* by default it runs :func:`slimact.functional.scaled_dot_product_attention`, the fused path: ``q``, ``k``,
  ``v`` and the output kept 8-bit per head (exact under a lossless policy) plus the log-sum-exp, never a
  ``[T, S]`` tensor, grouped-query heads never repeated;
* when the caller asks for the probabilities (``output_attentions=True``) it runs the eager path:
  ``q @ k^T`` and ``probs @ v`` through slimact's MatMul, the softmax through slimact's Softmax (the
  probabilities 8-bit per head, kept by the softmax and again by ``probs @ v``, which reads them through a
  grouped view the pack cache does not match), dropout as bits.

``convert`` registers it as ``"slimact"`` (with SDPA-style masks: ``None`` for plain causal attention, a
boolean mask otherwise), selects it on the model's config and tags the model's attention modules; ``revert``
restores the original setting. An untagged module runs plain PyTorch attention.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from slimact.functional.attention import _additive, scaled_dot_product_attention
from slimact.functional.dropout import dropout as _dropout
from slimact.functional.matmul import matmul
from slimact.functional.softmax import softmax
from slimact.policy import Policy
from slimact.quant import RunningRange
from slimact.quant.reference import COMPRESSIBLE_DTYPES

__all__ = ["NAME", "POLICY_ATTR", "SEEN_ATTR", "attention_forward", "register"]

NAME = "slimact"
POLICY_ATTR = "_slimact_attention"
#: Probabilities asked for where nothing is compressed: the same eager path, every tensor exact.
_EXACT = Policy(name="exact", quantize=False)
#: Set on a tagged module each time its attention runs here (``summary`` checks the routing took).
SEEN_ATTR = "_slimact_attention_seen"


def _eager(module, query, key, value, mask, scaling, p, policy, is_causal):
    """Eager attention returning the probabilities, each tensor kept as ``policy`` says."""
    b, h, t, d = query.shape
    h_kv = key.shape[1]
    cfg = policy.quant_config("attention", 4)
    q = query.reshape(b, h_kv, h // h_kv, t, d)  # grouped: keys and values are never repeated
    scores = matmul(q, key.unsqueeze(2).transpose(-1, -2), cfg, cfg).reshape(b, h, t, -1) * scaling
    if mask is not None:
        scores = scores + _additive(mask, scores.dtype)
    elif is_causal:  # top-left aligned, as scaled_dot_product_attention's is_causal
        causal = torch.ones(t, scores.shape[-1], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    probs = softmax(scores.float(), -1, cfg).to(query.dtype)
    dropped = _dropout(probs, p, p > 0)
    out = matmul(dropped.reshape(b, h_kv, h // h_kv, t, -1), value.unsqueeze(2), cfg, cfg)
    return out.reshape(b, h, t, -1), probs


def _probabilities_wanted(kwargs: dict) -> bool:
    """Whether the caller collects attention probabilities (``output_attentions=True``).

    Some models (GPT-2) drop the flag before calling the attention function; transformers then collects the
    probabilities through a context variable, which is consulted too.
    """
    if kwargs.get("output_attentions", False):
        return True
    if torch.compiler.is_compiling():  # dynamo cannot read the context variable (a graph break): as SDPA, None
        return False
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # another transformers version: the flag above is all there is
        return False
    collected = _active_collector.get()
    return bool(collected) and "attentions" in collected


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    position_bias: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """``[B, H, T, D]`` query, ``[B, H_kv, S, D]`` key and value -> (``[B, T, H, D]`` output, probabilities or None)."""
    policy: Policy | None = module.__dict__.get(POLICY_ATTR)
    if policy is not None:
        module.__dict__[SEEN_ATTR] = True
        if not module.training or query.dtype not in COMPRESSIBLE_DTYPES:
            policy = None  # eval mode (or float64): PyTorch's own attention, nothing packed
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    p = dropout if module.training else 0.0
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[..., : key.shape[-2]]
    # As transformers' SDPA integration: causal only when no mask stands for it and there is more than one query.
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    if position_bias is not None:  # T5's learned relative bias: one additive mask, as transformers' SDPA builds it
        from transformers.integrations.sdpa_attention import create_position_bias_mask

        attention_mask = create_position_bias_mask(position_bias, attention_mask, is_causal, query, key)
        is_causal = False
    if _probabilities_wanted(kwargs):  # exact (lossless) in eval mode or for modules left alone
        out, probs = _eager(module, query, key, value, attention_mask, scaling, p, policy or _EXACT, is_causal)
        return out.transpose(1, 2).contiguous(), probs
    state = None
    if policy is not None and policy.settings("attention").scale == "running":
        state = {n: RunningRange(module, f"_slimact_{n}") for n in ("q", "k", "v", "o")}
    cfg = policy.quant_config("attention", 4) if policy is not None else None
    attend = scaled_dot_product_attention if policy is not None else nn.functional.scaled_dot_product_attention
    extra = {"cfg": cfg, "state": state} if policy is not None else {}
    out = attend(query, key, value, attn_mask=attention_mask, dropout_p=p, is_causal=is_causal, scale=scaling,
                 enable_gqa=key.shape[1] != query.shape[1], **extra)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"slimact"`` with ``transformers`` (attention function and SDPA-style masks). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(NAME, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
