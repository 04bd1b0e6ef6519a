"""``check``: does slimact train this model correctly? One training step of the plain model and of a converted
copy, compared: the forward, every parameter gradient, and a verdict against the policy's floors.

A user with a custom model runs it once before a long training job::

    report = slimact.check(model, batch)            # a converted model's policy, else "int8"
    print(report)                                   # worst parameters, what was left alone
    assert report.passed

How the two steps are made comparable: both run from deep copies of ``model`` (the user's model, its
gradients, buffers, mode and the global RNGs are left exactly as found), in training mode, each from the same
RNG state, so dropout draws agree (slimact's dropout replays PyTorch's draws and keeps them as bit masks). The
RNG state is PyTorch's (CPU, CUDA), Python's ``random`` and NumPy's global one: model code draws from those too
(LayerDrop as ``np.random.random()`` in wav2vec2-style encoders, SpecAugment's masks, ``random.random()``).

**Running estimates** (``scale="running"``, the ``"mesa"`` preset): each call packs its tensors with the estimate
the calls before it made (an EMA, decay 0.9), and a fresh copy's first call sets it from the very tensor it packs,
so a check of the first step alone sees nearly each tensor's own range and cannot see the estimate lag where a
tensor's range changes from call to call. Under such a policy ``check`` judges two converted steps and each
parameter by the worse: the first step (estimates fresh), and a step of a second converted copy whose estimates
were first warmed by training-mode forward calls on other batches (judged against a plain copy warmed on the same
batches from the same RNG state: a forward may change a model's own state outside its state dict), those given
as ``batches`` (a few from the
user's data loader), else ``warmup`` (8) batches mixed from the rows of ``inputs`` (:func:`_mixed`: each element
from one of all the rows but one, drawn at random, per-row integers such as sequence lengths kept as given; with
one row nothing can be mixed and only the first step is judged). ``micro_batch`` makes the step a gradient
accumulation loop over calls of that many rows, as the user's
loop makes them (the estimates then lag between the calls of one step, too). Measured on tiny Llama, 16-token rows
(training: eight steps on other batches, then the judged one): 1-row micro-batches accumulated over 2 rows,
training 0.966, check 0.9999 before, now 0.960 (``micro_batch=1``, failed); 2 rows per call, training 0.985, check
0.9999 before, now 0.984 (failed); 4 rows per call, training 0.996, check now 0.996 (passed). Mixed batches hold
the judged rows' values, so with few rows the verdict can err either way near the floor (a UNet's time-embedding
MLP fed 4 timesteps: 0.981 in one of three batches where other batches give 0.991-0.997); ``batches`` from the data
removes that. ``report.estimates`` says what was done; each parameter's ``step`` which step it was judged by.

The floors:

* **forward**: slimact's forward is PyTorch's own computation; the loss and every floating output must
  agree to float rounding (:func:`rounding_tolerance` of the output's dtype, float32's at least, relative to
  the output's largest magnitude).
* **lossless policies** (nothing quantised: ``"tempo"``): every gradient equals plain's to float rounding:
  ``||g - g_plain|| <= tol * ||g_plain||`` with ``tol`` from :func:`rounding_tolerance` of the gradient's dtype, or
  of the autocast dtype where the step runs under autocast, around ``check`` or entered in the model's own forward
  as accelerate's mixed precision does (the step then computes in it, and plain's gradients are rounded at its level
  as a 16-bit model's are: vit-pytorch's CvT under bfloat16
  autocast, whose "tempo" norm gradients are 0.026 relative from plain's and as far from float64 as plain's own,
  30% off it, failed against float32's 1.2e-4).
* **lossy policies**: every gradient at cosine >= 0.99 with plain's (:data:`MIN_COSINE`), and its norm within
  :data:`MAX_NORM_RATIO` (14%) of plain's: a cosine cannot see a scale (a weight gradient doubled, halved, a
  dequantisation off by a constant factor has cosine 1); 8-bit noise at the cosine floor changes the norm by about
  1% (tiny Llama under int8: at most 1.3% relative difference altogether).
* a parameter whose exact gradient is **negligible** holds noise in both runs, so its direction means nothing:
  it is judged by the size of the difference relative to the model's typical gradient (the median of the
  per-parameter gradient norms). Negligible is the level of the policy's own noise on that typical gradient:
  float rounding (``tol``) under a lossless policy; under a lossy one :data:`NOISE`, a thousandth, a quarter of
  an 8-bit step (1/255): an attention key bias (zero in exact arithmetic: softmax ignores a per-row shift), a
  BatchNorm bias whose shift the next BatchNorm removes, the embedding row of a token not in the batch.
  Its difference must stay within the same bound. Small is not always noise: a block behind a layer scale of 1e-6
  (ConvNeXt, CaiT, DeiT-III at initialisation) has gradients 1e-6 of the typical one, exact in plain's float32,
  and Adam steps each parameter as far whatever its gradient's size (judged by size, such a block's gradients
  flipped or zeroed passed). So one that passes by size but not by its floor against plain is judged against the
  float64 copy (below), where one is made: held to the floor where plain's gradient is (genuine), by size where
  plain's is off float64 too (a cancellation's remainder).
* a parameter that misses its floor against plain (or passes by size alone) is **judged again against a float64 copy**
  of the plain model (one float64 forward and backward, made only when some parameter does): both plain's gradient and
  the converted one against the float64 gradient. It passes when the converted gradient meets the floor against
  float64 (plain's was the one off); or, where plain's own gradient misses the floor against float64 too (cosine below
  :data:`MIN_COSINE`, or, lossless, a relative difference above ``tol``), when the converted one is no farther from
  float64 than ``max(bound, 2 * ||g_plain - g_float64||)`` (lossless: also ``||g_plain - g_float64|| + tol *
  ||g_float64||``): as close as plain's own (two roundings, each about as far from exact as the other), or
  negligible. It fails when plain meets the floor against float64 and the converted gradient does not. Two cases
  need it. Some exact gradients are zero by the model's structure, not by their size: a conv bias right before a
  training-mode BatchNorm (which removes any per-channel shift), a LayerNorm weight at initialisation (bias 0) whose
  output only feeds a per-channel conv and a BatchNorm; their float32 gradient is what rounding leaves of a
  cancellation, and can be far above :data:`NOISE` of the typical gradient where the model's gradients are tiny
  (SwiftFormer: typical 3e-5, such biases 1e-7); under a lossy policy such a gradient is then judged by size
  (negligible). And a model with **16-bit tensors** (a bfloat16 model with a LayerNorm kept in float32, as Hugging
  Face's ``_keep_in_fp32_modules`` does, or a bfloat16 norm inside a float32 model): plain PyTorch's gradients are
  rounded at bfloat16's level, so a lossless conversion's differ from them by more than float32 rounding while
  being as close to the truth, or closer. The float64 run widens every cast to a narrower floating dtype written
  in the model's code (``x.to(torch.bfloat16)``, ``.float()``, ``dtype=torch.float32``) to float64, and draws its
  random numbers (dropout, drop-path, noise) as float32 draws widened, so that it consumes the RNG exactly as the
  plain run did (``torch._grouped_mm``, which has no float64 kernel, runs as one matmul per group); it is used only
  if its loss and outputs agree with plain's to ``1e-3`` relative (with 16-bit tensors, in the parameters, inputs or
  outputs or cast to in the model's code, as torchtitan's MoE computes its experts in bfloat16 in a float32 model:
  8 of their ``eps``, bfloat16 0.0625) and it made no draw it cannot reproduce (alpha dropout); else, or if the
  model cannot run in float64, no parameter is judged this way. With 16-bit tensors that agreement is loose
  enough to hide model code that branches on the dtype (the float64 run taking the other branch in a small part of
  the model), so there, under a lossless policy, plain's distance from float64 counts only up to that guard.
  ``report.reference`` (and the report's ``reference:`` line) says what the gradients were judged against, and each
  parameter's ``reference`` which it was.

What a verdict cannot see (measured by deliberately broken conversions): a parameter is judged as a whole, and a
weight also by its halves and thirds along its output dim (:func:`_output_dims`: a fused projection's parts; GPT-2's
``c_attn`` at initialisation, whose query part holds 0.03% of its gradient: with that part's sign flipped
``"int8"`` passed at cosine 0.999), so an error confined to a part of it holding little of its gradient passes where
the part is none of those (a few tokens' share, one head). Under a lossy policy a
gradient within :data:`MAX_NORM_RATIO` of plain's norm passes (a weight gradient 1.1x plain's), and under autocast a
lossless one within the autocast dtype's rounding (bfloat16: 3%). The forward is held to float rounding relative to
the largest output (outputs 1e-4 off pass). Eval mode is not run. A step drawing randomness ``check`` cannot replay
(a NumPy ``Generator`` of the model's own, unseeded) fails as a gradient off its floor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from slimact._metrics import cosine, sqnr_db
from slimact.convert import Summary, _conversion_policies, _copied, _plain_copy, convert, summary
from slimact.policy import Policy, _running, resolve
from slimact.profile import _call, _default_loss, _train
from slimact.quant.state import ESTIMATES_ATTR

__all__ = ["MAX_NORM_RATIO", "MIN_COSINE", "NOISE", "PART_SHARE", "CheckReport", "ParamCheck", "check", "is_lossless",
           "rounding_tolerance"]

#: Cosine floor of every non-negligible gradient under a lossy policy.
MIN_COSINE = 0.99
#: Under a lossy policy, the noise level relative to the typical gradient norm: a gradient at most this large
#: is negligible, and a negligible gradient may differ by at most this much (a quarter of an 8-bit step, 1/255).
NOISE = 1e-3
#: A half or third of a weight along its output dim (a fused projection's part) holding at most this share of its
#: squared gradient norm is judged on its own too: the whole's cosine hardly sees it (:func:`_floor`).
PART_SHARE = 0.1
#: Under a lossy policy, how far ``||g|| / ||g_plain||`` may be from 1: the relative error noise at the cosine floor
#: has (``sqrt(2 * (1 - MIN_COSINE))``, 0.141), so that a scale error is held to the bound noise is.
MAX_NORM_RATIO = math.sqrt(2 * (1 - MIN_COSINE))


def rounding_tolerance(dtype: torch.dtype) -> float:
    """The relative difference two float computations of the same value may show from rounding alone.

    In fp32/fp64: ``1024 * eps`` (1.2e-4 in fp32). A training step's gradients are sums over up to
    ``batch * tokens * features`` ~ 1e5-1e7 terms, which slimact and PyTorch add in different orders
    (chunked LM loss, a different attention kernel, rebuilt norm inputs); rounding errors of such sums grow like
    ``sqrt(n) * eps``, about ``1e3 * eps``, which the bound allows. A real error (a mishandled argument, a wrong
    mask) shows as a relative difference of 1e-2 or more. In 16-bit dtypes, whose ``eps`` is 1e-3 to 1e-2,
    ``1024 * eps`` would allow anything: there the bound is ``4 * eps`` (the gradient is accumulated in fp32
    and rounded once to the parameter's dtype, and a couple of roundings apart).
    """
    eps = torch.finfo(dtype).eps
    return 1024 * eps if torch.finfo(dtype).bits >= 32 else 4 * eps


def is_lossless(policy: Policy) -> bool:
    """Whether ``policy`` quantises nothing (every enabled kind keeps its tensors exact, as ``"tempo"``)."""
    return not policy.quantizes


@dataclass(frozen=True)
class ParamCheck:
    """One parameter's gradient, converted against plain."""

    name: str
    cosine: float
    sqnr_db: float
    #: ``||g_plain||`` and ``||g_converted - g_plain||``.
    norm: float
    diff: float
    #: Judged by size, not direction (see the module docstring).
    negligible: bool
    passed: bool
    #: Why it missed its floor ("" when it passed).
    reason: str = ""
    #: What it was finally judged against: ``"plain"`` (plain PyTorch's gradient), or ``"float64"`` (a float64 copy
    #: of the plain model, made where it missed its floor against plain: see the module docstring).
    reference: str = "plain"
    #: With ``reference == "float64"``: ``||g_plain - g_float64||`` and ``||g_converted - g_float64||``.
    plain_off: float = math.nan
    off: float = math.nan
    #: Under running estimates, the converted step it was judged by (the worse of the two): ``"first step"``
    #: (estimates fresh) or ``"after warm-up"``; ``""`` where there was one step.
    step: str = ""
    #: False where it missed its floor against plain and no reference could judge it: plain's own gradient is
    #: farther from float64 than the 16-bit rounding the float64 run was guarded at (see :func:`_rejudge`).
    judged: bool = True

    @property
    def module(self) -> str:
        """The qualified name of the module holding the parameter."""
        return self.name.rpartition(".")[0]


@dataclass
class CheckReport:
    """What :func:`check` found. ``str(report)`` is a readable report; ``passed`` is the verdict."""

    policy: str
    lossless: bool
    #: Largest absolute difference between plain's and the converted model's loss and floating outputs, and
    #: whether each output was within float rounding.
    forward_max_abs_diff: float
    forward_equal: bool
    loss_plain: float
    loss_converted: float
    params: list[ParamCheck] = field(default_factory=list)
    #: ``slimact.summary`` of the converted copy: what was converted, what was left alone and why.
    summary: Summary | None = None
    #: Parameters with a gradient in one run and none in the other.
    missing: list[str] = field(default_factory=list)
    #: What the gradients were judged against (plain PyTorch; a float64 copy for those that missed the floor
    #: against plain, or why there was none).
    reference: str = "plain PyTorch"
    #: Under a policy with running estimates: how the converted copy's estimates were made before the judged step
    #: (``None`` under other policies).
    estimates: str | None = None
    #: Calls of the model in the judged step (``micro_batch``: one per micro-batch).
    calls: int = 1

    @property
    def passed(self) -> bool:
        return self.forward_equal and not self.missing and all(p.passed for p in self.params)

    @property
    def failures(self) -> list[ParamCheck]:
        """The parameters that missed their floor, worst first."""
        return [p for p in self.worst() if not p.passed]

    @property
    def unjudged(self) -> list[ParamCheck]:
        """The failures no reference could judge (:attr:`ParamCheck.judged`): plain's own gradient is too far from
        float64 there (a 16-bit step's rounding) for either run to be measured against."""
        return [p for p in self.failures if not p.judged]

    def worst(self, n: int | None = None) -> list[ParamCheck]:
        """Parameters, failures first, then by cosine (lowest first; negligible ones by relative difference)."""
        ranked = sorted(self.params, key=lambda p: (p.passed, p.cosine if not p.negligible else 2.0, -p.diff))
        return ranked if n is None else ranked[:n]

    def worst_modules(self, n: int = 5) -> list[tuple[str, float]]:
        """``(module, lowest cosine of its non-negligible gradients)`` for the ``n`` worst modules."""
        lowest: dict[str, float] = {}
        for p in self.params:
            if not p.negligible:
                lowest[p.module] = min(lowest.get(p.module, math.inf), p.cosine)
        return sorted(lowest.items(), key=lambda kv: kv[1])[:n]

    def __str__(self) -> str:
        floor = "equal to plain to float rounding" if self.lossless else f"cosine >= {MIN_COSINE}"
        lines = [
            f"slimact check (policy {self.policy!r}, {'lossless' if self.lossless else 'lossy'}: gradients {floor}): "
            + ("PASSED" if self.passed else "FAILED"),
            f"forward: loss {self.loss_plain:.6g} plain, {self.loss_converted:.6g} converted; max abs diff of "
            f"loss and outputs {self.forward_max_abs_diff:.3g} ({'equal' if self.forward_equal else 'DIFFERENT'} "
            "to float rounding)",
            f"gradients: {len(self.params)} parameters, {len(self.failures)} below the floor, "
            f"{sum(p.negligible for p in self.params)} negligible (judged by size)",
            *([f"not judged: {len(self.unjudged)} of those below the floor, where plain's own gradient is farther from "
               "float64 than 16-bit rounding, so that no run is a reference (their lines say how far each is from "
               "float64); a check of the step in float32 judges the conversion"] if self.unjudged else []),
            f"reference: {self.reference}",
        ]
        if self.calls > 1:
            lines.append(f"step: gradients accumulated over {self.calls} calls (micro-batches)")
        if self.estimates is not None:
            lines.append(f"running estimates: {self.estimates}")
        if self.missing:
            lines.append(f"gradient in one run only: {', '.join(self.missing)}")
        shown = self.worst(10)
        if shown:
            width = max(len("parameter"), *(len(p.name) for p in shown)) + 2
            lines.append(f"{'parameter':<{width}}{'cosine':>10}{'SQNR dB':>10}{'|g|':>11}{'|diff|':>11}  verdict")
            for p in shown:
                verdict = "ok" if p.passed else f"FAIL: {p.reason}"
                if p.step:
                    verdict += f" ({p.step})"
                if p.reference == "float64" and p.passed:
                    verdict += (f" against float64 (|g - g_float64| {p.off:.3g}, plain's |g_plain - g_float64| "
                                f"{p.plain_off:.3g})")
                if p.negligible:
                    verdict += " (negligible: judged by size)"
                lines.append(f"{p.name:<{width}}{p.cosine:>10.5f}{p.sqnr_db:>10.1f}{p.norm:>11.3g}{p.diff:>11.3g}"
                             f"  {verdict}")
        modules = self.worst_modules()
        if modules:
            lines.append("worst modules: " + ", ".join(f"{m or '(model)'} {c:.5f}" for m, c in modules))
        if self.summary is not None and self.summary.skipped:
            reasons: dict[str, list[str]] = {}
            for name, reason in self.summary.skipped.items():
                reasons.setdefault(reason, []).append(name)
            lines.append(f"left alone by convert: {len(self.summary.skipped)} module(s)")
            for reason, names in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
                more = f", ... ({len(names) - 3} more)" if len(names) > 3 else ""
                lines.append(f"  {len(names):>4} x {reason}: {', '.join(names[:3])}{more}")
        return "\n".join(lines)


def _floats(output: Any) -> Iterator[Tensor]:
    """The floating tensors of a model output (a tensor, a tuple/list, a dict or a ``ModelOutput``), in order."""
    if isinstance(output, Tensor):
        if output.is_floating_point():
            yield output
    elif isinstance(output, dict):
        for value in output.values():
            yield from _floats(value)
    elif isinstance(output, (tuple, list)):
        for value in output:
            yield from _floats(value)


def _map_tensors(inputs: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``inputs`` (a tensor, or dicts, tuples and lists of them) with ``fn`` applied to every tensor."""
    if isinstance(inputs, Tensor):
        return fn(inputs)
    if isinstance(inputs, dict):
        return {k: _map_tensors(v, fn) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_map_tensors(v, fn) for v in inputs)
    return inputs


def _fresh_inputs(inputs: Any) -> Any:
    """``inputs`` with every tensor replaced by a detached copy (requiring a gradient where it did), so that no step
    accumulates a gradient into the caller's tensors, and a model that writes into its inputs in place (a label
    remapped, ``x.mul_()``) neither changes the caller's batch nor hands the next step other inputs."""
    return _map_tensors(inputs, lambda t: t.detach().clone().requires_grad_(t.requires_grad))


def _numpy_random() -> Any:
    """NumPy's global random module, where NumPy is installed (model code may draw from it)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random


class _Rng(NamedTuple):
    """The state of every global generator model code draws from: PyTorch's CPU and CUDA ones, Python's
    ``random``, NumPy's global one (``None`` without NumPy)."""

    cpu: Tensor
    cuda: list[Tensor]
    python: Any
    numpy: Any


def _get_rng(cuda: list[int]) -> _Rng:
    np_random = _numpy_random()
    return _Rng(torch.random.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda], random.getstate(),
                None if np_random is None else np_random.get_state())


