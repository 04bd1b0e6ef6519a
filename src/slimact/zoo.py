"""Models built from configurations written in code (random weights, no network): the families slimact is
tested on, for the command line (``slimact profile --model NAME``), the tests and the benchmarks.

Every family comes in two sizes. The default is the family's architecture at the size of GPT-2 small
(12 layers, width 768, 12 heads; ViT-B/16 and DeiT-B at 224 x 224 images; Swin-T; T5-small; DistilBERT's
own 6 layers): what the memory tables in the README and ``docs/models.md`` are measured on. ``tiny=True``
keeps each family's layer types (gated MLPs, grouped-query heads, rotary embeddings, its own norm and
activation classes) at width 64 and 2 layers, for the tests.

:func:`example_inputs` makes a matching training batch (token ids and labels; images and class labels;
source and target ids for T5), and :func:`load` reads a local Hugging Face model directory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["MODELS", "TorchEncoderLM", "build", "example_inputs", "load"]


@dataclass(frozen=True)
class _Dims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int  # plain MLP width
    gated_ffn: int  # SwiGLU/GeGLU width (about 2/3 of the plain one at equal parameters)
    vocab: int
    positions: int
    image: int
    patch: int
    labels: int


_FULL = _Dims(768, 12, 12, 4, 3072, 2048, 50257, 2048, 224, 16, 1000)
_TINY = _Dims(64, 2, 4, 2, 128, 96, 96, 128, 32, 8, 10)


def _decoder(config_name: str, model_name: str, d: _Dims, **extra: Any) -> nn.Module:
    """A Llama-style causal LM (Llama, Mistral, Qwen2, Gemma, Phi-3) at the sizes of ``d``."""
    import transformers

    cfg = getattr(transformers, config_name)(
        vocab_size=d.vocab, hidden_size=d.hidden, intermediate_size=d.gated_ffn, num_hidden_layers=d.layers,
        num_attention_heads=d.heads, num_key_value_heads=d.kv_heads, max_position_embeddings=d.positions,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, **extra,
    )
    return getattr(transformers, model_name)(cfg)


def _encoder(config_name: str, model_name: str, d: _Dims, offset: int = 0, **extra: Any) -> nn.Module:
    """A BERT-style masked LM (BERT, RoBERTa: its positions start after ``offset = 2``) at the sizes of ``d``."""
    import transformers

    cfg = getattr(transformers, config_name)(
        vocab_size=d.vocab, hidden_size=d.hidden, num_hidden_layers=d.layers, num_attention_heads=d.heads,
        intermediate_size=d.ffn, max_position_embeddings=d.positions + offset, **extra,
    )
    return getattr(transformers, model_name)(cfg)


def _vision(config_name: str, model_name: str, d: _Dims) -> nn.Module:
    import transformers

    cfg = getattr(transformers, config_name)(
        image_size=d.image, patch_size=d.patch, hidden_size=d.hidden, num_hidden_layers=d.layers,
        num_attention_heads=d.heads, intermediate_size=d.ffn, num_labels=d.labels,
    )
    return getattr(transformers, model_name)(cfg)


def _gpt2(d: _Dims) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=d.vocab, n_embd=d.hidden, n_layer=d.layers, n_head=d.heads, n_positions=d.positions,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _distilbert(d: _Dims) -> nn.Module:
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    cfg = DistilBertConfig(vocab_size=d.vocab, dim=d.hidden, n_layers=d.layers // 2 or 1, n_heads=d.heads,
                           hidden_dim=d.ffn, max_position_embeddings=d.positions)
    return DistilBertForMaskedLM(cfg)


def _gpt_neox(d: _Dims) -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    # Pythia-160m's shape: parallel attention and MLP, rotary on a quarter of each head.
    cfg = GPTNeoXConfig(vocab_size=d.vocab, hidden_size=d.hidden, num_hidden_layers=d.layers,
                        num_attention_heads=d.heads, intermediate_size=d.ffn, max_position_embeddings=d.positions,
                        rotary_pct=0.25, bos_token_id=0, eos_token_id=0)
    return GPTNeoXForCausalLM(cfg)


def _opt(d: _Dims) -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=d.vocab, hidden_size=d.hidden, num_hidden_layers=d.layers,
                    num_attention_heads=d.heads, ffn_dim=d.ffn, word_embed_proj_dim=d.hidden,
                    max_position_embeddings=d.positions, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    return OPTForCausalLM(cfg)


def _swin(d: _Dims) -> nn.Module:
    from transformers import SwinConfig, SwinForImageClassification

    if d.hidden == _FULL.hidden:  # Swin-T
        cfg = SwinConfig(image_size=224, num_labels=d.labels)
    else:
        cfg = SwinConfig(image_size=d.image, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                         window_size=4, num_labels=d.labels)
    return SwinForImageClassification(cfg)


def _t5(d: _Dims) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    if d.hidden == _FULL.hidden:  # t5-small (6 encoder and 6 decoder layers unless told otherwise)
        cfg = T5Config(num_layers=d.layers, num_decoder_layers=d.layers, decoder_start_token_id=0)
    else:
        cfg = T5Config(vocab_size=d.vocab, d_model=d.hidden, d_kv=d.hidden // d.heads, d_ff=d.ffn,
                       num_layers=d.layers, num_heads=d.heads, decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg)


class TorchEncoderLM(nn.Module):
    """A plain ``torch.nn`` Transformer language model: ``nn.TransformerEncoder`` with its own defaults
    (post-norm, ReLU, dropout 0.1), a causal mask, token and position embeddings, a final LayerNorm and an
    output head. Returns an object with ``.loss`` and ``.logits``, like a Hugging Face model."""

    def __init__(self, vocab_size: int, hidden: int, layers: int, heads: int, ffn: int, positions: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, hidden)
        self.pos = nn.Embedding(positions, hidden)
        layer = nn.TransformerEncoderLayer(hidden, heads, ffn, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab_size, bias=False)

    def get_output_embeddings(self) -> nn.Linear:
        return self.head

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> Any:
        from types import SimpleNamespace

        t = input_ids.shape[1]
        x = self.embed(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=input_ids.device)
        logits = self.head(self.norm(self.encoder(x, mask=causal, is_causal=True)))  # [B, T, V]
        loss = None
        if labels is not None:  # next-token targets, the last position ignored (as Hugging Face shifts them)
            target = nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)
        return SimpleNamespace(loss=loss, logits=logits)


def _torch_encoder(d: _Dims) -> nn.Module:
    return TorchEncoderLM(d.vocab, d.hidden, d.layers, d.heads, d.ffn, d.positions)


MODELS: dict[str, Callable[[_Dims], nn.Module]] = {
    "bert-base": lambda d: _encoder("BertConfig", "BertForMaskedLM", d),
    "roberta": lambda d: _encoder("RobertaConfig", "RobertaForMaskedLM", d, offset=2, pad_token_id=1),
    "distilbert": _distilbert,
    "gpt2": _gpt2,
    "gpt-neox": _gpt_neox,
    "opt": _opt,
    # 12 query heads over 4 key/value heads, SwiGLU, RMSNorm: a Llama of GPT-2-small size.
    "llama": lambda d: _decoder("LlamaConfig", "LlamaForCausalLM", d),
    "mistral": lambda d: _decoder("MistralConfig", "MistralForCausalLM", d, sliding_window=4096),
    "qwen2": lambda d: _decoder("Qwen2Config", "Qwen2ForCausalLM", d),
    # GeGLU (tanh GELU), RMSNorm scaling by 1 + weight, scaled embeddings.
    "gemma": lambda d: _decoder("GemmaConfig", "GemmaForCausalLM", d, head_dim=d.hidden // d.heads),
    # Fused qkv and gate_up projections.
    "phi3": lambda d: _decoder("Phi3Config", "Phi3ForCausalLM", d, original_max_position_embeddings=d.positions),
    "vit-b16": lambda d: _vision("ViTConfig", "ViTForImageClassification", d),
    "deit": lambda d: _vision("DeiTConfig", "DeiTForImageClassification", d),
    "swin": _swin,
    "t5": _t5,
    "torch-encoder": _torch_encoder,
}


# The real vocabularies and position counts of the named base models.
_FULL_SIZE: dict[str, dict[str, int]] = {
    "bert-base": {"vocab": 30522, "positions": 512},
    "roberta": {"vocab": 50265, "positions": 512},
    "distilbert": {"vocab": 30522, "positions": 512},
    "gpt2": {"positions": 1024},
    "opt": {"vocab": 50272},
    "gpt-neox": {"vocab": 50304},
    "t5": {"layers": 6},
}


def build(name: str, *, layers: int | None = None, attn: str = "sdpa", seed: int = 0, tiny: bool = False) -> nn.Module:
    """A randomly initialised model of family ``name`` (see :data:`MODELS`).

    Args:
        layers: override the number of layers (blocks per stage for Swin; encoder and decoder layers for T5).
        attn: the Hugging Face attention implementation (``"sdpa"`` or ``"eager"``).
        tiny: width 64 and 2 layers instead of GPT-2-small size.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    dims = _TINY if tiny else _FULL
    changes = {} if tiny else dict(_FULL_SIZE.get(name, {}))
    if layers is not None and name != "swin":
        changes["layers"] = layers
    if changes:
        dims = _Dims(**{**dims.__dict__, **changes})
    torch.manual_seed(seed)
    model = MODELS[name](dims)
    if name == "swin" and layers is not None:
        raise ValueError("--layers is not supported for swin (its stages have fixed depths)")
    config = getattr(model, "config", None)
    if config is not None:
        config._attn_implementation = attn
    return model


