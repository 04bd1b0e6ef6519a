"""Triton kernels against the reference, bit for bit: on a CUDA device when there is one (benchmarks/gpu.sh),
else on CPU through TRITON_INTERPRET=1 (see conftest)."""

import pytest
import torch

pytest.importorskip("triton")

from slimact.quant import QuantConfig, pack, reference
from slimact.quant import triton as kernels
from slimact.quant.reference import PackMeta, group_layout, group_minmax, scale_params

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [
    ((1,), QuantConfig(group_dim=None)),
    ((7,), QuantConfig(groups=3)),
    ((5, 13), QuantConfig(groups=4)),
    ((3, 5, 16), QuantConfig(groups=0)),
    ((2, 3, 9, 5), QuantConfig(group_dim=1, groups=0)),
    ((2, 6, 9, 5), QuantConfig(group_dim=1, groups=4)),
    ((1023,), QuantConfig(group_dim=None)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("seed", [None, 0, 12345, 2**31 - 2], ids=["nearest", "seed0", "seed12345", "seedmax"])
@pytest.mark.parametrize("shape,cfg", CASES)
def test_triton_equals_reference(shape, cfg, bits, seed, dtype):
    x = (torch.randn(shape) * 4).to(dtype).to(DEVICE)
    layout = group_layout(x.shape, cfg)
    lo, step = scale_params(*group_minmax(x, layout), (1 << bits) - 1)
    ref = reference.quantize(x, layout, lo, step, bits, seed)
    tri = kernels.quantize(x, layout, lo, step, bits, seed)
    assert torch.equal(ref, tri)
    meta = PackMeta(x.shape, dtype, bits, layout, False)
    assert torch.equal(reference.dequantize(ref, meta, lo, step), kernels.dequantize(tri, meta, lo, step))


def test_pack_through_either_backend_gives_the_same_codes():
    x = torch.randn(9, 6, device=DEVICE).t()  # non-contiguous
    cfg = QuantConfig(groups=2)
    ref, tri = pack(x, cfg, backend="reference", share=False), pack(x, cfg, backend="triton", share=False)
    for a, b in zip(ref.tensors, tri.tensors, strict=True):
        assert torch.equal(a, b)


# The range pass: along the channels (inner == 1, several row blocks, a group count that does not divide), along
# inner (per head; a conv's channels), the whole tensor, and a trailing dim of one.
STATS_CASES = [
    *CASES,
    ((130, 70), QuantConfig(groups=8)),
    ((3, 4, 40, 33), QuantConfig(group_dim=1, groups=0)),
    ((2, 6, 5, 7), QuantConfig(group_dim=1, groups=4)),
    ((5000,), QuantConfig(group_dim=None)),
    ((9, 1), QuantConfig(groups=0)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,cfg", STATS_CASES)
def test_one_pass_stats_equal_the_references(shape, cfg, dtype):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 4).to(dtype).to(DEVICE)
    layout = group_layout(x.shape, cfg)
    lo, hi, root = kernels.group_stats(x, layout)
    ref_lo, ref_hi, ref_root = reference.group_stats(x, layout)
    assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi)
    # fp32 partial sums against the reference's fp64 sum: float rounding of at most 5000 terms
    torch.testing.assert_close(root, ref_root, rtol=5000 * 2**-24, atol=0)
    assert torch.equal(kernels.group_minmax(x, layout)[0], ref_lo)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_mark_their_group_and_keep_the_tensor_exact(bad):
    x = torch.randn(64, 48, device=DEVICE)
    x[10, 7] = bad  # channel 7: group 1 of 8
    layout = group_layout(x.shape, QuantConfig(groups=8))
    lo, hi, _ = kernels.group_stats(x, layout)
    assert torch.isnan(lo[1]) and torch.isnan(hi[1])
    ref_lo, ref_hi, _ = reference.group_stats(x, layout)
    others = torch.arange(8) != 1
    assert torch.equal(lo[others], ref_lo[others]) and torch.equal(hi[others], ref_hi[others])
    packed = pack(x, QuantConfig(groups=8), backend="triton", share=False)
    assert packed.raw
    torch.testing.assert_close(packed.tensors[0], x, rtol=0, atol=0, equal_nan=True)


def test_outliers_decided_from_the_one_pass_stats_give_the_references_pack():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 64, generator=gen)
    x.view(-1)[torch.randperm(x.numel(), generator=gen)[:30]] = 1e4
    x = x.to(DEVICE)
    for cfg in (QuantConfig(groups=8), QuantConfig(group_dim=None), QuantConfig(groups=0)):
        ref, tri = pack(x, cfg, backend="reference", share=False), pack(x, cfg, backend="triton", share=False)
        assert len(tri.tensors) == 5
        for a, b in zip(ref.tensors, tri.tensors, strict=True):
            assert torch.equal(a, b)