def _set_rng(rng: _Rng) -> None:
    torch.random.set_rng_state(rng.cpu)
    if rng.cuda:
        torch.cuda.set_rng_state_all(rng.cuda)
    random.setstate(rng.python)
    np_random = _numpy_random()
    if rng.numpy is not None and np_random is not None:
        np_random.set_state(rng.numpy)


@contextlib.contextmanager
def _forked_rng(cuda: list[int]) -> Iterator[None]:
    """Every global generator (:class:`_Rng`) restored on exit, as ``torch.random.fork_rng`` restores PyTorch's."""
    python, np_random = random.getstate(), _numpy_random()
    numpy_state = None if np_random is None else np_random.get_state()
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        random.setstate(python)
        if np_random is not None:
            np_random.set_state(numpy_state)


class _Reference(NamedTuple):
    """A plain step a converted one is judged against: the plain model after it, its loss, outputs and gradients, and
    its buffers as they were before it (the float64 copy's: :func:`_float64_grads`)."""

    model: nn.Module
    loss: Tensor
    outs: list[Tensor]
    grads: dict[str, Tensor | None]
    buffers: dict[str, Tensor]


def _buffer_values(model: nn.Module) -> dict[str, Tensor]:
    """``model``'s floating buffers' values (clones), by name."""
    return {name: b.detach().clone() for name, b in model.named_buffers() if b.is_floating_point()}


