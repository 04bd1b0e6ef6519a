import pytest
import torch
from torch import nn

from _harness import FLOAT_DTYPES, check_against_plain, non_contiguous, saved_ratio


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1,), (3, 7, 33), "non-contiguous"], ids=str)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_is_exact_with_the_same_draws(shape, dtype, p):
    x = non_contiguous(3, 9, 17) if shape == "non-contiguous" else torch.randn(shape)
    check_against_plain(nn.Dropout(p), x.to(dtype), exact=True)


def test_dropout_keeps_bits():
    ratio = saved_ratio(nn.Dropout(0.1), torch.randn(256, 256))
    assert ratio <= 0.125 + 1e-9  # PyTorch keeps a one-byte bool mask; slimact keeps one bit


def test_eval_dropout_is_identity():
    from _harness import converted_copy

    drop = converted_copy(nn.Dropout(0.5)).eval()
    x = torch.randn(10)
    assert torch.equal(drop(x), x)
