"""Property-based tests of every Function in :mod:`slimact.functional` against plain PyTorch (hypothesis).

Each Function gets drawn shapes (1-element and odd sizes included), dtypes (fp32, fp16, bf16; a dtype the plain
PyTorch op cannot run on the CPU is skipped), layouts (contiguous, transposed, channels-last for convolutions and
batch norm, expanded views), value distributions (normal, heavy-tailed, constant, all-zero, denormal-scale,
huge), scale-group counts that need not divide the channel count, and NaN/inf placed in an input. Properties,
against PyTorch on the same inputs and the same dropout draws:

1. the forward equals PyTorch's (``torch.equal``, NaN where PyTorch has NaN) where the Function's docstring says
   it is PyTorch's own computation; the fused attention and LM loss compute it otherwise: to float rounding;
2. gradients (:class:`Rule`, :func:`_judge`): exact ones ``assert_close``; lossless ones to float rounding; lossy
   (8-bit) ones within the error the documented bound of their restored tensors implies, elementwise, on all
   data, and at the SQNR / cosine floor of that op's own tests (``tests/functional/test_<stem>.py``) on data
   where a floor means something;
3. nothing is NaN/inf in slimact's result where PyTorch's and the exact one are finite;
4. NaN/inf placed in an input reach slimact's result wherever they reach PyTorch's and the exact one
   (:func:`_non_finite`).

"Exact" is PyTorch's op run in float64 on the same values (the gold run).

CI runs a small fixed profile (the same examples every run); ``SLIMACT_HYPOTHESIS=long`` draws many more, at
random, of tensors up to a few million elements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

import slimact.functional as sf
from _harness import upstream_loss
from slimact._metrics import cosine, sqnr_db
from slimact.functional import lm_loss as lm_loss_module
from slimact.functional import mlp as mlp_module
from slimact.functional.activation import FLAT, INPLACE_ERROR_BOUNDS, MINIMUM, derivative, reference
from slimact.quant import QuantConfig, pack

LONG = os.environ.get("SLIMACT_HYPOTHESIS") == "long"
# Profiles of their own (the compression core's file loads "ci"/"long" globally); each test is decorated.
_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]
# CI's examples are fixed (derandomize): the same on every run, so a red CI is a change's doing, not a new draw's;
# the long profile explores (random, with the local example database replaying what it found).
settings.register_profile("functional-ci", max_examples=25, deadline=None, suppress_health_check=_HEALTH,
                          derandomize=True)
settings.register_profile("functional-long", max_examples=400, deadline=None, suppress_health_check=_HEALTH)
PROFILE = settings.get_profile("functional-long" if LONG else "functional-ci")
#: The most elements (for products: multiply-adds) one drawn case computes with, and the largest single size.
WORK, CAP = (3_000_000, 4096) if LONG else (4_000, 48)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DISTRIBUTIONS = ["normal", "heavy", "constant", "zero", "denormal", "huge"]
LAYOUTS = ["contiguous", "transposed", "expanded"]
# Denormal scale: ~1e-39 in fp32 (subnormal, yet 2^-20 of the values still resolved). For fp16 and bf16 the
# dtype's smallest normal number: most values are subnormal, resolved as finely as the dtype resolves values of
# that size (at 1e-39 bf16 would keep 3 bits of each value, and PyTorch's own gradient would be noise too).
DENORMAL = {torch.float32: 1e-39, torch.float16: torch.finfo(torch.float16).tiny,
            torch.bfloat16: torch.finfo(torch.bfloat16).tiny}
HUGE = {torch.float32: 1e30, torch.float16: torch.finfo(torch.float16).max / 1e4,
        torch.bfloat16: torch.finfo(torch.bfloat16).max / 1e4}
# How models compute each activation: PyTorch's kernels (QuickGELU has none: Hugging Face's formula).
PLAIN_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "quick_gelu": functools.partial(reference, "quick_gelu"),
    "silu": F.silu,
    "relu": F.relu,
}
SMOOTH = ["gelu", "gelu_tanh", "quick_gelu", "silu"]
PRODUCT = ("denormal", "huge")  # the scale-free distributions of a product (see Case.scale_free)
EPS32, TINY32 = torch.finfo(torch.float32).eps, torch.finfo(torch.float32).tiny


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``assert_close``'s default ``(rtol, atol)`` for ``dtype``."""
    return {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}.get(dtype, (1.3e-6, 1e-5))


@functools.cache
def _lipschitz(form: str) -> tuple[float, float]:
    """``(max |y'|, max |y''|)`` of a smooth activation (on a fine grid of [-20, 20]; beyond, y' is flat)."""
    x = torch.linspace(-20, 20, 400_001, dtype=torch.float64, requires_grad=True)
    d1 = derivative(form, x)
    (d2,) = torch.autograd.grad(d1.sum(), x)
    return d1.abs().max().item(), d2.abs().max().item()


@dataclass(frozen=True)
class Rule:
    """How one gradient is judged against PyTorch's.

    ``"exact"``: computed as PyTorch computes it (bit masks, a product's input gradient, bias sums):
    ``assert_close``. ``"lossless"``: from exact tensors, computed otherwise (rebuilt from the output, fused,
    recomputed): to float rounding (:func:`_assert_rounding`). ``"lossy"``: from 8-bit tensors: ``floor``
    (``("sqnr", dB)`` or ``("cosine", c)``). ``"bounded"``: within ``bound`` only (the in-place activations'
    stated error). ``bound(upstream, output)``, where given: the largest error each element may have, from the
    documented error of the tensors the backward restores (:func:`_restore_error`).
    """

    kind: str
    floor: tuple[str, float] | None = None
    bound: Callable[[Tensor, Tensor], Tensor] | None = None


EXACT, LOSSLESS = Rule("exact"), Rule("lossless")


def _lossy(floor: tuple[str, float] = ("sqnr", 30.0), bound=None) -> Rule:
    """A lossy gradient; 30 dB is every 8-bit layer's floor (tests/functional/test_<stem>.py, README)."""
    return Rule("lossy", floor, bound)


@dataclass
class Case:
    """One drawn call: PyTorch's op and slimact's Function on the same ``inputs`` (the leaves of the backward)."""

    plain: Callable[..., Tensor]
    slim: Callable[..., Tensor]
    inputs: dict[str, Tensor]
    rules: dict[str, Rule]
    dtype: torch.dtype
    dist: str
    bad: float | None
    seed: int
    forward_equal: bool = True  # False: the Function computes the forward otherwise (fused)
    # The distributions that are scaled copies of normal data for this op: scaling the input scales every
    # gradient (products; normalisations only while the variance dwarfs eps), so the floors hold there too.
    scale_free: tuple[str, ...] = ()
    # Heavy tails (1% at 1e4) are well conditioned too where the tensors the backward restores keep their outliers
    # apart (slimact.quant.reference: exact, out of their group's range) or clamp them (activations).
    heavy_ok: bool = False
    degenerate: bool = False  # the layout made the data degenerate (a normalised dim broadcast: constant)
    gold: Callable[..., Tensor] | None = None  # the float64 run, when it is not ``plain``
    check: Callable[[], None] | None = None  # anything else to compare once both have run
    zero_scale: str | None = None  # attention: the gradient that sets "noise level" (see _judge)
    # Fused attention: NaN/inf are only required not to vanish, and only without a mask (see _non_finite).
    kernel_nan: bool = False
    masked: bool = False
    terms: dict[str, int] = field(default_factory=dict)  # terms each gradient element sums (see _assert_rounding)
    patches: list = field(default_factory=list)  # context managers around slimact's call
    # A forward computed otherwise (forward_equal=False): the size its rounding scales with, where that is not the
    # result's (see _sdpa), and how many roundings of it
    forward_size: Callable[[], Tensor] | None = None

    @property
    def broadcast(self) -> bool:
        """Whether an input is a broadcast view (a zero stride): see FLOOR_MIN_ELEMENTS."""
        return any(0 in t.stride() for t in self.inputs.values())

    @property
    def well_conditioned(self) -> bool:
        """Normal data, or a scaled copy of it for this op, not made degenerate by its layout. Not denormal
        fp16/bf16 data: PyTorch's fp16/bf16 CPU kernels (oneDNN) may flush subnormal operands to zero."""
        if self.dist == "denormal" and self.dtype != torch.float32:
            return False
        return (self.dist == "normal" or self.dist in self.scale_free or (self.dist == "heavy" and self.heavy_ok)
                ) and not self.degenerate


# ---------------------------------------------------------------------------------------------------------
# Drawing tensors.


def _sizes(draw, n: int, work: int = WORK, cap: int = CAP) -> list[int]:
    """``n`` sizes from 1 to ``cap`` (1 and odd sizes likely) whose product is at most ``work``."""
    sizes = [draw(st.one_of(st.sampled_from([1, 2, 3, 5, 7, 13, 33]), st.integers(1, cap))) for _ in range(n)]
    while math.prod(sizes) > work:
        i = max(range(n), key=sizes.__getitem__)
        sizes[i] = (sizes[i] + 1) // 2
    return sizes


