import copy

import pytest
import torch
from torch import nn

import slimact
from _harness import FLOAT_DTYPES, _step, assert_gradients_equal, check_against_plain, non_contiguous, saved_ratio
from slimact._kinds import activation_form
from slimact.functional.activation import FORMS, INPLACE_ERROR_BOUNDS, derivative, reference

SHAPES = [(1, 1, 5), (3, 7, 33), "non-contiguous"]


def _input(shape, dtype):
    x = non_contiguous(3, 9, 17) if shape == "non-contiguous" else torch.randn(shape)
    return (x * 3).to(dtype)


def _hf(name):
    transformers = pytest.importorskip("transformers")
    return transformers.activations.ACT2FN[name]


MODULES = {
    "gelu": lambda: nn.GELU(),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": lambda: nn.SiLU(),
    "hf_gelu_new": lambda: _hf("gelu_new"),  # GPT-2's tanh GELU spelled as five elementwise ops
    "hf_quick_gelu": lambda: _hf("quick_gelu"),
    "hf_gelu_pytorch_tanh": lambda: _hf("gelu_pytorch_tanh"),
    "hf_relu2": lambda: _hf("relu2"),  # Nemotron's ReLUSquaredActivation: relu, then square
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(MODULES))
def test_smooth_activations_match_torch(name, shape, dtype):
    check_against_plain(MODULES[name]().to(dtype), _input(shape, dtype))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_relu_mask_is_exact(shape, dtype):
    check_against_plain(nn.ReLU(), _input(shape, dtype), exact=True)


@pytest.mark.parametrize(
    "name,expected",
    [("gelu", "gelu"), ("gelu_tanh", "gelu_tanh"), ("silu", "silu"), ("hf_gelu_new", "gelu_tanh"),
     ("hf_quick_gelu", "quick_gelu"), ("hf_gelu_pytorch_tanh", "gelu_tanh"), ("hf_relu2", "relu2")],
)
def test_recognised_by_what_they_compute(name, expected):
    assert activation_form(MODULES[name]()) == expected


def test_unknown_activations_are_left_alone():
    class Mish(nn.Module):
        def forward(self, x):
            return x * torch.tanh(nn.functional.softplus(x))

    assert activation_form(Mish()) is None
    assert activation_form(nn.LeakyReLU()) is None
    model = slimact.convert(nn.Sequential(nn.Linear(4, 4), Mish()))
    assert not isinstance(model[1], slimact.nn.SlimModule)


