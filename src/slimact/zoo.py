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

import inspect
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["AUTO_TASKS", "MODELS", "MetaLlama", "NanoChat", "NanoGPT", "TorchEncoderLM", "auto_architectures", "build",
           "build_auto", "example_inputs", "load", "projection_loss", "tiny_config", "tiny_inputs"]


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



# ---------------------------------------------------------------- models outside Hugging Face, as written
# Two models as their repositories write them, abridged to what they compute (no init scheme, no generate): the
# shapes of model code slimact meets outside transformers (a norm module of its own, attention and norms in
# functional calls, a head found by its name, targets instead of labels, a soft cap before the loss).


class _NanoLayerNorm(nn.Module):
    """nanoGPT's ``LayerNorm`` (its bias optional): its own module, calling ``F.layer_norm``."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class _CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, flash: bool, block_size: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.attn_dropout, self.resid_dropout = nn.Dropout(dropout), nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout, self.flash = n_head, n_embd, dropout, flash
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # [B, H, T, D]
                   for z in self.c_attn(x).split(self.n_embd, dim=2))
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
            y = self.attn_dropout(F.softmax(att, dim=-1)) @ v
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class _NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, flash: bool, block_size: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = _NanoLayerNorm(n_embd, True), _NanoLayerNorm(n_embd, True)
        self.attn = _CausalSelfAttention(n_embd, n_head, dropout, flash, block_size)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's ``GPT`` (karpathy/nanoGPT, ``model.py``) as it computes: its own LayerNorm module calling
    ``F.layer_norm``, attention by ``F.scaled_dot_product_attention`` (``flash``) or by hand with a causal mask
    buffer, the head ``lm_head`` tied to the token embedding, and ``forward(idx, targets)`` returning ``(logits,
    loss)`` with ``F.cross_entropy(..., ignore_index=-1)``. Defaults: GPT-2 small as nanoGPT trains it (vocabulary
    50304, 1024 positions, no dropout). Not a Hugging Face model: no ``get_output_embeddings``, no ``labels``."""

    def __init__(self, n_embd: int = 768, n_head: int = 12, n_layer: int = 12, dropout: float = 0.0,
                 flash: bool = True, vocab_size: int = 50304, block_size: int = 1024) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab_size, n_embd), "wpe": nn.Embedding(block_size, n_embd),
            "drop": nn.Dropout(dropout),
            "h": nn.ModuleList(_NanoBlock(n_embd, n_head, dropout, flash, block_size) for _ in range(n_layer)),
            "ln_f": _NanoLayerNorm(n_embd, True)})
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def _norm(x):
    return F.rms_norm(x, (x.size(-1),))


def _rotary(x, cos, sin):
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], 3).to(x.dtype)


class _ChatAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_kv_head: int) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, n_embd // n_head
        self.c_q = nn.Linear(n_embd, n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x, cos_sin):
        b, t, _ = x.size()
        q = self.c_q(x).view(b, t, self.n_head, self.head_dim)
        k = self.c_k(x).view(b, t, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(b, t, self.n_kv_head, self.head_dim)
        q, k = _norm(_rotary(q, *cos_sin)), _norm(_rotary(k, *cos_sin))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=self.n_head != self.n_kv_head)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, -1))


class _ChatMLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class _ChatBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_kv_head: int) -> None:
        super().__init__()
        self.attn, self.mlp = _ChatAttention(n_embd, n_head, n_kv_head), _ChatMLP(n_embd)

    def forward(self, x, cos_sin):
        x = x + self.attn(_norm(x), cos_sin)
        return x + self.mlp(_norm(x))


class NanoChat(nn.Module):
    """nanochat's ``GPT`` as it computes: weightless ``F.rms_norm`` in model code, rotary embeddings, grouped-query
    ``F.scaled_dot_product_attention``, a ReLU-squared MLP, the head ``lm_head`` untied, logits soft-capped at 15
    and cast to fp32 before ``F.cross_entropy(..., ignore_index=-1)`` on ``targets``. Defaults: its depth-12 model
    (width 768, heads of 128, vocabulary 65536)."""

    def __init__(self, n_embd: int = 768, n_head: int = 6, n_kv_head: int = 6, n_layer: int = 12,
                 vocab_size: int = 65536, block_size: int = 2048) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab_size, n_embd),
            "h": nn.ModuleList(_ChatBlock(n_embd, n_head, n_kv_head) for _ in range(n_layer))})
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        head_dim = n_embd // n_head
        freqs = torch.outer(torch.arange(block_size, dtype=torch.float32),
                            1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("cos", freqs.cos()[None, :, None, :], persistent=False)  # [1, T, 1, D / 2]
        self.register_buffer("sin", freqs.sin()[None, :, None, :], persistent=False)

    def forward(self, idx, targets=None, loss_reduction="mean"):
        t = idx.size(1)
        cos_sin = self.cos[:, :t], self.sin[:, :t]
        x = _norm(self.transformer.wte(idx))
        for block in self.transformer.h:
            x = block(x, cos_sin)
        softcap = 15
        logits = softcap * torch.tanh(self.lm_head(_norm(x)) / softcap)
        if targets is None:
            return logits
        logits = logits.float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1,
                               reduction=loss_reduction)

