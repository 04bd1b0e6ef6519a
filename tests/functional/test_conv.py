import pytest
import torch
from torch import nn

import slimact
from _harness import FLOAT_DTYPES, check_against_plain, saved_ratio


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(
    "conv,shape",
    [
        (lambda: nn.Conv2d(3, 8, 3, padding=1), (1, 3, 5, 5)),
        (lambda: nn.Conv2d(4, 6, 3, stride=2, groups=2), (2, 4, 7, 9)),
        (lambda: nn.Conv2d(3, 16, 4, stride=4), (2, 3, 16, 16)),  # a ViT patch embedding
        (lambda: nn.Conv1d(5, 7, 3, padding="valid", bias=False), (2, 5, 11)),
    ],
    ids=["same-size", "strided-grouped", "patch-embed", "conv1d"],
)
@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_matches_torch(conv, shape, dtype, channels_last):
    x = torch.randn(shape)
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    check_against_plain(conv().to(dtype), x.to(dtype))


def test_conv_keeps_at_most_0_27x():
    assert saved_ratio(nn.Conv2d(16, 32, 3, padding=1), torch.randn(8, 16, 32, 32)) <= 0.27


def test_frozen_conv_weight_keeps_nothing():
    conv = nn.Conv2d(3, 4, 3)
    conv.weight.requires_grad_(False)
    conv.bias.requires_grad_(False)
    check_against_plain(conv, torch.randn(2, 3, 6, 6))
    assert saved_ratio(conv, torch.randn(2, 3, 6, 6)) == 0


def test_unsupported_padding_modes_are_reported():
    model = slimact.convert(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect")))
    assert "reflect" in slimact.summary(model).skipped["0"]


def test_bf16_weight_gradient_on_the_cpu_is_the_same_at_every_call():
    # PyTorch's bf16 CPU convolution backward (torch 2.13) reads uninitialised memory on this shape: its weight
    # gradient depends on what was freed before the call. slimact's backward runs in fp32 there.
    from slimact.functional import conv
    from slimact.policy import Policy

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 3, 4, 5, 2, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(2, 3, 1, 2, 2, generator=gen).bfloat16().requires_grad_()
    cfg = Policy().quant_config("conv", 5)
    args = ((1, 2, 3), (0, 0, 1), (1, 1, 1), 1, cfg)
    grads = []
    for fill in (float("nan"), 1e38, 0.0):
        junk = torch.full((1 << 16,), fill, dtype=torch.bfloat16)
        del junk
        y = conv(x, w, None, *args)
        grads.append(torch.autograd.grad(y, (x, w), torch.ones_like(y)))
    for gx, gw in grads[1:]:
        assert torch.equal(gx, grads[0][0]) and torch.equal(gw, grads[0][1])
    assert all(torch.isfinite(g).all() for g in grads[0])
