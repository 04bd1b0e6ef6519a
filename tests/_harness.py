"""Shared checks: a converted module against the plain one it replaces, and the bytes it keeps."""

from __future__ import annotations

import copy

import torch
from torch import nn

import slimact
from slimact._metrics import sqnr_db
from slimact.nn import SlimModule

FLOAT_DTYPES = [torch.float32, torch.bfloat16]


def _step(module: nn.Module, inputs: tuple[torch.Tensor, ...], seed: int):
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    torch.manual_seed(seed)
    out = module(*xs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out.dtype)
    out.backward(upstream)
    grads = {f"input{i}": x.grad for i, x in enumerate(xs) if x.grad is not None}
    grads.update({n: p.grad for n, p in module.named_parameters() if p.grad is not None})
    return out.detach(), grads


def converted_copy(plain: nn.Module, policy="int8") -> nn.Module:
    slim = slimact.convert(copy.deepcopy(plain), policy)
    assert any(isinstance(m, SlimModule) for m in slim.modules()), "nothing was converted"
    return slim


def check_against_plain(plain: nn.Module, *inputs: torch.Tensor, policy="int8", floor_db=30.0, exact=False):
    """Forward identical to the plain module's; every gradient within ``floor_db`` SQNR (or equal if exact)."""
    plain = plain.train()
    slim = converted_copy(plain, policy).train()
    out0, g0 = _step(plain, inputs, seed=1)
    out1, g1 = _step(slim, inputs, seed=1)
    assert torch.equal(out0, out1), "forward differs from PyTorch's"
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        if exact:
            torch.testing.assert_close(g1[name], g0[name], msg=name)
        else:
            db = sqnr_db(g0[name], g1[name])
            assert db >= floor_db, f"{name}: {db:.1f} dB < {floor_db} dB"
    return slim


def saved_ratio(plain: nn.Module, *inputs: torch.Tensor, policy="int8") -> float:
    """Bytes the converted module keeps for backward over what the plain fp32 module keeps."""
    xs = tuple(x.detach().requires_grad_(True) for x in inputs)
    before = slimact.profile(plain, xs).activation_bytes
    after = slimact.profile(converted_copy(plain, policy), xs).activation_bytes
    return after / before


def non_contiguous(*shape: int) -> torch.Tensor:
    """A tensor of ``shape`` read through transposed strides."""
    return torch.randn(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