class _MetaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


def _rope(x, freqs_cis):
    # x [B, T, H, D] as D / 2 complex numbers, rotated by freqs_cis [T, D / 2]
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs_cis[None, :, None, :]).flatten(3).type_as(x)


class _MetaAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        b, t, _ = x.shape
        xq = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        xk = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        xq, xk = _rope(xq, freqs_cis), _rope(xk, freqs_cis)
        rep = self.n_heads // self.n_kv_heads  # repeat_kv
        xk, xv = (z.repeat_interleave(rep, dim=2) for z in (xk, xv))
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class _MetaFeedForward(nn.Module):
    def __init__(self, dim: int, multiple_of: int) -> None:
        super().__init__()
        hidden = int(2 * 4 * dim / 3)
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _MetaBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, multiple_of: int) -> None:
        super().__init__()
        self.attention = _MetaAttention(dim, n_heads, n_kv_heads)
        self.feed_forward = _MetaFeedForward(dim, multiple_of)
        self.attention_norm, self.ffn_norm = _MetaRMSNorm(dim), _MetaRMSNorm(dim)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class MetaLlama(nn.Module):
    """Meta's Llama reference model (``llama3/model.py``; torchtitan's and gpt-fast's are alike) as it computes:
    an RMSNorm class of its own (computed in fp32), rotary embeddings through complex numbers, grouped-query
    heads repeated for ``F.scaled_dot_product_attention``, the SwiGLU feed-forward ``w2(F.silu(w1(x)) * w3(x))``
    in those names, the head ``output``. It returns the fp32 logits; the training loop computes the loss (as
    torchtitan's does), outside the model. Defaults: a Llama of GPT-2-small size (width 768, 12 heads over 4
    key/value heads, 12 layers) with Llama 2's vocabulary."""

    def __init__(self, dim: int = 768, n_layers: int = 12, n_heads: int = 12, n_kv_heads: int = 4,
                 vocab_size: int = 32000, multiple_of: int = 256, max_seq_len: int = 2048) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(_MetaBlock(dim, n_heads, n_kv_heads, multiple_of) for _ in range(n_layers))
        self.norm = _MetaRMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        head_dim = dim // n_heads
        freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32),
                            1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(freqs), freqs), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h)).float()


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


