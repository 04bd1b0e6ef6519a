"""The compression core: b-bit codes with per-group scales, running estimates, bit-packed masks.

``pack``/``unpack`` (in :mod:`slimact.quant.core`) are what slimact's Functions call; the pure-PyTorch
:mod:`slimact.quant.reference` is the oracle and CPU path; :mod:`slimact.quant.triton` (imported only on
demand) the GPU path.
"""

from slimact.quant.core import backend_for, pack, pack_many, unpack, unpack_map
from slimact.quant.packing import pack_bits, pack_mask, unpack_bits, unpack_mask
from slimact.quant.reference import Packed, QuantConfig
from slimact.quant.state import RunningRange

__all__ = [
    "Packed",
    "QuantConfig",
    "RunningRange",
    "backend_for",
    "pack",
    "pack_bits",
    "pack_many",
    "pack_mask",
    "unpack",
    "unpack_bits",
    "unpack_map",
    "unpack_mask",
]
