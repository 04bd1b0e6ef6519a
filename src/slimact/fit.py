"""``slimact fit``: the largest batch that fits a memory budget, plainly and under each policy.

Training memory = static bytes (weights and optimizer state: counted from the parameters) + the peak of one
forward and backward (``slimact.profile(..., peak=True).peak_bytes``: everything allocated at the step's highest
point, the parameter gradients, the bytes kept for the backward and the temporaries alive then), which is affine in
the batch size: ``p(b) = fixed + per_sample * b``. Both coefficients come from measured steps at two batch
sizes; a third checks the affine model (the report says when it does not hold). The largest batch is then
``floor((budget - static - fixed) / per_sample)``. ``policy="auto"`` picks the least lossy policy (``"tempo"``,
then ``"int8"``) whose largest batch reaches the requested one. The bytes kept for the backward
(:attr:`slimact.profile.Report.kept_bytes`: activations and gradients computed ahead, measured in the same steps)
are reported beside, per sample.

Why the peak and not the bytes kept: a layer's output exists at full precision until the next layer has read
it, and the backward restores each kept tensor at full precision, so a converted model's peak holds a few
layer-sized temporaries on top of its kept bytes. Counting the kept bytes alone put GPT-2's (tiny) int8 batch
at 258 under a budget whose measured limit was 39.

What is not counted: the allocator's slack and fragmentation, and the framework's own workspace (cuBLAS,
NCCL); on CPU the peak comes from ``torch.profiler``'s memory events, on CUDA from the allocator.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
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
    fixed: int  # peak bytes of a step independent of the batch size
    per_sample: int  # peak bytes of a step per sample (between one probe and max_batch where both are measured)
    affine_error: float  # relative error of the affine model at the check batch
    max_batch: int  # 0 if not even one sample fits
    kept_per_sample: int = 0  # bytes kept for the backward per sample (Report.kept_bytes)
    measured_peak: int | None = None  # the peak of a step at max_batch, measured (None: not measured)

    def predicted(self, batch: int) -> int:
        return self.fixed + self.per_sample * batch


@dataclass
class FitReport:
    budget: int
    static: int  # weights + optimizer state
    rows: list[FitRow] = field(default_factory=list)
    chosen: str | None = None
    requested_batch: int | None = None

    def table(self) -> str:
        size = functools.partial(_size, unit=2**30 if self.budget >= 2**30 else 2**20)  # (the budget's, throughout)
        lines = [f"budget {size(self.budget)}; weights and optimizer state {size(self.static)}",
                 f"{'policy':<8}{'kept/sample':>15}{'peak/sample':>15}{'max batch':>11}{'measured there':>16}"
                 f"{'affine check':>14}"]
        for r in self.rows:
            note = f"{100 * r.affine_error:.1f}%" + ("" if r.affine_error <= 0.02 else " NOT affine")
            there = "not measured" if r.measured_peak is None else size(self.static + r.measured_peak)
            lines.append(f"{r.policy:<8}{r.kept_per_sample / 2**20:>11.1f} MiB{r.per_sample / 2**20:>11.1f} MiB"
                         f"{r.max_batch:>11}{there:>16}{note:>14}")
        if self.requested_batch is not None:
            plain_fits = all(r.policy == "plain" and r.max_batch >= self.requested_batch for r in self.rows)
            verdict = (f"policy {self.chosen!r}" if self.chosen else "plain PyTorch fits it" if plain_fits and self.rows
                       else "no policy fits; reduce the batch or the sequence")
            lines.append(f"batch {self.requested_batch}: {verdict}")
        return "\n".join(lines)


def _size(n: int, unit: int) -> str:
    """``n`` bytes in GiB (``unit`` 2**30) or MiB: a 24 MiB budget printed in GiB read "0.02 GiB"."""
    return f"{n / 2**30:.2f} GiB" if unit == 2**30 else f"{n / 2**20:.1f} MiB"


def _free_bytes(model: nn.Module) -> int:
    """Memory the device of ``model`` has free now: the CUDA allocator's view, or the host's ``MemAvailable``."""
    param = next(model.parameters(), None)
    if param is not None and param.is_cuda:
        return torch.cuda.mem_get_info(param.device)[0] + torch.cuda.memory_reserved(param.device) \
            - torch.cuda.memory_allocated(param.device)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _measure(peak_at: Callable[[int], int], batch: int) -> float:
    """The peak of a step at ``batch``, or infinity where the device runs out of memory."""
    try:
        return peak_at(batch)
    except torch.OutOfMemoryError:
        return math.inf
    except RuntimeError as e:  # the CPU allocator's failure is a plain RuntimeError
        if "allocate" in str(e):
            return math.inf
        raise


def _largest_batch(peak_at: Callable[[int], int], room: int, points: list[tuple[int, int]], min_slope: int,
                   confirm: bool, steps: int = 10) -> tuple[int, int | None]:
    """``(batch, its measured peak or None)``: the largest batch whose step peak is within ``room``.

    The peak grows with the batch, affinely once the per-sample tensors dominate, but at a few samples a fixed
    tensor (a parameter gradient, the logits' chunk) may be the highest point: then the probes' slope
    understates it. The first guess follows the line through the two largest measured ``points``, at least as
    steep as ``min_slope`` (the bytes kept per sample, all alive at the end of the forward). With ``confirm``, the
    guess (at most 4x the largest batch measured) is measured, and the search goes on: further along that line
    while steps fit, then between the largest
    batch that fits and the smallest that does not (the line through the two, bisection where it stalls), at
    most ``steps`` measurements; the answer is the largest batch measured to fit."""
    measured = {b: float(p) for b, p in points}
    for i in range(steps + 1):
        fits = [b for b, p in measured.items() if p <= room]
        over = [b for b, p in measured.items() if p > room]
        lo, hi = max(fits, default=0), min(over, default=None)
        if hi is None:
            (ba, pa), (bb, pb) = sorted(measured.items())[-2:]
            slope = max((pb - pa) / (bb - ba), min_slope, 1)
            line = math.floor(bb + (room - pb) / slope)  # the line's last batch within room (bb itself fits)
            if not confirm:
                return max(bb, line), None
            # Measured, the search goes on past bb (to a batch that does not fit), at most 4x the largest batch
            # measured: an overshoot costs a step 4x the answer's at most.
            guess = min(max(bb + 1, line), 4 * bb)
        elif hi - lo <= 1:
            break
        elif not confirm:
            return lo, None
        else:
            p_lo = measured.get(lo, 0.0)
            guess = lo + math.floor((room - p_lo) * (hi - lo) / (measured[hi] - p_lo)) if measured[hi] < math.inf \
                else (lo + hi) // 2
            if i % 2:  # every other step a bisection: the line alone can creep towards one end
                guess = (lo + hi) // 2
            guess = min(max(guess, lo + 1), hi - 1)
        if i == steps:
            break
        measured[guess] = _measure(peak_at, guess)
    fits = [b for b, p in measured.items() if p <= room]
    best = max(fits, default=0)
    return best, (int(measured[best]) if best else None)


def fit(
    model: nn.Module,
    make_inputs: Callable[[int], Any],
    budget: int | str,
    *,
    policies: tuple[str, ...] = ("plain", *AUTO_ORDER),
    optimizer: str = "adamw",
    batch: int | None = None,
    probes: tuple[int, int, int] = (1, 2, 3),
    confirm: bool = True,
) -> FitReport:
    """The largest batch per policy under ``budget``; with ``batch``, also the least lossy policy reaching it.

    Args:
        model: the plain model (converted and reverted in turn; left as it was).
        make_inputs: ``batch size -> inputs`` for :func:`slimact.profile` (whose loss rule applies).
        budget: bytes, or a size such as ``"8GiB"``.
        policies: ``"plain"`` and policy names to evaluate.
        optimizer: ``"adamw"``/``"adam"`` (two fp32 states per parameter), ``"sgd"`` (momentum), ``"none"``.
        batch: the batch wanted; sets :attr:`FitReport.chosen` to the first of ``policies`` other than ``"plain"``
            reaching it (least lossy first with the default, :data:`AUTO_ORDER`).
        probes: two batch sizes for the fit and one to check it.
        confirm: measure steps until the largest batch that fits is found (a few, at most 10 per policy), where
            the device has free memory for the budget; off (or where it has not), the affine model's answer,
            which may be optimistic (``FitRow.measured_peak`` is then ``None``).
    """
    import slimact
    from slimact.profile import profile

    if optimizer not in _OPTIMIZER_STATE:
        raise ValueError(f"optimizer must be one of {sorted(_OPTIMIZER_STATE)}")
    budget = parse_bytes(budget)
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    state = sum(p.numel() for p in params) * 4 * _OPTIMIZER_STATE[optimizer]
    # Gradients are not static: the step's peak holds them (they are allocated by its backward).
    report = FitReport(budget=budget, static=weights + state, requested_batch=batch)
    b1, b2, b3 = probes
    try:
        for policy in policies:
            if policy != "plain":
                slimact.convert(model, policy)
            profile(model, make_inputs(b1), peak=True)  # one-time allocations (caches, tables) out of the probes
            step_at = functools.cache(lambda b: profile(model, make_inputs(b), peak=True))
            peak_at = lambda b, step_at=step_at: step_at(b).peak_bytes  # noqa: E731
            p1, p2, p3 = (peak_at(b) for b in (b1, b2, b3))
            k1, k2 = (step_at(b).kept_bytes for b in (b1, b2))
            per_sample = (p2 - p1) // (b2 - b1)
            fixed = p1 - per_sample * b1
            error = abs(fixed + per_sample * b3 - p3) / p3
            kept = (k2 - k1) // (b2 - b1)
            room = budget - report.static
            # A step is measured only where the device has the memory for it (a budget may be another machine's).
            largest, measured = _largest_batch(peak_at, room, [(b1, p1), (b2, p2), (b3, p3)], kept,
                                               confirm and room <= 0.9 * _free_bytes(model))
            if measured is not None and largest > b2:  # the line through the probe and the answer, both measured
                per_sample = (measured - p1) // (largest - b1)
                fixed = p1 - per_sample * b1
            report.rows.append(FitRow(policy, fixed, per_sample, error, largest, kept, measured))
            slimact.revert(model)
    finally:
        slimact.revert(model)
    if batch is not None:  # (the policies asked for, in their order: "mesa" or a policy file too)
        report.chosen = next((r.policy for r in report.rows if r.policy != "plain" and r.max_batch >= batch), None)
    return report
