"""Robustness: clear errors, and long runs that stay finite and track a distribution shift."""

import pytest
import torch
from torch import nn

import slimact
from slimact.quant import RunningRange, pack, unpack


def test_meta_device_model_is_a_clear_error():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    with pytest.raises(ValueError, match=r"meta device.*Materialise the model first"):
        slimact.convert(model)


def test_backward_twice_gives_pytorchs_own_message():
    model = slimact.convert(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2)))
    loss = model(torch.randn(3, 4)).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        loss.backward()


def test_unknown_policy_and_keys_are_clear_errors(tmp_path):
    with pytest.raises(slimact.PolicyError, match="unknown policy 'int7'"):
        slimact.convert(nn.Linear(2, 2), "int7")
    bad = tmp_path / "p.toml"
    bad.write_text("bitz = 8\n", encoding="utf-8")
    with pytest.raises(slimact.PolicyError, match=r"p\.toml:1: unknown key 'bitz'"):
        slimact.convert(nn.Linear(2, 2), bad)


def test_300_steps_stay_finite_and_running_estimates_track_a_shift():
    torch.manual_seed(0)
    model = slimact.convert(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)), "mesa")
    fc = model[0]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, target = torch.randn(32, 16), torch.randn(32, 16)
    for step in range(300):
        scale = 100.0 if step >= 150 else 1.0  # the data distribution shifts halfway
        inp = x * scale
        loss = (model(inp) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert torch.isfinite(loss), step
        assert all(torch.isfinite(p.grad).all() for p in model.parameters()), step
        if step == 150:  # the estimate is stale now: values beyond it must saturate at its ends, never wrap
            scratch = nn.Module()
            state = RunningRange(scratch, "_x")
            lo, rng = fc._slimact_x_lo.clone(), fc._slimact_x_range.clone()
            scratch._buffers["_x_lo"], scratch._buffers["_x_range"] = lo, rng
            cfg = fc._slimact_policy.quant_config("linear", 2)
            restored = unpack(pack(inp, cfg, state, training=False, share=False))
            hi_e = (lo + rng)[torch.arange(16) * lo.numel() // 16]  # per channel
            lo_e = lo[torch.arange(16) * lo.numel() // 16]
            step_e = (rng / 255)[torch.arange(16) * lo.numel() // 16]
            above = inp > hi_e
            assert above.any()
            assert ((restored - hi_e).abs() <= step_e)[above].all()  # saturated at the top, not wrapped
            assert (restored >= lo_e - step_e).all() and (restored <= hi_e + step_e).all()
    groups = fc._slimact_x_range.numel()
    shifted = (x * 100).view(32, groups, -1)  # [rows, group, channels in it]
    expected = shifted.amax((0, 2)) - shifted.amin((0, 2))
    # 150 steps after the shift the EMA (decay 0.9) has converged to the new ranges.
    torch.testing.assert_close(fc._slimact_x_range, expected, rtol=1e-3, atol=0)
