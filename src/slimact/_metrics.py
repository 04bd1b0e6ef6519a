"""Error metrics used to judge lossy paths (tests and benchmarks): SQNR in dB and cosine similarity."""

from __future__ import annotations

import math

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
    """Cosine similarity of two tensors, flattened, in float64 (1 for two zero tensors, 0 for one).

    Not ``F.cosine_similarity``: its ``eps=1e-8`` floor on ``|a| |b|`` gave near-zero cosines for gradients of
    norm ~1e-9 that agree to 1e-3 (a tiny model's vanishing LayerNorm gradients)."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    na, nb = a.norm(), b.norm()
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return (a @ b / (na * nb)).item()