def _values(shape: list[int], dtype: torch.dtype, dist: str, gen: torch.Generator) -> Tensor:
    x = torch.randn(shape, generator=gen)
    if dist == "heavy":  # 1% of the values (at least one) at 1e4 times the median magnitude
        outliers = torch.rand(shape, generator=gen) < 0.01
        outliers.view(-1)[torch.randint(x.numel(), (1,), generator=gen)] = True
        x = torch.where(outliers, x.sign() * 1e4 * x.abs().median(), x)
    elif dist == "constant":  # 3.25, or -0.75: next to the minimum of the GELUs, where their inversion is hardest
        x = torch.full(shape, 3.25 if torch.rand((), generator=gen) < 0.5 else -0.75)
    elif dist == "zero":
        x = torch.zeros(shape)
    elif dist == "denormal":
        x = x * DENORMAL[dtype]
    elif dist == "huge":
        x = x * HUGE[dtype]
    return x.to(dtype)


def _tensor(shape: list[int], dtype, dist: str, layout: str, gen, bad: float | None = None) -> Tensor:
    """Values of ``dist`` seen through ``layout``, with ``bad`` (NaN or inf), if given, at one random element."""
    base = [1, *shape[1:]] if layout == "expanded" and shape else list(shape)
    x = _values(base, dtype, dist, gen)
    if bad is not None:
        x.view(-1)[torch.randint(x.numel(), (1,), generator=gen)] = bad
    if layout == "expanded" and shape:
        return x.expand(shape)  # a broadcast view: stride 0 along dim 0
    if layout == "transposed" and x.dim() >= 2:
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)  # the same values through other strides
    if layout == "channels_last" and x.dim() in (4, 5):
        return x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    return x


def _weight(shape: tuple[int, ...], dtype, gen, fan_in: int = 1) -> Tensor:
    return (torch.randn(shape, generator=gen) / math.sqrt(fan_in)).to(dtype)


def _cfg(draw, shape: list[int], group_dims: tuple[int, ...] = (-1,)) -> QuantConfig:
    """An 8-bit config: one scale for the tensor, or groups along one of ``group_dims`` (any count from one per
    index, 0, to the dim's size: dividing it or not); round to nearest or stochastic."""
    group_dim = draw(st.sampled_from([*group_dims, None]))
    size = shape[group_dim] if group_dim is not None else 1
    return QuantConfig(group_dim=group_dim, groups=draw(st.integers(0, size)), stochastic=draw(st.booleans()))


@dataclass
class Draws:
    """What every case draws: dtype, value distribution, a generator, and NaN/inf to place (or None)."""

    dtype: torch.dtype
    dist: str
    gen: torch.Generator
    bad: float | None
    seed: int

    @classmethod
    def of(cls, draw) -> Draws:
        seed = draw(st.integers(0, 2**31 - 1))
        bad = draw(st.one_of(st.none(), st.sampled_from([math.nan, math.inf, -math.inf])))
        return cls(draw(st.sampled_from(DTYPES)), draw(st.sampled_from(DISTRIBUTIONS)),
                   torch.Generator().manual_seed(seed), bad, seed)

    def tensor(self, draw, shape: list[int], layouts=LAYOUTS, bad: bool = True) -> Tensor:
        return _tensor(shape, self.dtype, self.dist, draw(st.sampled_from(layouts)), self.gen,
                       self.bad if bad else None)

    def case(self, plain, slim, inputs: dict[str, Tensor], rules: dict[str, Rule], **kw) -> Case:
        rules = {n: r for n, r in rules.items() if n in inputs}
        return Case(plain, slim, inputs, rules, self.dtype, self.dist, self.bad, self.seed, **kw)


# ---------------------------------------------------------------------------------------------------------
# Error bounds: what the documented error of a restored tensor allows in a gradient computed from it.


def _group_range(x: Tensor, cfg: QuantConfig) -> Tensor:
    """Each element's scale-group range (max - min), as documented: index ``c`` of ``group_dim`` is in group
    ``c * G // C``."""
    if cfg.group_dim is None:
        return (x.max() - x.min()).expand_as(x)
    dim = cfg.group_dim % x.dim()
    size = x.shape[dim]
    groups = size if cfg.groups == 0 else min(cfg.groups, size)
    others = [d for d in range(x.dim()) if d != dim]
    lo, hi = (x.amin(others), x.amax(others)) if others else (x, x)
    index = torch.arange(size) * groups // size
    g_lo = torch.full((groups,), math.inf, dtype=x.dtype).scatter_reduce(0, index, lo, "amin")
    g_hi = torch.full((groups,), -math.inf, dtype=x.dtype).scatter_reduce(0, index, hi, "amax")
    shape = [size if d == dim else 1 for d in range(x.dim())]
    return (g_hi - g_lo)[index].reshape(shape).expand_as(x)


def _restore_error(x: Tensor, cfg: QuantConfig | None) -> Tensor:
    """float64 bound on ``|unpack(pack(x, cfg)) - x|`` per element (slimact.quant.reference): half a step (a
    whole one when stochastic), the step ``range / qmax`` grown by at most ``(qmax/2) / (qmax/2 - 1)`` where zero
    is made a code, plus the fp32 arithmetic and the cast back to x's dtype (half an ulp; absolute below the
    smallest normal). Zero for tensors kept exactly (no config, or NaN/inf in them)."""
    xd = x.detach().double()
    if cfg is None or not bool(torch.isfinite(xd).all()) or x.numel() == 0:
        return torch.zeros_like(xd)
    half = cfg.qmax / 2
    step = _group_range(xd, cfg) / cfg.qmax * half / (half - 1)
    fi = torch.finfo(x.dtype)
    arithmetic = 4 * EPS32 * torch.clamp(xd.abs().max() + step * cfg.qmax, min=TINY32)
    cast = fi.eps / 2 * torch.clamp(xd.abs() + step, min=fi.tiny)
    return step * (1.0 if cfg.stochastic else 0.5) + arithmetic + cast


def _companded_error(g: Tensor, cfg: QuantConfig | None) -> Tensor:
    """float64 bound on ``|g_hat - g|`` for a gated MLP's ``g`` kept as codes of ``c = K asinh(g / K)`` (fp32, fp16
    for an fp16 g; slimact.functional.mlp): ``c_hat`` within ``e`` of ``c`` (:func:`_restore_error`, plus
    the fp32 evaluation of asinh and the rounding to c's dtype) gives ``g_hat = K sinh(c_hat / K)`` within
    ``cosh((|c| + e) / K) e``; plus sinh's fp32 evaluation and the cast to g's dtype. Both are evaluated by series
    below ``|g| / K = 1e-2`` (relative: a few fp32 ulps) and by log/exp above (a few fp32 ulps of ``K`` absolute,
    where ``e - 1/e`` and ``log(a + sqrt(a^2 + 1))`` lose the leading bits); ``|g| / K`` rounds on the subnormal
    grid. Zero where g is kept exactly (no config, NaN/inf)."""
    gd = g.detach().double()
    if cfg is None or not bool(torch.isfinite(gd).all()) or g.numel() == 0:
        return torch.zeros_like(gd)
    k = mlp_module._K
    c = torch.asinh(gd / k) * k
    # (at the branch point the series is as close as log/exp: the threshold may round either way)
    formula = 4 * EPS32 * (c.abs() + k * (gd.abs() >= k * 1e-2 * (1 - 1e-6))) + 4 * k * TINY32 * EPS32
    # c is fp16 for an fp16 g, else fp32: rounded to it once made (half an ulp), and its restore is cast to it
    c_dtype = torch.float16 if g.dtype == torch.float16 else torch.float32
    rounded = torch.finfo(c_dtype).eps / 2 * c.abs() + torch.finfo(c_dtype).tiny
    e = _restore_error(c.to(c_dtype), cfg) + formula + rounded
    error = torch.cosh((c.abs() + e) / k) * e + formula * torch.cosh((c.abs() + e) / k)
    fi = torch.finfo(g.dtype)
    return error + (4 * EPS32 + fi.eps / 2) * (gd.abs() + error) + fi.tiny


def _gate_error(g: Tensor, cfg: QuantConfig | None) -> Tensor:
    """float64 bound on ``|g_hat - g|`` for a gated MLP's ``g``: kept as its own codes where its pack keeps outliers
    apart (a heavy tail: :func:`_restore_error`), else as codes of ``K asinh(g / K)`` (:func:`_companded_error`)."""
    if cfg is not None and cfg.outliers and cfg.scale == "dynamic" and g.numel() and bool(torch.isfinite(g).all()):
        if len(pack(g.detach(), cfg, share=False).tensors) > 3:
            return _restore_error(g, cfg)
    return _companded_error(g, cfg)


def _probability_error(y: Tensor, cfg: QuantConfig | None) -> Tensor:
    """float64 bound on ``|y_hat - y|`` for probabilities kept as codes of ``s = sqrt(y)``
    (slimact.functional.softmax.pack_probabilities): ``s_hat`` within ``e`` of ``s`` (:func:`_restore_error`)
    gives ``y_hat = s_hat^2`` within ``e (2 s + e)``; plus the rounding of the square root and of the square in
    ``y``'s dtype (an ulp of ``y``, half a subnormal spacing below the smallest normal)."""
    s = y.detach().sqrt()
    e = _restore_error(s, cfg)
    error = e * (2 * s.double() + e)
    fi = torch.finfo(y.dtype)
    return torch.where(e > 0, error + 2 * fi.eps * (y.detach().double().abs() + error) + fi.tiny * fi.eps, 0.0)