def load(path: str | os.PathLike[str], *, attn: str = "sdpa") -> nn.Module:
    """A Hugging Face model from a local directory (its ``config.json`` and weights), for training."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM,
                 transformers.AutoModelForSeq2SeqLM, transformers.AutoModelForImageClassification):
        if type(config) in auto._model_mapping:
            model = auto.from_pretrained(path, attn_implementation=attn)
            return model.train()
    raise ValueError(
        f"{path}: no causal-LM, masked-LM, seq2seq or image-classification head for {type(config).__name__}"
    )


def example_inputs(model: nn.Module, batch: int, seq: int, seed: int = 0) -> dict[str, Tensor]:
    """A training batch for ``model``: ``batch`` images of its size with class labels (vision models; ``seq``
    is ignored), or ``batch`` x ``seq`` random token ids with the ids as labels (source and target for
    encoder-decoders)."""
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "image_size") and hasattr(config, "num_channels"):
        size = config.image_size
        pixels = torch.randn(batch, config.num_channels, size, size, generator=g)
        labels = torch.randint(0, config.num_labels, (batch,), generator=g)
        return {"pixel_values": pixels.to(device), "labels": labels.to(device)}
    vocab = config.vocab_size if config is not None else model.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    if config is not None and getattr(config, "is_encoder_decoder", False):
        target = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        return {"input_ids": ids, "labels": target}
    return {"input_ids": ids, "labels": ids}