@pytest.mark.parametrize("form", [f for f in FORMS if f != "relu"])
def test_derivatives_match_autograd(form):
    x = torch.linspace(-8, 8, 2001, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(reference(form, x).sum(), x)
    torch.testing.assert_close(derivative(form, x.detach()), grad)


@pytest.mark.parametrize("name", ["gelu", "silu", "hf_gelu_new"])
def test_keeps_at_most_0_27x(name):
    assert saved_ratio(MODULES[name](), torch.randn(256, 256)) <= 0.27


def test_gpt2_gelu_keeps_one_8bit_tensor_instead_of_four():
    # Written as five ops, GPT-2's tanh GELU keeps four fp32 tensors of its input's size besides its output (the
    # input, tanh's output, 0.5 x and 1 + tanh): 16 bytes per element (README, docs/mesa.md, docs/tempo.md).
    x = torch.randn(256, 256)
    assert slimact.profile(MODULES["hf_gelu_new"](), x.requires_grad_()).activation_bytes == 4 * x.nbytes
    ratio = saved_ratio(MODULES["hf_gelu_new"](), torch.randn(256, 256))
    assert ratio <= 0.27 / 4  # four fp32 tensors -> one byte per element


def test_relu_keeps_at_most_0_04x():
    assert saved_ratio(nn.ReLU(), torch.randn(256, 256)) <= 0.04


def test_named_modules_for_direct_use():
    gelu = slimact.nn.GELU(approximate="tanh", policy="mesa")
    assert isinstance(gelu, nn.GELU) and gelu._slimact_form == "gelu_tanh"
    x = torch.randn(4, 8, requires_grad=True)
    assert torch.equal(gelu(x), nn.functional.gelu(x, approximate="tanh"))


# How models compute each form (PyTorch's kernels compute in fp32 and round once).
KERNELS = {
    "gelu": nn.functional.gelu,
    "gelu_tanh": lambda t: nn.functional.gelu(t, approximate="tanh"),
    "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t),
    "silu": nn.functional.silu,
}


@pytest.mark.parametrize("dtype", list(INPLACE_ERROR_BOUNDS), ids=str)
@pytest.mark.parametrize("form", list(KERNELS))
def test_inplace_gradient_error_over_the_real_line(form, dtype):
    from slimact.functional.activation import MINIMUM, activation

    torch.manual_seed(0)
    x = torch.cat([torch.linspace(-10, 10, 100001), torch.randn(50000) * 3]).to(dtype).requires_grad_(True)
    (grad,) = torch.autograd.grad(activation(x, form, None, fn=KERNELS[form]).sum(), x)
    exact = derivative(form, x.detach().double())
    err = (grad.double() - exact).abs()
    dist = (x.detach().double() - MINIMUM[form]).abs()
    radius, away, everywhere = INPLACE_ERROR_BOUNDS[dtype]
    assert err[dist >= radius].max() <= away
    assert err.max() <= everywhere
    tempo_interval = (x.detach() > 1.1) & (x.detach() < 3.0)  # where Tempo's released spline was wrong
    assert err[tempo_interval].max() <= away


def test_inplace_gelu_keeps_output_and_a_bit_mask():
    from slimact.functional.activation import activation

    x = torch.randn(256, 256, requires_grad=True)

    def keep(policy_cfg):
        return slimact.profile(lambda_module(lambda t: activation(t, "gelu", policy_cfg)), x).activation_bytes

    # Output (the next layer keeps it anyway) + 1 bit per element, against PyTorch's input.
    assert keep(None) == 256 * 256 * 4 + 256 * 256 // 8


def lambda_module(fn):
    class Wrap(nn.Module):
        def forward(self, t):
            return fn(t)

    return Wrap()


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu", "hf_gelu_new", "hf_quick_gelu"])
def test_tempo_activations_match_torch_gradients_within_the_stated_bound(name):
    from _harness import _step, converted_copy

    x = torch.randn(4, 33, 40) * 3
    out0, g0 = _step(MODULES[name](), (x,), seed=1)
    out1, g1 = _step(converted_copy(MODULES[name](), "tempo"), (x,), seed=1)
    assert torch.equal(out0, out1)
    upstream = torch.randn(out0.shape, generator=torch.Generator().manual_seed(1 + 1))  # as _step draws it
    # |error| <= |upstream| * (the stated fp32 bound on y' anywhere, 4e-4: an input of this draw lies at -0.7517,
    # within 1e-4 of GELU's minimum, where the error reaches 2.03e-4), plus float rounding of the product.
    bound = INPLACE_ERROR_BOUNDS[torch.float32][2]
    assert ((g1["input0"] - g0["input0"]).abs() <= upstream.abs() * bound + 1e-6).all()


def test_tempo_gelu_output_is_the_storage_the_next_linear_keeps():
    torch.manual_seed(0)
    x = torch.randn(64, 128, requires_grad=True)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))

    plain = slimact.profile(model(), x)
    tempo = slimact.profile(slimact.convert(model(), "tempo"), x)
    # PyTorch keeps the GELU's input and the second Linear's input (the GELU output); slimact keeps the
    # GELU output once (shared with the Linear) and a bit mask.
    assert plain.by_kind["gelu"] == 64 * 256 * 4
    assert tempo.by_kind["gelu"] == 64 * 256 * 4 + 64 * 256 // 8
    assert "2" not in tempo.by_module  # the second Linear's input is the GELU's kept output
    assert tempo.activation_bytes < plain.activation_bytes


@pytest.mark.parametrize("form", ["gelu", "gelu_tanh", "quick_gelu", "silu"])
def test_flat_bounds_hold(form):
    from slimact.functional.activation import FLAT

    x = torch.linspace(FLAT[form], 1e4, 10001, dtype=torch.float64)
    assert (derivative(form, x) - 1).abs().max() <= 1e-6
    assert derivative(form, -x).abs().max() <= 1e-6


@pytest.mark.parametrize("name", ["gelu", "silu", "hf_quick_gelu"])
def test_heavy_tailed_inputs_keep_the_sqnr_floor(name):
    torch.manual_seed(0)
    x = torch.randn(64, 128)
    outliers = torch.rand_like(x) < 0.01
    x = torch.where(outliers, x.sign() * 1e4, x)  # 1% of the inputs at 1e4 times the typical magnitude
    check_against_plain(MODULES[name](), x)


