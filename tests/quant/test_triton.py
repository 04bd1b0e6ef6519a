"""Triton kernels against the reference, bit for bit (on CPU through TRITON_INTERPRET=1, see conftest)."""

import pytest
import torch

pytest.importorskip("triton")

from slimact.quant import QuantConfig, pack, unpack

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
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("shape,cfg", CASES)
def test_triton_equals_reference(shape, cfg, bits, stochastic, dtype):
    cfg = QuantConfig(bits=bits, group_dim=cfg.group_dim, groups=cfg.groups, stochastic=stochastic)
    x = (torch.randn(shape) * 4).to(dtype)
    torch.manual_seed(7)
    ref = pack(x, cfg, backend="reference", share=False)
    torch.manual_seed(7)  # the same stochastic-rounding seed
    tri = pack(x, cfg, backend="triton", share=False)
    assert tri.tensors[0] is not ref.tensors[0]
    for a, b in zip(ref.tensors, tri.tensors, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(unpack(ref, backend="reference"), unpack(tri, backend="triton"))


def test_triton_reads_non_contiguous_input():
    x = torch.randn(9, 6).t()
    cfg = QuantConfig(groups=2)
    ref, tri = pack(x, cfg, backend="reference", share=False), pack(x, cfg, backend="triton", share=False)
    assert torch.equal(ref.tensors[0], tri.tensors[0])
