"""Fresh CPU buffers on transparent huge pages, for the large tensors an unpack returns.

An unpack returns a new tensor. glibc serves an allocation of 32 MiB or more (the largest its mmap threshold
grows to) with a fresh mapping of 4 KiB pages, each faulted in and zeroed by the kernel at its first write:
16384 faults for 64 MiB, which took 5x the time of the copy itself (``slimact bench --ops``: the unpack ran at
0.19x of ``Tensor.copy_``'s bandwidth, and ``clone()`` the same). On 2 MiB pages the same buffer takes 32 faults.
PyTorch can put all its allocations there (``THP_MEM_ALLOC_ENABLE=1``), but only when set before its first
allocation, for the whole process; here only slimact's own large outputs are, with no setting.

:func:`empty` maps ``nbytes`` plus 2 MiB of private anonymous memory, asks for huge pages (``MADV_HUGEPAGE``,
which the kernel's default ``madvise`` mode honours) and returns a tensor on the 2 MiB-aligned part. The tensor
owns the mapping: it is unmapped when the tensor's storage is freed, as glibc would unmap its own. Nothing
changes below :data:`MIN_BYTES` (glibc's heap reuses freed memory there, with no faults at all), where huge
pages are off (``[never]``), off Linux, or if the mapping fails: :func:`empty` then returns ``None`` and the
caller allocates as usual.

PyTorch's allocator does not see these buffers, nor does ``torch.profiler``'s memory view: a measurement of
peak CPU memory runs under :func:`off` (``slimact bench`` does), so that every byte goes through the allocator.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["MIN_BYTES", "empty", "off"]

#: Smallest buffer put on huge pages: glibc's largest mmap threshold (below it, freed memory is reused).
MIN_BYTES = 32 << 20
_HUGE_PAGE = 2 << 20
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_off = 0  # nesting depth of off()


@functools.cache
def _available() -> bool:
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_MODE.read_text()
    except OSError:
        return False


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Within it, :func:`empty` returns ``None``: every buffer comes from PyTorch's allocator."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> Tensor | None:
    """An uninitialised contiguous CPU tensor on huge pages, or ``None`` (see the module docstring)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or _off or not _available():
        return None
    try:
        buffer = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buffer.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    raw = torch.frombuffer(buffer, dtype=torch.uint8)  # holds the mapping until its storage is freed
    start = -raw.data_ptr() % _HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).view(shape)