def _rows(inputs: Any) -> int | None:
    """The batch size of ``inputs``: the first dim of its first tensor with one (``None`` where it has none)."""
    found: list[int] = []
    _map_tensors(inputs, lambda t: found.append(t.shape[0]) or t if t.dim() else t)
    return found[0] if found else None


def _take(inputs: Any, rows: int, index: Tensor | slice) -> Any:
    """``inputs`` with every tensor whose first dim is the batch (``rows``) indexed by ``index`` along it."""
    return _map_tensors(inputs, lambda t: t[index] if t.dim() and t.shape[0] == rows else t)


def _calls(inputs: Any, micro_batch: int | None) -> list[tuple[Any, float]]:
    """The calls of one training step on ``inputs`` and the weight of each call's loss: one call, or, with
    ``micro_batch``, consecutive slices of that many rows, each loss weighted by its share of the rows (a gradient
    accumulation loop over micro-batches of the mean loss)."""
    rows = _rows(inputs)
    if not micro_batch or rows is None or rows <= micro_batch:
        return [(inputs, 1.0)]
    return [(_take(inputs, rows, slice(i, min(i + micro_batch, rows))), (min(i + micro_batch, rows) - i) / rows)
            for i in range(0, rows, micro_batch)]


def _step(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], Tensor] | None,
          rng: _Rng, micro_batch: int | None = None,
          ) -> tuple[Tensor, list[Tensor], dict[str, Tensor | None]]:
    """One training step from the RNG state ``rng`` (CPU, CUDA): the loss, the floating outputs, the gradients.
    With ``micro_batch``: the model called on consecutive slices of that many rows, their weighted losses
    accumulated (:func:`_calls`); the loss is their sum, the outputs those of every call in turn."""
    _set_rng(rng)
    _train(model)
    total, outs = None, []
    for call, weight in _calls(inputs, micro_batch):
        output = _call(model, call)
        loss = (loss_fn or _default_loss)(output)
        outs += [t.detach() for t in _floats(output) if t is not loss]  # the loss itself is judged on its own scale
        if not loss.requires_grad:
            raise ValueError("the loss does not require a gradient: nothing to check (frozen model?)")
        loss = loss * weight if weight != 1.0 else loss
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    # (a sparse gradient, nn.Embedding(sparse=True)'s, judged as the dense one it adds up to)
    return total, outs, {n: p.grad.to_dense() if p.grad is not None and p.grad.is_sparse else p.grad
                         for n, p in model.named_parameters() if p.requires_grad}


def _mixed(inputs: Any, rows: int, gen: torch.Generator) -> Any:
    """Another batch made from the ``rows`` rows of ``inputs``: all the rows but one drawn at random, and each
    element of a batch tensor taken from one of them drawn at random, at its own place (the same draws for tensors
    of the same shape, so that labels follow their ids). A new combination of the batch's values that lacks one
    row's own values (and extremes), as another batch of the data would lack them. Drawn from all the rows, every
    such batch holds nearly the judged batch's extremes and the estimates fit it better than training's do (tiny
    Llama, batches of 2 rows: cosine 0.996 where other batches give 0.98-0.99); drawn from half of them, a per-row
    input such as a diffusion timestep takes too few values (a UNet at 4 rows: 0.97 where other batches give
    0.991-0.997).

    A per-row integer tensor (``[rows]``) whose largest value is the size of another input's dim, as sequence
    lengths are, is kept as given: mixed, the lengths of torchaudio's Conformer ``[20, 15]`` became ``[15, 15]``,
    and the model's padding mask, sized by the longest, no longer matched its 20 frames (an error in the model's code
    where its training runs); so is one of sorted, repeated values (:func:`_segment_ids`). Other per-row integers
    (diffusion timesteps, one id per row) are mixed."""
    draws: dict[tuple[int, ...], Tensor] = {}
    kept = torch.randperm(rows, generator=gen)[:max(1, rows - 1)]
    sizes: set[int] = set()
    _map_tensors(inputs, lambda t: sizes.update(t.shape[1:]) or t)

    def mix(t: Tensor) -> Tensor:
        if not t.dim() or t.shape[0] != rows or t.layout is not torch.strided:  # (a sparse input: as given)
            return t
        if t.dim() == 1 and not (t.is_floating_point() or t.is_complex()) and t.numel() and (
                int(t.max()) in sizes or _segment_ids(t)):
            return t
        if t.shape not in draws:
            draws[t.shape] = kept[torch.randint(0, len(kept), t.shape, generator=gen)].to(t.device)
        return torch.gather(t.detach(), 0, draws[t.shape])

    return _map_tensors(inputs, mix)


