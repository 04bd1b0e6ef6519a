"""``slimact fit``: the largest batch that fits a memory budget, plainly and under each policy.

Training memory = static bytes (weights, gradients, optimizer state: counted from the parameters) +
activation bytes, which are affine in the batch size: ``a(b) = fixed + per_sample * b``. Both coefficients
come from :func:`slimact.profile` at two batch sizes; a third profile checks the affine model (and the
report says when it does not hold). The largest batch is then ``floor((budget - static - fixed) /
per_sample)``. ``policy="auto"`` picks the least lossy policy (``"tempo"``, then ``"int8"``) whose largest
batch reaches the requested one.

What is not counted: the allocator's slack, temporary buffers of the backward pass and the framework's own
workspace; on a GPU, confirm with a real step (``torch.cuda.max_memory_allocated``) before relying on it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["AUTO_ORDER", "FitReport", "FitRow", "fit", "parse_bytes"]

#: Policies ``"auto"`` tries, least lossy first.
AUTO_ORDER = ("tempo", "int8")

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"8GiB"``, ``"512MiB"``, ``"2GB"`` or a number of bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (use e.g. 8GiB, 512MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


_OPTIMIZER_STATE = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}  # fp32 copies of the parameters


@dataclass
class FitRow:
    policy: str
    fixed: int  # activation bytes independent of the batch size
    per_sample: int  # activation bytes per sample
    affine_error: float  # relative error of the affine model at the check batch
    max_batch: int  # 0 if not even one sample fits

    def predicted(self, batch: int) -> int:
        return self.fixed + self.per_sample * batch


@dataclass
class FitReport:
    budget: int
    static: int  # weights + gradients + optimizer state
    rows: list[FitRow] = field(default_factory=list)
    chosen: str | None = None
    requested_batch: int | None = None

    def table(self) -> str:
        gib = 2**30
        lines = [f"budget {self.budget / gib:.2f} GiB; weights, gradients, optimizer state {self.static / gib:.2f} GiB",
                 f"{'policy':<8}{'activations/sample':>20}{'fixed':>12}{'max batch':>11}{'affine check':>14}"]
        for r in self.rows:
            note = f"{100 * r.affine_error:.1f}%" + ("" if r.affine_error <= 0.02 else " NOT affine")
            lines.append(f"{r.policy:<8}{r.per_sample / 2**20:>16.1f} MiB{r.fixed / 2**20:>8.1f} MiB"
                         f"{r.max_batch:>11}{note:>14}")
        if self.requested_batch is not None:
            verdict = f"policy {self.chosen!r}" if self.chosen else "no policy fits; reduce the batch or the sequence"
            lines.append(f"batch {self.requested_batch}: {verdict}")
        return "\n".join(lines)


def fit(
    model: nn.Module,
    make_inputs: Callable[[int], Any],
    budget: int | str,
    *,
    policies: tuple[str, ...] = ("plain", *AUTO_ORDER),
    optimizer: str = "adamw",
    batch: int | None = None,
    probes: tuple[int, int, int] = (1, 2, 3),
) -> FitReport:
    """The largest batch per policy under ``budget``; with ``batch``, also the least lossy policy reaching it.

    Args:
        model: the plain model (converted and reverted in turn; left as it was).
        make_inputs: ``batch size -> inputs`` for :func:`slimact.profile`.
        budget: bytes, or a size such as ``"8GiB"``.
        policies: ``"plain"`` and policy names to evaluate.
        optimizer: ``"adamw"``/``"adam"`` (two fp32 states per parameter), ``"sgd"`` (momentum), ``"none"``.
        batch: the batch wanted; sets :attr:`FitReport.chosen` to the first of :data:`AUTO_ORDER` reaching it.
        probes: two batch sizes for the fit and one to check it.
    """
    import slimact

    if optimizer not in _OPTIMIZER_STATE:
        raise ValueError(f"optimizer must be one of {sorted(_OPTIMIZER_STATE)}")
    budget = parse_bytes(budget)
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    state = sum(p.numel() for p in params) * 4 * _OPTIMIZER_STATE[optimizer]
    report = FitReport(budget=budget, static=2 * weights + state, requested_batch=batch)
    b1, b2, b3 = probes
    try:
        for policy in policies:
            if policy != "plain":
                slimact.convert(model, policy)
            a1, a2, a3 = (slimact.profile(model, make_inputs(b)).activation_bytes for b in (b1, b2, b3))
            per_sample = (a2 - a1) // (b2 - b1)
            fixed = a1 - per_sample * b1
            error = abs(fixed + per_sample * b3 - a3) / a3
            room = budget - report.static - fixed
            report.rows.append(FitRow(policy, fixed, per_sample, error,
                                      max(0, room // per_sample) if per_sample > 0 else 0))
            slimact.revert(model)
    finally:
        slimact.revert(model)
    if batch is not None:
        report.chosen = next((r.policy for r in report.rows if r.policy in AUTO_ORDER and r.max_batch >= batch), None)
    return report
