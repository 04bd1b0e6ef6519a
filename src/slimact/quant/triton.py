"""Triton kernels for the quantise and dequantise passes of :mod:`slimact.quant.reference`.

Same math, same codes: given the same per-group ``lo``/``step`` and the same seed, :func:`quantize` returns
the reference's codes bit for bit (tested on CPU under ``TRITON_INTERPRET=1``), including the stochastic
bits, which each program recomputes from ``fmix32(flat_index ^ seed_key)`` instead of reading a noise
tensor. One program handles ``BLOCK`` output bytes, i.e. ``BLOCK * 8 // bits`` elements laid out as a
``[BLOCK, 8 // bits]`` tile, so sub-byte codes are packed in registers before the single store.

Bytes moved per element: read ``x`` (2 or 4) and write ``bits/8`` to pack; the reverse to unpack.

The range pass, :func:`group_stats` (per group: min, max, the sum of ``sqrt|x|`` that decides outliers, and
whether any value is NaN/inf), reads ``x`` once too, where the reference's reductions read it three times (a
min, a max and an fp64 power sum). ``x`` is viewed as ``[outer, size, inner]`` around the grouped dim; each
program reduces one tile to a partial per index of that dim, written to its own slot (no atomics), and the few
partials are reduced by PyTorch in a fixed order, so the result is deterministic. Tiles run along the dim when
it is the last one (``inner == 1``: channel groups, coalesced along channels), along ``inner`` otherwise (per
head, the whole tensor).

:func:`quantize_stats` is that pass with the 8-bit codes written from the same read, for a given ``lo``/``step``
(a running estimate's): the pack under a running estimate reads ``x`` once and never waits for the host
(:func:`slimact.quant.core._pack_running`).

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

import torch
import triton
import triton.language as tl
from torch import Tensor

from slimact.quant import reference
from slimact.quant.packing import packed_numel
from slimact.quant.reference import GroupLayout, PackMeta, _group_reduce, seed_key

__all__ = ["decide", "dequantize", "group_minmax", "group_stats", "quantize", "quantize_stats"]

_BLOCK = 1024
_TILE = 4096  # elements one range program reduces
_GRID_MAX = (2**31 - 1, 65535, 65535)


@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _group_of(idx, inner, size, groups):
    return ((idx // inner) % size) * groups // size


@triton.jit
def _code(x, lo, step, idx, key, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    # The reference's code of x (fp32) at flat index idx: clamp(floor((x - lo) / step + u), 0, qmax), u = 1/2 or
    # the hashed uniform of the index.
    v = (x - lo) / step
    if STOCHASTIC:
        h = _fmix32(((idx & 0xFFFFFFFF) ^ key).to(tl.uint32))
        v = v + (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
    else:
        v = v + 0.5
    return tl.minimum(tl.maximum(tl.floor(v), 0.0), QMAX).to(tl.uint32)


@triton.jit
def _quantize_kernel(
    x_ptr, codes_ptr, lo_ptr, step_ptr, numel, nbytes, inner, size, groups, key,
    BITS: tl.constexpr, STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr,
):
    PER_BYTE: tl.constexpr = 8 // BITS
    QMAX: tl.constexpr = (1 << BITS) - 1
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    lane = tl.arange(0, PER_BYTE)  # [PER_BYTE]
    idx = byte[:, None] * PER_BYTE + lane[None, :]  # [BLOCK, PER_BYTE] flat element index
    mask = idx < numel
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    g = _group_of(idx, inner, size, groups)
    lo = tl.load(lo_ptr + g, mask=mask, other=0.0)
    step = tl.load(step_ptr + g, mask=mask, other=1.0)
    code = tl.where(mask, _code(x, lo, step, idx, key, QMAX, STOCHASTIC), 0)
    packed = tl.sum(code << (lane * BITS)[None, :], axis=1)
    tl.store(codes_ptr + byte, packed.to(tl.uint8), mask=byte < nbytes)


@triton.jit
def _dequantize_kernel(
    codes_ptr, out_ptr, lo_ptr, step_ptr, numel, nbytes, inner, size, groups,
    BITS: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK: tl.constexpr,
):
    PER_BYTE: tl.constexpr = 8 // BITS
    QMAX: tl.constexpr = (1 << BITS) - 1
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lane = tl.arange(0, PER_BYTE)
    packed = tl.load(codes_ptr + byte, mask=byte < nbytes, other=0).to(tl.uint32)
    code = (packed[:, None] >> (lane * BITS)[None, :]) & QMAX  # [BLOCK, PER_BYTE]
    idx = byte[:, None] * PER_BYTE + lane[None, :]
    mask = idx < numel
    g = _group_of(idx, inner, size, groups)
    lo = tl.load(lo_ptr + g, mask=mask, other=0.0)
    step = tl.load(step_ptr + g, mask=mask, other=1.0)
    out = lo + code.to(tl.float32) * step
    if BF16_BITS:
        # fp32 -> bf16 round-to-nearest-even on the bits (as torch does; values here are finite), stored
        # through an int16 view so every Triton backend, the interpreter included, rounds the same way.
        b = out.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        tl.store(out_ptr + idx, b.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(out_ptr + idx, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _stats_kernel(x_ptr, part_ptr, codes_ptr, lo_ptr, step_ptr, outer, size, inner, parts, groups, key,
                  OB: tl.constexpr, B: tl.constexpr, ALONG_SIZE: tl.constexpr, QUANTIZE: tl.constexpr,
                  STOCHASTIC: tl.constexpr):
    # One [OB, B] tile of x viewed as [outer, size, inner] -> partial (min, max, sum sqrt|x|, non-finite count)
    # per index of the grouped dim, at part[k, p, index] of a [4, parts, size] fp32 buffer. With QUANTIZE, the
    # tile's 8-bit codes for the given per-group lo/step too, from the same read.
    o = (tl.program_id(1).to(tl.int64) * OB + tl.arange(0, OB))[:, None]  # [OB, 1]
    b = (tl.program_id(0).to(tl.int64) * B + tl.arange(0, B))[None, :]  # [1, B]
    if ALONG_SIZE:  # inner == 1: b is the index along dim
        mask = (o < outer) & (b < size)
        off = o * size + b
        dim_index = b  # [1, B]
    else:  # b runs along inner, for one index s of dim
        s = tl.program_id(2).to(tl.int64)
        mask = (o < outer) & (b < inner)
        off = (o * size + s) * inner + b
        dim_index = s
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if QUANTIZE:
        g = dim_index * groups // size
        lo_g = tl.load(lo_ptr + g, mask=dim_index < size, other=0.0)
        step_g = tl.load(step_ptr + g, mask=dim_index < size, other=1.0)
        code = _code(x, lo_g, step_g, off, key, 255, STOCHASTIC)
        tl.store(codes_ptr + off, code.to(tl.uint8), mask=mask)
    finite = tl.abs(x) < float("inf")  # False for NaN and +-inf
    ok = mask & finite
    lo = tl.where(ok, x, float("inf"))
    hi = tl.where(ok, x, float("-inf"))
    root = tl.where(ok, tl.sqrt(tl.abs(x)), 0.0)
    bad = tl.where(mask & ~finite, 1.0, 0.0)
    if ALONG_SIZE:
        p = tl.program_id(1).to(tl.int64)
        index = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)  # [B]
        where = part_ptr + p * size + index
        keep = index < size
        tl.store(where, tl.min(lo, axis=0), mask=keep)
        tl.store(where + parts * size, tl.max(hi, axis=0), mask=keep)
        tl.store(where + 2 * parts * size, tl.sum(root, axis=0), mask=keep)
        tl.store(where + 3 * parts * size, tl.sum(bad, axis=0), mask=keep)
    else:
        p = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
        where = part_ptr + p * size + s
        tl.store(where, tl.min(tl.min(lo, axis=1), axis=0))
        tl.store(where + parts * size, tl.max(tl.max(hi, axis=1), axis=0))
        tl.store(where + 2 * parts * size, tl.sum(tl.sum(root, axis=1), axis=0))
        tl.store(where + 3 * parts * size, tl.sum(tl.sum(bad, axis=1), axis=0))


def _stats(
    x: Tensor, layout: GroupLayout, quantize_with: tuple[Tensor, Tensor, int | None] | None = None,
    partials: bool = False,
) -> tuple[Tensor, ...] | None:
    """One read of ``x``: per-group (min, max, sum of ``sqrt|x|``), and the 8-bit codes for ``(lo, step, seed)``
    when ``quantize_with`` is given (else ``None``). ``None`` where the grid would exceed the launch limits. With
    ``partials``: ``(partials, codes)``, the kernel's ``[4, parts, size]`` fp32 partials unreduced (:func:`decide`)."""
    x = x.contiguous()
    numel = x.numel()
    size, inner = (1, numel) if layout.dim is None else (layout.size, layout.inner)
    outer = numel // (size * inner)
    along_size = inner == 1 and size > 1
    width = size if along_size else inner
    block = min(1024 if not along_size else 64, triton.next_power_of_2(width))
    rows = max(1, _TILE // block)
    grid = (triton.cdiv(width, block), triton.cdiv(outer, rows), 1 if along_size else size)
    if any(g > limit for g, limit in zip(grid, _GRID_MAX, strict=True)):
        return None
    parts = grid[1] if along_size else grid[0] * grid[1]
    part = torch.empty(4, parts, size, dtype=torch.float32, device=x.device)
    codes = lo_q = step_q = None
    seed = None
    if quantize_with is not None:
        lo_q, step_q, seed = quantize_with
        codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _stats_kernel[grid](
        x, part, codes, lo_q, step_q, outer, size, inner, parts, layout.groups,
        seed_key(seed) if seed is not None else 0,
        OB=rows, B=block, ALONG_SIZE=along_size, QUANTIZE=codes is not None, STOCHASTIC=seed is not None,
    )
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


def _grid(nbytes: int) -> tuple[int]:
    return (triton.cdiv(nbytes, _BLOCK),)


def quantize(x: Tensor, layout: GroupLayout, lo: Tensor, step: Tensor, bits: int, seed: int | None) -> Tensor:
    """Codes of ``x`` (see :func:`slimact.quant.reference.quantize`); reads ``x`` once, writes codes once."""
    x = x.contiguous()
    numel = x.numel()
    nbytes = packed_numel(numel, bits)
    codes = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    key = seed_key(seed) if seed is not None else 0
    _quantize_kernel[_grid(nbytes)](
        x, codes, lo, step, numel, nbytes, layout.inner, layout.size, layout.groups, key,
        BITS=bits, STOCHASTIC=seed is not None, BLOCK=_BLOCK,
    )
    return codes.view(x.shape) if bits == 8 else codes


def dequantize(codes: Tensor, meta: PackMeta, lo: Tensor, step: Tensor) -> Tensor:
    """Restore codes to a contiguous tensor of ``meta.shape`` and ``meta.dtype``."""
    out = torch.empty(meta.shape, dtype=meta.dtype, device=codes.device)
    numel = out.numel()
    nbytes = codes.numel()
    layout = meta.layout
    bf16 = meta.dtype == torch.bfloat16
    _dequantize_kernel[_grid(nbytes)](
        codes, out.view(torch.int16) if bf16 else out, lo, step, numel, nbytes,
        layout.inner, layout.size, layout.groups,
        BITS=meta.bits, BF16_BITS=bf16, BLOCK=_BLOCK,
    )
    return out


# The finishing work of a pack on the device (issue 19): partials -> per-group decisions and scale, in one launch.


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
    start = (g * size + groups - 1) // groups  # the indices i of the grouped dim with i * groups // size == g
    end = ((g + 1) * size + groups - 1) // groups
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
    # The partials' sum in fp64, in a fixed order (PyTorch's order, which the replaced path had, is its reduction
    # kernel's: not reproducible, and not deterministic for scatter_reduce on CUDA); rounded to fp32 as the
    # reference's group_magnitude is.
    magnitude = tl.sum(tl.sum(root, axis=1), axis=0).to(tl.float32)
    # Not finite: a NaN/inf in the group, or a range overflowing fp32 (hi - lo in fp32, as the host decided).
    width = t_hi - t_lo
    not_finite = (tl.max(tl.max(bad, axis=1), axis=0) > 0) | ~(tl.abs(width) < float("inf"))
    if CLIP:
        # lo.clamp(-clip, clip) of fp32 lo with the clip rounded to fp32, as PyTorch's clamp and compare do
        c = clip_bits.to(tl.float32, bitcast=True)
        clipped = (t_lo < -c) | (t_hi > c)
        t_lo = tl.minimum(tl.maximum(t_lo, -c), c)
        t_hi = tl.minimum(tl.maximum(t_hi, -c), c)
        tl.atomic_max(flags_ptr + 1, clipped.to(tl.int32))
    # reference.outlier_threshold, its float operations in its order: (Q * sqrt(K) / (n - 1 + sqrt(K)))**2 in
    # fp64, where n - 1 + sqrt(K) is fp64 for the whole tensor (a Python float there) and fp32 per group (an int64
    # tensor plus a Python float), then rounded to fp32.
    if WHOLE:
        den = (numel.to(tl.float64) - 1.0) + ROOT
    else:
        count = (end - start) * per_index.to(tl.int64)  # elements in the group
        den = ((count - 1).to(tl.float32) + ROOT).to(tl.float64)
    limit = magnitude.to(tl.float64) * ROOT / den
    threshold = (limit * limit).to(tl.float32)
    heavy = tl.maximum(tl.abs(t_lo), tl.abs(t_hi)) > threshold
    # reference.scale_params, its float operations in its order (fp64, no NaN here but in a group that is not
    # finite, whose pack is then kept exact and these values unused).
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


def _finish(
    part: Tensor, layout: GroupLayout, numel: int, qmax: int, clip: float | None, flags: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    # part: [4, parts, size] fp32 partials of _stats_kernel -> lo, step [groups], aux [4, groups]; flags [3] or-ed
    parts, size = part.shape[1], part.shape[2]
    groups = layout.groups
    width = triton.cdiv(size, groups)  # the most indices a group has
    bs = min(64, triton.next_power_of_2(width))
    bp = max(1, min(triton.next_power_of_2(parts), 1024 // bs))
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
