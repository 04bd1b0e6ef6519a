"""Triton kernels for the quantise and dequantise passes of :mod:`slimact.quant.reference`.

Same math, same codes: given the same per-group ``lo``/``step`` and the same seed, :func:`quantize` returns
the reference's codes bit for bit (tested on CPU under ``TRITON_INTERPRET=1``), including the stochastic
bits, which each program recomputes from ``fmix32(flat_index ^ seed_key)`` instead of reading a noise
tensor. One program handles ``BLOCK`` output bytes, i.e. ``BLOCK * 8 // bits`` elements laid out as a
``[BLOCK, 8 // bits]`` tile, so sub-byte codes are packed in registers before the single store.

Bytes moved per element: read ``x`` (2 or 4) and write ``bits/8`` to pack; the reverse to unpack. The
per-group range is still a separate reduction (see ``core.pack``); fusing it is the GPU fast-path work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from slimact.quant.packing import packed_numel
from slimact.quant.reference import GroupLayout, PackMeta, group_minmax, group_stats, seed_key

__all__ = ["dequantize", "group_minmax", "group_stats", "quantize"]

_BLOCK = 1024


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
    v = (x - lo) / step
    if STOCHASTIC:
        h = _fmix32(((idx & 0xFFFFFFFF) ^ key).to(tl.uint32))
        v = v + (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
    else:
        v = v + 0.5
    code = tl.minimum(tl.maximum(tl.floor(v), 0.0), QMAX).to(tl.uint32)
    code = tl.where(mask, code, 0)
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
