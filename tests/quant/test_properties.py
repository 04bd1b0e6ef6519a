"""Property-based tests of the compression core (hypothesis).

CI runs a small profile; ``SLIMACT_HYPOTHESIS=long`` runs many more examples.
"""

import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slimact.quant import QuantConfig, pack, unpack
from slimact.quant.reference import _expand

# CI's examples are fixed (the same every run); the long profile explores at random.
settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=True)
settings.register_profile("long", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("long" if os.environ.get("SLIMACT_HYPOTHESIS") == "long" else "ci")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DISTRIBUTIONS = ["normal", "heavy", "constant", "zero", "tiny", "huge"]


@st.composite
def tensors(draw):
    ndim = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 9)) for _ in range(ndim)]
    shape[draw(st.integers(0, ndim - 1))] = draw(st.integers(1, 300))
    dtype = draw(st.sampled_from(DTYPES))
    dist = draw(st.sampled_from(DISTRIBUTIONS))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(shape, generator=gen)
    if dist == "heavy":
        x = torch.where(torch.rand(shape, generator=gen) < 0.01, x.sign() * 1e4, x)
    elif dist == "constant":
        x = torch.full(shape, 3.25)
    elif dist == "zero":
        x = torch.zeros(shape)
    elif dist == "tiny":
        x = x * (1e-6 if dtype == torch.float16 else 1e-30)
    elif dist == "huge":
        x = x * (100.0 if dtype == torch.float16 else 1e30)
    x = x.to(dtype)
    if draw(st.booleans()) and ndim >= 2:
        x = x.transpose(0, -1).contiguous().transpose(0, -1)  # the same values through other strides
    group_dim = draw(st.sampled_from([None, -1, 0]))
    # Group counts above the dim's size are drawn too: clamped, as a Policy's are (explicit configs refuse them).
    groups = draw(st.integers(0, 13))
    return x, QuantConfig(group_dim=group_dim, groups=groups, stochastic=draw(st.booleans()), clamp_groups=True)


@given(tensors())
def test_pack_unpack_bounds_hold_for_any_input(case):
    x, cfg = case
    packed = pack(x, cfg, share=False)
    x_hat = unpack(packed)
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    assert torch.isfinite(x_hat).all()  # nothing non-finite appears from finite input
    if packed.raw:
        assert x_hat is x
        return
    _, lo, step, *outliers = packed.tensors
    assert torch.isfinite(step).all() and (step > 0).all()
    if outliers:  # kept apart, exactly
        index, values = outliers
        assert torch.equal(x_hat.reshape(-1)[index.long()], x.reshape(-1)[index.long()])
        assert torch.equal(values, x.reshape(-1)[index.long()])
    s = _expand(step, packed.meta.layout, x.dim())
    fi = torch.finfo(x.dtype)
    # Half a step (a whole one when stochastic), plus the fp32 arithmetic and the cast back to x.dtype.
    bound = s * (1.0 if cfg.stochastic else 0.5)
    slack = 4 * torch.finfo(torch.float32).eps * (_expand(lo, packed.meta.layout, x.dim()).abs() + 255 * s)
    slack = slack + fi.eps * torch.clamp(x.float().abs() + s, min=fi.smallest_normal) / 2
    assert ((x_hat.float() - x.float()).abs() <= bound + slack).all()


@given(tensors(), st.sampled_from([float("nan"), float("inf"), -float("inf")]))
def test_non_finite_inputs_are_kept_exactly(case, bad):
    x, cfg = case
    x = x.clone()
    x[(0,) * x.dim()] = bad
    packed = pack(x, cfg, share=False)
    assert packed.raw
    torch.testing.assert_close(unpack(packed), x, equal_nan=True, rtol=0, atol=0)
