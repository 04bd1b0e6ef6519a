import copy

import pytest
import torch
from torch import nn

import slimact
from _harness import FLOAT_DTYPES, _step, check_against_plain, converted_copy
from slimact._metrics import cosine, sqnr_db
from slimact.nn.mlp import gated_mlp_form


class LlamaMLP(nn.Module):
    def __init__(self, hidden=48, inter=136, act=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = act or nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_recognised_by_what_it_computes():
    assert gated_mlp_form(LlamaMLP()) == "silu"
    assert gated_mlp_form(LlamaMLP(act=nn.GELU(approximate="tanh"))) == "gelu_tanh"

    class NotGated(LlamaMLP):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)))

    assert gated_mlp_form(NotGated()) is None


@pytest.mark.parametrize("act", [nn.SiLU(), nn.GELU(approximate="tanh")], ids=["swiglu", "geglu"])
def test_lossless_matches_torch(act):
    x = torch.randn(3, 17, 48)
    model = nn.Sequential(LlamaMLP(act=act))
    slim = check_against_plain(model, x, policy="tempo", exact=True)
    assert slim[0]._slimact_kind == "mlp"
    assert "computed by its parent" in slimact.summary(slim).skipped["0.down_proj"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_8bit_gradients_close(dtype):
    x = torch.randn(3, 17, 48).to(dtype)
    model = LlamaMLP().to(dtype)
    _, exact = _step(model, (x,), seed=1)
    _, approx = _step(converted_copy(model, "int8"), (x,), seed=1)
    for name in exact:
        assert cosine(exact[name], approx[name]) >= 0.99, name


def test_keeps_gate_and_up_only():
    torch.manual_seed(0)
    x = torch.randn(64, 48, requires_grad=True)
    rows, inter = 64, 136

    def mlp_bytes(policy):
        model = LlamaMLP()
        if policy:
            slimact.convert(model, policy)
        report = slimact.profile(model, x)
        # What the block keeps at the intermediate size: anything but the gate/up Linears' input x.
        return sum(e.nbytes for e in report.entries if e.shape[-1] == inter)

    assert mlp_bytes(None) == 4 * rows * inter * 4  # g, act(g), u, and the product h, fp32
    assert mlp_bytes("tempo") == 2 * rows * inter * 4  # g and u
    # 8-bit: g and u at one byte per element, plus their scales (8 groups each).
    assert mlp_bytes("int8") == 2 * rows * inter


@pytest.mark.parametrize(("policy", "floor_db"), [("int8", 36.0), ("mesa", 33.0)])
@pytest.mark.parametrize("act", [nn.SiLU(), nn.GELU(approximate="tanh")], ids=["swiglu", "geglu"])
def test_a_wide_trained_like_gate_keeps_every_gradient_floor(act, policy, floor_db):
    # A trained model's gate pre-activation is wide where a norm's large-weight channels feed it (a review's
    # trained-like Qwen2: std 22, magnitude 87): here two input features at 90x give g std 22, magnitude 145.
    # Kept on a uniform 8-bit grid over that range (step ~1.1) act'(g) is blurred where the activation bends: the
    # gate weight's gradient was at 26-32 dB (int8) and 26-29 (mesa); g kept as codes of K asinh(g / K): 35-39.
    torch.manual_seed(2)
    model = LlamaMLP(64, 172, act)
    with torch.no_grad():
        for proj in (model.gate_proj, model.up_proj):
            proj.weight.normal_(0, 1.5 / 64**0.5)
    x = torch.randn(2, 32, 64)
    x[..., [3, 17]] *= 90
    assert model.gate_proj(x).std() > 20
    _, exact = _step(copy.deepcopy(model).double(), (x.double(),), seed=1)
    _, approx = _step(converted_copy(model, policy), (x,), seed=1)
    for name in exact:
        db = sqnr_db(exact[name].float(), approx[name])
        assert db >= floor_db, f"{name}: {db:.1f} dB"


def _gradient_sqnr(g, u, w, up) -> dict[str, float]:
    """SQNR (dB) of ``gated_mlp``'s gradients to g, u and the down weight at 8 bits (8 channel groups, in the
    inputs' dtype) against float64 arithmetic on the same values."""
    import torch.nn.functional as F

    import slimact.functional as sf
    from slimact.quant import QuantConfig

    grads = []
    for cfg, dtype in ((None, torch.float64), (QuantConfig(groups=8), g.dtype)):
        leaves = [t.to(dtype).requires_grad_() for t in (g, u, w)]
        sf.gated_mlp(*leaves, None, "silu", cfg, act=F.silu).backward(up.to(dtype))
        grads.append([t.grad for t in leaves])
    return {name: sqnr_db(exact.float(), approx.float()) for name, exact, approx in zip(("g", "u", "weight"), *grads,
                                                                                        strict=True)}


def test_a_gate_with_a_heavy_tail_keeps_it_apart_not_in_the_range():
    # 1% of g at 1e4 (massive activations): g's own pack keeps them apart, exactly, and its step is set by the
    # normal values. In asinh codes they lie within the outlier threshold (34 against ~1): kept so, the range
    # spans them and grad_g fell to 26.4 dB (the property tests found it); g's own pack is kept: 40.5 dB.
    gen = torch.Generator().manual_seed(0)
    g, u = torch.randn(256, 96, generator=gen), torch.randn(256, 96, generator=gen)
    heavy = torch.randperm(g.numel(), generator=gen)[: g.numel() // 100]
    g.view(-1)[heavy] = 1e4 * torch.randn(heavy.numel(), generator=gen).sign()
    w, up = torch.randn(32, 96, generator=gen) / 10, torch.randn(256, 32, generator=gen)
    for name, db in _gradient_sqnr(g, u, w, up).items():
        assert db >= 36.0, name


@pytest.mark.parametrize("scale", [1e-7, 1e-30])
def test_a_bf16_gate_of_tiny_values_keeps_the_up_and_down_gradients(scale):
    # A bf16 g below fp16's range (gates of 1e-7, 1e-30): its asinh codes' values, c ~ g there, were kept in fp16,
    # which rounded them to 0: act(g) * u restored as ~0, and up_proj's and down_proj's gradients were 10.4 dB, and
    # at 1e-30 exactly 0 (found by review). c is fp32 for a bf16 g.
    gen = torch.Generator().manual_seed(0)
    g = (torch.randn(64, 48, generator=gen) * scale).bfloat16()
    u, w = torch.randn(64, 48, generator=gen).bfloat16(), (torch.randn(16, 48, generator=gen) / 8).bfloat16()
    up = torch.randn(64, 16, generator=gen).bfloat16()
    for name, db in _gradient_sqnr(g, u, w, up).items():
        assert db >= 30.0, name


_NEAR_MAX = [(torch.float16, [1.0, -0.05, 0.3, -0.02, 0.5, 0.7, -0.01, 0.9]),  # zero-aligned codes: lo moved
             (torch.float32, [1.0, 0.05, 0.3, 0.02, 0.5, 0.7, 0.01, 0.9]),  # (the top code's fp32 rounding)
             (torch.bfloat16, [1.0, 0.05, 0.3, 0.02, 0.5, 0.7, 0.01, 0.9])]


@pytest.mark.parametrize(("dtype", "fractions"), _NEAR_MAX, ids=[str(d) for d, _ in _NEAR_MAX])
def test_a_gate_at_the_dtypes_largest_value_restores_finite(dtype, fractions):
    # g up to the dtype's largest value, no outliers (all large): kept as asinh codes. A code restores within a
    # step of c's range (zero-aligned codes across 0; fp32 rounding of lo + 255 step at the top), and sinh
    # magnifies that: fp16's 65504 came back as inf, fp32's 3.4e38 too. g is finite: so is what the backward sees.
    import torch.nn.functional as F

    import slimact.functional as sf
    from slimact.functional import mlp
    from slimact.quant import QuantConfig

    cfg = QuantConfig(group_dim=None)
    g = (torch.tensor(fractions) * torch.finfo(dtype).max).to(dtype).repeat(4, 1).requires_grad_()
    assert mlp._pack_gate(g, cfg, None)[1]  # the asinh codes
    u = torch.ones(4, 8, dtype=dtype, requires_grad=True)
    w = torch.full((2, 8), 1e-3, dtype=dtype, requires_grad=True)
    out = sf.gated_mlp(g, u, w, None, "silu", cfg, act=F.silu)
    out.backward(torch.ones_like(out))
    assert torch.isfinite(u.grad).all() and torch.isfinite(g.grad).all()


def test_clustered_outliers_in_both_inputs_keep_the_weight_gradient_floor():
    # Both inputs heavy-tailed (the property tests' draw that found it): three values at 1e4x in one 37-element
    # column group of u, and one in g on a row where u is ordinary. The weight gradient sums gelu(g) * u: that
    # row multiplies u's restore error by 6500, so u's step must be set by its ordinary values, which needs all
    # three of its outliers kept apart (docs/quant.md). With a plain mean magnitude deciding, none was, 1.5
    # restored as 0, and the cosine was -0.07.
    import torch.nn.functional as F

    import slimact.functional as sf
    from slimact.quant import QuantConfig

    gen = torch.Generator().manual_seed(0)
    g, u = torch.randn(37, 15, generator=gen), torch.randn(37, 15, generator=gen)
    u[[4, 20, 33], 7] = 6500.0
    g[10, 7], u[10, 7] = 6500.0, 1.5
    g[[4, 20, 33], 7] = -4.0  # gelu ~ 0: row 10 makes column 7 of the weight gradient
    weight, upstream = torch.randn(2, 15, generator=gen) / 4, torch.randn(37, 2, generator=gen)
    grads = []
    for cfg in (None, QuantConfig(group_dim=-1, groups=0)):
        w = weight.clone().requires_grad_()
        if cfg is None:
            F.linear(F.gelu(g) * u, w).backward(upstream)
        else:
            sf.gated_mlp(g, u, w, None, "gelu", cfg, act=F.gelu).backward(upstream)
        grads.append(w.grad)
    assert cosine(grads[0], grads[1]) >= 0.99, cosine(grads[0], grads[1])


@pytest.mark.parametrize(("cfg", "dtype"), [(None, torch.float32), ("int8", torch.float32), ("int8", torch.bfloat16)],
                         ids=["lossless", "int8", "int8-bf16"])
def test_backward_as_one_compiled_loop_equals_the_eager_passes(cfg, dtype, monkeypatch):
    from slimact.functional import gated_mlp
    from slimact.policy import Policy
    from slimact.quant import inductor

    quant = None if cfg is None else Policy().quant_config("mlp", 2)
    gen = torch.Generator().manual_seed(0)
    g, u = ((torch.randn(512, 1024, generator=gen) * 2).to(dtype).requires_grad_() for _ in range(2))  # >= MIN_NUMEL
    w = (torch.randn(64, 1024, generator=gen) * 0.03).to(dtype).requires_grad_()
    up = torch.randn(512, 64, generator=gen).to(dtype)
    # Lossless: one compiled loop over g, u and grad_h (inductor.fused). At 8 bits: the forward's one loop making
    # the values g is packed as (asinh), and in the backward one compiled loop that also restores g and u from
    # their codes (inductor.dequantize_map, both packs in it: g's codes, of fp32 asinh values, beside u's of bf16
    # ones), and no loop of its own.
    calls, restoring = [], []
    original, original_map = inductor.fused, inductor.dequantize_map
    monkeypatch.setattr(inductor, "fused", lambda *a: calls.append(r := original(*a)) or r)
    monkeypatch.setattr(inductor, "dequantize_map",
                        lambda packs, *a: restoring.append((len(packs), r := original_map(packs, *a))) or r)
    fused = torch.autograd.grad(gated_mlp(g, u, w, None, "silu", quant, act=nn.SiLU()), (g, u, w), up)
    if cfg is None:
        assert len(calls) == 1 and calls[0] is not None and not restoring  # the compiled loop ran
    else:
        assert len(calls) == 1 and calls[0] is not None  # the forward's
        assert len(restoring) == 1 and restoring[0][0] == 2 and restoring[0][1] is not None
    monkeypatch.setattr(inductor, "fused", lambda *a: None)
    monkeypatch.setattr(inductor, "dequantize_map", lambda *a: None)
    eager = torch.autograd.grad(gated_mlp(g, u, w, None, "silu", quant, act=nn.SiLU()), (g, u, w), up)
    # The same formulas (the activation by its formula, not nn.SiLU's kernel): float rounding. In fp32 elementwise
    # for g and u; the weight gradient sums h's rounding over 512 tokens (elements that cancel move most):
    # normwise. In bf16 the compiled loop keeps its intermediates (the restored g, act(g)) in fp32 where the eager
    # passes round each to bf16 (an ulp of g moves act'(g) most where it crosses 0): normwise, each gradient
    # within bf16's own precision (eps, an ulp at 1).
    # At 8 bits the forward's compiled loop computes asinh(g / K) vectorised, the eager pass with ATen's kernel: a
    # last-ulp difference flips the code of a value that sits on a rounding boundary (on an AVX-512 host: 1 of g's
    # 524,288 codes, moving that element of g's and u's gradients by 8e-4 and 7e-4 and the weight gradient by 2e-6
    # of its norm; on AVX2 hosts none): at most 1 in 1e5 elements beyond rounding, each gradient within 1e-5 normwise.
    if dtype == torch.float32:
        for a, b in zip(fused[:2], eager[:2], strict=True):
            if cfg is None:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            else:
                assert int((~torch.isclose(a, b, rtol=1e-5, atol=1e-6)).sum()) <= 1e-5 * b.numel()
                assert (a - b).norm() <= 1e-5 * b.norm()
        assert (fused[2] - eager[2]).norm() <= (1e-6 if cfg is None else 1e-5) * eager[2].norm()
    else:
        for a, b in zip(fused, eager, strict=True):
            assert (a.float() - b.float()).norm() <= torch.finfo(dtype).eps * b.float().norm()
