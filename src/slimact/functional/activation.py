"""Pointwise activations: GELU (erf and tanh forms), QuickGELU and SiLU keep their 8-bit input, or, under a
lossless policy, their output plus a 1-bit branch mask (Tempo's in-place GELU); ReLU keeps a 1-bit mask; squared
ReLU keeps its 8-bit input, or, lossless, its output alone.

Math, per form, with ``s(z) = 1 / (1 + e^-z)``, ``Phi``/``phi`` the normal cdf/pdf, ``c = sqrt(2/pi)``::

    gelu        y = x Phi(x)                          y' = Phi(x) + x phi(x)
    gelu_tanh   y = x/2 (1 + tanh(u)), u = c (x + 0.044715 x^3)
                                                      y' = (1 + t)/2 + x/2 (1 - t^2) c (1 + 3 * 0.044715 x^2)
    quick_gelu  y = x s(1.702 x)                      y' = s + 1.702 x s (1 - s)
    silu        y = x s(x)                            y' = s + x s (1 - s)
    relu        y = max(x, 0)                         y' = [x > 0]
    relu2       y = max(x, 0)^2                       y' = 2 max(x, 0) = 2 sqrt(y)

The forward is the replaced module's own code (identical output, whatever formula it spells the
activation with: GPT-2's tanh GELU written as five elementwise ops keeps five full-size tensors in plain
PyTorch, here one 8-bit tensor). The backward evaluates ``y'`` in fp32 at the restored ``x_hat``.

What it keeps, 8-bit policies: ``x`` at ``b`` bits per element plus 8 bytes per scale group, its range clipped
to ``[-L, L]`` (``QuantConfig.clip``: what lies beyond saturates there), where ``L`` (6 for GELU, 18 for SiLU, 11
for QuickGELU) is where ``y'`` becomes constant to 1e-6, so the clip costs nothing and outliers do not stretch
the scale. The clip is the pack's: no pass of its own. Error: ``|x - x_hat| <= step/2`` inside ``[-L, L]``, so
the derivative's error is at most ``step/2 * max|y''|`` (0.80 for GELU, 0.50 for SiLU) + 1e-6; tests assert
SQNR >= 30 dB, also with 1% of the inputs at 1e4. The backward reads the codes and ``grad_y`` in one loop that
writes ``grad_x``, the restored ``x`` never written to memory (:func:`slimact.quant.unpack_map`), where the
compiled loops apply (8 bits, 256 Ki elements and more, on CPU and CUDA).

What it keeps, lossless policies (in-place): the output ``y``, which the next layer keeps anyway (one
storage), and the mask ``x >= x_min``, 1 bit per element. Each smooth form has a single minimum ``x_min``
(GELU -0.7518, tanh GELU -0.7525, QuickGELU -0.7512, SiLU -1.2785) and is monotonic on each side, so
``y'`` is a function of ``y`` on each branch. The backward reads it from a table, in fp32, one lookup and a
linear interpolation per element (about 15 elementwise passes; no iteration, no float64). The table's
coordinate is ``k = sqrt(y - y_min)`` on the right branch, where the inverse has a square-root singularity
that ``k`` straightens, and ``k = -(sqrt(y - y_min) + 0.01 log(y_min / y))`` on the left one, where ``y``
tends to 0 as ``x`` goes to minus infinity and the log term spreads the far tail over many cells; the grid
is uniform in ``k`` (spacing 1e-4, 30-60 thousand entries per form), and its values are ``y'`` at ``x``
found by inverting ``y`` in float64 (:func:`invert`: a bracketing table and safeguarded Newton steps),
once per form and device. Interpolation adds at most 4e-6 to the error below. Tempo's released spline
had a sign error on (1.1, 3.0), where its gradient reached 3.7 instead of 1.0.

Worst-case gradient error ``|y'(x_rebuilt) - y'(x)|`` over [-10, 10] and Gaussian inputs (measured, and
asserted by ``tests/functional/test_activation.py``); it comes from the rounding ``delta`` of ``y`` in its
dtype, which moves the rebuilt ``x`` by ``delta / |y'(x)|``, hence ``~ delta / |x - x_min|`` near the minimum
and ``sqrt(2 y''(x_min) delta)`` at it:

    fp32   <= 2e-5 for |x - x_min| >= 0.01;   <= 4e-4 within 0.01 of the minimum
    fp16   <= 1e-3 for |x - x_min| >= 0.2;    <= 1e-2 everywhere
    bf16   <= 1e-2 for |x - x_min| >= 0.2;    <= 3e-2 everywhere

The fp32 row allows for ``y`` as PyTorch's CPU kernels compute it: with a correctly rounded ``y`` the error is
below 5e-6 beyond 0.01 and 1.6e-4 everywhere, but the erf GELU's scalar path (strided inputs, e.g. a
transposed tensor) is off by up to 6e-7 absolute (40 ulp near the minimum), measured at 1.1e-5 and 2.7e-4.
(PyTorch's own bf16 gradient is rounded to bf16 too: a relative 4e-3.) Where ``y`` underflows to 0 on the
left tail (GELU below about -5.3 in fp32) the derivative is below 1e-6 and the rebuilt one is 0.

Squared ReLU (Primer's, Nemotron's ``ReLUSquaredActivation``, nanochat's ``F.relu(x).square()``) is simpler:
``y' = 2 sqrt(y)`` on its whole domain, so the lossless path keeps ``y`` alone (which the next layer keeps anyway:
no byte of its own) and its error is the rounding of ``y`` halved by ``sqrt``: about one ulp of ``max(x, 0)`` in
fp32 and bf16 (a relative 2^-9 in bf16), except where ``y`` underflows: there ``max(x, 0)`` is below ``sqrt`` of the
smallest normal (1.1e-19 in fp32, 2.4e-4 in fp16, whose derivative then loses up to 5e-4 absolute, inside the
1e-2 the in-place GELU states for fp16). Its 8-bit path keeps ``x`` unclipped (``y'`` is never constant on the
right), so the derivative is within one step of ``x`` (``2 * step / 2``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from slimact._cache import cache
from slimact.functional._saving import Mask, SlimFunction, foreign_saved_hooks, keep_output, load, save
from slimact.quant import QuantConfig, RunningRange, inductor, pack, unpack_map
from slimact.quant.core import note_kept_for, register_derivation, share_derived

__all__ = ["FORMS", "INPLACE_ERROR_BOUNDS", "MINIMUM", "activation", "build_tables", "derivative", "invert",
           "output_form", "reference"]

FORMS = ("gelu", "gelu_tanh", "quick_gelu", "silu", "relu", "relu2")


#: Where each smooth form has its minimum (y' = 0), to float64 precision.
MINIMUM = {"gelu": -0.7517915246935644, "gelu_tanh": -0.7524614220710162, "quick_gelu": -0.7511542554412889,
           "silu": -1.2784645427610737}
#: The stated worst-case error ``|y'(x_rebuilt) - y'(x)|`` of the in-place (lossless) path, by the dtype of
#: ``y`` (the table in the module docstring): ``(radius, bound beyond radius of x_min, bound everywhere)``.
INPLACE_ERROR_BOUNDS = {
    torch.float32: (0.01, 2e-5, 4e-4),
    torch.float16: (0.2, 1e-3, 1e-2),
    torch.bfloat16: (0.2, 1e-2, 3e-2),
}
# Beyond +-FLAT[form] the derivative is constant (0 on the left, 1 on the right) to within 1e-6, so the 8-bit
# path clips x's range to [-L, L]: an outlier then cannot stretch the scale and blur every other value (with 1%
# of the inputs at 1e4 the gradient's SQNR fell to -3 dB without the clip).
FLAT = {"gelu": 6, "gelu_tanh": 6, "quick_gelu": 11, "silu": 18}
# Left ends of the inverse tables: beyond them y' < 1e-20 and y is 0 in fp32 or close to it.
_LEFT_END = {"gelu": -10.0, "gelu_tanh": -10.0, "quick_gelu": -60.0, "silu": -104.0}
_RIGHT_END = 12.0  # beyond: x - y < 1e-4, and x = y is the start of Newton
_TABLE_SIZE = 2048


def _tanh_argument(x: Tensor) -> Tensor:
    # sqrt(2 / pi) (x + 0.044715 x^3). The constants here and in `derivative` (sqrt(2 / pi), sqrt(2 pi), 3 * 0.044715)
    # are literals, as FLAT's are integers: under torch.compile(dynamic=True) dynamo makes a module-level float an
    # input of the graph, and one read inside two autograd.Functions' forwards fails to trace (its
    # lift_tracked_freevar_to_input assertion).
    return 0.7978845608028654 * (x + 0.044715 * x.pow(3))


def reference(form: str, x: Tensor) -> Tensor:
    """The activation ``form`` computed in ``x``'s dtype (used to recognise modules by what they compute)."""
    if form == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if form == "gelu_tanh":
        return 0.5 * x * (1.0 + torch.tanh(_tanh_argument(x)))
    if form == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if form == "silu":
        return x * torch.sigmoid(x)
    if form == "relu":
        return x.clamp_min(0)
    if form == "relu2":
        return x.clamp_min(0).square()
    raise ValueError(f"unknown activation form {form!r}; known: {FORMS}")