def _segment_ids(t: Tensor) -> bool:
    """Whether the integer ``t`` (``[rows]``) is sorted with values repeated: the group of each row, as PyTorch
    Geometric's ``batch`` vector gives each node's graph. Mixed, the nodes of a warm-up batch belonged to random
    graphs, and aggregations that need them sorted (``SetTransformerAggregation``) raised where training runs."""
    return t.numel() > 1 and bool((t[1:] >= t[:-1]).all()) and bool((t[1:] == t[:-1]).any())


def _warm(slim: nn.Module, inputs: Any, micro_batch: int | None, batches: Any, warmup: int,
          rng: _Rng, own: bool = False) -> str:
    """Run the converted copy's forward (training mode, no backward) on the calls of other batches, so that its
    running estimates are those training has by then: the given ``batches``, else ``warmup`` batches mixed from
    the rows of ``inputs`` (:func:`_mixed`); from the RNG state ``rng``, so that a plain copy warmed the same way
    draws the same numbers. Returns what was done, for the report; ``own``: the copy holds the estimates the user's
    model had (judged as it is), which the first step then uses."""
    rows = _rows(inputs)
    size = rows if not micro_batch or rows is None else min(micro_batch, rows)
    if batches is not None:
        source, what = list(batches), "the batches given"
    elif rows is None or rows < 2 or warmup <= 0:
        first = ("the model's own, as its training left them" if own else
                 "fresh: the first step's, each call site's estimate set by the tensor it first packs")
        return (f"{first} (the inputs have one row: no other batch could be made from them; pass batches= to see "
                "the estimates training has after a few steps)") if warmup > 0 else f"{first} (warmup=0)"
    else:
        gen = torch.Generator().manual_seed(0)
        source = [_mixed(inputs, rows, gen) for _ in range(warmup)]
        what = (f"{warmup} batches mixed element-wise from {rows - 1} of the {rows} rows of the inputs (made from the "
                "judged rows' values: batches= from your data shows training's estimates better"
                + ("; with one row to mix from, every row of those batches is the same, and a per-sample tensor "
                   "(pooled features, a 1 x 1 map) shows the estimates no spread" if rows == 2 else "") + ")")
    calls = 0
    _train(slim)
    _set_rng(rng)
    # The buffers a training forward updates (BatchNorm's statistics, a call counter, an EMA codebook that the next
    # forward reads) move with the warm-up's forwards, in this copy and in the plain one warmed alike (restored after
    # it, a VQ-VAE's codebook was judged at its initial values with the estimates folded from the moved ones: check
    # passed at 0.9996 where training's steps 2-6 ran at cosine 0.88-0.97, a review 2026-12-07). With no optimizer
    # step between the forwards, such a buffer that the forward reads holds the warm-up's values, not training's
    # either way: the report names the buffers that moved.
    before = {name: b for name, b in _buffer_values(slim).items() if not _statistic(name, slim)}
    with torch.enable_grad():
        for batch in source:
            for call, _ in _calls(batch, micro_batch):
                # (the packs fold each call's range into the estimates; the graph is dropped)
                try:
                    _call(slim, _fresh_inputs(call))
                except Exception as e:
                    if batches is not None:
                        raise
                    # (a model taking only its training inputs, gpytorch's ExactGP: its own error said nothing of
                    # the batch being check's; a sweep, 2026-12-07)
                    raise RuntimeError(
                        "slimact.check warms the running estimates on batches mixed from the rows of the inputs, and "
                        f"the model raised on one ({type(e).__name__}: {e}): pass batches= (a few batches of your "
                        "data, or [inputs] * 4 for a model that takes no other) or warmup=0") from e
                calls += 1
    buffers = dict(slim.named_buffers())
    moved = [name for name, b in before.items() if name in buffers and not torch.equal(buffers[name], b)]
    per = f" of {size} row(s) each" if micro_batch else ""
    return (f"warmed by {calls} training-mode forward call(s){per} on {what}"
            + (", from the model's own (its first step judged with those)" if own else "") + ", then judged"
            + (f"; the warm-up's forwards moved {len(moved)} buffer(s) the model's forward updates "
               f"({', '.join(moved[:4])}{', ...' if len(moved) > 4 else ''}): with no optimizer step between them, "
               "where the forward reads such a buffer (an EMA codebook) the judged step is not one training reaches: "
               "batches= from a run, or \"int8\", judge it better" if moved else ""))


def _statistic(name: str, model: nn.Module) -> bool:
    """Whether the buffer ``name`` is a BatchNorm's running statistic, which a training-mode forward updates but does
    not read."""
    owner, _, key = name.rpartition(".")
    return key in ("running_mean", "running_var", "num_batches_tracked") and isinstance(
        model.get_submodule(owner), nn.modules.batchnorm._BatchNorm)


def _max_diff(a: Tensor, b: Tensor, floor: float = 0.0) -> tuple[float, bool]:
    """Largest absolute difference of two tensors, and whether it is float rounding of ``a``'s magnitude (at
    least ``floor``) in ``a``'s dtype (float32's at least)."""
    dtype = a.dtype
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return math.inf, False
    finite = torch.isfinite(a)
    # NaN and inf must sit at the same places with the same values (NaN matching NaN).
    if not torch.equal(finite, torch.isfinite(b)) or not torch.equal(a[~finite].nan_to_num(0.0),
                                                                      b[~finite].nan_to_num(0.0)):
        return math.inf, False
    if not finite.any():
        return 0.0, True
    diff = (a[finite] - b[finite]).abs().max().item()
    scale = a[finite].abs().max().item()
    # (A 16-bit output is rounded at its own precision: bfloat16 logits of two orders of summation differ by its
    # rounding, not float32's.)
    tol = max(rounding_tolerance(torch.float32), rounding_tolerance(dtype) if dtype.is_floating_point else 0.0)
    return diff, diff <= tol * max(scale, floor, 1e-30)


_DROPOUTS = {torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
             torch.nn.functional.dropout3d, torch.nn.functional.alpha_dropout,
             torch.nn.functional.feature_alpha_dropout, torch.dropout, torch.alpha_dropout}
_FACTORIES = {torch.rand, torch.randn, torch.rand_like, torch.randn_like, torch.bernoulli, torch.normal,
              torch.randint_like}
_IN_PLACE = {Tensor.bernoulli_, Tensor.uniform_, Tensor.normal_, Tensor.exponential_, Tensor.log_normal_,
             Tensor.cauchy_, Tensor.geometric_}


_NARROW = (torch.float16, torch.bfloat16, torch.float32)
_CASTS = {Tensor.half: torch.float16, Tensor.bfloat16: torch.bfloat16, Tensor.float: torch.float32}


def _wide_dtype(value: Any) -> Any:
    """``value`` with a narrower floating dtype replaced by float64 (and complex64 by complex128)."""
    if isinstance(value, torch.dtype) and value == torch.complex64:
        return torch.complex128
    return torch.float64 if isinstance(value, torch.dtype) and value in _NARROW else value


def _narrower(a: torch.dtype | None, b: torch.dtype | None) -> torch.dtype | None:
    """The one of two floating dtypes (or ``None``) with the larger ``eps``."""
    if a is None or b is None:
        return a if b is None else b
    return max(a, b, key=lambda d: torch.finfo(d).eps)


_GROUPED_MM = getattr(torch, "_grouped_mm", None)


