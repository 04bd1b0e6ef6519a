import pytest
import torch
from torch import nn

import slimact
from _harness import FLOAT_DTYPES, check_against_plain, non_contiguous, saved_ratio
from slimact._kinds import activation_form
from slimact.functional.activation import FORMS, derivative, reference

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
     ("hf_quick_gelu", "quick_gelu"), ("hf_gelu_pytorch_tanh", "gelu_tanh")],
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


def test_gpt2_gelu_keeps_one_8bit_tensor_instead_of_five():
    ratio = saved_ratio(MODULES["hf_gelu_new"](), torch.randn(256, 256))
    assert ratio <= 0.27 / 4  # five fp32 tensors -> one byte per element


def test_relu_keeps_at_most_0_04x():
    assert saved_ratio(nn.ReLU(), torch.randn(256, 256)) <= 0.04


def test_named_modules_for_direct_use():
    gelu = slimact.nn.GELU(approximate="tanh", policy="mesa")
    assert isinstance(gelu, nn.GELU) and gelu._slimact_form == "gelu_tanh"
    x = torch.randn(4, 8, requires_grad=True)
    assert torch.equal(gelu(x), nn.functional.gelu(x, approximate="tanh"))
