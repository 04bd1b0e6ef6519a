"""CPU fast path: the reference's range, quantise and dequantise passes as ``torch.compile``d loops.

Same math as :mod:`slimact.quant.reference`, over a 3-d view ``[outer, groups, run]`` of a contiguous
tensor, where a group's elements lie in ``outer`` contiguous runs of ``run`` elements (channel groups of
``[..., C]``: ``run = C / groups``; per head of ``[B, H, T, D]``: ``run = T * D``; the whole tensor:
``[1, 1, numel]``). With ``lo``/``step`` as ``[groups, 1]`` each pass is one loop over memory that
inductor vectorises: the range reads ``x`` once (min and max of each run together), the quantise reads it
once more and writes one byte per element, the dequantise reads a byte and writes the restored element (into a
buffer on huge pages from 32 MiB: :mod:`slimact.quant._hugepages`).
Eager PyTorch spends five passes with fp32 temporaries on the quantise alone (the reference).
:func:`pack8` is the whole 8-bit pack as one compiled call: the range (one reduction loop per group over
``(outer, run)``), the decisions and the fp64 scale on ``[groups]`` tensors (a few scalar loops inside the same
call, instead of the ~220 eager ops of ``[groups]`` size a pack took between its two loops) and the codes' loop;
under a running estimate the codes use the estimate's scale and the fold's new buffer values come out of the same
call. (A permuted tensor read in its memory order, codes copied back, was tried: on the CPU, [B, T, H, D] memory
seen as [B, H, T, D] packed at 7.6x a copy's time against 3.8x from a contiguous copy; it is packed from one.)
:func:`dequantize_map` restores inside a consumer's own loop (``fn(restored, *args)``, for
:func:`slimact.quant.unpack_map`), on CPU and on CUDA alike.

Codes and restored values equal the reference's bit for bit: the same operations in the same order (IEEE
division, no contraction into fused multiply-adds; tested on every dtype and layout).

Taken for 8-bit round-to-nearest codes of contiguous CPU tensors of at least :data:`MIN_NUMEL` elements
(:func:`pack8`, the whole pack: :data:`PACK_MIN_NUMEL`) whose group count divides the grouped dim; everything
else (smaller tensors, where a compiled call's fixed cost exceeds the eager passes; sub-byte codes; stochastic
rounding; odd groupings; strided tensors; code running under ``torch.compile``, where inductor fuses the
reference itself) goes to the reference. Each loop is
compiled on first use for each dtype (a few seconds, then cached on disk by inductor), with dynamic sizes and the
Python floats it reads (arguments, module globals) as constants; if that loop cannot be
compiled (:data:`_COMPILE_FAILED`: no working C++ compiler, or the backend failing on the graph), a warning, and
the reference (or the eager composition) for that loop from then on: for every shape where no compiler works, else
for the shapes its failed graph was specialised to (sizes 0 and 1: :data:`_failed`); the other loops are tried on
their own;
an error raised by running a loop is a bug and is raised. ``SLIMACT_BACKEND=reference`` turns it off.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from slimact.quant import _hugepages, reference, state
from slimact.quant.reference import GroupLayout, PackMeta, QuantConfig

__all__ = [
    "MIN_NUMEL", "PACK_MIN_NUMEL", "Packed8", "dequantize", "dequantize_map", "fused", "fused_or_eager",
    "group_minmax", "group_stats", "pack8", "pays_off", "quantize",
]

#: Smallest tensor the compiled loops take (256 Ki elements, 1 MiB in fp32).
MIN_NUMEL = 1 << 18

#: Smallest tensor :func:`pack8` takes (4 Ki elements). The reference's pack is some 25 eager ops on the tensor and
#: on ``[groups]`` tensors; the compiled pack one call, its loops on one thread below :data:`MIN_NUMEL`
#: (:func:`_compiled`). Measured (``benchmarks/results/pack_small.*``, fp32, by layout): 0.09-0.10 ms against
#: 0.22-0.45 ms at 4 Ki elements, 0.10 against 0.47-0.67 at 32 Ki, 0.16-0.18 against 1.04-1.39 at 128 Ki. Below
#: 4 Ki elements the saving is under 0.3 ms a pack, and each variant of the pack (dtype, layout, outliers,
#: estimate) would first cost seconds of compiling.
PACK_MIN_NUMEL = 1 << 12

#: The compiled loops that could not be compiled (:data:`_COMPILE_FAILED`), each with its error: they run eagerly.
#: Keyed by the loop where no C++ compiler works (every shape fails), else by ``(loop, _signature(args))``: a
#: backend failing on one specialisation of a loop's graph (torch 2.13's CPU codegen fails on the attention rows'
#: in-place loop for ``[1, 1, rows, S]`` blocks, not for others) turns off that specialisation only.
_failed: dict[Callable | tuple[Callable, tuple], BaseException] = {}
_failed_somewhere: set[Callable] = set()  # the loops with a failed specialisation (the signature read only for them)

#: Errors (by class name, anywhere in the chain of causes) raised by compiling, not by running, a loop: no working
#: C++ compiler here, or the backend failing on the graph (``BackendCompilerFailed``: torch 2.11's inductor failed in
#: ``tensorify_python_scalars`` on the loops' symbolic floats on an H200, which :func:`_compiled` now makes
#: constants). The loop's eager composition
#: computes the same values, so such a loop warns once and runs eagerly from then on; an error raised by running
#: the code is a bug, and is raised.
_COMPILE_FAILED = frozenset({"InvalidCxxCompiler", "CppCompileError", "BackendCompilerFailed"})


def _runs(shape: torch.Size | tuple[int, ...], layout: GroupLayout) -> tuple[int, int, int] | None:
    """``(outer, groups, run)`` of the 3-d view, or ``None`` when groups are not whole contiguous runs."""
    total = 1
    for s in shape:
        total *= s
    if layout.dim is None:
        return 1, 1, total
    if layout.size % layout.groups:
        return None
    run = layout.size // layout.groups * layout.inner
    return total // (layout.groups * run), layout.groups, run


def _applies(x: Tensor, layout: GroupLayout, smallest: int = MIN_NUMEL) -> tuple[int, int, int] | None:
    if (
        x.device.type != "cpu" or x.numel() < smallest or not x.is_contiguous()
        or torch.compiler.is_compiling()
    ):
        return None
    return _runs(x.shape, layout)


def _minmax(x3: Tensor) -> tuple[Tensor, Tensor]:
    return x3.amin(-1), x3.amax(-1)  # [outer, groups] each


def _stats(x3: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return x3.amin(-1), x3.amax(-1), x3.abs().float().sqrt().sum(-1)  # [outer, groups] each


def _column_stats(x2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return x2.amin(0), x2.amax(0), x2.abs().float().sqrt().sum(0)  # [groups] each


def _codes(x3: Tensor, lo: Tensor, step: Tensor) -> Tensor:
    # reference.quantize, nearest rounding: clamp((x - lo) / step + 0.5, 0, 255) truncated to uint8.
    return ((x3.float() - lo) / step + 0.5).clamp(0, 255).to(torch.uint8)


def _pack8(x3: Tensor, outliers: bool, whole: bool, est_lo: Tensor | None, est_rng: Tensor | None, clip: float | None,
           decay: float) -> tuple[Tensor, ...]:
    # A whole 8-bit pack of x3 [outer, groups, run] in one compiled call: the per-group range (and, with outliers,
    # the sum of sqrt|x| and the outlier threshold; whole: x3 is the whole tensor, one group), the decisions
    # (reference.range_decisions), the scale (reference.scale_params: of the running estimate est_lo, est_lo +
    # est_rng where one is given, else of the clipped range) and the codes, and with an estimate the buffers
    # after folding the clipped range in (state.folded). Inductor makes it a reduction loop over x3, a few
    # loops over [groups] and the codes' loop: no eager op in between.
    # One reduction over (outer, run) per group (no [outer, groups] partials reduced again in their own loops)
    lo, hi = x3.amin((0, 2)).float(), x3.amax((0, 2)).float()  # [groups] each
    threshold = None
    if outliers:
        magnitude = x3.abs().float().sqrt().sum((0, 2))  # [groups], fp32 sums, as group_stats
        # n = outer * run elements in every group (whole runs), as reference.group_counts gives them. Made here, not
        # cached: a cached tensor allocated by the first pack of a shape would show in that step's peak only.
        count = x3.shape[0] * x3.shape[2]
        counts = float(count) if whole else torch.full((x3.shape[1],), count, dtype=torch.int64, device=x3.device)
        threshold = reference.threshold_of(magnitude, counts)
    lo, hi, bad, clipped, heavy = reference.range_decisions(lo, hi, clip, threshold)
    # (The flags are returned apart, not stacked: each copy into a stack is one more serial step of the loop nest.)
    flags = tuple(flag for flag in (bad, clipped, heavy) if flag is not None)
    if est_lo is None or est_rng is None:
        scale_lo, step = reference.scale_params(lo, hi, 255)
        folded: tuple[Tensor, ...] = ()
    else:
        scale_lo, step = reference.scale_params(est_lo, est_lo + est_rng, 255)
        folded = state.folded(est_lo, est_rng, lo, hi - lo, decay)
    codes = _codes(x3, scale_lo.view(-1, 1), step.view(-1, 1))
    return codes, scale_lo, step, lo, hi, *flags, *(() if threshold is None else (threshold,)), *folded


class Packed8(NamedTuple):
    """What :func:`pack8` gives: the codes (``x``'s shape, for the scale ``lo``/``step``), the tensor's own
    per-group range (clipped), the decisions of :func:`slimact.quant.reference.range_decisions` (0-d bool tensors:
    NaN/inf; clipped, ``None`` without a clip; outliers present, ``None`` without outliers; to be read by the
    host), the outlier threshold
    (``None`` without outliers) and, with a running estimate, the estimate's buffers after the fold (``None``
    without)."""

    codes: Tensor
    lo: Tensor
    step: Tensor
    range_lo: Tensor
    range_hi: Tensor
    bad: Tensor
    clipped: Tensor | None
    heavy: Tensor | None
    threshold: Tensor | None
    folded: tuple[Tensor, Tensor] | None


def pack8(x: Tensor, layout: GroupLayout, cfg: QuantConfig, estimate: tuple[Tensor, Tensor] | None) -> Packed8 | None:
    """An 8-bit round-to-nearest pack of ``x`` in one compiled call and two reads of ``x`` (the range, then the
    codes; one pass apart from the dispatch of PyTorch's several dozen small ops on ``[groups]`` tensors that
    the decisions and the scale otherwise take): everything :func:`slimact.quant.core.pack` computes before the
    host reads the decisions. ``estimate``: the running estimate's live tensors ``(lo, range)``
    (:meth:`slimact.quant.state.RunningRange.live`); the codes are then those of the estimate's scale, and
    :attr:`Packed8.folded` the buffers' values after this tensor's clipped range is folded in (the caller copies
    them into place when it should). The same values as the reference's ops bit for bit (codes, scale, range,
    flags, fold), but for the sum of ``sqrt|x|`` behind the outlier threshold (fp32 sums, as :func:`group_stats`).
    ``None`` where it does not apply (as :func:`quantize`: 8-bit nearest codes of a large contiguous CPU tensor
    in whole runs)."""
    if cfg.bits != 8 or cfg.stochastic:
        return None
    runs = _applies(x, layout, PACK_MIN_NUMEL)
    if runs is None:
        return None
    est_lo, est_rng = (None, None) if estimate is None else estimate
    whole = layout.dim is None
    key = ("pack8", x.dtype, cfg.outliers, whole, estimate is not None, cfg.clip, cfg.decay)
    out = _call(_compiled(_pack8, key, x.numel() < MIN_NUMEL),
                (x.view(runs), cfg.outliers, whole, est_lo, est_rng, cfg.clip, cfg.decay))
    if out is None:
        return None
    codes, lo, step, range_lo, range_hi, bad, *rest = out
    clipped = rest.pop(0) if cfg.clip is not None else None
    heavy = threshold = None
    if cfg.outliers:
        heavy, threshold = rest.pop(0), rest.pop(0)
    codes = codes.view(x.shape)
    return Packed8(codes, lo, step, range_lo, range_hi, bad, clipped, heavy, threshold,
                   (rest[0], rest[1]) if rest else None)


def _restore(c3: Tensor, lo: Tensor, step: Tensor, dtype: torch.dtype) -> Tensor:
    # reference.dequantize: code * step, then + lo, in fp32, then the original dtype.
    return (c3.float() * step + lo).to(dtype)


def _restore_into(c3: Tensor, lo: Tensor, step: Tensor, out3: Tensor) -> Tensor:
    # _restore, written by the same loop into a buffer the caller allocated (on huge pages).
    return out3.copy_(_restore(c3, lo, step, out3.dtype))


#: The backend the loops are compiled with (a test records the traced graphs through its own).
_BACKEND: str | Callable = "inductor"


@functools.cache
def _compiled(fn: Callable, key: object, serial: bool = False) -> Callable:
    # A copy of fn with its own code object per key (a dtype; a consumer and a dtype): dynamo's cache (and its
    # recompile limit) is per code object, and each dtype needs its own loops. serial: loops on one thread, for
    # tensors below MIN_NUMEL. With dynamic sizes inductor's C++ opens an OpenMP team at every call whatever the
    # size, where PyTorch's own ops stay on one thread below 32 Ki elements; on a machine whose cores are all busy
    # the team's barrier waits for a descheduled thread (a 4 Ki-element pack measured at 13 ms, against 0.1 ms).
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    options = {"options": {"cpp.threads": 1}} if serial and _BACKEND == "inductor" else {}
    compiled = torch.compile(fresh, dynamic=True, backend=_BACKEND, **options)

    def call(*args):
        # Python floats (arguments such as a norm's offset or a table's left end, and module globals such as
        # math.pi or a table's spacing) are constants of the graph, as in eager code, not symbolic inputs: sizes
        # stay dynamic, a float is guarded by its value (each loop sees one or two). Symbolic floats reach
        # inductor's tensorify_python_scalars pass, which raised BackendCompilerFailed on torch 2.11 (an H200 run:
        # math.pi in the GELU gradient's restore-in-its-loop). Set per call (dynamo reads it while tracing, which
        # any call may do), as a plain attribute: config.patch's context manager cost 14 us a call, this 4.
        config = torch._dynamo.config
        if config.specialize_float:
            return compiled(*args)
        config.specialize_float = True
        try:
            return compiled(*args)
        finally:
            config.specialize_float = False

    return call


def _run(fn: Callable, dtype: torch.dtype, *args) -> object | None:
    return _call(_compiled(fn, dtype), args)


def _raised_by(e: BaseException, names: frozenset[str]) -> bool:
    """Whether ``e`` or what caused it (dynamo wraps the backend's errors) is of a class named in ``names``."""
    seen: set[int] = set()
    chain: BaseException | None = e
    while chain is not None and id(chain) not in seen:
        if any(cls.__name__ in names for cls in type(chain).__mro__):
            return True
        seen.add(id(chain))
        chain = chain.__cause__ or chain.__context__ or getattr(chain, "inner_exception", None)
    return False


def _compile_failed(e: BaseException) -> bool:
    """Whether ``e`` was raised by compiling the loop (see :data:`_COMPILE_FAILED`)."""
    return _raised_by(e, _COMPILE_FAILED)


def _no_compiler(e: BaseException) -> bool:
    """Whether ``e`` says there is no working C++ compiler (every loop, every shape, would fail)."""
    return _raised_by(e, frozenset({"InvalidCxxCompiler"}))


def _signature(args: tuple) -> tuple:
    """What a loop's graph is specialised on besides its key: each tensor's device type (C++ or Triton), dtype and
    which of its sizes are 0 or 1 (dynamic sizes are specialised on those), and the other arguments (Python floats
    are constants), through tuples."""
    out = []
    for a in args:
        if isinstance(a, Tensor):
            out.append((a.device.type, a.dtype, tuple(min(s, 2) for s in a.shape)))
        elif isinstance(a, tuple):
            out.append(_signature(a))
        else:
            out.append(a if isinstance(a, (int, float, bool, str, type(None), torch.dtype)) else type(a))
    return tuple(out)


def _call(compiled: Callable, args: tuple) -> object | None:
    # Detached: whether the caller's tensor requires grad must not be a guard (pack runs under no_grad). With
    # torch-function handling off: dynamo would otherwise trace an active TorchFunctionMode (slimact's routing
    # follows tensors by identity) and guard on this very tensor, recompiling at every call.
    if compiled in _failed or (compiled in _failed_somewhere and (compiled, _signature(args)) in _failed):
        return None
    args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
    try:
        with torch._C.DisableTorchFunction():
            return compiled(*args)
    except Exception as e:
        if not _compile_failed(e):
            raise
        everywhere = _no_compiler(e)
        if everywhere:
            _failed[compiled] = e
        else:
            _failed[(compiled, _signature(args))] = e
            _failed_somewhere.add(compiled)
        shapes = "" if everywhere else f" for {_signature(args)} (sizes 0, 1, more)"
        warnings.warn(
            f"slimact: a compiled loop is unavailable{shapes} ({type(e).__name__}: {str(e)[:300]}); it runs eagerly "
            "there now", RuntimeWarning, stacklevel=3,
        )
        return None


def pays_off(t: Tensor) -> bool:
    """Whether a compiled loop over ``t`` repays its call: :data:`MIN_NUMEL` elements or more, on CPU or CUDA
    (below, a compiled call's fixed cost exceeds the eager passes)."""
    return t.numel() >= MIN_NUMEL and t.device.type in ("cpu", "cuda")


def fused(fn: Callable, key: object, *args: object) -> object | None:
    """``fn(*args)`` compiled into as few loops as inductor makes of it (C++ on CPU, Triton on CUDA), for a
    Function's own elementwise passes (the in-place activations' mask and backward). ``key`` names the compiled
    copy (one per dtype, say); ``None`` where compiling is off, failed, or code already runs under
    ``torch.compile`` (inductor fuses the eager code there itself): the caller then runs ``fn`` eagerly."""
    if torch.compiler.is_compiling():
        return None
    return _call(_compiled(fn, key), args)


def fused_or_eager(fn: Callable, key: object, x: Tensor, *args: object) -> Any:
    """``fn(x, *args)``: compiled (:func:`fused`) where ``x`` repays a compiled call (:func:`pays_off`), else, or
    where compiling is off or failed, eagerly: the same math."""
    if pays_off(x):
        out = fused(fn, key, x, *args)
        if out is not None:
            return out
    return fn(x, *args)


def group_minmax(x: Tensor, layout: GroupLayout) -> tuple[Tensor, Tensor]:
    """:func:`slimact.quant.reference.group_minmax`, in one pass over ``x`` where it applies."""
    runs = _applies(x, layout)
    # The reference where it is one pass already (the whole tensor: torch.aminmax), and for runs of one
    # element (a group per channel of [..., C]), whose eager column reductions beat a loop over runs of one.
    if runs is None or layout.dim is None or runs[2] == 1:
        return reference.group_minmax(x, layout)
    out = _run(_minmax, x.dtype, x.view(runs))
    if out is None:
        return reference.group_minmax(x, layout)
    lo, hi = out
    return lo.amin(0).float(), hi.amax(0).float()


def quantize(x: Tensor, layout: GroupLayout, lo: Tensor, step: Tensor, bits: int, seed: int | None) -> Tensor:
    """:func:`slimact.quant.reference.quantize`, in one pass where it applies (8 bits, nearest rounding)."""
    runs = _applies(x, layout) if bits == 8 and seed is None else None
    codes = None if runs is None else _run(_codes, x.dtype, x.view(runs), lo.view(-1, 1), step.view(-1, 1))
    if codes is None:
        return reference.quantize(x, layout, lo, step, bits, seed)
    return codes.view(x.shape)


def dequantize(codes: Tensor, meta: PackMeta, lo: Tensor, step: Tensor) -> Tensor:
    """:func:`slimact.quant.reference.dequantize`, in one pass where it applies (8-bit codes)."""
    runs = _applies(codes, meta.layout) if meta.bits == 8 else None
    if runs is not None and codes.numel() == runs[0] * runs[1] * runs[2]:
        args = (codes.view(runs), lo.view(-1, 1), step.view(-1, 1))
        out = _hugepages.empty(meta.shape, meta.dtype)
        if out is None:
            restored = _run(_restore, meta.dtype, *args, meta.dtype)
        else:
            restored = _run(_restore_into, meta.dtype, *args, out.view(runs))
        if restored is not None:
            return restored.view(meta.shape)
    return reference.dequantize(codes, meta, lo, step)


def _restore_map(fn: Callable, dtypes: tuple[torch.dtype, ...], packs: tuple[tuple[Tensor, Tensor, Tensor], ...],
                 args: tuple[Tensor, ...]) -> Any:
    # fn(*(_restore(...) of each pack, to its dtype), *args) in one loop: the restored values live in registers only.
    return fn(*(_restore(c3, lo, step, dtype) for (c3, lo, step), dtype in zip(packs, dtypes, strict=True)), *args)


def dequantize_map(packs: Sequence[tuple[Tensor, Tensor, Tensor]], dtypes: Sequence[torch.dtype], meta: PackMeta,
                   fn: Callable, args: tuple[Tensor, ...]) -> Any:
    """``fn(*(dequantize(codes, lo, step) to dtype, for each pack and its dtype), *args)`` as one compiled loop
    (:func:`slimact.quant.unpack_map`), on CPU and on CUDA (where inductor writes a Triton kernel): 8-bit codes
    of at least :data:`MIN_NUMEL` elements in whole contiguous runs, every pack of ``meta``'s shape and layout,
    ``args`` contiguous and of that shape. ``fn`` returns a tensor or a tuple of them, of that shape.
    ``None`` where it does not apply."""
    runs = _runs(meta.shape, meta.layout) if meta.bits == 8 else None
    if (
        runs is None or torch.compiler.is_compiling()
        or any(not pays_off(c) or c.numel() != runs[0] * runs[1] * runs[2] for c, _, _ in packs)
        or any(a.shape != meta.shape or not a.is_contiguous() or a.device != packs[0][0].device for a in args)
    ):
        return None
    # (Detached here: _call detaches only its own arguments, and these sit in tuples.)
    views = tuple((c.view(runs), lo.detach().view(-1, 1), step.detach().view(-1, 1)) for c, lo, step in packs)
    dtypes = tuple(dtypes)
    out = _call(_compiled(_restore_map, (fn, dtypes)), (fn, dtypes, views, tuple(a.detach().view(runs) for a in args)))
    if out is None:
        return None
    return tuple(o.view(meta.shape) for o in out) if isinstance(out, (tuple, list)) else out.view(meta.shape)


def group_stats(x: Tensor, layout: GroupLayout) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`slimact.quant.reference.group_stats` (range and magnitude) in one pass over ``x`` where it applies:
    over runs, then over their ``outer`` count; a group per channel of ``[..., C]`` (runs of one element) as one
    column reduction (eager column reductions cost 17x a copy there)."""
    runs = _applies(x, layout)
    out = None
    if runs is not None:
        outer, groups, run = runs
        if run == 1:
            out = _run(_column_stats, x.dtype, x.view(outer, groups))
        else:
            per_run = _run(_stats, x.dtype, x.view(runs))
            out = None if per_run is None else (per_run[0].amin(0), per_run[1].amax(0), per_run[2].sum(0))
    if out is None:
        return reference.group_stats(x, layout)
    lo, hi, magnitude = out
    return lo.float(), hi.float(), magnitude