@pytest.mark.parametrize("policy", ["int8", "tempo"])
def test_non_finite_inputs_show_in_the_gradient_as_in_torch(policy):
    from _harness import _step, converted_copy

    x = torch.randn(4, 16)
    x[1, 3], x[2, 5], x[3, 7] = float("nan"), float("inf"), -float("inf")
    _, g0 = _step(nn.GELU(), (x,), seed=1)
    _, g1 = _step(converted_copy(nn.GELU(), policy), (x,), seed=1)
    assert torch.equal(g0["input0"].isnan(), g1["input0"].isnan())
    finite = torch.isfinite(g0["input0"])
    # int8 keeps a tensor holding NaN/inf exact: PyTorch's gradient to float rounding; "tempo" differentiates from
    # the output, within the in-place GELU's documented bound on y' (4e-4 absolute, docs/tempo.md)
    tol = {"rtol": 0.0, "atol": 4e-4} if policy == "tempo" else {}
    torch.testing.assert_close(g1["input0"][finite], g0["input0"][finite], **tol)


@pytest.mark.parametrize("policy", ["int8", "tempo"])
def test_relu_passes_the_gradient_at_nan_as_torch(policy):
    # PyTorch's ReLU backward masks where y <= 0, so a NaN input passes its upstream gradient; the bit mask was
    # y > 0, which stopped it there.
    from _harness import _step, converted_copy

    x = torch.tensor([[float("nan"), 1.0, -1.0, float("inf"), -float("inf"), 0.0]])
    _, g0 = _step(nn.ReLU(), (x,), seed=1)
    _, g1 = _step(converted_copy(nn.ReLU(), policy), (x,), seed=1)
    torch.testing.assert_close(g1["input0"], g0["input0"], rtol=0, atol=0)


@pytest.mark.parametrize("form", ["gelu", "silu"])
def test_8bit_backward_restores_x_inside_its_own_loop(form, monkeypatch):
    from slimact.functional import activation
    from slimact.functional.activation import FLAT
    from slimact.quant import QuantConfig, inductor, pack, unpack

    fused = []
    original = inductor.dequantize_map
    monkeypatch.setattr(inductor, "dequantize_map", lambda *a: fused.append(r := original(*a)) or r)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(512, 1024, generator=gen) * 3).requires_grad_()
    g = torch.randn(512, 1024, generator=gen)
    cfg = QuantConfig(groups=8)
    (grad,) = torch.autograd.grad(activation(x, form, cfg), x, g)
    assert len(fused) == 1 and fused[0] is not None  # the compiled loop ran
    # what the eager backward computes from the same codes, to fp32 rounding of the derivative's own ops
    x_hat = unpack(pack(x.detach(), QuantConfig(groups=8, clip=FLAT[form]), share=False))
    torch.testing.assert_close(grad, g * derivative(form, x_hat), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("form", "dtype"), [*((f, torch.float32) for f in ("gelu", "gelu_tanh", "quick_gelu", "silu")),
                                             ("gelu_tanh", torch.bfloat16)])