def _rounding(dtype: torch.dtype, terms: int, size: Tensor, reach: Tensor | None = None) -> Tensor:
    """The float rounding two computations of one gradient may differ by: each sums ``terms`` products in fp32
    and rounds to ``dtype`` (``size`` bounds the sum of the products' magnitudes); a subnormal result is rounded
    to the subnormal grid, through fp32 and then the dtype (two of its spacings each). PyTorch's fp16/bf16 CPU
    kernels (oneDNN) may flush subnormal operands to zero: each product may then lose up to ``tiny`` times its
    other factor (``reach``: the sum of those factors' magnitudes); and a subnormal result to zero (up to
    ``tiny``: normal bf16 operands 0.48 and 2.4e-38 gave 0 for their product, 1.17e-38)."""
    fi = torch.finfo(dtype)
    rounding = (2 * terms * EPS32 + 2 * fi.eps) * size + (terms + 1) * TINY32 * EPS32 + 4 * fi.tiny * fi.eps
    if reach is not None:
        rounding = rounding + 2 * _flushed(dtype) * reach + _flushed(dtype)
    return rounding


def _product_bound(product: Callable[[Tensor], Tensor], err: Tensor, size: Tensor, terms: int,
                   dtype: torch.dtype) -> Tensor:
    """Bound on a weight gradient ``product(x_hat)`` (linear in its operand): the restore error carried through
    ``product``, plus the rounding of ``terms``-long sums of magnitude ``product(size)``."""
    return product(err) + _rounding(dtype, terms, product(size), product(torch.ones_like(size)))


def _flushed(dtype: torch.dtype) -> float:
    """What a subnormal operand may lose in PyTorch's fp16/bf16 CPU kernels (oneDNN flushes them to zero)."""
    return torch.finfo(dtype).tiny if dtype in (torch.float16, torch.bfloat16) else 0.0


def _normalised_bounds(g: Tensor, xn: Tensor, err: Tensor, mean_dims, outer: Tensor, scaled_x: Tensor):
    """Bound on the input-gradient error of a normalisation, ``outer * (g - mean(g) - xn * mean(g xn))`` (means
    over ``mean_dims``), when ``xn`` is restored within ``err``: ``|d(xn mean(g xn))| <= err |mean(g xn)| +
    (|xn| + err) mean(|g| err)``; the rest is exact. And the size of the terms the two computations sum, for
    their rounding: PyTorch's kernels work with ``x`` and the mean (``scaled_x = (|x| + |mean|) * rstd``, which
    cancel to xn), slimact's with xn. All float64."""
    m_gx = (g * xn).mean(mean_dims, keepdim=True).abs()
    m_ge = (g.abs() * err).mean(mean_dims, keepdim=True)
    big = torch.maximum(xn.abs(), scaled_x) + err
    size = g.abs() + g.abs().mean(mean_dims, keepdim=True) + big * (g.abs() * big).mean(mean_dims, keepdim=True)
    return outer * (err * (m_gx + m_ge) + xn.abs() * m_ge), outer * size


def _recentred_error(err: Tensor, xn: Tensor, dims, m: int) -> Tensor:
    """Bound on the error of an ``xn`` restored within ``err`` and then re-centred over its row of ``m`` elements
    (``dims``), as a LayerNorm's or GroupNorm's backward does at 8 bits (slimact.functional.norm): ``e - mean(e)``
    is within ``err + mean(err)``, and the fp32 mean and the subtraction add ``m eps32 mean(|xn| + err)`` and
    ``eps32 (|xn| + err)``."""
    big = xn.abs() + err
    return err + err.mean(dims, keepdim=True) + m * EPS32 * big.mean(dims, keepdim=True) + EPS32 * big


# ---------------------------------------------------------------------------------------------------------
# One case per Function.


def _linear(draw) -> Case:
    d = Draws.of(draw)
    *lead, c_in, c_out = _sizes(draw, draw(st.integers(1, 3)) + 1)
    transposed = draw(st.booleans())  # Hugging Face's Conv1D keeps W^T
    x = d.tensor(draw, [*lead, c_in])
    inputs = {"x": x, "weight": _weight((c_in, c_out) if transposed else (c_out, c_in), d.dtype, d.gen, c_in)}
    if draw(st.booleans()):
        inputs["bias"] = _weight((c_out,), d.dtype, d.gen)
    cfg = _cfg(draw, list(x.shape))
    tokens = math.prod(lead)

    def plain(x, weight, bias=None):
        return F.linear(x, weight.t() if transposed else weight, bias)

    def slim(x, weight, bias=None):
        return sf.linear(x, weight, bias, cfg, transposed=transposed)

    def bound(upstream: Tensor, _out: Tensor) -> Tensor:  # grad_W = grad_y^T x: |grad_y|^T err, elementwise
        g = upstream.double().abs().reshape(tokens, c_out)
        err = _restore_error(x, cfg).reshape(tokens, c_in)
        size = x.detach().double().abs().reshape(tokens, c_in) + err

        def product(a: Tensor) -> Tensor:
            return a.t() @ g if transposed else g.t() @ a

        return _product_bound(product, err, size, tokens, d.dtype)

    # grad_x needs only W, grad_b only grad_y: from exact tensors. grad_x to float rounding, not bit for bit:
    # PyTorch picks the product's order from x's strides (mm_mat1_backward computes a column-major x's gradient
    # as (W^T grad_y^T)^T), and slimact does not keep x. grad_W sees the 8-bit x.
    rules = {"x": LOSSLESS, "weight": _lossy(bound=bound), "bias": EXACT}
    return d.case(plain, slim, inputs, rules, scale_free=PRODUCT, heavy_ok=True)


def _matmul(draw) -> Case:
    d = Draws.of(draw)
    rank = draw(st.integers(2, 4))
    *batch, n, k, m = _sizes(draw, rank + 1)
    # b's batch dims: the same, broadcast (size 1), or missing (a 2-d right operand)
    b_batch = draw(st.sampled_from([batch, [1] * len(batch), []]))
    a = d.tensor(draw, [*batch, n, k])
    b = d.tensor(draw, [*b_batch, k, m], bad=False)  # NaN/inf in one operand
    cfg_a = _cfg(draw, list(a.shape), (-1, 1) if a.dim() == 4 else (-1,))
    cfg_b = _cfg(draw, list(b.shape), (-1, 1) if b.dim() == 4 else (-1,))

    def bound_of(operand: str) -> Callable[[Tensor, Tensor], Tensor]:
        # grad_a = grad_y b^T, grad_b = a^T grad_y, each summed over the dims its operand was broadcast along
        def bound(upstream: Tensor, _out: Tensor) -> Tensor:
            g = upstream.double().abs()
            if operand == "a":
                other, err = b, _restore_error(b, cfg_b)

                def product(t: Tensor) -> Tensor:
                    return (g @ t.transpose(-1, -2)).sum_to_size(a.shape)
            else:
                other, err = a, _restore_error(a, cfg_a)

                def product(t: Tensor) -> Tensor:
                    return (t.transpose(-1, -2) @ g).sum_to_size(b.shape)

            terms = g.numel() * k // (a.numel() if operand == "a" else b.numel())
            size = other.detach().double().abs() + err
            return product(err) + _rounding(d.dtype, terms, product(size), product(torch.ones_like(size)))

        return bound

    return d.case(lambda a, b: torch.matmul(a, b), lambda a, b: sf.matmul(a, b, cfg_a, cfg_b), {"a": a, "b": b},
                  {"a": _lossy(bound=bound_of("a")), "b": _lossy(bound=bound_of("b"))}, scale_free=PRODUCT,
                  heavy_ok=True)


def _softmax(draw) -> Case:
    d = Draws.of(draw)
    shape = _sizes(draw, draw(st.integers(1, 4)))
    x = d.tensor(draw, shape)
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    cfg = _cfg(draw, shape, (-1, 1) if len(shape) == 4 else (-1,))

    def bound(upstream: Tensor, out: Tensor) -> Tensor:
        # grad_x = y (g - <g, y>) at the restored y: with |y_hat - y| <= err the error is at most
        # err |g - <g, y_hat>| + y <|g|, err>, and <g, y_hat> is within <|g|, err> of <g, y>.
        g, y = upstream.double(), out.double()
        err = _probability_error(out, cfg)
        gy = (g * y).sum(dim, keepdim=True)
        g_err = (g.abs() * err).sum(dim, keepdim=True)
        size = y.abs() * (g.abs() + (g.abs() * y.abs()).sum(dim, keepdim=True))
        return err * ((g - gy).abs() + g_err) + (y.abs() + err) * g_err + _rounding(d.dtype, shape[dim], size)

    return d.case(lambda x: torch.softmax(x, dim), lambda x: sf.softmax(x, dim, cfg), {"x": x},
                  {"x": _lossy(bound=bound)})


