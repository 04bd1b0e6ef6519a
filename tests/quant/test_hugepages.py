"""Large unpack outputs on huge pages (slimact.quant._hugepages): placement, release, and the restore into them."""

import torch

from slimact.quant import QuantConfig, _hugepages, pack, unpack

HUGE_PAGE = 2 << 20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_large_buffers_are_aligned_writable_and_small_ones_left_to_the_allocator():
    t = _hugepages.empty((4096, 2048), torch.float32)  # 32 MiB
    if not _hugepages._available():  # huge pages off (or not Linux): the caller allocates as usual
        assert t is None
        return
    assert t.shape == (4096, 2048) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(3.0)
    assert bool((t == 3.0).all())
    assert _hugepages.empty((4096, 2047), torch.float32) is None  # under MIN_BYTES


def test_a_freed_buffer_is_unmapped(monkeypatch):
    # Huge pages or not, the mapping is the tensor's: madvise refused leaves a plain private mapping.
    monkeypatch.setattr(_hugepages, "_available", lambda: True)
    before = _resident_bytes()
    for _ in range(16):
        t = _hugepages.empty((16 << 20,), torch.float32)  # 64 MiB, every page touched
        t.fill_(1.0)
        del t
    # 16 leaked buffers would be 1 GiB resident; freed ones are not.
    assert _resident_bytes() - before < 256 << 20


def test_unpack_restores_into_huge_pages_bit_for_bit(monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(2048, 4096) * torch.linspace(0.1, 5, 4096)  # 32 MiB fp32
    cfg = QuantConfig(groups=8)
    packed = pack(x, cfg, backend="inductor", share=False)
    ref = unpack(packed, backend="reference")
    fast = unpack(packed, backend="inductor")
    assert torch.equal(fast, ref)
    if _hugepages._available():
        assert fast.data_ptr() % HUGE_PAGE == 0
    # Without huge pages (off, or the mapping refused): the usual allocation, the same values.
    monkeypatch.setattr(_hugepages, "_available", lambda: False)
    assert _hugepages.empty(x.shape, x.dtype) is None
    assert torch.equal(unpack(packed, backend="inductor"), ref)


def test_off_sends_every_buffer_through_the_allocator():
    # What a peak-memory measurement needs (torch.profiler sees only the allocator's buffers).
    with _hugepages.off():
        assert _hugepages.empty((16 << 20,), torch.float32) is None
        with _hugepages.off():
            pass
        assert _hugepages.empty((16 << 20,), torch.float32) is None
    assert (_hugepages.empty((16 << 20,), torch.float32) is None) == (not _hugepages._available())