for _form in ("gelu", "gelu_tanh", "quick_gelu", "silu", "relu2"):
    register_derivation(_form, functools.partial(reference, _form))


def derivative(form: str, x: Tensor) -> Tensor:
    """``y'(x)`` of ``form``, in ``x``'s dtype (call with fp32)."""
    if form == "gelu":
        return 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))) + x * torch.exp(-0.5 * x * x) / 2.5066282746310002
    if form == "gelu_tanh":
        t = torch.tanh(_tanh_argument(x))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
    if form in ("quick_gelu", "silu"):
        # (silu: x itself, not 1.0 * x, which a compiled loop took for another value and ran sigmoid twice on)
        ax = 1.702 * x if form == "quick_gelu" else x
        s = torch.sigmoid(ax)
        return s + ax * s * (1.0 - s)
    if form == "relu2":
        return 2.0 * x.clamp_min(0)
    raise ValueError(f"no smooth derivative for activation form {form!r}")


def _gradient(form: str, x: Tensor, grad_y: Tensor) -> Tensor:
    """``grad_y * y'(x)`` in fp32, in ``grad_y``'s dtype: the 8-bit backward, fused with the restore of ``x``."""
    return (grad_y.float() * derivative(form, x.float())).to(grad_y.dtype)


#: One callable per form (unpack_map compiles one loop per callable).
_GRADIENTS = {form: functools.partial(_gradient, form)
              for form in ("gelu", "gelu_tanh", "quick_gelu", "silu", "relu2")}