def _derivative_terms(form: str, x: Tensor, dtype: torch.dtype) -> Tensor | float:
    """The size of what a plain activation's backward sums into ``y'``, for its rounding: ``max |y'|`` for
    PyTorch's kernels (fp32 inside). QuickGELU has none: autograd runs Hugging Face's formula, ``y' = s + z s
    (1 - s)`` with ``z = 1.702 x``, ``s = sigmoid(z)``, rounding in the dtype at each of its steps (about three
    deep). ``1 - s`` comes from a rounded ``s``: off by half an ulp of ``s`` wherever ``s < 1`` in the dtype
    (fp16 at x = 4.2: 34% off, an error of 1.8e-3 in y' = 1.0045), which ``z s`` multiplies; and the forward's
    rounding of ``z`` moves ``s`` by ``|z| s (1 - s)`` ulps (fp16 at x = -4.9: 0.4% of y')."""
    if form != "quick_gelu":
        return _lipschitz(form)[0]
    z = 1.702 * x.detach().double()
    s, a = torch.sigmoid(z), z.abs()
    below_one = (1 - s) >= torch.finfo(dtype).eps / 4  # 1 - s rounded, not exactly 0
    return (3 * (s + a * s * (1 - s) + a * s * below_one + a * (1 + a) * s * (1 - s))).nan_to_num(0.0)


def _activation(draw) -> Case:
    d = Draws.of(draw)
    form = draw(st.sampled_from(list(PLAIN_ACTIVATIONS)))
    x = d.tensor(draw, _sizes(draw, draw(st.integers(1, 3))))
    fn = PLAIN_ACTIVATIONS[form]
    lossless = draw(st.booleans())
    cfg = None if lossless else _cfg(draw, list(x.shape))

    def inplace_bound(upstream: Tensor, _out: Tensor) -> Tensor:
        # The in-place form rebuilds x from y: the stated bound on |y'(x_rebuilt) - y'(x)| (by distance from the
        # minimum), times |grad_y|, plus the rounding of both gradients (|y'| <= max |y'|).
        radius, away, everywhere = INPLACE_ERROR_BOUNDS[d.dtype]
        per_element = torch.where((x.double() - MINIMUM[form]).abs() >= radius, away, everywhere)
        g = upstream.double().abs()
        return g * per_element + _rounding(d.dtype, 1, g * _derivative_terms(form, x, d.dtype))

    def quantised_bound(upstream: Tensor, _out: Tensor) -> Tensor:
        # The module's documented error: y' at x_hat (x clamped to +-FLAT, where y' is flat to 1e-6) is within
        # err * max|y''| + 1e-6 of y'(x); plus the rounding of both gradients and of y' evaluated in fp32.
        flat = FLAT[form]
        kept = torch.where(torch.isfinite(x), x.clamp(-flat, flat), x)
        g = upstream.double().abs()
        restore = _restore_error(kept, cfg) * _lipschitz(form)[1]
        return g * (restore + 1e-6) + _rounding(d.dtype, 16, g * _derivative_terms(form, x, d.dtype))

    if form == "relu":
        rule = EXACT  # a bit mask, either way
    elif lossless:
        rule = Rule("bounded", None, inplace_bound)  # within its stated bound, not to float rounding
    else:
        rule = _lossy(bound=quantised_bound)  # the docs: >= 30 dB, heavy tails included (the clamp)
    return d.case(fn, lambda x: sf.activation(x, form, cfg, fn=fn), {"x": x}, {"x": rule}, heavy_ok=True)


def _norm(draw) -> Case:
    d = Draws.of(draw)
    centered = draw(st.booleans())
    # RMSNorm over one channel is sign(x) * w: its gradient is eps / x^2 of the upstream one, below an 8-bit step
    *lead, c = _sizes(draw, draw(st.integers(1, 3)))
    c = c if centered else max(c, 2)
    x = d.tensor(draw, [*lead, c])
    affine = draw(st.sampled_from(["none", "weight", "bias" if centered else "gemma"]))
    inputs = {"x": x}
    offset = 1.0 if affine == "gemma" else 0.0
    if affine != "none":  # gammas in [0.5, 1.5] (Gemma: the offset from 1, in [-0.5, 0.5])
        inputs["weight"] = (torch.rand(c, generator=d.gen) - (1.0 if offset else 0.0) + 0.5).to(d.dtype)
    if affine == "bias":
        inputs["bias"] = (torch.randn(c, generator=d.gen) * 0.1).to(d.dtype)
    cfg = None if draw(st.booleans()) else _cfg(draw, list(x.shape))
    eps = 1e-5

    def plain(x, weight=None, bias=None):
        w = weight + offset if weight is not None and offset else weight
        if centered:
            return F.layer_norm(x, [c], w, bias, eps)
        return F.rms_norm(x, [c], w, eps)

    def slim(x, weight=None, bias=None):
        return sf.norm(x, weight, bias, eps, cfg, centered=centered, offset=offset)

    def stats():
        xd = x.double()
        weight, bias = inputs.get("weight"), inputs.get("bias")
        w = torch.ones(c, dtype=torch.float64) if weight is None else weight.double() + offset
        if centered:
            var, mean = torch.var_mean(xd, -1, unbiased=False, keepdim=True)
        else:
            var, mean = xd.pow(2).mean(-1, keepdim=True), torch.zeros(())
        rstd = (var + eps).rsqrt()
        return (xd - mean) * rstd, rstd, w, (torch.zeros(c, dtype=torch.float64) if bias is None else bias.double())

    def restored_error(out: Tensor) -> Tensor:
        """Bound on how far the normalised input the backward uses is from PyTorch's, whichever the module's guard
        chose (slimact.functional.norm): ``(y_hat - b) / w``, y kept per channel (plus y's rounding to its dtype
        and the forward's fp32 rounding of ``x * rstd``), or ``(x_hat - mean) * rstd``."""
        xn, rstd, w, b = stats()
        y, xd = out.double(), x.double()
        per_channel = None if cfg is None else dataclasses.replace(cfg, group_dim=-1, groups=0)
        rounding = torch.finfo(d.dtype).eps * y.abs() + 4 * EPS32 * (y.abs() + b.abs())
        forward = 2 * EPS32 * (xd.abs() + xd.mean(-1, keepdim=True).abs()) * rstd if centered else 2 * EPS32 * xn.abs()
        from_output = (_restore_error(out, per_channel) + rounding) / w.abs() + forward
        from_input = rstd * _restore_error(x, cfg) + 4 * EPS32 * xn.abs()
        err = torch.maximum(from_output.nan_to_num(math.inf), from_input) + _flushed(d.dtype) * rstd
        return _recentred_error(err, xn, -1, c) if centered and cfg is not None else err

    def bound_of(name: str) -> Callable[[Tensor, Tensor], Tensor]:
        def bound(upstream: Tensor, out: Tensor) -> Tensor:
            xn, rstd, w, _ = stats()
            err = restored_error(out)
            g = upstream.double()
            rows = g.numel() // c
            # PyTorch's kernels work with x and the mean (which cancel to xn), rounded in the dtype. (A row holding
            # NaN/inf has no finite gradient to bound: 0 there, not NaN for every channel's sum over rows.)
            scaled_x = ((x.double().abs() + x.double().mean(-1, keepdim=True).abs()) * rstd).nan_to_num(0.0, 0.0)
            if name == "x":  # grad_x = rstd (gw - mean(gw) - xn mean(gw xn)), gw = g w
                error, size = _normalised_bounds(g * w, xn, err, -1, rstd, scaled_x)
                return error + _rounding(d.dtype, c, size)
            flat = (g.abs() * err).reshape(rows, c).sum(0)  # grad_w = sum over rows of g xn
            size = g.abs() * (torch.maximum(xn.abs(), scaled_x) + err)
            return flat + _rounding(d.dtype, rows, size.reshape(rows, c).sum(0))

        return bound

    # Lossless: rebuilt from the output, so within the output's rounding too (the bound)
    rule = (lambda n: Rule("lossless", None, bound_of(n))) if cfg is None else (lambda n: _lossy(bound=bound_of(n)))
    rules = {n: rule(n) for n in ("x", "weight")}
    rules["bias"] = LOSSLESS  # sum(grad_y), in fp32 (PyTorch's bf16 kernel sums in bf16 chunks)
    # LayerNorm over one or two channels (xn is 0, or +-1: grad_x is zero in exact arithmetic, float noise), or
    # over a broadcast row (constant)
    degenerate = centered and (c <= 2 or x.stride(-1) == 0)
    return d.case(plain, slim, inputs, rules, scale_free=("huge",), degenerate=degenerate, heavy_ok=True)


def _dropout(draw) -> Case:
    d = Draws.of(draw)
    x = d.tensor(draw, _sizes(draw, draw(st.integers(1, 3))))
    p = draw(st.sampled_from([0.1, 0.5, 0.9, 1.0]))
    # The same draws from PyTorch's generator (seeded alike before each call): the mask is PyTorch's, kept as bits.
    return d.case(lambda x: F.dropout(x, p, True), lambda x: sf.dropout(x, p, True), {"x": x}, {"x": EXACT})


