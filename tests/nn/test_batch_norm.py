"""``slimact.nn`` BatchNorm: the module's running-statistics bookkeeping, as ``nn.BatchNorm`` keeps it."""

import copy

import torch
from torch import nn

import slimact


def test_running_statistics_turned_off_after_construction_are_neither_used_nor_updated():
    # A BatchNorm whose track_running_stats is set False after it was built keeps its buffers; PyTorch's forward then
    # passes None for them (batch statistics, nothing updated) and its eval forward still reads them. slimact's
    # passed the buffers on: they moved in training and the eval output differed from plain.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).train()
    plain[1].track_running_stats = False
    slim = slimact.convert(copy.deepcopy(plain), "int8")
    assert isinstance(slim[1], slimact.nn.SlimModule)
    for _ in range(3):
        x = torch.randn(2, 3, 3, 3) * 2 + 1
        for model in (plain, slim):
            model(x).square().sum().backward()
    for (name, b0), b1 in zip(plain.named_buffers(), slim.buffers(), strict=True):
        assert torch.equal(b1, b0), name
    x = torch.randn(2, 3, 3, 3)
    torch.testing.assert_close(slim.eval()(x), plain.eval()(x), rtol=0, atol=0)
