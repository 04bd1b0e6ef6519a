"""Triton kernels for the quantise and dequantise passes of :mod:`slimact.quant.reference`.

Same math, same codes: given the same per-group ``lo``/``step`` and the same seed, :func:`quantize` returns
the reference's codes and :func:`dequantize` its restored values bit for bit, on the device as under
``TRITON_INTERPRET=1`` (where the suite runs them on CPU). Two compiler defaults would break that on hardware,
never in the interpreter, and are turned off:

* fp contraction: Triton fuses ``code * step + lo`` into one fused multiply-add (one rounding) where the
  reference rounds the product and the sum separately, so every kernel is launched with
  ``enable_fp_fusion=False``;
* approximate division and square root: Triton's fp32 ``/`` compiles to ``div.full.f32`` (up to 2 ulp off), which
  moves a code by one wherever ``(x - lo) / step`` lies next to a rounding boundary, so codes divide with
  ``tl.math.div_rn`` and the range pass takes ``tl.math.sqrt_rn`` (PyTorch's are correctly rounded).

Tiling (:func:`quantize`, :func:`dequantize`): ``x`` is viewed as ``[rows, width]`` so that the group of an
element is a function of its row or of its column alone, computed once per row or column of a tile (never
per element): the whole tensor or a single group is one row (``group 0``); channel groups (the grouped dim is
the last) are rows of ``size`` channels, the group a function of the column; otherwise (per head, a conv's
channels) rows of ``inner`` elements, the group a function of the row (``(row % size) * groups // size``).
One program handles a ``[R, BB * 8 // bits]`` tile of elements, i.e. ``[R, BB]`` output bytes, ``R * BB * 8 /
bits`` at most ``_TILE``, ``R`` no more rows than there are: sub-byte codes are packed along the flat index
(:mod:`slimact.quant.packing`), so a row packs into its own bytes when its width is a multiple of ``8 // bits``
or when there is one row; otherwise (a 4-bit ``[5, 13]``) the tile is flat and the group is computed per element
from the flat index (three integer divisions: the one case that keeps them). Offsets are int32 when every
offset a program forms is below ``2**31`` and int64 otherwise. The stochastic bits are recomputed from
``fmix32(flat_index ^ key)`` instead of read from a noise tensor. All programs run on grid axis 0 (its limit is
``2**31 - 1``; axes 1 and 2 stop at 65535), whatever the tensor's size.

Bytes moved per element: read ``x`` (2 or 4) and write ``bits/8`` to pack; the reverse to unpack.

The range pass, :func:`group_stats` (per group: min, max, the sum of ``sqrt|x|`` that decides outliers, and
whether any value is NaN/inf), reads ``x`` once too, where the reference's reductions read it three times (a
min, a max and an fp64 power sum). ``x`` is viewed as ``[outer, size, inner]`` around the grouped dim; each
program reduces one ``[OB, B]`` tile to a partial per index of that dim, written to its own slot of a
``[4, parts, size]`` buffer (no atomics), and the few partials are reduced by PyTorch in a fixed order, so the
result is deterministic. Tiles run along the dim when it is the last one (``inner == 1``: channel groups,
coalesced along channels), along ``inner`` otherwise (per head, the whole tensor), their shape chosen from the
actual extents (the whole tensor, ``outer == 1``, gets ``[1, _TILE]`` tiles, no masked rows).

:func:`quantize_stats` is that pass with the 8-bit codes written from the same read, for a given ``lo``/``step``
(a running estimate's). The pack under a running estimate (:func:`slimact.quant.core._pack_running`) is three
launches and never waits for the host: :func:`scale_estimate` (the estimate's tensors -> ``scale_params``'
``lo``/``step``), that pass with its partials left unreduced, and :func:`quantize_fold`'s per-group kernel
(partials -> range, NaN/inf, clip, outlier-threshold cut, the EMA fold into the estimate's tensors in place, a NaN
step for a group that is not finite), built from the same ``@triton.jit`` helpers as :func:`decide`'s finishing
kernel, so the same values as the PyTorch ops they replace, bit for bit but for the fp64 sum of ``sqrt|x|`` below.

Stochastic keys: the kernels take the seed as a value plus an offset read from a device tensor, and use
``key = fmix32(seed + offset)`` (``reference.seed_key(seed)`` when the offset is 0). Outside CUDA-graph capture
the offset is a constant 0 and the seed comes from ``reference.draw_seed()``, as in the reference. While the
current stream is capturing, the seed drawn at capture would be frozen into the graph, so the offset is instead
a per-device counter that an in-graph ``add_(1)`` advances after each use: every replay draws new noise. The
counter is created by the device's first stochastic pack outside capture (capture needs a warm-up pack anyway:
Triton compiles there), the same kernel specialisation serves both.

:func:`decide` is the range pass followed by one finishing kernel, one program per group, instead of PyTorch
ops: the group's partials reduced (min and max exactly; the sum of ``sqrt|x|`` in fp64, in a fixed order), the
NaN/inf and clip flags, :func:`slimact.quant.reference.outlier_threshold` and the outlier flag, and
:func:`slimact.quant.reference.scale_params`' ``lo``/``step``, with the reference's float operations in its order
(fp64 where it is fp64, every division in fp64, fp32 rounding where it rounds, ``nextafter`` on the bits, no FMA
contraction), so the same ``lo``/``step`` bit for bit. The flags go to a buffer the host reads once for all the
tensors of a :func:`slimact.quant.core.pack_many`.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from slimact.quant import reference
from slimact.quant.packing import packed_numel
from slimact.quant.reference import GroupLayout, PackMeta, _group_reduce

__all__ = [
    "decide", "dequantize", "group_minmax", "group_stats", "quantize", "quantize_fold", "quantize_stats",
    "scale_estimate",
]

_TILE = 4096  # elements one program handles
_GRID_MAX = (2**31 - 1, 65535, 65535)
_INT32_OFFSETS = 2**31  # offsets below this are int32 in the kernels, int64 from it
# How the group of an element is found (the kernels' MODE): one group, per column, per row, per element.
_WHOLE, _PER_COL, _PER_ROW, _PER_ELEMENT = 0, 1, 2, 3


@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _key(seed, offset_ptr):
    # The 32-bit key of seed + offset (a scalar): reference.seed_key(seed) when the offset is 0.
    return _fmix32((seed + tl.load(offset_ptr)).to(tl.uint32))


@triton.jit
def _group_of(idx, inner, size, groups):
    # int64 idx: (idx // inner) % size < size, times groups < 2**63
    return ((idx // inner) % size) * groups // size


@triton.jit
def _code(x, lo, step, idx, key, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    # The reference's code of x (fp32) at flat index idx: clamp(floor((x - lo) / step + u), 0, qmax), u = 1/2 or
    # the hashed uniform of the index. The division is correctly rounded, as the reference's (Triton's `/` is not
    # on hardware).
    v = tl.math.div_rn(x - lo, step)
    if STOCHASTIC:
        h = _fmix32(idx.to(tl.uint32) ^ key)  # idx mod 2**32
        v = v + (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
    else:
        v = v + 0.5
    return tl.minimum(tl.maximum(tl.floor(v), 0.0), QMAX).to(tl.uint32)


@triton.jit
def _tile(rows, width, row_bytes, col_blocks, R: tl.constexpr, BB: tl.constexpr, PER_BYTE: tl.constexpr,
          WIDE: tl.constexpr):
    # This program's tile of x viewed as [rows, width] (codes: [rows, row_bytes]): row [R, 1], element column
    # [1, BB * PER_BYTE], flat element index [R, BB * PER_BYTE] and its mask, byte offset [R, BB] and its mask.
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    rb = pid // col_blocks
    cb = pid - rb * col_blocks
    row = (rb * R + tl.arange(0, R))[:, None]
    col = (cb * (BB * PER_BYTE) + tl.arange(0, BB * PER_BYTE))[None, :]
    bcol = (cb * BB + tl.arange(0, BB))[None, :]
    off = row * width + col
    mask = (row < rows) & (col < width)
    boff = row * row_bytes + bcol
    bmask = (row < rows) & (bcol < row_bytes)
    return row, col, off, mask, boff, bmask


@triton.jit
def _group_params(lo_ptr, step_ptr, row, col, off, mask, inner, size, groups, MODE: tl.constexpr):
    # (lo, step) broadcastable against the [R, BB * PER_BYTE] tile: a scalar, a [1, C] column vector, an [R, 1]
    # row vector, or per element. Group arithmetic in int64 (col * groups reaches 2**31 at 46341 channels).
    if MODE == 0:
        lo = tl.load(lo_ptr)
        step = tl.load(step_ptr)
    elif MODE == 1:
        g = col.to(tl.int64) * groups // size  # [1, C]
        lo = tl.load(lo_ptr + g, mask=col < size, other=0.0)
        step = tl.load(step_ptr + g, mask=col < size, other=1.0)
    elif MODE == 2:
        g = (row.to(tl.int64) % size) * groups // size  # [R, 1]
        lo = tl.load(lo_ptr + g)
        step = tl.load(step_ptr + g)
    else:
        g = _group_of(off.to(tl.int64), inner, size, groups)  # [R, C]
        lo = tl.load(lo_ptr + g, mask=mask, other=0.0)
        step = tl.load(step_ptr + g, mask=mask, other=1.0)
    return lo, step


@triton.jit(do_not_specialize=["seed"])
def _quantize_kernel(
    x_ptr, codes_ptr, lo_ptr, step_ptr, offset_ptr, seed, rows, width, row_bytes, col_blocks, inner, size, groups,
    BITS: tl.constexpr, STOCHASTIC: tl.constexpr, MODE: tl.constexpr, R: tl.constexpr, BB: tl.constexpr,
    WIDE: tl.constexpr,
):
    # x [rows, width] (any float dtype) -> codes [rows, row_bytes] uint8, 8 // BITS codes per byte.
    PER_BYTE: tl.constexpr = 8 // BITS
    QMAX: tl.constexpr = (1 << BITS) - 1
    row, col, off, mask, boff, bmask = _tile(rows, width, row_bytes, col_blocks, R, BB, PER_BYTE, WIDE)
    lo, step = _group_params(lo_ptr, step_ptr, row, col, off, mask, inner, size, groups, MODE)
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)  # [R, BB * PER_BYTE]
    key = 0
    if STOCHASTIC:
        key = _key(seed, offset_ptr)
    code = tl.where(mask, _code(x, lo, step, off, key, QMAX, STOCHASTIC), 0)  # [R, BB * PER_BYTE] uint32
    if PER_BYTE > 1:
        shift = (tl.arange(0, PER_BYTE) * BITS)[None, None, :]  # [1, 1, PER_BYTE]
        code = tl.sum(tl.reshape(code, (R, BB, PER_BYTE)) << shift, axis=2)  # [R, BB]
    tl.store(codes_ptr + boff, code.to(tl.uint8), mask=bmask)


@triton.jit
def _dequantize_kernel(
    codes_ptr, out_ptr, lo_ptr, step_ptr, rows, width, row_bytes, col_blocks, inner, size, groups,
    BITS: tl.constexpr, BF16_BITS: tl.constexpr, MODE: tl.constexpr, R: tl.constexpr, BB: tl.constexpr,
    WIDE: tl.constexpr,
):
    # codes [rows, row_bytes] uint8 -> out [rows, width] (fp32, fp16, or bf16 through an int16 view).
    PER_BYTE: tl.constexpr = 8 // BITS
    QMAX: tl.constexpr = (1 << BITS) - 1
    row, col, off, mask, boff, bmask = _tile(rows, width, row_bytes, col_blocks, R, BB, PER_BYTE, WIDE)
    code = tl.load(codes_ptr + boff, mask=bmask, other=0).to(tl.uint32)  # [R, BB]
    if PER_BYTE > 1:
        shift = (tl.arange(0, PER_BYTE) * BITS)[None, None, :]  # [1, 1, PER_BYTE]
        code = tl.reshape((code[:, :, None] >> shift) & QMAX, (R, BB * PER_BYTE))
    lo, step = _group_params(lo_ptr, step_ptr, row, col, off, mask, inner, size, groups, MODE)
    out = code.to(tl.float32) * step + lo  # two roundings, as the reference (launched without fp fusion)
    if BF16_BITS:
        # fp32 -> bf16 round-to-nearest-even on the bits (as torch does; values here are finite), stored
        # through an int16 view so every Triton backend, the interpreter included, rounds the same way.
        b = out.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        tl.store(out_ptr + off, b.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(out_ptr + off, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])
def _stats_kernel(x_ptr, part_ptr, codes_ptr, lo_ptr, step_ptr, offset_ptr, outer, size, inner, parts, groups,
                  seed, col_blocks, row_blocks, OB: tl.constexpr, B: tl.constexpr, ALONG_SIZE: tl.constexpr,
                  QUANTIZE: tl.constexpr, STOCHASTIC: tl.constexpr, WIDE: tl.constexpr):
    # One [OB, B] tile of x viewed as [outer, size, inner] -> partial (min, max, sum sqrt|x|, non-finite count)
    # per index of the grouped dim, at part[k, p, index] of a [4, parts, size] fp32 buffer. With QUANTIZE, the
    # tile's 8-bit codes for the given per-group lo/step too, from the same read. Program id ->
    # (index s along dim, row block, column block), column block fastest; s is 0 when ALONG_SIZE.
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    cb = pid % col_blocks
    rest = pid // col_blocks
    rb = rest % row_blocks
    s = rest // row_blocks
    o = (rb * OB + tl.arange(0, OB))[:, None]  # [OB, 1]
    b = (cb * B + tl.arange(0, B))[None, :]  # [1, B]
    if ALONG_SIZE:  # inner == 1: b is the index along dim
        mask = (o < outer) & (b < size)
        off = o * size + b
        dim_index = b  # [1, B]
    else:  # b runs along inner, for one index s of dim
        mask = (o < outer) & (b < inner)
        off = (o * size + s) * inner + b
        dim_index = s
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if QUANTIZE:
        g = dim_index.to(tl.int64) * groups // size
        lo_g = tl.load(lo_ptr + g, mask=dim_index < size, other=0.0)
        step_g = tl.load(step_ptr + g, mask=dim_index < size, other=1.0)
        key = 0
        if STOCHASTIC:
            key = _key(seed, offset_ptr)
        code = _code(x, lo_g, step_g, off, key, 255, STOCHASTIC)
        tl.store(codes_ptr + off, code.to(tl.uint8), mask=mask)
    finite = tl.abs(x) < float("inf")  # False for NaN and +-inf
    ok = mask & finite
    lo = tl.where(ok, x, float("inf"))
    hi = tl.where(ok, x, float("-inf"))
    root = tl.where(ok, tl.math.sqrt_rn(tl.abs(x)), 0.0)  # correctly rounded, as torch.sqrt
    bad = tl.where(mask & ~finite, 1.0, 0.0)
    if ALONG_SIZE:
        index = cb * B + tl.arange(0, B)  # [B]
        where = part_ptr + rb * size + index
        keep = index < size
        tl.store(where, tl.min(lo, axis=0), mask=keep)
        tl.store(where + parts * size, tl.max(hi, axis=0), mask=keep)
        tl.store(where + 2 * parts * size, tl.sum(root, axis=0), mask=keep)
        tl.store(where + 3 * parts * size, tl.sum(bad, axis=0), mask=keep)
    else:
        p = rb * col_blocks + cb
        where = part_ptr + p * size + s
        tl.store(where, tl.min(tl.min(lo, axis=1), axis=0))
        tl.store(where + parts * size, tl.max(tl.max(hi, axis=1), axis=0))
        tl.store(where + 2 * parts * size, tl.sum(tl.sum(root, axis=1), axis=0))
        tl.store(where + 3 * parts * size, tl.sum(tl.sum(bad, axis=1), axis=0))


#: Per device: int64 [4], slot 0 a constant 0 (the offset outside capture), slot 2 the counter captured graphs
#: advance (16 bytes apart, so both pointers have the same alignment and the same kernel specialisation).
_seed_offsets: dict[torch.device, Tensor] = {}


def _seed_args(seed: int | None, device: torch.device) -> tuple[int, Tensor | None, Tensor | None]:
    """``(seed as a signed 32-bit value, offset pointer, counter to advance after the launch or None)``."""
    if seed is None:
        return 0, None, None
    s = seed & 0xFFFFFFFF
    s = s - (1 << 32) if s >= (1 << 31) else s  # the same 32 bits, one kernel argument type
    offsets = _seed_offsets.get(device)
    capturing = torch.cuda._is_compiled() and torch.cuda.is_current_stream_capturing()  # (no CUDA: no capture)
    if offsets is None:
        if capturing:
            raise RuntimeError(
                "stochastic rounding inside CUDA-graph capture needs one stochastic pack on this device before the "
                "capture (the warm-up that compiles the kernels): it creates the device's seed counter"
            )
        offsets = _seed_offsets[device] = torch.zeros(4, dtype=torch.int64, device=device)
    if capturing:  # the seed drawn now would be frozen into the graph: add a counter each replay advances
        return s, offsets[2:3], offsets[2:3]
    return s, offsets[0:1], None


def _stats(
    x: Tensor, layout: GroupLayout, quantize_with: tuple[Tensor, Tensor, int | None] | None = None,
    partials: bool = False,
) -> tuple[Tensor, ...] | None:
    """One read of ``x``: per-group (min, max, sum of ``sqrt|x|``), and the 8-bit codes for ``(lo, step, seed)``
    when ``quantize_with`` is given (else ``None``). ``None`` where the grid would exceed the launch limit. With
    ``partials``: ``(partials, codes)``, the kernel's ``[4, parts, size]`` fp32 partials unreduced (:func:`decide`)."""
    x = x.contiguous()
    numel = x.numel()
    size, inner = (1, numel) if layout.dim is None else (layout.size, layout.inner)
    outer = numel // (size * inner)
    along_size = inner == 1 and size > 1
    width = size if along_size else inner
    rows_p2 = triton.next_power_of_2(outer)
    # Tile [rows, block] from the actual extents: along channels at least 64 wide (coalesced, few partials),
    # wider when there are few rows; along inner up to the whole tile; never more rows than outer has.
    cap = max(64, _TILE // rows_p2) if along_size else _TILE
    block = min(cap, triton.next_power_of_2(width))
    rows = min(rows_p2, max(1, _TILE // block))
    col_blocks, row_blocks = triton.cdiv(width, block), triton.cdiv(outer, rows)
    grid = col_blocks * row_blocks * (1 if along_size else size)
    if grid > _GRID_MAX[0]:
        return None
    parts = row_blocks if along_size else col_blocks * row_blocks
    # int32 offsets unless a tile's (overhanging) offsets or the partials reach 2**31
    last_row = row_blocks * rows * (1 if along_size else size) - 1  # of x as [outer * size, inner] or [outer, size]
    wide = max(last_row * width + col_blocks * block, 4 * parts * size) >= _INT32_OFFSETS
    part = torch.empty(4, parts, size, dtype=torch.float32, device=x.device)
    codes = lo_q = step_q = None
    seed, offset, advance = 0, None, None
    if quantize_with is not None:
        lo_q, step_q, seed_q = quantize_with
        codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
        seed, offset, advance = _seed_args(seed_q, x.device)
    _stats_kernel[(grid,)](
        x, part, codes, lo_q, step_q, offset, outer, size, inner, parts, layout.groups, seed, col_blocks, row_blocks,
        OB=rows, B=block, ALONG_SIZE=along_size, QUANTIZE=codes is not None, STOCHASTIC=offset is not None,
        WIDE=wide, enable_fp_fusion=False,
    )
    if advance is not None:
        advance.add_(1)
    if partials:  # (for decide: the [4, parts, size] partials as they are)
        return part, codes
    lo, hi, root, bad = part[0].amin(0), part[1].amax(0), part[2].sum(0), part[3].sum(0)  # [size] each
    bad = _group_reduce(bad, layout, "sum") > 0
    lo = _group_reduce(lo, layout, "amin").masked_fill(bad, float("nan"))
    hi = _group_reduce(hi, layout, "amax").masked_fill(bad, float("nan"))
    return lo, hi, _group_reduce(root, layout, "sum"), codes


def group_stats(x: Tensor, layout: GroupLayout) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`slimact.quant.reference.group_stats` in one read of ``x`` (see the module docstring): fp32
    ``[groups]`` min, max and sum of ``sqrt|x|``; a group holding NaN or inf gets NaN for its min and max, which
    the pack reads as "keep the tensor exact", as it reads the reference's."""
    stats = _stats(x, layout)
    if stats is None:
        return reference.group_stats(x, layout)
    return stats[:3]


def quantize_stats(
    x: Tensor, layout: GroupLayout, lo: Tensor, step: Tensor, bits: int, seed: int | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`quantize` and :func:`group_stats` of ``x`` at once: ``(codes, min, max, sum sqrt|x|)``. The codes
    are for the given ``lo``/``step`` (a running estimate's), the statistics are ``x``'s own, to fold into that
    estimate afterwards. 8-bit codes come from the same read of ``x`` as the statistics; 4- and 2-bit codes,
    packed across tile rows, from a second read."""
    stats = _stats(x, layout, (lo, step, seed)) if bits == 8 else None
    if stats is None:
        return (quantize(x, layout, lo, step, bits, seed), *group_stats(x, layout))
    t_lo, t_hi, root, codes = stats
    return codes, t_lo, t_hi, root


def group_minmax(x: Tensor, layout: GroupLayout) -> tuple[Tensor, Tensor]:
    """:func:`slimact.quant.reference.group_minmax` from the same one-read pass (:func:`group_stats`)."""
    lo, hi, _ = group_stats(x, layout)
    return lo, hi


class _Tiling(NamedTuple):
    """How :func:`quantize`/:func:`dequantize` view a tensor (see the module docstring)."""

    mode: int  # _WHOLE, _PER_COL, _PER_ROW or _PER_ELEMENT
    rows: int
    width: int  # elements per row
    row_bytes: int  # code bytes per row
    r: int  # rows per tile
    bb: int  # code bytes per tile row
    col_blocks: int
    grid: int
    wide: bool  # int64 offsets


def _tiling(numel: int, layout: GroupLayout, bits: int) -> _Tiling:
    per_byte = 8 // bits
    if layout.dim is None or layout.groups == 1:
        mode, rows, width = _WHOLE, 1, numel
    elif layout.inner == 1:
        mode, rows, width = _PER_COL, numel // layout.size, layout.size
    else:
        mode, rows, width = _PER_ROW, numel // layout.inner, layout.inner
    if rows > 1 and width % per_byte:  # sub-byte codes would straddle rows: flat tiles
        mode, rows, width = _PER_ELEMENT, 1, numel
    row_bytes = -(-width // per_byte)
    bb = min(triton.next_power_of_2(row_bytes), _TILE // per_byte)
    r = min(triton.next_power_of_2(rows), max(1, _TILE // (bb * per_byte)))
    col_blocks, row_blocks = triton.cdiv(row_bytes, bb), triton.cdiv(rows, r)
    wide = (row_blocks * r - 1) * width + col_blocks * bb * per_byte >= _INT32_OFFSETS  # past the last offset
    return _Tiling(mode, rows, width, row_bytes, r, bb, col_blocks, col_blocks * row_blocks, wide)


def quantize(x: Tensor, layout: GroupLayout, lo: Tensor, step: Tensor, bits: int, seed: int | None) -> Tensor:
    """Codes of ``x`` (see :func:`slimact.quant.reference.quantize`); reads ``x`` once, writes codes once."""
    x = x.contiguous()
    numel = x.numel()
    codes = torch.empty(packed_numel(numel, bits), dtype=torch.uint8, device=x.device)
    t = _tiling(numel, layout, bits)
    seed_arg, offset, advance = _seed_args(seed, x.device)
    _quantize_kernel[(t.grid,)](
        x, codes, lo, step, offset, seed_arg, t.rows, t.width, t.row_bytes, t.col_blocks,
        layout.inner, layout.size, layout.groups,
        BITS=bits, STOCHASTIC=seed is not None, MODE=t.mode, R=t.r, BB=t.bb, WIDE=t.wide, enable_fp_fusion=False,
    )
    if advance is not None:
        advance.add_(1)
    return codes.view(x.shape) if bits == 8 else codes


def dequantize(codes: Tensor, meta: PackMeta, lo: Tensor, step: Tensor) -> Tensor:
    """Restore codes to a contiguous tensor of ``meta.shape`` and ``meta.dtype``."""
    out = torch.empty(meta.shape, dtype=meta.dtype, device=codes.device)
    layout = meta.layout
    t = _tiling(out.numel(), layout, meta.bits)
    bf16 = meta.dtype == torch.bfloat16
    _dequantize_kernel[(t.grid,)](
        codes, out.view(torch.int16) if bf16 else out, lo, step, t.rows, t.width, t.row_bytes, t.col_blocks,
        layout.inner, layout.size, layout.groups,
        BITS=meta.bits, BF16_BITS=bf16, MODE=t.mode, R=t.r, BB=t.bb, WIDE=t.wide, enable_fp_fusion=False,
    )
    return out


# The finishing work of a pack on the device (issue 19): partials -> per-group decisions and scale, in one launch.


@triton.jit
def _group_bounds(g, size, groups):
    # The indices i of the grouped dim with i * groups // size == g: start <= i < end (g int64).
    return (g * size + groups - 1) // groups, ((g + 1) * size + groups - 1) // groups


@triton.jit
def _reduce_partials(part_ptr, parts, size, start, end, BP: tl.constexpr, BS: tl.constexpr):
    # A group's partials part[:, :, start:end] of _stats_kernel's [4, parts, size] fp32 buffer (min, max, sum
    # sqrt|x|, non-finite count) -> (min, max, sum sqrt|x| as fp32, not finite). Min and max exactly; the sum in
    # fp64, in a fixed order (PyTorch's order is its reduction kernel's: not reproducible, and not deterministic
    # for scatter_reduce on CUDA), rounded to fp32 as the reference's group_magnitude is.
    rows = tl.arange(0, BP)[:, None]  # [BP, 1]
    cols = tl.arange(0, BS)[None, :]  # [1, BS]
    mn = tl.full([BP, BS], float("inf"), tl.float32)
    mx = tl.full([BP, BS], float("-inf"), tl.float32)
    root = tl.zeros([BP, BS], tl.float64)
    bad = tl.zeros([BP, BS], tl.float32)
    stride = parts.to(tl.int64) * size  # [parts, size] per statistic
    for s0 in range(start, end, BS):
        for p0 in range(0, parts, BP):
            p = (p0 + rows).to(tl.int64)  # [BP, 1]
            s = s0 + cols  # [1, BS]
            mask = (p < parts) & (s < end)
            at = part_ptr + p * size + s  # [BP, BS]
            mn = tl.minimum(mn, tl.load(at, mask=mask, other=float("inf")))
            mx = tl.maximum(mx, tl.load(at + stride, mask=mask, other=float("-inf")))
            root += tl.load(at + 2 * stride, mask=mask, other=0.0).to(tl.float64)
            bad = tl.maximum(bad, tl.load(at + 3 * stride, mask=mask, other=0.0))
    t_lo = tl.min(tl.min(mn, axis=1), axis=0)
    t_hi = tl.max(tl.max(mx, axis=1), axis=0)
    magnitude = tl.sum(tl.sum(root, axis=1), axis=0).to(tl.float32)
    # Not finite: a NaN/inf in the group, or a range overflowing fp32 (hi - lo in fp32, as the host decided).
    width = t_hi - t_lo
    not_finite = (tl.max(tl.max(bad, axis=1), axis=0) > 0) | ~(tl.abs(width) < float("inf"))
    return t_lo, t_hi, magnitude, not_finite


@triton.jit
def _clip_range(t_lo, t_hi, clip_bits):
    # (lo, hi).clamp(-clip, clip) of fp32 lo/hi with the clip rounded to fp32, as PyTorch's clamp and compare
    # do -> (clipped lo, clipped hi, whether the clip cut).
    c = clip_bits.to(tl.float32, bitcast=True)
    clipped = (t_lo < -c) | (t_hi > c)
    return tl.minimum(tl.maximum(t_lo, -c), c), tl.minimum(tl.maximum(t_hi, -c), c), clipped


@triton.jit
def _outlier_threshold(magnitude, start, end, per_index, numel, ROOT: tl.constexpr, WHOLE: tl.constexpr):
    # reference.outlier_threshold, its float operations in its order: (Q * sqrt(K) / (n - 1 + sqrt(K)))**2 in
    # fp64, where n - 1 + sqrt(K) is fp64 for the whole tensor (a Python float there) and fp32 per group (an int64
    # tensor plus a Python float), then rounded to fp32.
    if WHOLE:
        den = (numel.to(tl.float64) - 1.0) + ROOT
    else:
        count = (end - start) * per_index.to(tl.int64)  # elements in the group
        den = ((count - 1).to(tl.float32) + ROOT).to(tl.float64)
    limit = magnitude.to(tl.float64) * ROOT / den
    return (limit * limit).to(tl.float32)


@triton.jit
def _scale_params(t_lo, t_hi, QMAX: tl.constexpr):
    # reference.scale_params of fp32 (lo, hi) (scalars or blocks), its float operations in its order (fp64, every
    # division in fp64, nextafter on the bits) -> fp32 (lo, step). (No NaN here but in a group that is not finite,
    # whose values the caller then leaves unused.)
    lo64 = t_lo.to(tl.float64)
    hi64 = t_hi.to(tl.float64)
    rng = hi64 - lo64
    step64 = rng / QMAX
    straddles = (lo64 < 0) & (hi64 > 0)
    lo_out = t_lo
    if QMAX >= 15:
        tiny = tl.full([], 0x0010000000000000, tl.int64).to(tl.float64, bitcast=True)  # finfo(float64).tiny
        z_star = -lo64 / tl.maximum(rng, tiny) * QMAX
        z_lo = tl.minimum(tl.maximum(tl.floor(z_star), 1.0), QMAX - 1.0)
        z_hi = tl.minimum(tl.maximum(tl.ceil(z_star), 1.0), QMAX - 1.0)
        cand_lo = tl.maximum(-lo64 / z_lo, hi64 / (QMAX - z_lo))
        cand_hi = tl.maximum(-lo64 / z_hi, hi64 / (QMAX - z_hi))
        z = tl.where(cand_hi < cand_lo, z_hi, z_lo)
        zero_step = tl.minimum(cand_lo, cand_hi)
        # reference._past_half: zero-aligned codes that fp16 data would restore beyond its largest finite value
        past = (((QMAX - z) * zero_step > 65504.0) & (hi64 <= 65504.0)) | ((z * zero_step > 65504.0)
                                                                          & (-lo64 <= 65504.0))
        straddles = straddles & (past == 0)
        step64 = tl.where(straddles, zero_step, step64)
    step = step64.to(tl.float32)
    # rounded up, never down: nextafter(step, inf) on the bits (step >= 0 here; 0 -> the smallest subnormal)
    bits = step.to(tl.int32, bitcast=True)
    up = tl.where(step == 0, 1, tl.where(step > 0, bits + 1, bits - 1)).to(tl.float32, bitcast=True)
    step = tl.where(step.to(tl.float64) < step64, up, step)
    ok = (rng > 0) & (step > 0)
    if QMAX >= 15:
        lo_out = tl.where(straddles & ok, -(z.to(tl.float32) * step), t_lo)
    step = tl.where(ok, step, 1.0)
    return lo_out, step


# (Scalars not specialised: a 1 would become a constexpr, which has no .to.)
@triton.jit(do_not_specialize=["parts", "size", "groups", "per_index", "numel", "clip_bits"])
def _finish_kernel(
    part_ptr, lo_ptr, step_ptr, aux_ptr, flags_ptr, parts, size, groups, per_index, numel, clip_bits,
    QMAX: tl.constexpr, ROOT: tl.constexpr, WHOLE: tl.constexpr, CLIP: tl.constexpr, BP: tl.constexpr,
    BS: tl.constexpr,
):
    # One program per group g: its partials part[:, :, start:end] of _stats_kernel's [4, parts, size] fp32 buffer
    # (min, max, sum sqrt|x|, non-finite count) -> lo[g], step[g] (scale_params' of the clipped range), aux[:, g] of
    # a [4, groups] fp32 buffer (the clipped range's lo and hi, sum sqrt|x|, outlier threshold), and the pack's
    # three flags (not finite, clipped, outliers present), or-ed over the groups into flags[0:3] (zeroed int32).
    g = tl.program_id(0).to(tl.int64)
    start, end = _group_bounds(g, size, groups)
    t_lo, t_hi, magnitude, not_finite = _reduce_partials(part_ptr, parts, size, start, end, BP, BS)
    if CLIP:
        t_lo, t_hi, clipped = _clip_range(t_lo, t_hi, clip_bits)
        tl.atomic_max(flags_ptr + 1, clipped.to(tl.int32))
    threshold = _outlier_threshold(magnitude, start, end, per_index, numel, ROOT, WHOLE)
    heavy = tl.maximum(tl.abs(t_lo), tl.abs(t_hi)) > threshold
    lo_out, step = _scale_params(t_lo, t_hi, QMAX)
    tl.store(lo_ptr + g, lo_out)
    tl.store(step_ptr + g, step)
    tl.store(aux_ptr + g, t_lo)
    tl.store(aux_ptr + groups + g, t_hi)
    tl.store(aux_ptr + 2 * groups + g, magnitude)
    tl.store(aux_ptr + 3 * groups + g, threshold)
    tl.atomic_max(flags_ptr, not_finite.to(tl.int32))
    tl.atomic_max(flags_ptr + 2, heavy.to(tl.int32))


def _f32_bits(v: float) -> int:
    # The int32 bits of v rounded to fp32 (as PyTorch casts a Python scalar against an fp32 tensor).
    try:
        return struct.unpack("<i", struct.pack("<f", v))[0]
    except OverflowError:
        return struct.unpack("<i", struct.pack("<f", math.copysign(math.inf, v)))[0]


def decide(
    x: Tensor, layout: GroupLayout, qmax: int, clip: float | None, flags: Tensor
) -> tuple[Tensor, Tensor, Tensor] | None:
    """The range pass and the pack's finishing work in two launches, nothing read back: ``(lo, step, aux)``.

    ``lo``/``step`` (fp32 ``[groups]``) are :func:`slimact.quant.reference.scale_params` of the range clipped to
    ``clip``; ``aux`` (fp32 ``[4, groups]``) holds that clipped range's lo and hi, the sum of ``sqrt|x|`` and the
    :func:`slimact.quant.reference.outlier_threshold` per group; ``flags`` (int32 ``[3]``, zeroed by the caller, a
    slice of one buffer for all the tensors of a ``pack_many``) gets whether the range is not finite, whether the
    clip cut it, and whether some ``|x|`` lies beyond the threshold, or-ed over the groups: what the host then
    reads, once. The same values as the host's float operations on :func:`group_stats` (the reference's min and
    max; the sum of square roots as close as in :func:`group_stats`, so the outlier decision may differ from the
    reference's only for a value within float rounding of the threshold). ``None`` where the range pass's grid
    would exceed the launch limits."""
    stats = _stats(x, layout, partials=True)
    if stats is None:
        return None
    return _finish(stats[0], layout, x.numel(), qmax, clip, flags)


def _partial_blocks(parts: int, size: int, groups: int) -> tuple[int, int]:
    # The [BP, BS] tile a program per group reads its partials by (_reduce_partials).
    width = triton.cdiv(size, groups)  # the most indices a group has
    bs = min(64, triton.next_power_of_2(width))
    return max(1, min(triton.next_power_of_2(parts), 1024 // bs)), bs


def _finish(
    part: Tensor, layout: GroupLayout, numel: int, qmax: int, clip: float | None, flags: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    # part: [4, parts, size] fp32 partials of _stats_kernel -> lo, step [groups], aux [4, groups]; flags [3] or-ed
    parts, size = part.shape[1], part.shape[2]
    groups = layout.groups
    bp, bs = _partial_blocks(parts, size, groups)
    lo = torch.empty(groups, dtype=torch.float32, device=part.device)
    step = torch.empty(groups, dtype=torch.float32, device=part.device)
    aux = torch.empty(4, groups, dtype=torch.float32, device=part.device)
    _finish_kernel[(groups,)](
        part, lo, step, aux, flags, parts, size, groups, numel // max(size, 1), numel,
        _f32_bits(clip) if clip is not None else 0,
        QMAX=qmax, ROOT=math.sqrt(reference.OUTLIER_RATIO), WHOLE=layout.dim is None, CLIP=clip is not None,
        BP=bp, BS=bs, enable_fp_fusion=False,
    )
    return lo, step, aux


# The pack under a running estimate on the device (:func:`slimact.quant.core._pack_running`): one small kernel
# before the pass over x (the estimate's lo/step), one after (x's range folded into the estimate, in place).


@triton.jit(do_not_specialize=["groups"])
def _estimate_kernel(est_lo_ptr, est_rng_ptr, lo_ptr, step_ptr, groups, QMAX: tl.constexpr, B: tl.constexpr):
    # The running estimate's tensors (lo, range), fp32 [groups] -> scale_params(lo, lo + range) into fresh lo, step:
    # RunningRange.estimate's hi (an fp32 add) and the reference's scale, bit for bit.
    g = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    keep = g < groups
    e_lo = tl.load(est_lo_ptr + g, mask=keep, other=0.0)
    e_hi = e_lo + tl.load(est_rng_ptr + g, mask=keep, other=0.0)
    lo, step = _scale_params(e_lo, e_hi, QMAX)
    tl.store(lo_ptr + g, lo, mask=keep)
    tl.store(step_ptr + g, step, mask=keep)


@triton.jit(do_not_specialize=["parts", "size", "groups", "per_index", "numel", "clip_bits", "decay_bits",
                               "rest_bits"])
def _fold_kernel(
    part_ptr, step_ptr, est_lo_ptr, est_rng_ptr, parts, size, groups, per_index, numel, clip_bits, decay_bits,
    rest_bits, ROOT: tl.constexpr, WHOLE: tl.constexpr, CLIP: tl.constexpr, OUTLIERS: tl.constexpr,
    TRAINING: tl.constexpr, BP: tl.constexpr, BS: tl.constexpr,
):
    # One program per group g: its partials (as _finish_kernel's) -> step[g] set to NaN where the group is not
    # finite; when TRAINING, the group's range, clipped (CLIP) and cut to its outlier threshold (OUTLIERS), folded
    # into the estimate's tensors in place with RunningRange.fold's float operations in its order
    # (lo <- lo * decay + t_lo * (1 - decay), range likewise with t_hi - t_lo; decay and 1 - decay rounded to fp32
    # as PyTorch rounds a Python scalar against an fp32 tensor), a group that is not finite keeping its estimate.
    g = tl.program_id(0).to(tl.int64)
    start, end = _group_bounds(g, size, groups)
    t_lo, t_hi, magnitude, not_finite = _reduce_partials(part_ptr, parts, size, start, end, BP, BS)
    step = tl.load(step_ptr + g)
    tl.store(step_ptr + g, tl.where(not_finite, float("nan"), step))
    if TRAINING:
        if CLIP:
            t_lo, t_hi, _ = _clip_range(t_lo, t_hi, clip_bits)
        if OUTLIERS:
            limit = _outlier_threshold(magnitude, start, end, per_index, numel, ROOT, WHOLE)
            t_lo = tl.maximum(t_lo, -limit)
            t_hi = tl.minimum(t_hi, limit)
        decay = decay_bits.to(tl.float32, bitcast=True)
        rest = rest_bits.to(tl.float32, bitcast=True)
        old_lo = tl.load(est_lo_ptr + g)
        old_rng = tl.load(est_rng_ptr + g)
        new_lo = old_lo * decay + t_lo * rest  # two roundings each (launched without fp fusion), as PyTorch's ops
        new_rng = old_rng * decay + (t_hi - t_lo) * rest
        tl.store(est_lo_ptr + g, tl.where(not_finite, old_lo, new_lo))
        tl.store(est_rng_ptr + g, tl.where(not_finite, old_rng, new_rng))


def scale_estimate(est_lo: Tensor, est_rng: Tensor, qmax: int) -> tuple[Tensor, Tensor]:
    """:func:`slimact.quant.reference.scale_params` of a running estimate's ``(lo, lo + range)`` in one launch,
    from its tensors (fp32 ``[groups]``, read on the device, not copied): fresh fp32 ``[groups]`` ``lo``/``step``,
    the same bits as ``scale_params(*RunningRange.estimate(groups, device), qmax)``."""
    groups = est_lo.numel()
    lo = torch.empty(groups, dtype=torch.float32, device=est_lo.device)
    step = torch.empty(groups, dtype=torch.float32, device=est_lo.device)
    block = min(1024, triton.next_power_of_2(groups))
    _estimate_kernel[(triton.cdiv(groups, block),)](
        est_lo, est_rng, lo, step, groups, QMAX=qmax, B=block, enable_fp_fusion=False,
    )
    return lo, step


def quantize_fold(
    x: Tensor, layout: GroupLayout, lo: Tensor, step: Tensor, bits: int, seed: int | None,
    estimate: tuple[Tensor, Tensor], decay: float, clip: float | None, outliers: bool, training: bool,
) -> Tensor | None:
    """The codes of ``x`` for ``lo``/``step`` (a running estimate's, :func:`scale_estimate`) and ``x``'s own range
    folded into that estimate's tensors ``estimate`` (fp32 ``[groups]`` lo and range, updated in place when
    ``training``), nothing read back: the range pass with the 8-bit codes from the same read (4- and 2-bit codes
    from a :func:`quantize`), then one program per group (:func:`_fold_kernel`), which also sets ``step`` to NaN
    in place for a group holding NaN/inf (or whose range overflows fp32). ``None`` where the range pass's grid
    would exceed the launch limits (nothing launched)."""
    if bits == 8:
        stats = _stats(x, layout, (lo, step, seed), partials=True)
        if stats is None:
            return None
        part, codes = stats
    else:
        stats = _stats(x, layout, partials=True)
        if stats is None:
            return None
        part, codes = stats[0], quantize(x, layout, lo, step, bits, seed)
    parts, size = part.shape[1], part.shape[2]
    groups = layout.groups
    bp, bs = _partial_blocks(parts, size, groups)
    numel = x.numel()
    _fold_kernel[(groups,)](
        part, step, estimate[0], estimate[1], parts, size, groups, numel // max(size, 1), numel,
        _f32_bits(clip) if clip is not None else 0, _f32_bits(decay), _f32_bits(1.0 - decay),
        ROOT=math.sqrt(reference.OUTLIER_RATIO), WHOLE=layout.dim is None, CLIP=clip is not None,
        OUTLIERS=outliers, TRAINING=training, BP=bp, BS=bs, enable_fp_fusion=False,
    )
    return codes
