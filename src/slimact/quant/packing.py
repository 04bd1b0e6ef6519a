"""Packing of sub-byte codes and boolean masks into bytes.

``b``-bit codes (``b`` in 1, 2, 4, 8) are laid ``8 // b`` to a byte, element ``j`` of a byte at bits
``[j*b, (j+1)*b)`` (least significant first); the tail is padded with zeros. A boolean mask is the
``b = 1`` case: 8 elements per byte, 1/8 of a byte per element instead of ``torch.bool``'s one byte.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

__all__ = ["pack_bits", "pack_mask", "packed_numel", "unpack_bits", "unpack_mask"]

_SUPPORTED = (1, 2, 4, 8)


def packed_numel(numel: int, bits: int) -> int:
    """Bytes needed for ``numel`` codes of ``bits`` bits."""
    per_byte = 8 // bits
    return (numel + per_byte - 1) // per_byte


def _shifts(bits: int, device: torch.device) -> Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack a flat uint8 tensor of codes (each ``< 2**bits``) into ``packed_numel(n, bits)`` bytes."""
    if bits not in _SUPPORTED:
        raise ValueError(f"bits must be one of {_SUPPORTED}, got {bits}")
    codes = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return codes
    per_byte = 8 // bits
    pad = (-codes.numel()) % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    # [n_bytes, per_byte] << [per_byte]; fields do not overlap, so the sum is a bitwise or.
    return (codes.view(-1, per_byte) << _shifts(bits, codes.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` codes as a flat uint8 tensor."""
    if bits not in _SUPPORTED:
        raise ValueError(f"bits must be one of {_SUPPORTED}, got {bits}")
    if bits == 8:
        return packed.reshape(-1)[:numel]
    mask = (1 << bits) - 1
    fields = (packed.reshape(-1, 1) >> _shifts(bits, packed.device)) & mask  # [n_bytes, per_byte]
    return fields.reshape(-1)[:numel]


# Masks as bits, 8 bytes at a time (the same bytes as pack_bits(mask, 1)): the 8 bools of a byte read as one
# little-endian int64 (one 0/1 per byte); multiplying by _GATHER puts bool j at bit 56 + j and nothing else
# there (every product term lands on its own bit: no carries), so the top byte is the packed byte. Unpacking
# spreads the byte to all 8 bytes (times _SPREAD), keeps bit j in byte j (_SELECT), turns a nonzero byte's
# high bit on (+ 0x7F per byte, no carry between bytes) and moves it to bit 0. A few int64 passes over n/8
# elements instead of uint8 passes broadcast over [n/8, 8]: on the CPU about 10x faster for a dropout mask.
_GATHER = 0x0102040810204080
_SPREAD = 0x0101010101010101
_SELECT = 0x8040201008040201 - (1 << 64)  # as a signed int64
_HIGH = 0x7F7F7F7F7F7F7F7F


def _words() -> bool:
    """Whether the int64 route applies: a little-endian host, and not while dynamo traces (dtype views)."""
    return sys.byteorder == "little" and not torch.compiler.is_compiling()


def pack_mask(mask: Tensor) -> Tensor:
    """A boolean tensor as bits, 8 per byte (its shape is the caller's to keep)."""
    flat = mask.reshape(-1)
    if flat.dtype != torch.bool or not _words():
        return pack_bits(flat, 1)
    n = flat.numel()
    if n % 8 or flat.storage_offset() % 8:
        flat = torch.cat([flat, flat.new_zeros((-n) % 8)])
    return ((flat.view(torch.uint8).view(torch.int64) * _GATHER) >> 56).to(torch.uint8)


def unpack_mask(packed: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """Inverse of :func:`pack_mask`: a boolean tensor of ``shape``."""
    numel = 1
    for s in shape:
        numel *= s
    if not _words():
        return unpack_bits(packed, 1, numel).reshape(shape).bool()
    words = packed.reshape(-1).to(torch.int64).mul_(_SPREAD).bitwise_and_(_SELECT).add_(_HIGH)
    words = words.bitwise_right_shift_(7).bitwise_and_(_SPREAD)
    return words.view(torch.uint8)[:numel].view(torch.bool).reshape(shape)