def test_inplace_backward_as_one_compiled_loop_equals_the_eager_passes(form, dtype, monkeypatch):
    import sys

    from slimact.functional.activation import MINIMUM, activation
    from slimact.quant import inductor

    module = sys.modules["slimact.functional.activation"]
    calls = []
    original = inductor.fused
    monkeypatch.setattr(inductor, "fused", lambda *a: calls.append(r := original(*a)) or r)
    gen = torch.Generator().manual_seed(1)
    # The real line, the minimum's neighbourhood and a normal sample: above the compiled loop's size threshold.
    x = torch.cat([torch.linspace(-10, 10, 200001), MINIMUM[form] + torch.linspace(-0.02, 0.02, 10001),
                   torch.randn(100000, generator=gen) * 3]).to(dtype).requires_grad_(True)
    assert x.numel() >= inductor.MIN_NUMEL
    g = torch.randn(x.shape, generator=gen).to(dtype)
    (grad,) = torch.autograd.grad(activation(x, form, None, fn=KERNELS[form]), x, g)
    assert len(calls) == 1 and calls[0] is not None  # the compiled loop ran
    (one,) = torch.autograd.grad(activation(x, form, None, fn=KERNELS[form]).sum(), x)
    radius, away, everywhere = INPLACE_ERROR_BOUNDS[dtype]
    err = (one.double() - derivative(form, x.detach().double())).abs()
    assert err[(x.detach().double() - MINIMUM[form]).abs() >= radius].max() <= away  # the stated bound holds
    assert err.max() <= everywhere
    monkeypatch.setattr(module, "_loop_shape", lambda *t: False)
    (eager,) = torch.autograd.grad(activation(x, form, None, fn=KERNELS[form]), x, g)
    # The same fp32 operations, but a vectorised sqrt and log may round the table key an ulp differently, which
    # moves the interpolated y' by up to slope / spacing * ulp (~6e-7): a thirtieth of the fp32 bound; then one
    # rounding of the product to the dtype.
    torch.testing.assert_close(grad.float(), eager.float(), rtol=torch.finfo(dtype).eps,
                               atol=1e-6 * g.abs().max().item())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_squared_relu_under_tempo_is_exact_and_keeps_only_its_output(dtype):
    # y' = 2 sqrt(y): the output alone gives the gradient, to sqrt's rounding; in a model the next Linear keeps the
    # same y, so the activation costs nothing of its own where plain keeps relu(x) besides.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 64), _hf("relu2"), nn.Linear(64, 32)).to(dtype)
    x = _input((3, 7, 32), dtype)
    slim = slimact.convert(copy.deepcopy(plain), "tempo")
    (out0, g0), (out1, g1) = (_step(m, (x,), seed=1) for m in (plain, slim))
    assert torch.equal(out1, out0)
    # Normwise, as slimact.check judges a lossless policy: bf16's y is rounded before sqrt (0.2% of an element).
    assert_gradients_equal(g0, g1)
    hidden = 3 * 7 * 64 * x.element_size()  # bytes of one [3, 7, 64] tensor

    def kept(model):
        return [e.module for e in slimact.profile(model, x.requires_grad_(True)).entries if e.nbytes == hidden]

    assert kept(plain) == ["1", "2"]  # relu(x) for the square, y for the Linear
    assert kept(slim) == ["1"]  # y, for both


@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_squared_relu_output_changed_in_place_in_model_code(policy):
    # A residual added in place to a squared ReLU's output (`y = F.relu(conv(x)).square(); y += x`, found by a CNN
    # fuzzer): PyTorch's square keeps its input, so plain trains; "tempo" keeps the output and did not mark it
    # (keep_output), so the in-place add was not moved to a copy and the backward raised.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.head = nn.Conv2d(4, 4, 1), nn.Linear(4, 2)

        def forward(self, x):
            y = torch.nn.functional.relu(self.conv(x)).square()
            y += x
            return self.head(y.mean((2, 3)))

    torch.manual_seed(0)
    plain = Block()
    x = torch.randn(8, 4, 5, 5)
    slim = slimact.convert(copy.deepcopy(plain), policy)
    (out0, g0), (out1, g1) = (_step(m, (x,), seed=1) for m in (plain, slim))
    assert torch.equal(out1, out0)
    if policy == "tempo":
        assert_gradients_equal(g0, g1)
    else:
        from _harness import assert_gradients_close

        assert_gradients_close(g0, g1)


@pytest.mark.parametrize("policy", ["int8", "tempo"])
def test_squared_relu_shows_non_finite_inputs_in_the_gradient_as_torch(policy):
    from _harness import _step, converted_copy

    x = torch.tensor([[float("nan"), 1.5, -1.0, float("inf"), -float("inf"), 0.0, 3.0, -2.0]])
    _, g0 = _step(_hf("relu2"), (x,), seed=1)
    _, g1 = _step(converted_copy(_hf("relu2"), policy), (x,), seed=1)
    torch.testing.assert_close(g1["input0"], g0["input0"], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("policy", ["int8", "tempo"])
def test_nemotrons_squared_relu_mlp_is_converted(policy):
    # Its ReLUSquaredActivation was left alone ("no slimact replacement yet"): the ReLU's fp32 output kept twice
    # over the MLP's width, for the square and as its input.
    from _harness import assert_gradients_close, loss_grads

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.NemotronForCausalLM(transformers.NemotronConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).train()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    _, exact = loss_grads(model, inputs)
    plain_bytes = slimact.profile(model, inputs).activation_bytes
    slim = slimact.convert(copy.deepcopy(model), policy)
    assert slimact.summary(slim).modules["model.layers.0.mlp.act_fn"] == "relu"
    _, grads = loss_grads(slim, inputs)
    (assert_gradients_equal if policy == "tempo" else assert_gradients_close)(exact, grads)
    assert slimact.profile(slim, inputs).activation_bytes < (0.2 if policy == "int8" else 0.65) * plain_bytes
