"""nanoGPT's, nanochat's and Meta's Llama models (:class:`slimact.zoo.NanoGPT`, :class:`slimact.zoo.NanoChat`,
:class:`slimact.zoo.MetaLlama`) at test size, with their training batch."""

from __future__ import annotations

import torch

from slimact import zoo

VOCAB, T = 200, 64  # (a vocabulary no activation shares its last dim with)


def NanoGPT(**kwargs) -> torch.nn.Module:
    return zoo.NanoGPT(n_embd=64, n_head=4, n_layer=2, dropout=0.1, vocab_size=VOCAB, block_size=T, **kwargs)


def NanoChat() -> torch.nn.Module:
    return zoo.NanoChat(n_embd=64, n_head=4, n_kv_head=2, n_layer=2, vocab_size=VOCAB, block_size=T)


def MetaLlama() -> torch.nn.Module:
    return zoo.MetaLlama(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=16, max_seq_len=T)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx, targets)``: ``[2, T]`` tokens and the next ones, the last five of the first row ignored (-1)."""
    idx = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(0))
    targets = idx.roll(-1, 1)
    targets[0, -5:] = -1
    return idx, targets


def loss_of(output) -> torch.Tensor:
    """nanoGPT returns ``(logits, loss)``, nanochat the loss."""
    return output[1] if isinstance(output, tuple) else output
