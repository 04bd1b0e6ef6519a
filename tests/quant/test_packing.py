import pytest
import torch

from slimact.quant import pack_bits, pack_mask, unpack_bits, unpack_mask
from slimact.quant.packing import packed_numel


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1023])
def test_mask_round_trip(n):
    mask = torch.rand(n) > 0.5
    packed = pack_mask(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == (n + 7) // 8
    assert torch.equal(unpack_mask(packed, (n,)), mask)


def test_mask_keeps_shape_and_bit_order():
    mask = torch.tensor([[True, False, False, False], [False, False, False, True]])
    packed = pack_mask(mask)
    assert packed.tolist() == [0b10000001]  # element j at bit j, least significant first
    assert torch.equal(unpack_mask(packed, mask.shape), mask)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 3, 8, 1023])
def test_code_round_trip(bits, n):
    codes = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.numel() == packed_numel(n, bits)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_bad_width_is_an_error():
    with pytest.raises(ValueError):
        pack_bits(torch.zeros(3, dtype=torch.uint8), 3)
