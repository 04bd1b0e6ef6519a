import pytest
import torch
from torch import nn

from _harness import FLOAT_DTYPES, check_against_plain, non_contiguous, saved_ratio


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (1, 1, 9), (2, 3, 5, 7), (2, 5, 17, 17), "non-contiguous"], ids=str)
def test_softmax_matches_torch(shape, dtype):
    x = non_contiguous(2, 3, 9, 9) if shape == "non-contiguous" else torch.randn(shape)
    check_against_plain(nn.Softmax(dim=-1).to(dtype), (x * 2).to(dtype))


def test_softmax_keeps_at_most_0_27x():
    assert saved_ratio(nn.Softmax(dim=-1), torch.randn(4, 4, 64, 64)) <= 0.27
