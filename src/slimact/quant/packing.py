"""Packing of sub-byte codes and boolean masks into bytes.

``b``-bit codes (``b`` in 1, 2, 4, 8) are laid ``8 // b`` to a byte, element ``j`` of a byte at bits
``[j*b, (j+1)*b)`` (least significant first); the tail is padded with zeros. A boolean mask is the
``b = 1`` case: 8 elements per byte, 1/8 of a byte per element instead of ``torch.bool``'s one byte.
"""

from __future__ import annotations

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


def pack_mask(mask: Tensor) -> Tensor:
    """A boolean tensor as bits, 8 per byte (its shape is the caller's to keep)."""
    return pack_bits(mask.reshape(-1), 1)


def unpack_mask(packed: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """Inverse of :func:`pack_mask`: a boolean tensor of ``shape``."""
    numel = 1
    for s in shape:
        numel *= s
    return unpack_bits(packed, 1, numel).reshape(shape).bool()
