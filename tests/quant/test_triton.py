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