def _conv(draw) -> Case:
    d = Draws.of(draw)
    if d.dtype == torch.bfloat16:
        # No bf16 reference: PyTorch's bf16 CPU convolution (torch 2.13) reads uninitialised memory, forward and
        # backward, in any layout: the same call on the same inputs differs with what was freed before it (the
        # weight gradient by up to 1e38 on ~2% of small shapes, the forward on ~0.3%). slimact's forward is that
        # kernel; its backward runs in fp32 on the CPU (tests/functional/test_conv.py::test_bf16_weight_gradient_*).
        reject()
    nd = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 2, 3]))
    c_in, c_out = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    largest = 2 if nd == 3 else 3  # 3-d: smaller kernels, to keep the case's work in the budget
    kernel = [draw(st.integers(1, largest)) for _ in range(nd)]
    stride = [draw(st.integers(1, 3)) for _ in range(nd)]
    dilation = [draw(st.integers(1, largest - 1)) for _ in range(nd)]
    padding = [draw(st.integers(0, k - 1)) for k in kernel]
    reach = [dl * (k - 1) + 1 - 2 * p for k, dl, p in zip(kernel, dilation, padding, strict=True)]
    # A quarter of the work of other ops: the float64 (gold, bound) and fp16 convolutions are PyTorch's slow paths
    free = _sizes(draw, nd + 1, work=max(1, WORK // (4 * c_in * c_out * math.prod(kernel))))
    batch, spatial = free[0], [max(1, r) + f - 1 for r, f in zip(reach, free[1:], strict=True)]
    layouts = [*LAYOUTS, "channels_last"] if nd >= 2 else LAYOUTS
    x = d.tensor(draw, [batch, c_in, *spatial], layouts)
    w_shape = (c_out, c_in // groups, *kernel)
    inputs = {"x": x, "weight": _weight(w_shape, d.dtype, d.gen, c_in * math.prod(kernel))}
    if draw(st.booleans()):
        inputs["bias"] = _weight((c_out,), d.dtype, d.gen)
    cfg = _cfg(draw, list(x.shape), (1,))

    def plain(x, weight, bias=None):
        return torch.convolution(x, weight, bias, stride, padding, dilation, False, [0] * nd, groups)

    def slim(x, weight, bias=None):
        return sf.conv(x, weight, bias, stride, padding, dilation, groups, cfg)

    def bound(upstream: Tensor, _out: Tensor) -> Tensor:
        # grad_W is bilinear in (grad_y, x) with non-negative coefficients: its value at (|grad_y|, err) bounds it
        g = upstream.double().abs()
        err = _restore_error(x, cfg)

        def weight_grad(t: Tensor) -> Tensor:
            return torch.ops.aten.convolution_backward(
                g, t, torch.zeros(w_shape, dtype=torch.float64), None, stride, padding, dilation, False,
                [0] * nd, groups, [False, True, False])[1]

        terms = g.numel() // c_out
        size = x.detach().double().abs() + err
        return _product_bound(weight_grad, err, size, terms, d.dtype)

    # grad_x needs only W, grad_b only grad_y: PyTorch's own convolution_backward, but on x_hat's layout
    # (contiguous), which may round and sum otherwise than PyTorch's channels-last kernel: to float rounding
    # (grad_b: 2e-6 relative over 1269 terms, fp32).
    rules = {"x": LOSSLESS, "weight": _lossy(bound=bound), "bias": LOSSLESS}
    return d.case(plain, slim, inputs, rules, scale_free=PRODUCT, heavy_ok=True)


def _batch_norm(draw) -> Case:
    d = Draws.of(draw)
    rank = draw(st.integers(2, 5))
    n, c, *spatial = _sizes(draw, rank)
    # One value per channel is PyTorch's error (test_batch_norm.py); with two, grad_x is zero in exact arithmetic
    # (the normalised input is +-1), float noise in PyTorch: test_two_samples_per_channel_... covers both.
    n = max(n, 3)
    x = d.tensor(draw, [n, c, *spatial], [*LAYOUTS, "channels_last"])
    inputs = {"x": x}
    if draw(st.booleans()):
        inputs["weight"] = (torch.rand(c, generator=d.gen) + 0.5).to(d.dtype)
        inputs["bias"] = torch.randn(c, generator=d.gen).to(d.dtype)
    track = draw(st.booleans())
    stats = [(torch.zeros(c, dtype=d.dtype), torch.ones(c, dtype=d.dtype)) if track else (None, None)
             for _ in range(2)]
    cfg = _cfg(draw, list(x.shape), (1,))
    per_channel = dataclasses.replace(cfg, group_dim=1, groups=0)  # what it keeps, whatever the config's groups
    dims = [0, *range(2, rank)]

    def plain(x, weight=None, bias=None):
        return F.batch_norm(x, *stats[0], weight, bias, True, 0.1, 1e-5)

    def gold(x, weight=None, bias=None):  # the running statistics are not the gold run's to move
        return F.batch_norm(x, None, None, weight, bias, True, 0.1, 1e-5)

    def slim(x, weight=None, bias=None):
        return sf.batch_norm(x, *stats[1], weight, bias, 0.1, 1e-5, cfg)

    def check():  # running statistics advanced exactly as PyTorch's
        for ours, torchs in zip(stats[1], stats[0], strict=True):
            if torchs is not None:
                torch.testing.assert_close(ours, torchs, rtol=0, atol=0, equal_nan=True)

    def bound_of(name: str) -> Callable[[Tensor, Tensor], Tensor]:
        def bound(upstream: Tensor, _out: Tensor) -> Tensor:
            # As LayerNorm's, per channel: xn = (x_hat - mean) invstd with the batch's exact mean and invstd
            xd, g = x.double(), upstream.double()
            var, mean = torch.var_mean(xd, dims, unbiased=False, keepdim=True)
            invstd = (var + 1e-5).rsqrt()
            xn = (xd - mean) * invstd
            err = invstd * (_restore_error(x, per_channel) + _flushed(d.dtype)) + 4 * EPS32 * xn.abs()
            w = inputs["weight"].double().abs().view(1, c, *[1] * len(spatial)) if "weight" in inputs else 1.0
            terms = g.numel() // c
            if name == "x":
                error, size = _normalised_bounds(g, xn, err, dims, w * invstd, (xd.abs() + mean.abs()) * invstd)
                return error + _rounding(d.dtype, terms, size)
            return (g.abs() * err).sum(dims) + _rounding(d.dtype, terms, (g.abs() * (xn.abs() + err)).sum(dims))

        return bound

    # grad_b is sum(grad_y): PyTorch's own kernel, but on x_hat's layout (contiguous), which may sum in another
    # order than on x's (expanded, channels-last): to float rounding. grad_x and grad_W see the 8-bit x.
    rules = {"x": _lossy(bound=bound_of("x")), "weight": _lossy(bound=bound_of("weight")), "bias": LOSSLESS}
    degenerate = x.stride(0) == 0 and math.prod(spatial) == 1  # the batch broadcast: constant channels
    return d.case(plain, slim, inputs, rules, scale_free=("huge",), degenerate=degenerate, gold=gold, check=check,
                  heavy_ok=True)


def _group_norm(draw) -> Case:
    d = Draws.of(draw)
    n, c, *spatial = _sizes(draw, 2 + draw(st.integers(0, 2)))
    groups = draw(st.sampled_from([k for k in range(1, c + 1) if c % k == 0]))
    cg, s = c // groups, math.prod(spatial)
    m = cg * s  # one row per (n, g): C/G channels x spatial
    # One value per channel-group across the batch (N * C/G * S == 1) is PyTorch's error (F.group_norm's
    # _verify_batch_size), which sf.group_norm raises alike (tests/functional/test_norm.py): no case for the bounds
    n = max(n, 2) if n * m == 1 else n
    x = d.tensor(draw, [n, c, *spatial], [*LAYOUTS, "channels_last"] if len(spatial) == 2 else LAYOUTS)
    affine = draw(st.sampled_from(["none", "weight", "bias"]))
    inputs = {"x": x}
    if affine != "none":  # gammas in [0.5, 1.5]
        inputs["weight"] = (torch.rand(c, generator=d.gen) + 0.5).to(d.dtype)
    if affine == "bias":
        inputs["bias"] = (torch.randn(c, generator=d.gen) * 0.1).to(d.dtype)
    # The policy's 8-bit config for a GroupNorm: grouped along dim 1 (slimact.policy._CHANNEL_FIRST_KINDS), or one
    # scale. The Function packs its output per channel whatever the groups, its input (the guard) by the config.
    cfg = None if draw(st.booleans()) else _cfg(draw, list(x.shape), (1,))
    eps, dims = 1e-5, (2, 3)

    def rows(t: Tensor) -> Tensor:  # [N, C, *] as [N, G, C/G, S]
        return t.reshape(n, groups, cg, s)

    def plain(x, weight=None, bias=None):
        return F.group_norm(x, groups, weight, bias, eps)

    def slim(x, weight=None, bias=None):
        return sf.group_norm(x, groups, weight, bias, eps, cfg)

    def stats():
        """float64 rows of x, their mean, xn, rstd, and w, b broadcast per channel ([1, G, C/G, 1])."""
        xd = rows(x.double())
        var, mean = torch.var_mean(xd, dims, unbiased=False, keepdim=True)
        rstd = (var + eps).rsqrt()
        weight, bias = inputs.get("weight"), inputs.get("bias")
        w = torch.ones(()) if weight is None else weight.double().view(1, groups, cg, 1)
        b = torch.zeros((), dtype=torch.float64) if bias is None else bias.double().view(1, groups, cg, 1)
        return xd, mean, (xd - mean) * rstd, rstd, w, b

    def restored_error(out: Tensor) -> Tensor:
        """As LayerNorm's (see _norm), per (n, g) row: ``(y_hat - b) / w``, y kept per channel along dim 1, or
        ``(x_hat - mean) * rstd``, x kept by the config; then, at 8 bits, the re-centring per row
        (:func:`_recentred_error`)."""
        xd, mean, xn, rstd, w, b = stats()
        y = rows(out.double())
        per_channel = None if cfg is None else dataclasses.replace(cfg, group_dim=1, groups=0)
        rounding = torch.finfo(d.dtype).eps * y.abs() + 4 * EPS32 * (y.abs() + b.abs())
        forward = 2 * EPS32 * (xd.abs() + mean.abs()) * rstd
        from_output = (rows(_restore_error(out, per_channel)) + rounding) / w.abs() + forward
        from_input = rstd * rows(_restore_error(x, cfg)) + 4 * EPS32 * xn.abs()
        err = torch.maximum(from_output.nan_to_num(math.inf), from_input) + _flushed(d.dtype) * rstd
        return _recentred_error(err, xn, dims, m) if cfg is not None else err

    def bound_of(name: str) -> Callable[[Tensor, Tensor], Tensor]:
        def bound(upstream: Tensor, out: Tensor) -> Tensor:
            xd, mean, xn, rstd, w, _ = stats()
            err = restored_error(out)
            g = rows(upstream.double())
            # PyTorch's kernels work with x and the row's mean (which cancel to xn); 0 on a row holding NaN/inf
            scaled_x = ((xd.abs() + mean.abs()) * rstd).nan_to_num(0.0, 0.0)
            if name == "x":  # grad_x = rstd (gw - mean_row(gw) - xn mean_row(gw xn)), gw = g w_c
                error, size = _normalised_bounds(g * w, xn, err, dims, rstd, scaled_x)
                return (error + _rounding(d.dtype, m, size)).reshape(x.shape)
            flat = (g.abs() * err).sum((0, 3)).reshape(c)  # grad_w[c] = sum over n and spatial of g xn
            size = (g.abs() * (torch.maximum(xn.abs(), scaled_x) + err)).sum((0, 3)).reshape(c)
            return flat + _rounding(d.dtype, n * s, size)

        return bound

    rule = (lambda n: Rule("lossless", None, bound_of(n))) if cfg is None else (lambda n: _lossy(bound=bound_of(n)))
    rules = {name: rule(name) for name in ("x", "weight")}
    rules["bias"] = LOSSLESS  # sum over n and spatial of grad_y, in fp32
    # A row of one or two elements (xn is 0, or +-1: grad_x is zero in exact arithmetic, float noise)
    return d.case(plain, slim, inputs, rules, scale_free=("huge",), degenerate=m <= 2, heavy_ok=True)


def _gated_mlp(draw) -> Case:
    d = Draws.of(draw)
    *lead, inter, hidden = _sizes(draw, draw(st.integers(1, 3)) + 1)
    form = draw(st.sampled_from(SMOOTH))
    which = draw(st.sampled_from(["g", "u"]))  # the input that gets the NaN/inf, if any
    g = d.tensor(draw, [*lead, inter], bad=which == "g")
    u = d.tensor(draw, [*lead, inter], bad=which == "u")
    inputs = {"g": g, "u": u, "weight": _weight((hidden, inter), d.dtype, d.gen, inter)}
    if draw(st.booleans()):
        inputs["bias"] = _weight((hidden,), d.dtype, d.gen)
    cfg = None if draw(st.booleans()) else _cfg(draw, list(g.shape))
    act = PLAIN_ACTIVATIONS[form]
    d1, d2 = _lipschitz(form)

    def plain(g, u, weight, bias=None):
        return F.linear(act(g) * u, weight, bias)

    def slim(g, u, weight, bias=None):
        return sf.gated_mlp(g, u, weight, bias, form, cfg, act=act)

    def bound_of(name: str) -> Callable[[Tensor, Tensor], Tensor]:
        def bound(upstream: Tensor, _out: Tensor) -> Tensor:
            # With |g_hat - g| <= e_g, |u_hat - u| <= e_u: act(g_hat) within d1 e_g, act'(g_hat) within d2 e_g
            # (a subnormal operand may also be flushed to zero by PyTorch's fp16/bf16 kernels)
            e_g, e_u = _gate_error(g, cfg) + _flushed(d.dtype), _restore_error(u, cfg) + _flushed(d.dtype)
            gd, ud = g.double(), u.double()
            gy = upstream.double()
            gh = (gy @ inputs["weight"].double()).abs()  # grad_h = grad_y W, exact
            # grad_h's own rounding scales with sum |grad_y| |W|, not |grad_y W| (which may cancel).
            gsize = gy.abs() @ inputs["weight"].double().abs()
            a, da = act(gd).abs(), derivative(form, gd).abs()
            if name == "u":  # grad_u = grad_h act(g_hat)
                return gh * d1 * e_g + _rounding(d.dtype, hidden, gsize * (a + d1 * e_g))
            if name == "g":  # grad_g = grad_h u_hat act'(g_hat); act' sums terms up to max|act'| (rounding)
                err = gh * (e_u * (da + d2 * e_g) + ud.abs() * d2 * e_g)
                # Both sides also round the two elementwise products (grad_h * u, then * act') in the dtype, and
                # evaluate act' by different formulas (autograd's GELU backward vs slimact.functional.activation
                # .derivative), each a few fp32 ulps of act' off.
                products = (4 * torch.finfo(d.dtype).eps + 16 * EPS32) * gh * (ud.abs() + e_u) * d1
                # A subnormal factor in those products may be flushed to zero by either side's kernels (fp32
                # included): each may lose up to the smallest normal times its other factors.
                products = products + 4 * TINY32 * (gsize + 1) * (ud.abs() + e_u + d1)
                return err + products + _rounding(d.dtype, hidden, gsize * (ud.abs() + e_u) * d1)
            # grad_W = grad_y^T (act(g_hat) u_hat)
            e_h = d1 * e_g * (ud.abs() + e_u) + a * e_u
            rows = gy.numel() // hidden
            flat_g = gy.abs().reshape(rows, hidden).t()
            size = flat_g @ ((a + d1 * e_g) * (ud.abs() + e_u)).reshape(rows, inter)
            return flat_g @ e_h.reshape(rows, inter) + _rounding(d.dtype, rows, size)

        return bound

    if cfg is None:
        rules = dict.fromkeys(["g", "u", "weight"], LOSSLESS)
    else:  # the floor of tests/functional/test_mlp.py
        rules = {n: _lossy(("cosine", 0.99), bound_of(n)) for n in ("g", "u", "weight")}
    rules["bias"] = EXACT
    return d.case(plain, slim, inputs, rules, heavy_ok=True)


def _lm_loss(draw) -> Case:
    d = Draws.of(draw)
    # One class makes the loss identically 0: its gradient is float noise in both.
    *lead, c, vocab = _sizes(draw, draw(st.integers(1, 2)) + 2)
    vocab = max(vocab, 2)
    h = d.tensor(draw, [*lead, c])
    tokens = math.prod(lead)
    target = torch.randint(0, vocab, (tokens,), generator=d.gen)
    target[torch.rand(tokens, generator=d.gen) < draw(st.sampled_from([0.0, 0.3, 1.0]))] = -100
    inputs = {"h": h, "weight": _weight((vocab, c), d.dtype, d.gen, c)}
    if draw(st.booleans()):
        inputs["bias"] = _weight((vocab,), d.dtype, d.gen)
    smoothing = draw(st.sampled_from([0.0, 0.1]))
    reduction = draw(st.sampled_from(["mean", "sum"]))
    given = draw(st.booleans())  # the head's logits handed in (the routed model loss), or computed per chunk
    # Up to 7 chunks, their boundaries anywhere. (Each chunk's weight gradient is added to the others' in fp32, a
    # rounding per chunk beyond PyTorch's one product: float rounding while the chunks are few, as they are at
    # the real 4M logits per chunk.)
    rows = -(-tokens // draw(st.sampled_from([1, 2, 3, 7])))

    def plain(h, weight, bias=None):
        logits = F.linear(h, weight, bias).reshape(tokens, vocab)
        return F.cross_entropy(logits, target, label_smoothing=smoothing, reduction=reduction)

    def slim(h, weight, bias=None):
        logits = F.linear(h, weight, bias).reshape(tokens, vocab) if given else None
        return sf.linear_cross_entropy(h, weight, bias, target, label_smoothing=smoothing, reduction=reduction,
                                       logits=logits)

    # The forward runs in fp32 chunks (a logsumexp per chunk), not as F.cross_entropy's log-softmax over the whole
    # [tokens, vocab]: equal to float rounding only.
    case = d.case(plain, slim, inputs, dict.fromkeys(inputs, LOSSLESS), forward_equal=False,
                  terms={"h": vocab, "weight": tokens, "bias": tokens})
    case.patches.append(mock.patch.object(lm_loss_module, "CHUNK_ELEMENTS", rows * vocab))
    return case


def _attention_sizes(draw) -> tuple[int, int, int, int, int, int]:
    """``(B, H, H_kv, T, S, D)``: ``H`` a multiple of ``H_kv`` (grouped-query attention)."""
    b, h_kv, rep, t, s, dd = _sizes(draw, 6, cap=CAP if LONG else 16)
    return b, h_kv * rep, h_kv, t, s, dd


def _reference_attention(scores: Tensor, v: Tensor, p: float) -> Tensor:
    """Eager attention's tail as Hugging Face computes it: fp32 softmax, dropout, product with repeated v
    (``repeat_kv``: v itself, with its strides, when the heads match)."""
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(scores.dtype)
    probs = F.dropout(probs, p, p > 0)
    n_rep = scores.shape[1] // v.shape[1]
    return torch.matmul(probs, v if n_rep == 1 else v.repeat_interleave(n_rep, dim=1))


def _softmax_dropout_matmul(draw) -> Case:
    d = Draws.of(draw)
    b, h, h_kv, t, s, dd = _attention_sizes(draw)
    which = draw(st.sampled_from(["scores", "v"]))  # the input that gets the NaN/inf, if any
    inputs = {"scores": d.tensor(draw, [b, h, t, s], bad=which == "scores"),
              "v": d.tensor(draw, [b, h_kv, s, dd], bad=which == "v")}
    p = draw(st.sampled_from([0.0, 0.1, 0.5]))
    lossy = draw(st.booleans())
    cfg_p = _cfg(draw, [b, h, t, s], (1, -1)) if lossy else None
    cfg_v = _cfg(draw, [b, h_kv, s, dd], (1, -1)) if lossy else None
    rule = _lossy() if lossy else LOSSLESS  # the floor of tests/functional/test_attention.py, any row length

    def slim(scores, v):
        return sf.softmax_dropout_matmul(scores, v, p, cfg_p, cfg_v)

    # With fewer key/value heads the product runs on grouped views, the reference on repeated v: another batching
    # of the same products, which may round differently.
    return d.case(lambda scores, v: _reference_attention(scores, v, p), slim, inputs, dict.fromkeys(inputs, rule),
                  forward_equal=h == h_kv, zero_scale="v", terms={"scores": s * dd, "v": t * h})


def _sdpa(draw) -> Case:
    d = Draws.of(draw)
    b, h, h_kv, t, s, dd = _attention_sizes(draw)
    which = draw(st.sampled_from("qkv"))
    inputs = {name: d.tensor(draw, [b, heads, length, dd], bad=which == name)
              for name, heads, length in (("q", h, t), ("k", h_kv, s), ("v", h_kv, s))}
    kw: dict = {"enable_gqa": h != h_kv, "dropout_p": draw(st.sampled_from([0.0, 0.0, 0.2])),
                "scale": draw(st.sampled_from([None, 0.3]))}
    mask = draw(st.sampled_from(["none", "causal", "bool", "additive"]))
    if mask == "causal":
        kw["is_causal"] = True
    elif mask == "bool":  # padding; some rows may be fully masked (PyTorch gives them 0)
        kw["attn_mask"] = torch.rand(b, 1, t, s, generator=d.gen) > draw(st.sampled_from([0.3, 0.9]))
    elif mask == "additive":
        kw["attn_mask"] = torch.randn(b, 1, 1, s, generator=d.gen).to(d.dtype)
    cfg = _cfg(draw, [b, h_kv, s, dd], (1,)) if draw(st.booleans()) else None

    def plain(q, k, v):
        mask = kw.get("attn_mask")
        return F.scaled_dot_product_attention(q, k, v, **{**kw, "attn_mask": _like(mask, q)})

    def slim(q, k, v):
        return sf.scaled_dot_product_attention(q, k, v, **kw, cfg=cfg)

    def gold(q, k, v):  # the definition: PyTorch's math path (its CPU flash kernel runs float64 too)
        with sdpa_kernel(SDPBackend.MATH):
            return plain(q, k, v)

    def forward_size() -> Tensor:
        # Each score is rounded relative to its terms' magnitude, |q| |k|^T scale (1e8 with heavy tails: an ulp
        # of 8), and a score's error e_j moves the output by at most sum_j P_j |e_j - sum_i P_i e_i| |v_j|: so
        # the output's rounding scales with max_j (|q| |k|^T scale)_j * (P |v|), P the probabilities (dropout's
        # 1 / (1 - p) included), not with the output. float64.
        q, k, v = (inputs[n].double() for n in "qkv")
        k, v = (t.repeat_interleave(h // h_kv, dim=1) for t in (k, v))  # [B, H, S, D]
        mag = (q.abs() @ k.abs().transpose(-1, -2)) * (kw["scale"] or 1 / math.sqrt(dd))
        scores = (q @ k.transpose(-1, -2)) * (kw["scale"] or 1 / math.sqrt(dd))
        mask = kw.get("attn_mask")
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.double()
        if kw.get("is_causal"):
            scores = scores.masked_fill(~torch.ones(t, s, dtype=torch.bool).tril(), -math.inf)
        probs = torch.softmax(scores, -1).nan_to_num(0.0)
        return (probs @ v.abs()) * mag.amax(-1, keepdim=True).nan_to_num(0.0) / (1 - kw["dropout_p"])

    # The floor of tests/functional/test_attention.py: 25 dB for q, k, v (three 8-bit tensors meet in the scores).
    # Fused: PyTorch's CPU flash kernel or a chunked flash-style path, not the kernel F.scaled_dot_product_attention
    # picks: the forward is equal to float rounding only.
    rule = LOSSLESS if cfg is None else _lossy(("sqnr", 25.0))
    return d.case(plain, slim, inputs, dict.fromkeys(inputs, rule), forward_equal=False, zero_scale="v",
                  kernel_nan=True, masked=mask != "none", gold=gold, forward_size=forward_size,
                  terms={"q": s * dd, "k": t * h, "v": t * h, "forward": dd})


def _like(mask: Tensor | None, q: Tensor) -> Tensor | None:
    """An additive mask in q's dtype (the gold run is float64)."""
    return mask.to(q.dtype) if mask is not None and mask.is_floating_point() else mask


BUILDERS: dict[str, Callable] = {
    "linear": _linear,
    "matmul": _matmul,
    "softmax": _softmax,
    "activation": _activation,
    "norm": _norm,
    "dropout": _dropout,
    "conv": _conv,
    "batch_norm": _batch_norm,
    "group_norm": _group_norm,
    "gated_mlp": _gated_mlp,
    "linear_cross_entropy": _lm_loss,
    "softmax_dropout_matmul": _softmax_dropout_matmul,
    "scaled_dot_product_attention": _sdpa,
}


# ---------------------------------------------------------------------------------------------------------
# Running and judging.


@dataclass
class Run:
    out: Tensor
    grads: dict[str, Tensor | None]
    upstream: Tensor


def _run(fn: Callable[..., Tensor], case: Case, dtype: torch.dtype | None = None, magnitude: bool = False) -> Run:
    """One forward and backward of ``fn`` on leaves of the inputs (cast to ``dtype``, if given); the upstream
    gradient (its magnitude, if asked) and the dropout draws depend on the case's seed only."""
    leaves = {n: (t.detach() if dtype is None else t.detach().to(dtype)).requires_grad_(True)
              for n, t in case.inputs.items()}
    torch.manual_seed(case.seed)
    out = fn(*leaves.values())  # the builders list the inputs in the order the calls take them
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(case.seed + 1)).to(case.dtype)
    loss, out = upstream_loss(out, upstream.abs() if magnitude else upstream), out.detach()
    loss.backward()
    return Run(out, {n: t.grad for n, t in leaves.items()}, upstream)


def _norm2(t: Tensor) -> float:
    return t.double().norm().item()


#: How far from the exact result another algorithm's float rounding may land, in roundings of the result or in
#: units of PyTorch's own error (see _assert_rounding): the same sums taken in another order or blocking
#: (flash-style rescaled partial sums, a softmax term from the output rounded to fp16, fp32 accumulation
#: against per-op rounding) differ in their rounding by a small factor, not by orders of magnitude as an
#: 8-bit error would.
ROUNDINGS = 4


def _assert_rounding(name: str, approx: Tensor, exact: Tensor, gold: Tensor,
                     size: Callable[[], Tensor] | None = None, terms: int = 1) -> None:
    """``approx`` equals PyTorch's ``exact`` to float rounding: ``assert_close``'s default tolerances, elementwise,
    or, failing that, normwise against the float64 ``gold``: within the same rtol of its norm, within
    ``ROUNDINGS`` roundings of it or times PyTorch's own error, or within ``terms`` roundings of ``size()`` (the
    exact gradient of the upstream's magnitude: the sum's terms without their cancelling signs; ``terms``: how
    many each element sums, for a kernel adding them one after another, as PyTorch's CPU flash kernel
    accumulates a key's gradient over queries and heads).

    Elementwise tolerances cannot hold where an element cancels (its rounding is relative to the terms it sums,
    not to the result: LayerNorm's gradient scaled by 1/sqrt(eps) on a constant row), where fp16/bf16 kernels
    round intermediates differently (PyTorch's own differ from the exact ones by more than the tolerance there),
    or where a value is zero in exact arithmetic and only rounding noise remains."""
    rtol, atol = _tolerance(exact.dtype)
    if torch.allclose(approx, exact, rtol=rtol, atol=atol):
        return
    err = _norm2(approx.double() - gold)
    own = max(torch.finfo(exact.dtype).eps * _norm2(gold), _norm2(exact.double() - gold))
    allowed = max(rtol * _norm2(gold), ROUNDINGS * own)
    if err > allowed and size is not None:  # a sum of n terms, in any order: within n roundings of their size
        allowed = max(allowed, max(ROUNDINGS, terms) * torch.finfo(exact.dtype).eps * _norm2(size()))
    assert err <= allowed, f"{name}: {err:.3g} from the exact one, over {allowed:.3g} (not assert_close either)"


#: Fewest elements a gradient needs for its SQNR to be a statistic: a k-element gradient's energy fluctuates like
#: a chi-square with k degrees of freedom (each element a sum of products that may happen to cancel), so one
#: element falls 10 dB below its typical size one time in four, 16 of them practically never. An input seen
#: through a broadcast view (``Case.broadcast``) takes the same few degrees of freedom from any gradient:
#: ``grad_b = a^T g`` with the rows of ``a`` one broadcast row ``r`` is ``r * sum(g)``, a single random sum that
#: may cancel, while the 8-bit error (rounded per element) does not.
FLOOR_MIN_ELEMENTS = 16


def _judge(name: str, approx: Tensor, exact: Tensor, gold: Tensor, rule: Rule, case: Case, torchs: Run,
           where: Tensor, size: Callable[[], Tensor]) -> None:
    """Property 2 for one gradient (``approx``, ``exact``, ``gold``: the elements ``where`` all are finite;
    ``size``: see :func:`_assert_rounding`).

    * A bound, where the rule has one, holds elementwise on all data.
    * The floor (lossy) or float rounding (lossless, :func:`_assert_rounding`; where a lossless rule has a bound,
      a normalisation rebuilt from its rounded output, that bound) holds on well-conditioned data: normal, a
      distribution that is a scaled copy of it for this op (``Case.scale_free``), heavy tails where outliers are
      kept apart (``Case.heavy_ok``).
    * Constant and all-zero tensors are restored exactly (zero-range scale groups, tests/quant/test_core.py):
      there a gradient equals PyTorch's to float rounding, or, for ops that rebuild a tensor from another (a
      normalisation: the output's rounding, amplified by 1/sqrt(eps)), stays within its bound.
    * Heavy tails (1% at 1e4) in a softmax's or attention's scores saturate it, and huge or denormal inputs
      saturate or underflow a softmax, an activation, a product of two tensors (and make it ill-conditioned: its
      gradient then hangs on the last bit of each score, lossless or not): no floor holds there, only the bound.
      Fused attention and the LM loss have no bound: on such data, only properties 1, 3 and 4.
    * Attention: a gradient that is zero in exact arithmetic (softmax over one key, uniform attention over
      constant keys) is float noise in PyTorch; it only has to stay at noise level (tests/functional/
      test_attention.py).
    """
    if rule.bound is not None:
        allowed = rule.bound(torchs.upstream, torchs.out)[where]
        if exact.dtype in (torch.float16, torch.bfloat16):
            # PyTorch's own half-precision kernels round partial sums in the dtype (its fp16 LayerNorm weight
            # gradient over heavy tails: 2 ulps from the float64 one, where slimact's fp32 sum is within half an
            # ulp): the bound is on the distance from the exact value, so PyTorch's own distance from it is added.
            allowed = allowed + (exact.double() - gold).abs()
        excess = (approx.double() - exact.double()).abs() - allowed
        assert (excess <= 0).all(), f"{name}: error beyond the bound by {excess.max():.3g}"
    if rule.kind == "exact":
        torch.testing.assert_close(approx, exact, msg=lambda m: f"{name}: {m}")
        return
    if rule.kind == "bounded":
        return
    constant = case.dist in ("constant", "zero") and case.bad is None and rule.bound is None
    if not (case.well_conditioned or constant):
        return
    if case.zero_scale is not None:
        scale = _norm2(torchs.grads[case.zero_scale][torch.isfinite(torchs.grads[case.zero_scale])])
        if 0 < scale and _norm2(gold) <= 1e-5 * scale:
            # noise: a fraction of an 8-bit step, or the dtype's own rounding
            noise = max(1e-3, 2 * torch.finfo(case.dtype).eps) * scale
            assert _norm2(approx) <= noise, f"{name}: zero in exact arithmetic, not at noise level"
            return
    if _norm2(gold) == 0:  # nothing reaches it (every token ignored): zero, not a ratio to judge
        torch.testing.assert_close(approx, torch.zeros_like(approx), msg=lambda m: f"{name}: {m}")
        return
    if rule.kind == "lossless" and rule.bound is not None:
        return  # its bound is the float rounding of what it rebuilds from (a normalisation's bf16 output), above
    if rule.kind == "lossless" or constant:
        _assert_rounding(name, approx, exact, gold, size, case.terms.get(name, 1))
        return
    if rule.floor is None or exact.numel() < FLOOR_MIN_ELEMENTS or case.broadcast:
        return
    # Against PyTorch's gradient, or, where that is itself below the floor from the exact one (its bf16 LayerNorm
    # sums the weight gradient in bf16: 25.6 dB from exact over 3878 rows), against the exact gradient.
    kind, floor = rule.floor
    metric = sqnr_db if kind == "sqnr" else cosine
    value = max(metric(exact, approx), metric(gold, approx))
    assert value >= floor, f"{name}: {kind} {value:.4g} < {floor}"


def _non_finite(name: str, approx: Tensor, exact: Tensor, gold: Tensor, case: Case, unbounded: bool = False) -> Tensor:
    """Properties 3 and 4 where PyTorch's result (``exact``) and the float64 one (``gold``) agree on them: finite
    where both are (nothing non-finite made from finite values), NaN/inf where both are (NaN/inf placed in an
    input reach the result as in PyTorch). Where they disagree, PyTorch's own kernels do (an overflow in its
    dtype: its tanh-GELU cubes x), and either is right. Returns where all three are finite.

    Fused attention (``Case.kernel_nan``) follows its kernel: PyTorch's CPU flash kernel gives 0 for a row whose
    scores are all -inf where its math path (grouped-query attention, fp16, float64) gives NaN, and at 8 bits a
    query element restored as 0 turns an inf score into NaN. There NaN/inf placed in an input must not vanish:
    some element is NaN/inf wherever PyTorch's and the float64 one have some, unless a mask is given (PyTorch's
    math path adds it to the scores, NaN + -inf = NaN; a flash-style kernel skips masked keys, and a fully masked
    row gives 0). (Where only PyTorch's has some, its kernel disagrees with float64: a bf16 -inf query against keys
    of 1e-38 gives NaN in bf16, 0 in float64 and in slimact.)

    ``unbounded`` (see _check): property 3 is not asserted either."""
    finite, exact_finite = torch.isfinite(exact), torch.isfinite(gold)
    both = finite & exact_finite
    if case.kernel_nan and case.bad is not None:
        if not finite.all() and not exact_finite.all() and not case.masked:
            assert not torch.isfinite(approx).all(), f"{name}: NaN/inf in the input vanished"
        return both & torch.isfinite(approx)
    if unbounded:
        return both & torch.isfinite(approx)
    assert torch.isfinite(approx[both]).all(), f"{name}: NaN/inf where PyTorch's and the exact one are finite"
    if not case.kernel_nan:
        assert not torch.isfinite(approx[~finite & ~exact_finite]).any(), f"{name}: finite where PyTorch's is NaN/inf"
    return both


def _check(case: Case) -> None:
    try:
        torchs = _run(case.plain, case)
    except (RuntimeError, NotImplementedError) as e:  # a dtype PyTorch's CPU op lacks: nothing to compare with
        if "not implemented" in str(e):
            reject()
        raise
    gold = _run(case.gold or case.plain, case, torch.float64)
    magnitudes = functools.cache(lambda: _run(case.gold or case.plain, case, torch.float64, magnitude=True).grads)
    with contextlib.ExitStack() as stack:
        for patch in case.patches:
            stack.enter_context(patch)
        ours = _run(case.slim, case)
    # 1. the forward
    if case.forward_equal:
        torch.testing.assert_close(ours.out, torchs.out, rtol=0, atol=0, equal_nan=True, msg="forward differs")
    else:
        both = _non_finite("forward", ours.out, torchs.out, gold.out, case)
        size = None if case.forward_size is None else (lambda: case.forward_size()[both])
        _assert_rounding("forward", ours.out[both], torchs.out[both], gold.out[both], size,
                         case.terms.get("forward", 1))
    if case.check is not None:
        case.check()
    for name, rule in case.rules.items():
        exact, approx, g64 = torchs.grads[name], ours.grads[name], gold.grads[name]
        assert exact is not None and approx is not None, name
        assert approx.shape == exact.shape and approx.dtype == exact.dtype, name
        # Outside the floors' domain (heavy tails, huge values) a lossy gradient without a bound may be far off,
        # and an fp16 one may overflow where PyTorch's does not (its fp16 convolution backward sums in fp16: its own
        # partial sums overflow where the result fits, on other data): there property 3 is not asserted.
        unbounded = rule.kind == "lossy" and (rule.bound is None or case.dtype == torch.float16) and (
            case.dist in ("heavy", "huge"))
        both = _non_finite(name, approx, exact, g64, case, unbounded)  # 3 and 4
        _judge(name, approx[both], exact[both], g64[both], rule, case, torchs, both,
               lambda name=name, both=both: magnitudes()[name][both])


@contextlib.contextmanager
def _threads(n: int | None):
    """Run with ``n`` intra-op threads (``None``: as set). The CI profile's tensors are small: there, OpenMP's
    thread start-up and barriers cost 100x the arithmetic (0.27 s against 3 ms for a small float64 convolution
    with two threads per pytest-xdist worker on two cores)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@PROFILE
@pytest.mark.parametrize("function", list(BUILDERS))
@given(data=st.data())
def test_function_matches_torch(function, data):
    with _threads(None if LONG else 1):
        _check(BUILDERS[function](data.draw))


def test_every_public_function_is_covered():
    assert set(BUILDERS) == set(sf.__all__)