def _stable(form: str, x: Tensor) -> Tensor:
    """``reference`` written to keep its relative precision on the far left tail (for the tables)."""
    if form == "gelu":
        return x * 0.5 * torch.special.erfc(-x / math.sqrt(2.0))
    if form == "gelu_tanh":
        return x * torch.sigmoid(2.0 * _tanh_argument(x))
    return reference(form, x)


@cache
def _table(form: str, device: torch.device) -> tuple[Tensor, Tensor, float]:
    """float64 ``(x, key, y_min)``: ``x`` ascending over both branches, ``key`` ascending with it.

    ``key`` is ``y`` on the right branch and ``2 y_min - y`` (the left branch reflected below the minimum) on
    the left one, so one search finds any element's cell whatever its branch.
    """
    t = torch.linspace(0.0, 1.0, _TABLE_SIZE, dtype=torch.float64, device=device).pow(2)
    x_min = MINIMUM[form]
    x_left = (x_min - t[1:] * (x_min - _LEFT_END[form])).flip(0)  # ascending, ends just below x_min
    x_right = x_min + t * (_RIGHT_END - x_min)
    x = torch.cat([x_left, x_right])
    y = _stable(form, x)
    y_min = float(_stable(form, torch.tensor(x_min, dtype=torch.float64)))
    key = torch.where(x < x_min, 2 * y_min - y, y)
    return x, key, y_min


def _newton(form: str, y: Tensor, x: Tensor, lo: Tensor, hi: Tensor, right: Tensor, steps: int = 2) -> Tensor:
    """Safeguarded Newton on ``reference(form, x) = y`` inside the bracket ``[lo, hi]`` (increasing on the
    right branch, decreasing on the left)."""
    for _ in range(steps):
        f = _stable(form, x) - y
        above = torch.where(right, f > 0, f < 0)
        hi = torch.where(above, x, hi)
        lo = torch.where(above, lo, x)
        step = x - f / derivative(form, x)
        x = torch.where((step >= lo) & (step <= hi), step, (lo + hi) / 2)
    return x


