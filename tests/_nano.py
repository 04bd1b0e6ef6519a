"""Two models as their repositories write them, abridged to what they compute (no download, no init scheme):
nanoGPT's ``model.py`` (a LayerNorm module of its own calling ``F.layer_norm``, attention by
``F.scaled_dot_product_attention`` or by hand, the head ``lm_head`` tied to the token embedding, the loss on
``targets`` with ``ignore_index=-1``) and nanochat's GPT (weightless ``F.rms_norm``, rotary embeddings, grouped
query heads, a ReLU-squared MLP, logits soft-capped at 15 and cast to fp32 before the loss). Neither is a Hugging
Face model: no ``get_output_embeddings``, no ``labels``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, T = 200, 64  # (a vocabulary no activation shares its last dim with)


class LayerNorm(nn.Module):
    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, flash: bool) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.attn_dropout, self.resid_dropout = nn.Dropout(dropout), nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout, self.flash = n_head, n_embd, dropout, flash
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

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


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, flash: bool) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = LayerNorm(n_embd, True), LayerNorm(n_embd, True)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, flash)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, n_embd: int = 64, n_head: int = 4, n_layer: int = 2, dropout: float = 0.1,
                 flash: bool = True) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(VOCAB, n_embd), "wpe": nn.Embedding(T, n_embd), "drop": nn.Dropout(dropout),
            "h": nn.ModuleList(Block(n_embd, n_head, dropout, flash) for _ in range(n_layer)),
            "ln_f": LayerNorm(n_embd, True)})
        self.lm_head = nn.Linear(n_embd, VOCAB, bias=False)
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


class ChatAttention(nn.Module):
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


class ChatMLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class ChatBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_kv_head: int) -> None:
        super().__init__()
        self.attn, self.mlp = ChatAttention(n_embd, n_head, n_kv_head), ChatMLP(n_embd)

    def forward(self, x, cos_sin):
        x = x + self.attn(_norm(x), cos_sin)
        return x + self.mlp(_norm(x))


class NanoChat(nn.Module):
    def __init__(self, n_embd: int = 64, n_head: int = 4, n_kv_head: int = 2, n_layer: int = 2) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(VOCAB, n_embd),
            "h": nn.ModuleList(ChatBlock(n_embd, n_head, n_kv_head) for _ in range(n_layer))})
        self.lm_head = nn.Linear(n_embd, VOCAB, bias=False)
        head_dim = n_embd // n_head
        freqs = torch.outer(torch.arange(T, dtype=torch.float32),
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


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx, targets)``: ``[2, T]`` tokens and the next ones, the last five of the first row ignored (-1)."""
    idx = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(0))
    targets = idx.roll(-1, 1)
    targets[0, -5:] = -1
    return idx, targets


def loss_of(output) -> torch.Tensor:
    """nanoGPT returns ``(logits, loss)``, nanochat the loss."""
    return output[1] if isinstance(output, tuple) else output