def build(
    name: str, *, layers: int | None = None, attn: str = "sdpa", seed: int = 0, tiny: bool = False,
    vocab: int | None = None,
) -> nn.Module:
    """A randomly initialised model of family ``name`` (see :data:`MODELS`).

    Args:
        layers: override the number of layers (blocks per stage for Swin; encoder and decoder layers for T5).
        attn: the Hugging Face attention implementation (``"sdpa"`` or ``"eager"``).
        tiny: width 64 and 2 layers instead of GPT-2-small size.
        vocab: override the vocabulary size (token models; the speed benchmark's blocks-alone shape).
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    dims = _TINY if tiny else _FULL
    changes = {} if tiny else dict(_FULL_SIZE.get(name, {}))
    if layers is not None and name != "swin":
        changes["layers"] = layers
    if vocab is not None:
        changes["vocab"] = vocab
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


# --- Every architecture of transformers' auto mappings, at a tiny size (``slimact bench --zoo --all``) ---

#: The auto mappings the sweep covers, by task: the heads slimact targets, then the base models.
AUTO_TASKS: dict[str, str] = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "base": "MODEL_MAPPING_NAMES",
}

#: The attribute names (as configs spell them) of the number of layers.
_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
               "num_encoder_layers", "num_decoder_layers", "depth", "num_self_attends_per_block")
#: The tiny size: attribute names (as configs spell them) -> value. A name is only set where the default
#: configuration has it as an int (or as a list of one int per layer), so one table serves every family.
_TINY_ATTRS: dict[str, int] = {
    **dict.fromkeys(_LAYER_KEYS, 2),
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "model_dim", "d_embed",
                     "word_embed_proj_dim", "embedding_size", "emb_dim", "d_latents", "hidden_size_global",
                     "vision_output_dim", "projector_input_dim", "projector_output_dim",
                     # a vision tower's output width: the text model's width it is projected into
                     "out_hidden_size", "text_hidden_size", "projection_size", "pooler_output_size"), 64),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "num_self_attention_heads", "num_cross_attention_heads"), 4),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim",
                     "mlp_dim", "hidden_dim", "decoder_intermediate_size", "mamba_d_ssm",
                     "projector_hidden_size"), 128),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "projection_dim",
                     "q_lora_rank", "entity_emb_size"), 32),
    **dict.fromkeys(("head_dim", "d_kv", "kv_channels", "attention_head_size", "v_head_dim", "qk_head_dim",
                     "kv_lora_rank", "linear_key_head_dim", "linear_value_head_dim", "mamba_d_head", "mamba_headdim",
                     "mamba_head_dim", "mamba_d_state", "mamba_chunk_size"), 16),
    # Rotary on half of a 16-wide head (GPT-J's and CodeGen's rotary_dim is a width, not a fraction).
    **dict.fromkeys(("qk_nope_head_dim", "qk_rope_head_dim", "rotary_dim", "mamba_dt_rank"), 8),
    # Mamba heads: 8 of width 16 span the inner width (expand 2 x 64).
    **dict.fromkeys(("mamba_n_heads", "n_mamba_heads", "mamba_num_heads"), 8),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), 4),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_target_positions"), 64),
    **dict.fromkeys(("vocab_size", "entity_vocab_size", "encoder_hash_byte_group_vocab",
                     "vocab_size_per_layer_input"), 128),
    "hidden_size_per_layer_input": 16,
    # Windows shorter than the batch's 16 tokens, so that sliding-window and chunked attention masks matter, and
    # sparse attention's top-k keys fewer (DeepSeek V3.2's 2048 kept every key: its model code's branch on the
    # attention setting, which folds them into the mask, went untested); MiniMax M3's top 2 blocks of 4 keys.
    **dict.fromkeys(("sliding_window", "attention_chunk_size", "sliding_window_size", "local_attention",
                     "index_topk"), 8),
    "index_block_size": 4,
    "index_topk_blocks": 2,
    "index_kpool": 4,  # (GLM-5 Next: its top-k a multiple of its key pools)
    "num_latents": 16,
    "image_size": 32,
    "window_size": 4,
}
#: Sizes whose 0 turns their part off: kept off (GLM-5 Next's sparse attention requires heads without rotary).
_KEPT_OFF = ("qk_rope_head_dim",)
#: Upper bounds (the default is kept if smaller): routing to 2 of the 4 experts, one shared expert.
_TINY_CAPS: dict[str, int] = {"num_experts_per_tok": 2, "num_experts_per_token": 2, "n_shared_experts": 1,
                              "n_group": 1, "num_expert_group": 1, "topk_group": 1,
                              "num_key_value_heads": 2, "patch_size": 4, "first_k_dense_replace": 1,
                              "num_dense_layers": 1}
#: Sizes a configuration may leave as ``None`` for its model code to fail on (no default of its own): set to the
#: tiny value where the configuration has the feature (a head dimension beside heads, expert counts beside an
#: expert width, a vocabulary).
_TINY_UNSET: dict[str, tuple[str, ...]] = {
    "head_dim": ("num_attention_heads",), "vocab_size": (),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group",
                     "topk_group"), ("moe_intermediate_size",)),
}
#: Sizes that must stay equal to another (the key follows the value) where the default has them equal: MLA's
#: rotary part is the rotary embedding's head dimension.
_TIED: dict[str, str] = {"head_dim": "qk_rope_head_dim"}
#: The multimodal rotary sections model code takes where a text configuration names none (Qwen2-VL's, GLM-4V's).
_MROPE_SECTION: dict[str, list[int]] = {
    **{key: [16, 24, 24] for key in ("qwen2_vl_text", "qwen2_5_vl_text", "paddleocr_vl_text", "qwen2_5_omni_text")},
    **{key: [8, 12, 12] for key in ("glm4v_text", "glm4v_moe_text", "glm_image_text", "glm_ocr_text")},
}
#: Layers repeat with a period from an offset (``attn_layer_period``, ``expert_layer_offset``): period 2, so
#: that 2 layers hold each kind.
_PERIODIC = ("_layer_period", "_layer_offset")
#: Per-family overrides the generic names cannot express (the value replaces the generic one; a dict is merged
#: into the shrunk sub-configuration).
_TINY_FAMILY: dict[str, dict[str, Any]] = {
    # A convolutional feature encoder of 3 layers (stride 5 * 2 * 2 = 20 samples a frame) of 32 channels.
    **{family: {"conv_dim": [32, 32, 32], "conv_stride": [5, 2, 2], "conv_kernel": [10, 3, 3],
                "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4, "ctc_zero_infinity": True,
                "mask_time_prob": 0.0}
       for family in ("wav2vec2", "hubert", "wavlm", "sew", "sew-d", "unispeech", "unispeech-sat", "data2vec-audio",
                      "wav2vec2-conformer", "wav2vec2-bert")},
    "whisper": {"max_source_positions": 32, "num_mel_bins": 16},
    "encoder-decoder": {"pad_token_id": 0, "decoder_start_token_id": 0},  # what a checkpoint's config names
    "distilbert": {"n_layers": 2},
    "nemotron": {"num_key_value_heads": 2},  # its default None is not resolved by the config
    # One global and one local (windowed) layer: the attention types list its layers.
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # Mamba-2 checks its heads span the inner width: 8 heads of 16 (the generic num_heads is attention's 4).
    "mamba2": {"num_heads": 8},
    # Its layer types default to None and its model code indexes them: one convolution and one attention layer.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # The last layers reuse the keys and values of the last earlier layer of their type: 2 layers computing
    # them (one sliding-window, one global) and 2 sharing them.
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "intermediate_size": [128] * 4,
                     "layer_types": ["sliding_attention", "full_attention"] * 2,
                     "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0]},
    # A single hybrid layer fails its shared-weight tying (transformers ties the shared block across >= 2).
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    # Its image-token map defaults to None and its model code reads it.
    "emu3": {"vocabulary_map": {"<image>": 127, "<|extra_200|>": 126}},
    # Its model code reads the attention's rotary base from the attention sub-configuration, which lacks it.
    # (and clamps q, k, v by clip_qkv, whose default None it cannot clamp by: DBRX's released value, 8).
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}, "ffn_config": {"ffn_hidden_size": 128}},
    # The widths of its dense MLP and of its experts, its routing (12 of 256 "zero" experts plus the routed ones).
    "longcat_flash": {"ffn_hidden_size": 128, "expert_ffn_hidden_size": 32, "moe_topk": 2, "zero_expert_num": 2},
    # Emu3's image tokenizer (VQGAN): convolution channels and codebook.
    "emu3_vqgan": {"base_channels": 32, "codebook_size": 128},
    # No projections around its quantizer: the codebook's width is the encoder's.
    **{family: {"codebook_dim": 64} for family in ("wavtokenizer", "wavtokenizer_encoder")},
    # Its image and audio tokens are ranges of the vocabulary, one after the other (image codes from its VQ image
    # tokenizer, audio codes from WavTokenizer): 32 image codes from id 32, 64 audio codes from id 64.
    "apertus1p5": {"image_token_offset": 32, "audio_token_offset": 64,
                   "vision_config": {"codebook_size": 32, "base_channels": 32, "num_res_blocks": 1},
                   "audio_config": {"codebook_size": 64}},
    # Its adapter reads the image features of the vision tower's last layer and of an earlier one ([24, 18] of 25).
    "molmo2": {"adapter_config": {"vision_feature_layer": [1, 0]}},
    # EfficientNet's compound scaling (B7's by default: depth x 3.1, width x 2) scales its blocks' repeats and
    # channels: B0's at half the depth (1 to 2 blocks a stage) and a quarter of the width, whose last
    # convolution's 1280 channels are 320 (hidden_dim: the width its model code gives it). Images of 64 x 64: its
    # strides (32 in all) leave 2 x 2 pixels, where 32 x 32 left one, and a training-mode BatchNorm over a batch
    # of 2 single pixels gives +-1 whatever its input: no gradient before it but float noise.
    **{family: {"depth_coefficient": 0.5, "width_coefficient": 0.25, "hidden_dim": 320, "image_size": 64}
       for family in ("efficientnet", "align_vision_model")},
    # Janus's image tokenizer (VQGAN): convolution channels, codebook, the codes' embedding width.
    "janus_vqgan": {"base_channels": 32, "num_res_blocks": 1, "num_embeddings": 128, "image_token_embed_dim": 64},
    # Florence-2's DaViT stages: a width per stage.
    "florence_vision": {"embed_dim": [16, 32, 64, 128]},
    # Its layer types name indexed attention, whose token indexer's sizes default to None (a checkpoint's config
    # names them): 4 query heads and its one key head of 16, 8 tokens selected in blocks of 2 (of the batch's 16).
    "qwen4_exp_text": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 2},
    # Rotary parameters per layer type, which default to none (a checkpoint's config names them), with its model
    # code's multimodal sections ([24, 20, 20]) for heads of 16.
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [3, 3, 2]}}},
    # V-JEPA 2's predictor (its own width, heads and depth) and its video crops (256 x 256, 64 frames).
    "vjepa2": {"pred_hidden_size": 64, "pred_num_attention_heads": 4, "pred_num_hidden_layers": 2, "crop_size": 32,
               "frames_per_clip": 4},
    # Qwen2.5-VL's vision tower: windows of 16 pixels (2 x 2 merged patches of 4; 112 = 2 x 2 x 4 x 14 in
    # the default, where 4 pixels made windows of none), its second layer attending globally.
    **{family: {"window_size": 16, "fullatt_block_indexes": [1]} for family in ("qwen2_5_vl_vision",
                                                                                "exaone4_5_vision")},
    # Its model code compares ids with the padding and mask ids, which default to None.
    "esm": {"pad_token_id": 1, "mask_token_id": 2},
    # DETR's kind names a timm ResNet-50 as its backbone (timm is not installed, and it is 24M parameters):
    # transformers' own ResNet instead, of basic blocks, one a stage, its four stages' features out (the
    # deformable ones read three levels), on 128 x 128 images (a 4 x 4 map at the last stage's stride 32), 8
    # object queries.
    **{family: {"backbone_config": {"model_type": "resnet", "embedding_size": 16, "hidden_sizes": [16, 32, 64, 128],
                                    "depths": [1, 1, 1, 1], "layer_type": "basic", "out_indices": [1, 2, 3, 4],
                                    "out_features": None},
                "num_queries": 8, "image_size": 128}
       for family in ("detr", "conditional_detr", "dab-detr", "deformable_detr", "table-transformer")},
    # Reformer's axial position embeddings factor the 16 positions (4 x 4) and their widths sum to the width; its
    # attention chunks are shorter than the batch's 16 tokens.
    "reformer": {"axial_pos_shape": [4, 4], "axial_pos_embds_dim": [32, 32], "local_attn_chunk_length": 8,
                 "lsh_attn_chunk_length": 8},
    # BiT's GroupNorm groups divide the shrunk stages' narrowest bottleneck (8 channels).
    "bit": {"num_groups": 8},
    # Swin2SR keeps one width through its stages: heads that divide it.
    "swin2sr": {"num_heads": [2] * 6},
    # Grounding DINO selects its 900 queries among the image's positions: 8 of a 64 x 64 image's.
    **{family: {"num_queries": 8, "image_size": 64} for family in ("grounding-dino", "mm-grounding-dino")},
}
#: Swin-like stages: a narrower first stage, and images large enough for each stage to hold a window.
_STAGED = {"embed_dim": 16, "image_size": 64, "window_size": 2}
#: Parameters above this count mean the shrinker missed a size attribute: such a model is skipped, not built.
_MAX_TINY_PARAMS = 20_000_000

def auto_architectures() -> list[tuple[str, str, str]]:
    """``(task, model_type, class name)`` for every architecture in the auto mappings of :data:`AUTO_TASKS`,
    each class once (under the first task that names it)."""
    from transformers.models.auto import modeling_auto

    found: dict[str, tuple[str, str]] = {}
    for task, mapping in AUTO_TASKS.items():
        for model_type, names in getattr(modeling_auto, mapping).items():
            for cls in (names,) if isinstance(names, str) else names:
                # A class several model types map to (LlamaForCausalLM serves "exaone" too) is built from the
                # config of the type its name spells, where there is one.
                if cls not in found or (_spells(cls, model_type) and found[cls][0] == task
                                        and not _spells(cls, found[cls][1])):
                    found[cls] = (found.get(cls, (task,))[0], model_type)
    return [(task, model_type, cls) for cls, (task, model_type) in found.items()]


def _spells(cls: str, model_type: str) -> bool:
    return cls.lower().startswith(model_type.replace("-", "").replace("_", ""))


def _layer_count_key(values: dict[str, Any]) -> str | None:
    return next((k for k in _LAYER_KEYS if isinstance(values.get(k), int) and not isinstance(values[k], bool)), None)


def _is_layer_index_list(key: str, value: list[Any], layers: int) -> bool:
    """Whether ``value`` names layers by index (``moe_layers``, ``hybrid_layer_ids``), not one entry per layer."""
    return ("layer" in key and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
            and all(0 <= a < b < layers for a, b in itertools.pairwise(value)) and (not value or value[-1] < layers)
            and not (len(value) == layers and set(value) <= {0, 1} and layers > 2))


def _per_layer(values: dict[str, Any], sizes: dict[str, Any]) -> dict[str, Any]:
    """The overrides that keep a model's layer kinds when its layers are cut: per-layer lists (``layer_types``,
    ``no_rope_layers``, per-layer widths), lists of layer indices (``moe_layers``) and cyclic patterns
    (``block_types``). The layers kept are the first of each kind, where the kind is a layer's entries in the
    categorical per-layer lists (strings, flags) and the index lists: Gemma 3's five sliding-window layers and one
    global layer become one of each, Llama 4's chunked rotary layer and global no-rotary layer one of each. At
    least 2 layers. A per-layer size (``num_key_value_heads_per_layer``) takes the shrunk size ``sizes`` has."""
    key = _layer_count_key(values)
    if key is None or values[key] <= 2:
        return {}
    n = values[key]
    lists = {k: v for k, v in values.items() if isinstance(v, list)}
    indices = {k: v for k, v in lists.items() if _is_layer_index_list(k, v, n)}
    rows = {k: v for k, v in lists.items() if len(v) == n and k not in indices}
    # Per-layer overrides keyed by layer index ("02": {"num_attention_heads": 64, ...}).
    configs = {k: v for k, v in values.items() if isinstance(v, dict) and v and all(
        isinstance(i, str) and i.isdigit() and int(i) < n and isinstance(c, dict) for i, c in v.items())}
    kinds = [v for v in rows.values() if all(isinstance(x, (str, bool)) for x in v)
             or all(isinstance(x, int) and x in (0, 1) for x in v)]
    kinds += [[i in set(v) for i in range(n)] for v in indices.values()]
    kinds += [[str(i) in {str(int(j)) for j in v} for i in range(n)] for v in configs.values()]
    cycles = {k: list(dict.fromkeys(v)) for k, v in lists.items() if k.endswith("_types") and 0 < len(v) < n
              and all(isinstance(x, str) for x in v)}
    first: dict[tuple[Any, ...], int] = {}
    for i in range(n):
        first.setdefault(tuple(v[i] for v in kinds), i)
    keep = set(first.values())
    count = max([2, len(keep), *(len(c) for c in cycles.values())])  # a cycle longer than the kinds found
    keep = sorted(keep | set([i for i in range(n) if i not in keep][:count - len(keep)]))
    out: dict[str, Any] = {key: len(keep), **cycles}
    for k, v in rows.items():
        base = k.removesuffix("_per_layer")
        size = sizes.get(base, _TINY_ATTRS.get(base))
        if size is not None:
            out[k] = [size] * len(keep)
        elif any(v is kind for kind in kinds) or not all(isinstance(x, int) for x in v):
            out[k] = [v[i] for i in keep]
        # else a per-layer size the shrinker does not know: left for the configuration to derive, as it does
        # for a list that does not match its layer count
    for k, v in indices.items():
        out[k] = [j for j, i in enumerate(keep) if i in set(v)]
    for k, v in configs.items():
        width = len(next(iter(v)))
        by_layer = {int(i): c for i, c in v.items()}
        out[k] = {f"{j:0{width}d}": {**by_layer[i], **_shrunk(by_layer[i], {}, layers=False)}
                  for j, i in enumerate(keep) if i in by_layer}
    return out


def _shrunk(values: dict[str, Any], family: dict[str, Any], layers: bool = True) -> dict[str, Any]:
    """The tiny-size overrides of a configuration's fields ``values`` (a ``to_dict()``), sub-configurations
    (``text_config``, ``vision_config``, MusicGen's ``decoder``...) shrunk the same way; ``layers``: keep each
    kind of layer (:func:`_per_layer`), else the first layers."""
    out: dict[str, Any] = {}
    staged = isinstance(values.get("depths"), list)  # Swin-like stages: widths and depths are per stage
    for key, value in values.items():
        if isinstance(value, dict) and "model_type" in value:
            sub = {**value, **_shrunk(value, _TINY_FAMILY.get(value["model_type"], {}), layers)}
            out[key] = {**sub, **family[key]} if isinstance(family.get(key), dict) else sub
        elif isinstance(value, bool) or not isinstance(value, int):
            continue
        elif staged and (key in ("num_layers", "hidden_size")
                         or (key in _LAYER_KEYS and value == len(values["depths"]))):
            continue  # derived from the stages (as is a layer count that counts the stages)
        elif key in _KEPT_OFF and value == 0:
            continue
        elif key in _TINY_ATTRS:
            out[key] = _STAGED.get(key, _TINY_ATTRS[key]) if staged else _TINY_ATTRS[key]
        elif key in _TINY_CAPS:
            out[key] = min(value, _TINY_CAPS[key])
        elif key.endswith(_PERIODIC[0]):
            out[key] = 2
        elif key.endswith(_PERIODIC[1]):
            out[key] = value % 2
    for key, needs in _TINY_UNSET.items():
        if key in values and values[key] is None and all(values.get(k) is not None for k in needs):
            out[key] = _TINY_ATTRS.get(key) or _TINY_CAPS[key]
    for key, follow in _TIED.items():
        if key in out and follow in out and values.get(key) == values.get(follow):
            out[key] = out[follow]
    if not staged and layers:
        out.update(_per_layer(values, out))
    elif staged:
        n = len(values["depths"])
        out["depths"] = [1] * n
        if isinstance(values.get("num_heads"), list):
            out["num_heads"] = [2**i for i in range(n)]
    if isinstance(values.get("hidden_sizes"), list):
        out["hidden_sizes"] = [16 * 2**i for i in range(len(values["hidden_sizes"]))]
        if isinstance(values.get("num_attention_heads"), list):  # heads per stage (PVT's 1, 2, 5, 8) must divide them
            out["num_attention_heads"] = [2**i for i in range(len(values["num_attention_heads"]))]
    vocab = out.get("vocab_size", values.get("vocab_size"))
    if isinstance(vocab, int):
        # Special token ids must index the small vocabulary: the ones beyond it get distinct ids from its top.
        special = [k for k, v in values.items() if (k.endswith("_token_id") or k.endswith("_token_index"))
                   and isinstance(v, int) and not isinstance(v, bool) and v >= vocab]
        out.update({key: vocab - 1 - i for i, key in enumerate(special)})
    out.update(_mrope(values, out))
    heads, kv = out.get("num_attention_heads"), values.get("num_key_value_heads")
    if heads and isinstance(kv, int) and kv == values.get("num_attention_heads"):
        out["num_key_value_heads"] = heads  # multi-head stays multi-head
    if "use_cache" in values:
        # A training step keeps no cache: hybrid models' caches (Mamba, linear attention) cannot even be made
        # for a step without one.
        out["use_cache"] = False
    return {**out, **{k: v for k, v in family.items() if not (isinstance(v, dict) and k in out)}}


def _head_width(values: dict[str, Any]) -> int | None:
    """The width rotary embeddings turn: the rotary part of a latent-attention head, else a head's width."""
    for key in ("qk_rope_head_dim", "head_dim"):
        if isinstance(values.get(key), int) and values[key] > 0:
            return values[key]
    hidden, heads = values.get("hidden_size"), values.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _mrope(values: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """Multimodal rotary sections (``mrope_section``: a head's rotary frequencies split among time, height and
    width) for the shrunk head, whose rotary frequencies they must sum to: the configuration's sections, else
    its model code's (:data:`_MROPE_SECTION`), in the same proportions, rounded to whole frequencies by largest
    remainder."""
    width, rope = _head_width({**values, **out}), values.get("rope_parameters")
    rope = rope if isinstance(rope, dict) else {}
    section = values.get("mrope_section") or rope.get("mrope_section") or _MROPE_SECTION.get(values.get("model_type"))
    if not width or not isinstance(section, list) or not all(isinstance(x, int) for x in section):
        return {}
    factor = rope.get("partial_rotary_factor", values.get("partial_rotary_factor")) or 1.0
    target = int(width * factor) // 2
    exact = [x * target / sum(section) for x in section]
    parts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: parts[i] - exact[i])[:target - sum(parts)]:
        parts[i] += 1
    if values.get("mrope_section"):
        return {"mrope_section": parts}
    return {"rope_parameters": {**rope, "mrope_section": parts}}


def tiny_config(model_type: str) -> Any:
    """The configuration of ``model_type`` (``transformers.CONFIG_MAPPING``) at a tiny size: 2 layers, width 64,
    4 heads, a 128-token vocabulary, 64 positions, 32 x 32 images (see ``_TINY_ATTRS``), built in code."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    values, family = cls().to_dict(), _TINY_FAMILY.get(model_type, {})
    try:
        config = cls(**_shrunk(values, family))
    except Exception:  # a configuration that derives its layer count its own way (Dory): the first layers
        config = cls(**_shrunk(values, family, layers=False))
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = 0  # what a checkpoint's config names (T5's pad token); needed for labels
    return config


def build_auto(class_name: str, config: Any, seed: int = 0) -> nn.Module:
    """A randomly initialised ``transformers.<class_name>`` of ``config``; ``ValueError`` if it would be larger
    than a tiny model should be (a size attribute the shrinker did not know)."""
    import transformers

    cls = getattr(transformers, class_name)
    config = _own_config(cls, config)
    with torch.device("meta"):
        n = sum(p.numel() for p in cls(config).parameters())
    if n > _MAX_TINY_PARAMS:
        raise ValueError(f"{n / 1e6:.0f}M parameters after shrinking (a size attribute the shrinker does not know)")
    torch.manual_seed(seed)
    return cls(config)


def _own_config(cls: type, config: Any) -> Any:
    """The configuration ``cls`` is made from: ``config``, or its sub-configuration of ``cls``'s config class
    (a model type's text-only class, Llama4ForCausalLM, takes the ``text_config`` of the composite config the
    auto mapping names it under)."""
    want = getattr(cls, "config_class", None)
    if want is None or isinstance(config, want):
        return config
    subs = [v for v in vars(config).values() if isinstance(v, want)]
    return subs[0] if len(subs) == 1 else config


def tiny_inputs(model: nn.Module, task: str, batch: int = 2, seq: int = 16, seed: int = 0,
                padded: bool = True) -> dict[str, Tensor]:
    """A training batch for a model of :func:`build_auto`, from its ``main_input_name``: token ids, images,
    raw audio or audio features; labels where ``task`` has them (the base models have none); and whatever else
    its ``forward`` requires (no default) that :func:`_required_inputs` can make. Token ids come with an
    ``attention_mask`` padding the first sequence where the model takes one, unless ``padded`` is False."""
    g = torch.Generator().manual_seed(seed)
    inputs = _main_inputs(model, task, batch, seq, g, padded)
    return {**inputs, **_required_inputs(model, inputs, batch, seq, g)}


def _vocab(config: Any) -> int:
    """The vocabulary size token ids are drawn below: the config's, its text config's, else 128."""
    return getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", 128)


def _required_inputs(model: nn.Module, inputs: dict[str, Tensor], batch: int, seq: int,
                     g: torch.Generator) -> dict[str, Tensor]:
    """The arguments ``model.forward`` requires beyond ``inputs`` that their names say how to make: token ids
    (an image-text model's text, Grounding DINO's), images like the ones given, and the mask
    of a feature input (``input_features_mask``, ``audio_mel_mask``: every frame present)."""
    vocab = _vocab(model.config)
    images = next((t for k, t in inputs.items() if k.endswith("pixel_values")), None)
    out: dict[str, Tensor] = {}
    for name, p in inspect.signature(model.forward).parameters.items():
        if p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or name in inputs:
            continue
        if name.endswith("input_ids"):
            out[name] = torch.randint(0, vocab, (batch, seq), generator=g)
        elif name.endswith("pixel_values") and images is not None:
            out[name] = torch.randn(images.shape, generator=g)
        elif name.endswith("_mask") and isinstance(inputs.get(name.removesuffix("_mask")), Tensor):
            out[name] = torch.ones(inputs[name.removesuffix("_mask")].shape[:2], dtype=torch.bool)
    return out


#: Tokens of padding at the end of the first sequence of a batch of token ids (:func:`_main_inputs`).
_PADDED = 5


def _main_inputs(model: nn.Module, task: str, batch: int, seq: int, g: torch.Generator,
                 padded: bool = True) -> dict[str, Tensor]:
    config = model.config
    main = getattr(model, "main_input_name", "input_ids")
    vocab = _vocab(config)
    inputs: dict[str, Tensor] = {}
    params = inspect.signature(model.forward).parameters
    if main not in params and "pixel_values" in params:  # a vision tower left with the default main input name
        main = "pixel_values"
    grid = next((k for k in ("grid_thw", "image_grid_thw") if k in params), None)
    if grid is not None and "input_ids" not in params:
        # A vision tower of Qwen2-VL's kind: images as rows of flattened patches (channels x frames x patch x
        # patch), each image's grid of patches (frames, height, width) apart: 4 x 4 patches an image.
        vision = getattr(config, "vision_config", config)
        patch = getattr(vision, "patch_size", 4)
        patch = patch if isinstance(patch, int) else patch[0]
        width = (getattr(vision, "in_channels", None) or getattr(vision, "num_channels", None) or 3) * patch * patch
        width *= getattr(vision, "temporal_patch_size", None) or getattr(vision, "patch_temporal", None) or 1
        first = next(iter(params))
        inputs[first] = torch.randn(batch * 16, width, generator=g)
        inputs[grid] = torch.tensor([[1, 4, 4]] * batch)
        return inputs
    if main == "pixel_values":
        vision = getattr(config, "vision_config", config)
        size = getattr(vision, "image_size", 32)  # convolutional models take any size: 32 x 32
        size = size if isinstance(size, int) else size[0]
        inputs[main] = torch.randn(batch, getattr(vision, "num_channels", 3), size, size, generator=g)
        if task == "image-classification":
            inputs["labels"] = torch.randint(0, config.num_labels, (batch,), generator=g)
        return inputs
    if main == "pixel_values_videos":  # video: [batch, frames, channels, height, width], 4 frames unless named
        vision = getattr(config, "vision_config", config)
        size = getattr(vision, "image_size", None) or getattr(vision, "crop_size", 32)
        frames = getattr(vision, "num_frames", None) or 4
        inputs[main] = torch.randn(batch, frames, getattr(vision, "num_channels", 3), size, size, generator=g)
        return inputs
    if main == "past_values":  # a time series: [batch, context, channels] (a channel-less one [batch, context])
        length = min(getattr(config, "context_length", None) or 64, 512)
        channels = getattr(config, "num_input_channels", None)
        inputs[main] = torch.randn(batch, length, *([channels] if channels else []), generator=g)
        return inputs
    books = None
    if main == "input_values":  # raw audio: 64 frames of the feature encoder
        inputs[main] = torch.randn(batch, 64 * 20, generator=g)
    elif main in ("input_features", "audio_mel"):
        mel = getattr(config, "num_mel_bins", None) or getattr(config, "feature_size", 80)
        frames = 2 * getattr(config, "max_source_positions", seq)
        shape = (batch, mel, frames) if getattr(config, "model_type", "") == "whisper" else (batch, frames, mel)
        inputs[main] = torch.randn(*shape, generator=g)
    else:
        # Audio codes (MusicGen's decoder) come as one row of ids per codebook: labels [batch, seq, codebooks].
        books = getattr(config, "num_codebooks", None) if main == "input_ids" else None
        inputs[main] = torch.randint(0, vocab, (batch * (books or 1), seq), generator=g)
        if hasattr(model, "get_text_features") and hasattr(model, "get_image_features") and "pixel_values" in params:
            # An image-text dual encoder (CLIP's kind) scores images against texts: it takes both.
            vision = getattr(config, "vision_config", config)
            size = getattr(vision, "image_size", 32)
            size = size if isinstance(size, int) else size[0]
            inputs["pixel_values"] = torch.randn(batch, getattr(vision, "num_channels", 3), size, size, generator=g)
        if books and task == "causal-lm":
            inputs["labels"] = inputs[main].reshape(batch, books, seq).transpose(1, 2)
            return inputs
    if padded and main == "input_ids" and "attention_mask" in params and not books and batch > 1:
        # The first sequence right-padded over its last 5 tokens (how batches of texts of several lengths come): the
        # mask, and the branches models take on it, are tested with the rest (no ids-only batch tests them).
        inputs["attention_mask"] = torch.ones_like(inputs[main])
        inputs["attention_mask"][0, -_PADDED:] = 0
    if task in ("causal-lm", "masked-lm"):  # (no loss at padded positions)
        pad = inputs.get("attention_mask")
        inputs["labels"] = inputs[main] if pad is None else inputs[main].masked_fill(pad == 0, -100)
    elif task == "ctc":
        inputs["labels"] = torch.randint(1, vocab, (batch, 4), generator=g)
    elif task == "seq2seq-lm":
        inputs["labels"] = torch.randint(0, vocab, (batch, seq), generator=g)
    elif getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = torch.randint(0, vocab, (batch, seq), generator=g)
    return inputs


def projection_loss(output: Any) -> Tensor:
    """The loss of an output with none of its own (a base model): ``output.loss`` if it has one, else the first
    floating tensor projected on fixed random weights (``sum()`` alone would give a LayerNorm'd output a zero
    gradient in exact arithmetic: normalised features sum to a constant)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, Tensor):
        return loss
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else [output]
    first = next(t for t in values if isinstance(t, Tensor) and t.is_floating_point() and t.requires_grad)
    weights = torch.randn(first.shape, generator=torch.Generator().manual_seed(1)).to(first)
    return (first * weights).sum() / first.numel() ** 0.5