def invert(form: str, y: Tensor, right: Tensor) -> Tensor:
    """float64 ``x`` with ``reference(form, x) = y`` on the branch ``right`` (``x >= x_min``) or left of it."""
    x_tab, key_tab, y_min = _table(form, y.device)
    y = torch.clamp(y.double(), min=y_min)  # rounding may put y a hair below the minimum
    key = torch.where(right, y, 2 * y_min - y)
    i = torch.searchsorted(key_tab, key).clamp_(1, len(key_tab) - 1)
    lo, hi = x_tab[i - 1], x_tab[i]
    k_lo, k_hi = key_tab[i - 1], key_tab[i]
    width = k_hi - k_lo  # zero where the far-left tail's keys coincide in float64
    start = lo + torch.where(width > 0, (key - k_lo) / width, 0.5) * (hi - lo)
    beyond = key > key_tab[-1]  # right of the table: x - y < 1e-4, Newton from x = y
    lo = torch.where(beyond, y, lo)
    hi = torch.where(beyond, y + 0.01, hi)
    start = torch.where(beyond, y, start).clamp(lo, hi)
    x = _newton(form, y, start, lo, hi, right)
    # Left of the table (y closer to 0 than y(LEFT_END)): y' is below 1e-20 there.
    return torch.where(key < key_tab[0], torch.full_like(x, _LEFT_END[form]), x)


_KEY_SPACING = 1e-4
_KEY_LOG = 0.01  # weight of the left branch's log term
_FP32_TINY = torch.finfo(torch.float32).tiny


def _key(y: Tensor, right: Tensor, y_min: float) -> Tensor:
    """The table coordinate of ``y`` (float32 or float64) on its branch (module docstring)."""
    root = (y - y_min).clamp_min(0).sqrt()
    # log(y_min / y) on the left branch, where y_min <= y < 0; y = 0 (an underflowed tail) gives +inf.
    tail = math.log(-y_min) - torch.clamp(-y, min=_FP32_TINY).log()
    return torch.where(right, root, -(root + _KEY_LOG * tail))


@cache
def _derivative_table(form: str, device: torch.device) -> tuple[Tensor, Tensor, int, float]:
    """fp32 ``(values, slopes, offset, y_min)``: ``y'`` at keys ``(j - offset) * _KEY_SPACING``."""
    x_min = MINIMUM[form]
    y_min = float(_stable(form, torch.tensor(x_min, dtype=torch.float64)))
    left = math.sqrt(-y_min) + _KEY_LOG * (math.log(-y_min) - math.log(_FP32_TINY))
    right_end = math.sqrt(FLAT[form] - y_min)  # beyond FLAT, y' is 1 to within 1e-6
    offset = math.ceil(left / _KEY_SPACING) + 1
    k = torch.arange(-offset, math.ceil(right_end / _KEY_SPACING) + 2, dtype=torch.float64) * _KEY_SPACING
    right = k >= 0
    # Left keys: y in [y_min, -tiny] by bisection (the key decreases as y rises towards 0).
    lo, hi = torch.full_like(k, y_min), torch.full_like(k, -_FP32_TINY)
    for _ in range(120):
        mid = (lo + hi) / 2
        up = _key(mid, torch.zeros_like(right), y_min) > k
        lo, hi = torch.where(up, mid, lo), torch.where(up, hi, mid)
    y = torch.where(right, y_min + k * k, (lo + hi) / 2)
    values = derivative(form, invert(form, y, right)).float().to(device)
    return values, values[1:] - values[:-1], offset, y_min


def _table_for(form: str, device: torch.device) -> tuple[Tensor, Tensor, int, float]:
    return _derivative_table(form, device)


def build_tables(device: torch.device) -> None:
    """Build every form's derivative table on ``device`` now (once per process and device; a backward builds the
    one it needs at its first use). ``slimact.profile(..., peak=True)`` calls it before measuring: built inside the
    measured backward, a table's temporaries made a first call's peak 39x the next one's (diffusers' DiT under
    "tempo": 10.4 MiB against 0.36; a sweep, 2026-12-07)."""
    for form in MINIMUM:
        _table_for(form, device)


# Under torch.compile the (cached) table is a constant of the graph, not traced: its build reads floats off
# tensors (graph breaks) and bisects for hundreds of passes. This is what torch.compiler.assume_constant_result
# does; calling it would import dynamo (and Triton) with slimact. (A graph-break test guards the marking.)
_table_for._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _inplace_gradient(y: Tensor, right: Tensor, grad_y: Tensor, values: Tensor, slopes: Tensor, offset: int,
                      y_min: float) -> Tensor:
    """``grad_y * y'``, ``y'`` read from the table at ``y``'s key on its branch ``right``: the in-place backward,
    eager or as one compiled loop (:func:`slimact.quant.inductor.fused`)."""
    # Fractional table position; NaN (a NaN or infinite y) is parked at 0 and restored below.
    pos = (_key(y.float(), right, y_min) * (1 / _KEY_SPACING) + offset).nan_to_num(0.0).clamp(0, values.numel() - 2)
    i = pos.long()
    d = values[i] + (pos - i) * slopes[i]
    # As PyTorch's: a non-finite input gives a NaN gradient (inf * 0 in its formula).
    d = torch.where(torch.isfinite(y), d, torch.nan)
    return (grad_y * d).to(grad_y.dtype)


