import copy

import pytest
import torch
from torch import nn

from _harness import FLOAT_DTYPES, check_against_plain, saved_ratio


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 6, 1, 1), (3, 6, 5, 7), "channels-last"], ids=str)
def test_batch_norm_matches_torch(shape, dtype):
    x = torch.randn(4, 6, 5, 5).contiguous(memory_format=torch.channels_last) if shape == "channels-last" else (
        torch.randn(shape)
    )
    bn = nn.BatchNorm2d(6)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
    x = (x * 2 + 1).to(dtype)
    plain = copy.deepcopy(bn).to(dtype)
    slim = check_against_plain(bn.to(dtype), x)
    # Running statistics advanced exactly as PyTorch's (one step each).
    plain.train()(x)
    torch.testing.assert_close(slim.running_mean, plain.running_mean)
    torch.testing.assert_close(slim.running_var, plain.running_var)
    assert slim.num_batches_tracked == plain.num_batches_tracked


def test_batch_norm_keeps_at_most_0_27x():
    assert saved_ratio(nn.BatchNorm2d(16), torch.randn(8, 16, 32, 32)) <= 0.27
