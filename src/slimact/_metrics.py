"""Error metrics used to judge lossy paths (tests and benchmarks): SQNR in dB and cosine similarity."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["cosine", "sqnr_db"]


def sqnr_db(exact: Tensor, approx: Tensor) -> float:
    """Signal-to-quantisation-noise ratio ``10 log10(|exact|^2 / |exact - approx|^2)`` in dB (inf if equal)."""
    exact, approx = exact.detach().double(), approx.detach().double()
    noise = (exact - approx).pow(2).sum().item()
    signal = exact.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def cosine(a: Tensor, b: Tensor) -> float:
    """Cosine similarity of two tensors, flattened."""
    return torch.nn.functional.cosine_similarity(
        a.detach().double().reshape(1, -1), b.detach().double().reshape(1, -1)
    ).item()
