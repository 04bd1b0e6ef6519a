"""Running estimates (``scale="running"``) across moves of the model that holds them."""

import copy

import pytest
import torch
from torch import nn

import slimact
from slimact._metrics import cosine


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).train()


def _grads(model: nn.Module, x: torch.Tensor) -> dict:
    model.zero_grad(set_to_none=True)
    (model(x) * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("how", ["meta then to_empty", "to_empty in place"])
def test_estimates_a_to_empty_left_unwritten_start_again(how):
    # to_empty() gives every buffer fresh, unwritten memory: the estimates (non-persistent, so no load_state_dict
    # brings them back) held whatever it had, and the next pack saturated against it (worst gradient at cosine
    # 0.38 from plain's on a 2-block model; here a 10x range made tiny).
    x = torch.randn(4, 6, 16) * 10
    slim = slimact.convert(_model(), "mesa")
    _grads(slim, x)
    weights = copy.deepcopy(slim.state_dict())
    if how == "meta then to_empty":
        slim.to("meta")
    slim.to_empty(device="cpu")
    with torch.no_grad():  # what to_empty may leave there: a range far off the tensors' (here 1e-3 of it)
        for name, b in slim.named_buffers():
            b.copy_(torch.full_like(b, 1e-3) if name.endswith("range") else torch.zeros_like(b))
    slim.load_state_dict(weights)
    plain = _model()
    plain.load_state_dict(weights)
    exact, approx = _grads(plain, x), _grads(slim, x)
    assert min(cosine(exact[n], approx[n]) for n in exact) >= 0.99


def test_estimates_survive_moves_that_carry_their_values():
    slim = slimact.convert(_model(), "mesa")
    _grads(slim, torch.randn(4, 6, 16))
    before = {n: b.clone() for n, b in slim.named_buffers()}
    slim.half().float()  # (fp16 rounding, then back)
    moved = copy.deepcopy(slim)
    slim.to(torch.float32)
    for model in (slim, moved):
        for n, b in before.items():
            state = dict(model.named_buffers())[n]
            assert state is not None and torch.allclose(state.float(), b, rtol=1e-3), n
    # the estimate read after a value-carrying move is the one moved (read through the accessor that checks)
    from slimact.quant import RunningRange

    lin = slim[0]
    rr = RunningRange(lin, "_slimact_x")
    assert rr.estimate(before["0._slimact_x_lo"].numel()) is not None