def _loop_shape(*tensors: Tensor) -> bool:
    """Whether the compiled loop takes these tensors (one shape, contiguous, large enough to repay a call)."""
    t = tensors[0]
    return inductor.pays_off(t) and all(u.shape == t.shape and u.is_contiguous() and u.device == t.device
                                        for u in tensors)


def read_in_root(fn: Callable[[Tensor], Tensor], x: Tensor) -> None:
    """Under torch.compile, call the elementwise ``fn`` once on one element like ``x`` where the graph is traced,
    before an autograd.Function's forward calls it (its result is unused: the compiler drops it).

    Under ``dynamic=True`` dynamo makes each module-level float that model code reads (transformers' ``gelu_new``
    reads ``math.pi``) an input of the graph, and one first read inside two autograd.Functions' forwards fails to
    trace (``lift_tracked_freevar_to_input should not be called on root SubgraphTracer``: GPT-2 and T5 crashed);
    read here first, it is the root graph's input, which each Function's graph takes as plain model code's would.
    """
    if torch.compiler.is_compiling():
        fn(x.new_zeros(1))


def _apply(ctx, fn: Callable[[Tensor], Tensor], x: Tensor, inplace: bool, kept: Tensor | None = None) -> Tensor:
    """``fn(x)``; where ``fn`` wrote its result into ``x`` (an ``inplace=True`` module), ``x`` is marked dirty, so
    autograd sees the input overwritten, as with the plain module (whatever it kept is taken before: the mask
    or the pack). ``kept``: a tensor the Function keeps as it is, which an in-place ``fn`` must not have
    overwritten. Eagerly the write is detected (``x._version``) whether announced or not; under torch.compile
    (where reading the version breaks the graph) ``inplace`` says it."""
    if torch.compiler.is_compiling():
        y = fn(x)
        if inplace:
            ctx.mark_dirty(x)
        return y
    version = x._version
    y = fn(x)
    if x._version != version:
        if y is not x or kept is x:
            raise RuntimeError(
                "slimact: an activation module wrote into its input and returned "
                + ("another tensor" if y is not x else "it, with no `inplace` attribute saying so")
                + "; leave it out of the conversion (slimact.convert(model, filter_fn=...))"
            )
        ctx.mark_dirty(x)
    return y


class _InplaceActivationFunction(SlimFunction):
    layer = "activation (output kept)"

    @staticmethod
    def forward(ctx, x, fn, form, inplace):
        right = Mask.of(x >= MINIMUM[form])  # before fn, which may write y into x
        y = _apply(ctx, fn, x, inplace)
        ctx.form = form
        save(ctx, y, right)
        keep_output(y, ctx)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        y, right = load(ctx)
        values, slopes, offset, y_min = _table_for(ctx.form, y.device)
        args = (y, right, grad_y, values, slopes, offset, y_min)
        if _loop_shape(y, right, grad_y):
            # One compiled loop instead of ~15 eager passes with fp32 and int64 temporaries (4x faster on
            # [4, 256, 3072]); the mask's bits are unpacked before it (extracting them inside the loop halves its
            # speed: the loop no longer vectorises).
            out = inductor.fused(_inplace_gradient, (ctx.form, y.dtype, grad_y.dtype), *args)
            if out is not None:
                return out, None, None, None
        return _inplace_gradient(*args), None, None, None


class _SquaredReLUFunction(SlimFunction):
    """Squared ReLU under a lossless policy: keeps its output ``y``; ``y' = 2 sqrt(y)`` (a NaN stays NaN, an
    infinite ``y`` gives an infinite derivative, as PyTorch's ``relu`` then ``square`` do)."""

    layer = "activation (output kept)"

    @staticmethod
    def forward(ctx, x, fn, inplace):
        y = _apply(ctx, fn, x, inplace)
        save(ctx, y)
        # Kept as it is where PyTorch's square keeps its input: an in-place op on y in model code (`y += h`) must
        # move it to a copy first (copy_on_write), as for the other outputs kept; unmarked, autograd refused it.
        keep_output(y, ctx)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (y,) = load(ctx)
        return (grad_y.float() * (2.0 * y.float().sqrt())).to(grad_y.dtype), None, None


