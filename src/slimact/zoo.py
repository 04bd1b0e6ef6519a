"""Hugging Face models built from configurations written in code (random weights, no network).

Used by the command line (``slimact profile --model gpt2``), the tests and the benchmarks. Each entry is a
function that returns a model; :func:`example_inputs` makes a matching training batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["MODELS", "build", "example_inputs"]


def _gpt2(layers: int | None) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config()  # gpt2 (124M): 12 layers, 768 wide, 12 heads, 50257 tokens
    if layers is not None:
        cfg.n_layer = layers
    return GPT2LMHeadModel(cfg)


def _bert_base(layers: int | None) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig()  # bert-base-uncased: 12 layers, 768 wide, 12 heads, 30522 tokens
    if layers is not None:
        cfg.num_hidden_layers = layers
    return BertForMaskedLM(cfg)


def _llama(layers: int | None) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    # A Llama of GPT-2-small size: 12 layers, hidden 768, 12 query heads over 4 key/value heads, SwiGLU
    # (intermediate 2048), RMSNorm, GPT-2's 50257-token vocabulary.
    cfg = LlamaConfig(
        vocab_size=50257, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers or 12,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return LlamaForCausalLM(cfg)


MODELS: dict[str, Callable[[int | None], nn.Module]] = {"gpt2": _gpt2, "bert-base": _bert_base, "llama": _llama}


def build(name: str, *, layers: int | None = None, attn: str = "sdpa", seed: int = 0) -> nn.Module:
    """A randomly initialised model ``name`` (see :data:`MODELS`), optionally with fewer layers."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    torch.manual_seed(seed)
    model = MODELS[name](layers)
    model.config._attn_implementation = attn
    return model


def example_inputs(model: nn.Module, batch: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A language-modelling batch for ``model``: random token ids, labels equal to the ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    device = next(model.parameters()).device
    return {"input_ids": ids.to(device), "labels": ids.to(device)}