def _grouped_mm_wide(mat_a: Tensor, mat_b: Tensor, offs: Tensor | None = None, bias: Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> Tensor:
    """``torch._grouped_mm`` for the float64 run, which it has no kernel for (torchtitan's and Hugging Face's MoE
    experts call it): one matmul per group. With ``offs`` (group ends): 2-D x 3-D, rows of ``mat_a`` per group (rows
    past the last end are zero); 3-D x 2-D, columns of ``mat_b`` per group; 2-D x 2-D, the inner dimension per group
    (one output per group). Without: 3-D x 3-D, a batched matmul."""
    if bias is not None:
        raise NotImplementedError("slimact.check: a float64 grouped_mm with a bias")
    if offs is None:
        if mat_a.dim() != 3 or mat_b.dim() != 3:
            raise NotImplementedError("slimact.check: a float64 grouped_mm without offsets of other than 3-D inputs")
        return torch.bmm(mat_a, mat_b)
    ends = [int(e) for e in offs.tolist()]
    starts = [0, *ends[:-1]]
    if mat_a.dim() == 2 and mat_b.dim() == 3:
        parts = [mat_a[s:e] @ mat_b[g] for g, (s, e) in enumerate(zip(starts, ends, strict=True))]
        tail = mat_a.shape[0] - (ends[-1] if ends else 0)
        return torch.cat([*parts, mat_a.new_zeros(tail, mat_b.shape[-1])])
    if mat_a.dim() == 3 and mat_b.dim() == 2:
        parts = [mat_a[g] @ mat_b[:, s:e] for g, (s, e) in enumerate(zip(starts, ends, strict=True))]
        tail = mat_b.shape[-1] - (ends[-1] if ends else 0)
        return torch.cat([*parts, mat_a.new_zeros(mat_a.shape[1], tail)], dim=-1)
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return torch.stack([mat_a[:, s:e] @ mat_b[s:e] for s, e in zip(starts, ends, strict=True)])
    raise NotImplementedError(f"slimact.check: a float64 grouped_mm of {mat_a.dim()}-D and {mat_b.dim()}-D inputs")


class _Float32Draws(TorchFunctionMode):
    """Inside a float64 run: every random draw made in float32, then widened, so that it consumes the RNG (and
    gives the values) the float32 run's draw did. A float64 draw takes other bits of the generator's stream.

    Also every cast to a narrower floating dtype written in the model's code is made a cast to float64
    (``x.to(torch.bfloat16)``, ``x.float()``, ``.half()``, ``.type(...)``, a ``dtype=torch.float32`` argument as in
    ``softmax(..., dtype=torch.float32)``): a model that keeps a module in float32 inside a bfloat16 model (Hugging
    Face's ``_keep_in_fp32_modules``) or casts around a bfloat16 one, with the dtype spelled out, then runs wholly in
    float64 instead of failing on mixed dtypes or rounding to bfloat16 where the reference should not (an integer
    tensor made floating, ``positions.float()``, is made float64 too)."""

    #: The name of a draw it could not reproduce (``alpha_dropout``), if one was made: the run is then no reference.
    unreproducible: str | None = None
    #: The narrowest floating dtype below float32 that a cast in the model's code asked for (a float32 model computing
    #: its experts in bfloat16, ``x.bfloat16() @ w.bfloat16()``, as torchtitan's MoE does), ``None`` if none: the plain
    #: run had tensors that narrow, which its parameters, inputs and outputs do not show.
    narrowest: torch.dtype | None = None

    def _cast_to(self, dtype: Any) -> None:
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point and torch.finfo(dtype).bits < 32:
            self.narrowest = _narrower(self.narrowest, dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _CASTS and args and isinstance(args[0], Tensor):
            self._cast_to(_CASTS[func])
            return args[0].double()
        if func in (Tensor.to, Tensor.type) and args and isinstance(args[0], Tensor):
            for a in (*args[1:], kwargs.get("dtype")):
                self._cast_to(a)
            args = (args[0], *(_wide_dtype(a) for a in args[1:]))
            if "dtype" in kwargs:
                kwargs["dtype"] = _wide_dtype(kwargs["dtype"])
        elif func is not Tensor.view and kwargs.get("dtype") in _NARROW:
            self._cast_to(kwargs["dtype"])
            kwargs["dtype"] = torch.float64
        elif func is not Tensor.view and kwargs.get("dtype") == torch.complex64:  # (FEDformer's torch.cfloat buffers)
            kwargs["dtype"] = torch.complex128
        if func is _GROUPED_MM and args and isinstance(args[0], Tensor) and args[0].dtype == torch.float64:
            return _grouped_mm_wide(*args, **kwargs)
        if func in _DROPOUTS and args and isinstance(args[0], Tensor) and args[0].dtype == torch.float64:
            x = args[0]
            inplace = kwargs.pop("inplace", args[3] if len(args) > 3 else False)
            # The float32 draw of the same shape and layout, through the same function: its mask scaled by 1/(1-p)
            # (PyTorch fills a mask in the tensor's memory order: a contiguous one dropped other elements of a
            # channels-last or transposed tensor than plain's did, and the float64 run was no reference).
            scaled = func(torch.ones_like(x, dtype=torch.float32), *args[1:3], **kwargs)
            if func in (torch.nn.functional.alpha_dropout, torch.nn.functional.feature_alpha_dropout,
                        torch.alpha_dropout):
                # Not reproducible this way (its affine correction is not a mask): left as is, and where it drew
                # (it changed its input) the run is no reference: the guard on the outputs alone let it pass where
                # the dropped path is a small part of them (bfloat16's 8 eps), and its gradients there are another
                # draw's, far from plain's, so that any converted gradient as far counted as "as close as plain's".
                out = func(x, *args[1:], **kwargs)
                if not torch.equal(out, x):
                    self.unreproducible = getattr(func, "__name__", str(func))
                return out
            return x.mul_(scaled.double()) if inplace else x * scaled.double()
        if func in _FACTORIES and kwargs.get("dtype", getattr(args[0], "dtype", None) if args else None) \
                == torch.float64:
            if "dtype" in kwargs:
                kwargs["dtype"] = torch.float32
                return func(*args, **kwargs).double()
            return func(args[0].float(), *args[1:], **kwargs).double()
        if func in _IN_PLACE and args and isinstance(args[0], Tensor) and args[0].dtype == torch.float64:
            tmp = args[0].float()
            func(tmp, *args[1:], **kwargs)
            return args[0].copy_(tmp)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _float64_run() -> Iterator[_Float32Draws]:
    """:class:`_Float32Draws` on for a float64 run, in the recompute of an activation checkpoint too.

    A non-reentrant checkpoint recomputes its module in the backward, where no torch function mode is on: the
    recompute drew and cast as written where the forward had not (a dropout's mask made in float32, a cast
    widened), and PyTorch's check of the tensors it saved failed ("A different number of tensors was saved": every
    diffusers model after ``enable_gradient_checkpointing()``, whose attention has an ``nn.Dropout(p=0.0)``), so
    the check had no float64 reference. A module called with the mode off while grad is on (that recompute) enters
    it for its own call, as slimact's routing does (``slimact.nn.routing``)."""
    mode = _Float32Draws()
    entered: list[nn.Module] = []

    def enter(module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and not any(m is mode for m in _get_current_function_mode_stack()):
            mode.__enter__()
            entered.append(module)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if entered and entered[-1] is module:
            entered.pop()
            mode.__exit__(None, None, None)

    handles = [nn.modules.module.register_module_forward_pre_hook(enter),
               nn.modules.module.register_module_forward_hook(leave, always_call=True)]
    try:
        with mode:
            yield mode
    finally:
        for handle in handles:
            handle.remove()


def _widened(inputs: Any) -> Any:
    """``inputs`` with every floating tensor in float64 (complex64 in complex128)."""
    return _map_tensors(inputs, lambda t: t.detach().to(_wide_dtype(t.dtype)).requires_grad_(t.requires_grad)
                        if t.is_floating_point() or t.dtype == torch.complex64 else t)


def _low_precision(model: nn.Module, inputs: Any, outputs: list[Tensor]) -> torch.dtype | None:
    """The narrowest floating dtype below float32 among ``model``'s parameters and buffers, the inputs and the
    outputs (``None`` where all are float32 or wider)."""
    found: list[torch.dtype] = []
    _map_tensors(inputs, lambda t: found.append(t.dtype) or t)
    found += [t.dtype for t in (*model.parameters(), *model.buffers(), *outputs)]
    low = [d for d in found if d.is_floating_point and torch.finfo(d).bits < 32]
    return max(low, key=lambda d: torch.finfo(d).eps) if low else None


def _guard_tolerance(low: torch.dtype | None) -> float:
    """How far (relative to its largest magnitude) plain's loss or an output may be from the float64 run's for the
    latter to count as the same function: 1e-3 in float32; in a model with 16-bit tensors, 8 of their ``eps``
    (bfloat16: 0.0625), the rounding of values that passed through them. A draw the float64 run could not reproduce
    changes elements by their own size."""
    return 1e-3 if low is None else max(1e-3, 8 * torch.finfo(low).eps)


def _float64_grads(plain: nn.Module, inputs: Any, loss_fn: Callable[[Any], Tensor] | None,
                   rng: _Rng, loss32: Tensor, outs32: list[Tensor],
                   low: torch.dtype | None = None, micro_batch: int | None = None,
                   buffers: dict[str, Tensor] | None = None,
                   ) -> tuple[dict[str, Tensor | None], torch.dtype | None] | str:
    """The gradients of a float64 copy of the plain model from the same RNG state, and the narrowest dtype below
    float32 of the plain run (``low``, or narrower where the model's code casts to one), or why there are none: it
    cannot run in float64, or does not compute what the plain run did (loss or outputs off by more than
    :func:`_guard_tolerance` relative: a draw it could not reproduce)."""
    try:
        # (complex64 parameters too, which Module.double() leaves: FEDformer's Fourier weights met complex128 inputs
        # and the float64 run failed, so a lossless gradient zero by structure was held to plain's rounding)
        wide = _copied(plain).double()._apply(lambda t: t.to(torch.complex128) if t.dtype == torch.complex64 else t)
        for q in wide.parameters():
            q.grad = None  # the plain step's
        # The buffers as the plain step found them: a forward that updates a buffer it reads (an EMA) had left the
        # copy another model, plain's own gradient "off float64" by that, and a converted one 0.62 from it passed.
        with torch.no_grad():
            for name, b in wide.named_buffers():
                if (before := (buffers or {}).get(name)) is not None and before.shape == b.shape:
                    b.copy_(before)
        # (PyTorch's math attention: its CPU flash kernel's backward is not the gradient of its forward where a row is
        # masked whole by a large finite fill, Hugging Face's finfo.min: 195% off on dq, in float64 too, so the
        # reference sided with plain against slimact's right gradient and check failed "tempo")
        with _float64_run() as mode, sdpa_kernel(SDPBackend.MATH):
            loss, outs, grads = _step(wide, _fresh_inputs(_widened(inputs)), loss_fn, rng, micro_batch)
    except Exception as e:  # an op without a float64 kernel (torchao's int8 layers assert their input dtype)
        first = str(e).splitlines()[0][:120] if str(e) else ""
        return f"the model did not run in float64 ({type(e).__name__}: {first})"
    if mode.unreproducible:
        return f"the float64 run cannot draw what the plain run drew ({mode.unreproducible})"
    low = _narrower(low, mode.narrowest)
    tol = _guard_tolerance(low)
    pairs = [(loss32, loss), *zip(outs32, outs, strict=False)]
    if not all(torch.isfinite(a).all() for a, _ in pairs):  # (a tolerance relative to NaN is none)
        return "plain's loss or outputs are not finite"
    if len(outs) != len(outs32) or any(
        a.shape != b.shape or not torch.allclose(b.double(), a.double(), rtol=tol,
                                                 atol=tol * max(a.detach().abs().max().item(), 1e-30))
        for a, b in pairs if a.numel()
    ):
        return f"the float64 run's loss or outputs differ from plain's by more than {tol:.3g} relative"
    return grads, low


def _plain_reference(low: torch.dtype | None) -> str:
    """The report's ``reference:`` line for plain's own gradients, naming the 16-bit dtype the plain run had."""
    return "plain PyTorch" + (f" (which has {str(low).removeprefix('torch.')} tensors)" if low else "")


def _autocast_dtype() -> torch.dtype | None:
    """The narrowest dtype autocast computes in where it is on now (on the CPU or a GPU); else ``None``."""
    found = None
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            found = _narrower(found, torch.get_autocast_dtype(device))
    return found


@contextlib.contextmanager
def _autocast_seen() -> Iterator[list[torch.dtype]]:
    """The autocast dtypes in force at the module calls made in the block: the step's compute dtype, whether autocast
    was on around ``check`` or is entered in the model's own forward (accelerate's mixed precision wraps ``forward``
    in it; a hook on the top module runs before that)."""
    seen: list[torch.dtype] = []

    def note(module: nn.Module, args: Any) -> None:
        dtype = _autocast_dtype()
        if dtype is not None and dtype not in seen:
            seen.append(dtype)

    handle = nn.modules.module.register_module_forward_pre_hook(note)
    try:
        yield seen
    finally:
        handle.remove()


def _tolerance(dtype: torch.dtype, compute: torch.dtype | None) -> float:
    """:func:`rounding_tolerance` of a gradient of ``dtype`` computed under autocast to ``compute`` (or not)."""
    return rounding_tolerance(_narrower(dtype, compute) if compute is not None else dtype)


def _floor(exact: Tensor, approx: Tensor, lossless: bool, tol: float) -> str:
    """Why ``approx`` misses the policy's floor against ``exact`` (``""`` where it meets it): float rounding
    (``tol``, relative) under a lossless policy; the cosine and the norm ratio under a lossy one."""
    norm = exact.detach().double().norm().item()
    diff = (approx.detach().double() - exact.detach().double()).norm().item()
    if lossless:
        relative = diff / norm if norm else math.inf
        return "" if diff <= tol * norm else f"relative diff {relative:.3g} > {tol:.3g} (float rounding)"
    if not (cos := cosine(exact, approx)) >= MIN_COSINE:  # (NaN too)
        return f"cosine {cos:.4f} < {MIN_COSINE}"
    size = approx.detach().double().norm().item()
    if not norm:
        return "" if not size else f"|g| {size:.3g} where plain's is 0"
    ratio = size / norm
    return "" if abs(ratio - 1) <= MAX_NORM_RATIO else \
        f"|g| {ratio:.4g}x plain's (more than {MAX_NORM_RATIO:.3g} off: a scale)"


def _part_floor(exact: Tensor, approx: Tensor, lossless: bool, tol: float, dim: int | None,
                plain: Tensor | None = None, bound: float = 0.0) -> str:
    """Why a part of ``approx`` misses the floor against ``exact``'s (``""`` where none does): the halves and thirds
    along a weight's output dim ``dim`` (:func:`_output_dims`: a fused projection's parts; the query part of GPT-2's
    ``c_attn`` holds 0.03% of its gradient at initialisation, which no error there moves the whole's cosine from),
    those holding at most :data:`PART_SHARE` of ``exact``'s squared norm (the whole's floor lets a part of share
    ``s`` sit at cosine ``1 - 0.01 / s``: a larger one is judged with the whole). With ``plain`` (``exact`` being the
    float64 gradient), only the parts where plain's own meets the floor: one where it does not is a cancellation's
    remainder (a FiLM layer's shift half before a BatchNorm), noise in both runs. A part whose gradient is at most
    ``bound`` (the negligible size, :func:`_judge`) is judged by size, as a whole gradient is (TabNet's GLU half
    holding 7.7e-12 of its weight's gradient, 1e-18 in float64, failed at cosine 0.27 of plain's noise)."""
    norm2 = exact.detach().double().norm().item() ** 2
    if dim is None or not norm2:
        return ""
    size, tensors = exact.shape[dim], (exact, approx) if plain is None else (exact, approx, plain)
    for k, part in ((2, "half"), (3, "third")):
        if size % k or size <= k:
            continue
        for i, (e, a, *own) in enumerate(zip(*(t.chunk(k, dim) for t in tensors), strict=True)):
            share = e.detach().double().norm().item() ** 2 / norm2
            if share > PART_SHARE or (own and _floor(e, own[0], lossless, tol)):
                continue
            if (small := share * norm2 <= bound ** 2) and (d := (a.double() - e.double()).norm().item()) > bound:
                return (f"|diff| {d:.3g} > {bound:.3g} in its {('first', 'second', 'third')[i]} {part} along dim {dim}"
                        f" ({share:.2g} of it, judged by size)")
            if not small and (why := _floor(e, a, lossless, tol)):
                return f"{why} in its {('first', 'second', 'third')[i]} {part} along dim {dim} ({share:.2g} of it)"
    return ""


def _misses(exact: Tensor, approx: Tensor, lossless: bool, tol: float, dim: int | None, bound: float = 0.0) -> str:
    """Why ``approx`` misses the floor against ``exact``, as a whole or in a part (:func:`_floor`,
    :func:`_part_floor`); ``""`` where it meets it."""
    return _floor(exact, approx, lossless, tol) or _part_floor(exact, approx, lossless, tol, dim, bound=bound)


def _output_dims(model: nn.Module) -> dict[str, int]:
    """The dim of a weight's output units, by parameter name, where fused projections concatenate their parts
    along it (q, k and v; gate and up): an ``nn.Linear``'s and ``nn.MultiheadAttention``'s ``in_proj_weight``'s 0,
    transformers' ``Conv1D``'s 1 (its weight is ``[in, out]``)."""
    dims = {}
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if p.ndim != 2:
                continue
            if (isinstance(module, nn.Linear) and name == "weight") or name == "in_proj_weight":
                dims[f"{prefix}.{name}" if prefix else name] = 0
            elif type(module).__name__ == "Conv1D" and name == "weight":
                dims[f"{prefix}.{name}" if prefix else name] = 1
    return dims


def _judge(name: str, exact: Tensor, approx: Tensor, typical: float, lossless: bool,
           compute: torch.dtype | None = None, dim: int | None = None) -> ParamCheck:
    norm = exact.detach().double().norm().item()
    diff = (approx.detach().double() - exact.detach().double()).norm().item()
    cos, db = cosine(exact, approx), sqnr_db(exact, approx)
    if not math.isfinite(diff):
        return ParamCheck(name, cos, db, norm, diff, False, False, "non-finite difference" + (
            "" if torch.isfinite(exact).all() else " (plain's gradient is not finite: the plain step is not)"))
    tol = _tolerance(exact.dtype, compute)
    bound = (tol if lossless else NOISE) * typical
    negligible = norm <= bound
    if negligible:
        ok = diff <= bound
        reason = "" if ok else f"|diff| {diff:.3g} > {bound:.3g} (of the typical gradient {typical:.3g})"
    else:
        reason = _misses(exact, approx, lossless, tol, dim, bound)
        ok = not reason
    return ParamCheck(name, cos if not math.isnan(cos) else 0.0, db, norm, diff, negligible, ok, reason)


def _rejudge(p: ParamCheck, exact: Tensor, approx: Tensor, wide: Tensor, typical: float,
             lossless: bool, guard: float = math.inf, compute: torch.dtype | None = None,
             dim: int | None = None) -> ParamCheck:
    """``p`` (which missed its floor against plain, or passed by size only) judged again against the float64
    gradient ``wide``, both plain's and the converted one (see the module docstring): it passes when the converted
    gradient meets the floor against float64, or, where plain's own gradient misses it too, when it is no farther
    from float64 than plain's (twice plain's distance, or plain's plus float rounding, or negligible). Under a
    lossless policy plain's distance counts only up to ``guard`` of the gradient (in a model with 16-bit tensors
    :func:`_guard_tolerance`, what the float64 run's outputs were allowed; farther, the float64 run may have computed
    something else there, a branch on the dtype, and the converted gradient is held to the floor against float64
    alone). A gradient small beside the typical one but genuine (plain's within the floor of float64: a block behind
    a layer scale of 1e-6) is so held to the floor, not judged by size."""
    wide = wide.detach().double()
    norm = wide.norm().item()
    own = (exact.detach().double() - wide).norm().item()
    off = (approx.detach().double() - wide).norm().item()
    tol = _tolerance(exact.dtype, compute)
    bound = (tol if lossless else NOISE) * typical
    marked = dataclasses.replace(p, reference="float64", plain_off=own, off=off)
    if part := _part_floor(wide, approx, lossless, tol, dim, plain=exact, bound=bound):  # a genuine part missed
        return dataclasses.replace(marked, passed=False, negligible=False, reason=(
            f"{part} (against float64; |g - g_float64| {off:.3g}, plain's {own:.3g})"))
    if not _floor(wide, approx, lossless, tol):  # the converted gradient is within the floor of the truth
        return dataclasses.replace(marked, passed=True, negligible=False, reason="")
    if not _floor(wide, exact, lossless, tol):  # plain's is: a genuine gradient, whatever its size
        why = _floor(exact, approx, lossless, tol) or p.reason
        return dataclasses.replace(marked, passed=False, negligible=False, reason=(
            f"{why} (and against float64: |g - g_float64| {off:.3g}, plain's {own:.3g})"))
    limit = max(bound, 2 * own, own + tol * norm if lossless else 0.0)
    if lossless and norm > bound and own > guard * norm:
        return dataclasses.replace(marked, judged=False, reason=p.reason + (
            f" (plain is farther from float64 than rounding, |g_plain - g_float64| {own:.3g} > {guard:.3g} of "
            f"|g_float64| {norm:.3g}: no reference for it; |g - g_float64| {off:.3g})"))
    ok = off <= limit
    reason = "" if ok else (f"plain is off float64 too (|g_plain - g_float64| {own:.3g}), but |g - g_float64| "
                            f"{off:.3g} > {limit:.3g}")
    # Under a lossy policy a plain gradient off the float64 direction is float noise: judged by size.
    return dataclasses.replace(marked, negligible=p.negligible or not lossless, passed=ok, reason=reason)


def check(
    model: nn.Module,
    inputs: Any,
    policy: str | os.PathLike[str] | Policy | None = None,
    *,
    loss_fn: Callable[[Any], Tensor] | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    micro_batch: int | None = None,
    batches: Iterable[Any] | None = None,
    warmup: int = 8,
) -> CheckReport:
    """One training step of ``model`` plain and converted with ``policy``, compared (see the module docstring).

    Args:
        model: any module; it is not changed (both runs use deep copies; an already converted model is
            reverted in its copy to give the plain run).
        inputs: as for :func:`slimact.profile`: a dict (``model(**inputs)``), a tuple (``model(*inputs)``) or
            a tensor (``model(inputs)``).
        policy: a preset name, a :class:`slimact.Policy` or a policy file, as for :func:`slimact.convert`: a copy
            of the model, reverted, is converted with it. Default: a converted model (or one holding converted
            modules) is judged as it is, a copy of it against a reverted copy, under the floors of the policy it
            was converted with; any other model is converted with ``"int8"``.
        loss_fn: ``loss_fn(output) -> scalar``; default: ``output.loss`` if present, else the sum of the output.
        filter_fn: passed to :func:`slimact.convert` (a converted model given one without ``policy`` is converted
            again with its own policy and it).
        micro_batch: the rows per call of a gradient accumulation loop: the step (plain and converted alike) calls
            the model on consecutive slices of ``inputs`` of that many rows, each loss weighted by its share of the
            rows, and judges the accumulated gradients. Default: one call on all of ``inputs``.
        batches: under a policy with running estimates (``"mesa"``): other batches as your training loop feeds
            them (a few from your data loader, each split by ``micro_batch``), run through the converted copy's
            forward before the judged step so that its estimates are those training has after a few steps.
            Default: ``warmup`` batches mixed from the rows of ``inputs`` (see the module docstring).
        warmup: how many batches to mix from ``inputs`` when ``batches`` is not given (0: judge the first step,
            with estimates fresh).

    Returns:
        a :class:`CheckReport`; ``report.passed`` is the verdict, ``str(report)`` the table.
    """
    detached: list[str] = []
    policies = _conversion_policies(model) if policy is None else []
    if policies and filter_fn is None:
        # A converted model is judged as it is: a copy of it against a reverted copy (its policy, the modules its
        # filter_fn or a later revert left plain, those added after convert). The default had been "int8" whatever
        # the model: a model converted with "mesa", which small batches fail, was judged under int8's ranges.
        lossless, running = all(map(is_lossless, policies)), any(map(_running, policies))
        policy_name = "/".join(dict.fromkeys(p.name for p in policies))
        slim = _copied(model, detached=detached)
        plain = _plain_copy(slim)
        own = any(m.__dict__.get(ESTIMATES_ATTR) for m in slim.modules())
    else:
        if policy is None and len(policies) > 1:
            raise ValueError(f"slimact.check: this model holds conversions under {len(policies)} policies: with "
                             "filter_fn, pass the policy to convert its copy with")
        pol = policies[0] if policies else resolve(policy if policy is not None else "int8")
        lossless, running, policy_name, own = is_lossless(pol), _running(pol), pol.name, False
        plain = _plain_copy(model, detached=detached)
        slim = convert(_copied(plain), pol, filter_fn=filter_fn)
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    # Converted steps: (label, loss, outputs, gradients, reference). Under running estimates, the first step
    # (estimates fresh) and, after warming them on other batches, a later one, judged against a plain copy warmed
    # on the same batches (a model whose own state a forward changes: a module made at its first call, as BigBird's
    # switch to full attention draws fresh weights, a counter); each parameter is judged by the worse of the two.
    steps = []
    estimates = None
    batches = None if batches is None else list(batches)
    with _forked_rng(cuda):
        rng = _get_rng(cuda)
        warm = (_copied(plain), _copied(slim)) if running else None
        with _autocast_seen() as seen:
            before = _buffer_values(plain)
            try:
                loss0, outs0, grads0 = _step(plain, _fresh_inputs(inputs), loss_fn, rng, micro_batch)
            except ValueError as e:
                if not detached or "does not require a gradient" not in str(e):
                    raise
                raise ValueError(f"{e}: the copies hold {', '.join(detached)} detached (tensors computed from "
                                 "others that the model holds, which the copy cannot make again), and no gradient "
                                 "reaches a parameter otherwise") from e
        # Under autocast the step computes in its dtype: plain's gradients are rounded at that level.
        compute = functools.reduce(_narrower, seen, None)
        first = _Reference(plain, loss0, outs0, grads0, before)
        steps.append(("", *_step(slim, _fresh_inputs(inputs), loss_fn, rng, micro_batch), first))
        if warm is not None:
            estimates = _warm(warm[1], inputs, micro_batch, batches, warmup, rng, own)
            if estimates.startswith("warmed"):
                _warm(warm[0], inputs, micro_batch, batches, warmup, rng)
                before = _buffer_values(warm[0])
                later = _Reference(warm[0], *_step(warm[0], _fresh_inputs(inputs), loss_fn, rng, micro_batch), before)
                steps[0] = ("first step", *steps[0][1:])
                steps.append(("after warm-up", *_step(warm[1], _fresh_inputs(inputs), loss_fn, rng, micro_batch),
                              later))
    # A loss is in nats (or its own units) whatever its value: a loss near 0 (a model that already predicts its
    # labels) is a difference of O(1) log-probabilities, rounded at that scale.
    diffs, same_count = [], True
    for _, loss1, outs1, _, ref in steps:
        diffs += [_max_diff(ref.loss, loss1, floor=1.0)]
        diffs += [_max_diff(a, b) for a, b in zip(ref.outs, outs1, strict=False)]
        same_count = same_count and len(ref.outs) == len(outs1)
    # (Finite norms only: one NaN gradient of plain's, PyTorch's bf16 CPU convolution reading uninitialised memory,
    # made the median NaN, every bound NaN, and a zero gradient's judgement divided by zero.)
    norms = [n for g in grads0.values() if g is not None and math.isfinite(n := g.detach().double().norm().item())]
    typical = float(torch.tensor(norms, dtype=torch.float64).median()) if norms else 0.0
    params, missing, judged, dims = [], [], {}, _output_dims(plain)
    # PyTorch's deepcopy of a TorchScript module leaves its parameters without gradients (no leaves of its compiled
    # code): those of a scripted submodule cannot be judged here, and are said to be (a review: they had been left
    # out of the verdict silently, as parameters the loss does not reach).
    scripted = tuple(f"{n}." for n, m in plain.named_modules() if n and isinstance(m, torch.jit.ScriptModule))
    unjudged = []
    for name, exact in grads0.items():
        if exact is None and all(grads1.get(name) is None for *_, grads1, _ in steps):
            if scripted and name.startswith(scripted):
                unjudged.append(name)
            continue  # a parameter the loss does not reach, in both runs
        if exact is None or any(grads1.get(name) is None or ref.grads.get(name) is None
                                for *_, grads1, ref in steps):
            missing.append(name)
            continue
        # The worse step: a failure first, then the lower cosine (negligible ones: the larger difference).
        options = [(dataclasses.replace(_judge(name, ref.grads[name], grads1[name], typical, lossless, compute,
                                               dims.get(name)), step=label),
                    (grads1[name], ref)) for label, _, _, grads1, ref in steps]
        p, judged[name] = min(options, key=lambda o: (o[0].passed, o[0].cosine if not o[0].negligible else 2.0,
                                                      -o[0].diff))
        params.append(p)
    low = _narrower(_low_precision(plain, inputs, outs0), compute)
    reference = _plain_reference(low)
    # Passed by size alone, not within the floor against plain: rounding noise (a cancellation), or a gradient small
    # beside the typical one but genuine, which an optimizer scaling each parameter's step (Adam) follows as far as
    # any other (a block behind a layer scale of 1e-6: a sign flip there passed by size). The float64 run tells.
    small = {p.name for p in params if p.negligible and p.passed and _misses(
        (exact := judged[p.name][1].grads[p.name]), judged[p.name][0], lossless, _tolerance(exact.dtype, compute),
        dims.get(p.name))}
    if any(not p.passed for p in params) or small:
        wides: dict[int, dict[str, Tensor | None] | str] = {}
        for ref in {id(r): r for _, (_, r) in judged.items()}.values():
            with _forked_rng(cuda):
                wide = _float64_grads(ref.model, inputs, loss_fn, rng, ref.loss, ref.outs, low, micro_batch,
                                      ref.buffers)
            if isinstance(wide, tuple):  # its casts may show narrower tensors than the parameters and outputs did
                wide, low = wide
            wides[id(ref)] = wide
        why = [w for w in wides.values() if not isinstance(w, dict)]
        reference = _plain_reference(low)

        # Plain's own distance from float64 bounds the converted one's wherever it is rounding. In a float32 model
        # it is, however far (a gradient zero by the model's structure keeps what rounding leaves of a cancellation:
        # 3% of a BatchNorm bias gradient in MobileViT, 1e9x the float64 value in a tiny EfficientNet). With 16-bit
        # tensors the float64 run may also compute otherwise (model code branching on the dtype, hidden within the
        # outputs' looser guard): there plain's distance counts only up to that guard.
        guard = math.inf if low is None else _guard_tolerance(low)

        def rejudged(p: ParamCheck) -> ParamCheck:
            approx, ref = judged[p.name]
            wide = wides[id(ref)]
            if (p.passed and p.name not in small) or not isinstance(wide, dict) or wide.get(p.name) is None:
                return p
            if not torch.isfinite(ref.grads[p.name]).all():  # (its reason says so; NaNs compared say nothing)
                return p
            again = _rejudge(p, ref.grads[p.name], approx, wide[p.name], typical, lossless, guard, compute,
                             dims.get(p.name))
            return p if p.passed and not again.judged else again  # (no reference for it: judged by size, as it was)

        params = [rejudged(p) for p in params]
        n = sum(p.reference == "float64" for p in params)
        if n:
            reference += (f"; {n} parameter(s) that missed the floor against it judged against a float64 copy of "
                          "the plain model, plain's gradient and the converted one both")
        if why:
            reference += f"; no float64 reference for the parameters below the floor: {why[0] or 'unavailable'}"
            unsure = sorted(p.name for p in params if p.name in small and p.reference != "float64")
            if unsure:  # (a genuine small gradient, a branch behind a layer scale of 1e-6, passes so unseen)
                reference += (f"; {len(unsure)} parameter(s) passed by size alone, off plain's gradient beyond the "
                              f"floor with no float64 run to tell rounding from a genuine small gradient: "
                              f"{', '.join(unsure[:3])}{', ...' if len(unsure) > 3 else ''}")
    if unjudged:
        reference += (f"; not judged: {len(unjudged)} parameter(s) of TorchScript submodules ({', '.join(unjudged[:3])}"
                      f"{', ...' if len(unjudged) > 3 else ''}), which a copy of the model cannot train: PyTorch's "
                      "deepcopy of a scripted module leaves its parameters without gradients")
    unfinite = [name for name, g in grads0.items() if g is not None and not torch.isfinite(g).all()]
    if unfinite:  # (with a finite loss: a NaN backward, sqrt at 0; the float64 run's verdicts on them said nothing)
        reference += (f"; plain's gradient is not finite for {len(unfinite)} parameter(s) ({', '.join(unfinite[:3])}"
                      f"{', ...' if len(unfinite) > 3 else ''}): the plain step is not")
    idle = [name for name, m in model.named_modules() if not m.training] if model.training else []
    if idle:  # (fastai's DynamicUnet is built with 140 of its 163 modules in eval mode: its Learner trains them all)
        reference += (f"; run in the modes the model's modules are in: {len(idle)} of "
                      f"{sum(1 for _ in model.modules())} in eval mode inside the training model ({', '.join(idle[:3])}"
                      f"{', ...' if len(idle) > 3 else ''}; a BatchNorm frozen for fine-tuning stays so: call "
                      "model.train() first where training runs them in training mode)")
    if detached:
        reference += (f"; copied detached: {', '.join(detached[:3])}{', ...' if len(detached) > 3 else ''} (tensors "
                      "computed by an earlier call that the model holds, which PyTorch cannot copy: a gradient "
                      "through them is not judged)")
    return CheckReport(
        policy=policy_name,
        lossless=lossless,
        forward_max_abs_diff=max(d for d, _ in diffs),
        forward_equal=same_count and all(ok for _, ok in diffs),
        loss_plain=loss0.item(),
        loss_converted=steps[0][1].item(),
        params=params,
        summary=summary(slim),
        missing=missing,
        reference=reference,
        estimates=estimates,
        calls=len(_calls(inputs, micro_batch)),
    )
