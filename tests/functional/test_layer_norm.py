import pytest
import torch
from torch import nn

import slimact
from _harness import FLOAT_DTYPES, check_against_plain, non_contiguous, saved_ratio
from slimact.functional.layer_norm import output_recoverable


def _ln(c, dtype, affine=True):
    ln = nn.LayerNorm(c, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.normal_(0, 0.1)
    return ln.to(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 7, 33), "non-contiguous"], ids=str)
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_matches_torch(shape, dtype, affine):
    x = non_contiguous(3, 17, 48) if shape == "non-contiguous" else torch.randn(shape)
    x = (x * 2 + 0.5).to(dtype)
    check_against_plain(_ln(x.shape[-1], dtype, affine), x)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_zero_weight_falls_back_to_keeping_the_input(dtype):
    ln = _ln(40, dtype)
    with torch.no_grad():
        ln.weight[3] = 0.0  # xn cannot be rebuilt from y for this channel (Tempo divided by it)
    assert not output_recoverable(ln.weight, ln.bias, dtype)
    check_against_plain(ln, torch.randn(5, 40).to(dtype))


def test_tiny_weight_against_bias_falls_back():
    w, b = torch.ones(8), torch.zeros(8)
    assert output_recoverable(w, b, torch.float32)
    w[2], b[2] = 1e-3, 10.0
    assert output_recoverable(w, b, torch.float32)  # fp32 rounding of y is still far below a step
    assert not output_recoverable(w, b, torch.bfloat16)  # bf16 rounding of y would swamp xn


def test_layer_norm_keeps_at_most_0_27x():
    assert saved_ratio(_ln(256, torch.float32), torch.randn(256, 256)) <= 0.27


def test_layer_norm_and_next_linear_share_one_packed_copy():
    torch.manual_seed(0)
    model = nn.Sequential(_ln(256, torch.float32), nn.Linear(256, 256))
    x = torch.randn(256, 256, requires_grad=True)
    report = slimact.profile(slimact.convert(model), x)
    # One uint8 copy of the LayerNorm output (plus per-channel scales and the rows' rstd); the Linear
    # reuses it and keeps nothing of its own.
    assert report.by_module.get("1", 0) == 0
    assert report.by_module["0"] == 256 * 256 + 2 * 256 * 4 + 256 * 4
