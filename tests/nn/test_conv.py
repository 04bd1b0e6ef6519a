"""``slimact.nn`` convolutions: calls the converted module takes as PyTorch's does."""

import copy

import pytest
import torch
from torch import nn

import slimact
from slimact._metrics import cosine


def _assert_same_step(plain, slim, x):
    """One weighted-sum step of each: the converted output equal to plain's, every gradient at cosine >= 0.999."""
    steps = []
    for model in (plain, slim):
        out = model(x)
        (out * torch.linspace(-1.0, 2.0, out.numel()).view(out.shape)).sum().backward()
        steps.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (out0, g0), (out1, g1) = steps
    torch.testing.assert_close(out1, out0, rtol=0, atol=0)
    assert all(cosine(g0[n], g1[n]) >= 0.999 for n in g0)


@pytest.mark.parametrize("conv, shape", [(nn.Conv1d(4, 6, 3), (4, 9)), (nn.Conv2d(4, 6, 3, padding=1), (4, 7, 7)),
                                         (nn.Conv3d(2, 3, 2), (2, 4, 4, 4))], ids=["1d", "2d", "3d"])
def test_an_unbatched_input_runs_as_in_pytorch(conv, shape):
    # PyTorch's convolutions take an unbatched [C, *spatial] input; the converted one ran its forward, then raised in
    # the backward ("Expected 4-dimensional input for 4-dimensional weight"), convolution_backward being batched only.
    torch.manual_seed(0)
    plain = nn.Sequential(conv, nn.GELU()).train()
    slim = slimact.convert(copy.deepcopy(plain), "int8")
    assert "0" in slimact.summary(slim).modules
    x = torch.randn(*shape)
    _assert_same_step(plain, slim, x)


@pytest.mark.parametrize("change", ["padding_mode", "padding"])
def test_a_padding_set_after_convert_is_the_one_computed(change):
    # nn.Conv's _conv_forward reads padding_mode and padding at each call; convert leaves a reflect-padded or
    # "same"-padded conv alone, but one set so after convert ran its forward (right) and differentiated zero padding
    # (weight gradient at cosine 0.96), or raised in the backward for padding="same".
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.GELU()).train()
    slim = slimact.convert(copy.deepcopy(plain), "int8")
    for model in (plain, slim):
        if change == "padding_mode":
            model[0].padding_mode = "reflect"
        else:
            model[0].padding = "same"
    x = torch.randn(2, 4, 7, 7)
    _assert_same_step(plain, slim, x)