@cache
def _clipped(cfg: QuantConfig, flat: float | None) -> QuantConfig:
    return cfg if flat is None else dataclasses.replace(cfg, clip=flat)


class _ActivationFunction(SlimFunction):
    layer = "activation"

    @staticmethod
    def forward(ctx, x, fn, form, cfg, state, inplace):
        ctx.form = form
        if form == "relu":
            y = _apply(ctx, fn, x, inplace)
            # PyTorch's ReLU backward passes the gradient wherever not y <= 0, a NaN input included.
            mask = Mask.of(~(y <= 0))
            save(ctx, mask)
            # (a second copy where the next layer keeps y in full, a conv or Linear a lossless policy leaves as
            # written: 1/32 of y's fp32 bytes more than plain's; slimact.profile marks it, summary notes it)
            note_kept_for(y, (mask.bits,))
        else:
            # The range clipped to +-FLAT (NaN/inf still keep x exact, as PyTorch would), decided in the pack's one
            # host sync, with no pass of its own. Packed before fn, which may write y into x; where the pack is
            # x itself (NaN/inf), an in-place fn needs a copy of it.
            packed = pack(x, _clipped(cfg, FLAT.get(form)), state)
            if inplace and packed.meta.raw:
                packed = pack(x.clone(), None)
            y = _apply(ctx, fn, x, inplace, packed.tensors[0] if packed.meta.raw else None)
            save(ctx, packed)
            # Where nothing lay beyond the clip, the codes of x also give y = f(x): the next Linear keeps y through
            # them, not a second copy (share_derived declines a clipped pack).
            share_derived(y, packed, form)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        if ctx.form == "relu":
            (saved,) = load(ctx)
            return grad_y * saved, None, None, None, None, None
        (packed,) = load(ctx, restore=False)
        # grad_y * y'(x_hat), with x restored inside the same loop where it can be (unpack_map)
        return unpack_map(packed, _GRADIENTS[ctx.form], grad_y), None, None, None, None, None


def output_form(t: Tensor) -> str | None:
    """The form of the slimact activation whose output ``t`` is, unchanged since (its ``grad_fn`` is that
    Function's node, which an in-place change or a view would replace), on the path that keeps its input compressed
    or, for ReLU, a mask; else ``None``."""
    node = t.grad_fn
    return node.form if type(node) is _ActivationFunction._backward_cls else None


def activation(
    x: Tensor,
    form: str,
    cfg: QuantConfig | None,
    state: RunningRange | None = None,
    fn: Callable[[Tensor], Tensor] | None = None,
    *,
    inplace: bool = False,
) -> Tensor:
    """Apply the activation ``form`` (computed by ``fn``, default :func:`reference`).

    Keeps ``x`` compressed with ``cfg``, or (``cfg=None``, lossless) the output and a branch mask. Falls back
    to ``fn(x)`` with PyTorch's own saving when no gradient will flow through ``x``. ``inplace``: ``fn`` writes
    its result into ``x`` (``nn.SiLU(inplace=True)``); ``x`` is then overwritten, as by the plain module, and
    what the backward needs is taken from it first. (An ``fn`` that writes into ``x`` unannounced is detected
    too; it raises only where ``x`` itself would have been kept, a NaN/inf input under an 8-bit policy.)
    """
    if form not in FORMS:
        raise ValueError(f"unknown activation form {form!r}; known: {FORMS}")
    fn = fn or (lambda t: reference(form, t))
    if not torch.is_grad_enabled() or not x.requires_grad or (
            cfg is None and form != "relu" and (torch.compiler.is_compiling() or foreign_saved_hooks())):
        # (lossless under saved-tensor hooks: PyTorch's own saving, the input, not the output; see
        # foreign_saved_hooks. Likewise under torch.compile: the traced graph functionalises an in-place op on the
        # output in model code, `h += x`, and hands the backward the output after it, with no version check: the
        # input gradient 2.4 off after a GELU, silently; copy_on_write does not run there.)
        return fn(x)
    read_in_root(fn, x)
    if cfg is None and form == "relu2":
        return _SquaredReLUFunction.apply(x, fn, inplace)
    if cfg is None and form != "relu":
        return _InplaceActivationFunction.apply(x, fn, form, inplace)
    return _ActivationFunction.apply(x, fn, form, cfg, state, inplace)
