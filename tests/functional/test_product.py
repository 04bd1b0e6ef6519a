"""The product of a gate written in model code (``slimact.functional.product``): PyTorch's forward, both factors
kept with the policy's codes, an activation's output through its input's codes (no bytes of its own)."""

from __future__ import annotations

import pytest
import torch

import slimact
from slimact._metrics import cosine
from slimact.functional.activation import activation, output_form
from slimact.functional.product import product
from slimact.policy import resolve

CFG = resolve("int8").quant_config("silu", 3)


def _factors(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, 16, 64, generator=gen) * 2).to(dtype).requires_grad_(True)
    b = torch.randn(4, 16, 64, generator=gen).to(dtype).requires_grad_(True)
    return x, b


def _grads(fn, x, b, seed=1):
    y = fn(x, b)
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y)
    return (y.detach(), *torch.autograd.grad(y, (x, b), grad_y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_forward_is_pytorchs_and_the_gradients_are_close(dtype):
    x, b = _factors(dtype)
    y0, gx0, gb0 = _grads(lambda x, b: torch.nn.functional.silu(x) * b, x, b)
    y1, gx1, gb1 = _grads(lambda x, b: product(activation(x, "silu", CFG, fn=torch.nn.functional.silu), b, CFG), x, b)
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    assert cosine(gx0, gx1) >= 0.999 and cosine(gb0, gb1) >= 0.999


def test_an_activations_output_costs_no_bytes_of_its_own():
    # Plain keeps x (the SiLU's input), silu(x) and b: 12 bytes per element in fp32. Here x's codes serve both the
    # SiLU and the product's rebuilt silu(x); b's codes are the product's own: 2 bytes per element and the scales.
    x, b = _factors()

    class Gate(torch.nn.Module):
        def forward(self, x, b):
            return product(activation(x, "silu", CFG, fn=torch.nn.functional.silu), b, CFG)

    report = slimact.profile(Gate(), (x, b), loss_fn=lambda y: y.sum())  # (a sum keeps nothing)
    codes = 2 * x.numel()
    assert codes <= report.activation_bytes < 1.1 * codes


def test_only_what_a_gradient_needs_is_kept():
    x, b = _factors()
    b = b.detach()  # (b needs no gradient: a's factor b is kept, silu(x) is not needed)
    y = product(activation(x, "silu", CFG, fn=torch.nn.functional.silu), b, CFG)
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    assert saved and all(t.dtype in (torch.uint8, torch.int8, torch.float32) for t in saved)
    assert sum(t.numel() * t.element_size() for t in saved) < 1.1 * b.numel()


def test_the_square_of_one_factor_packs_it_once():
    x, _ = _factors()
    a = activation(x, "gelu", CFG, fn=torch.nn.functional.gelu)
    assert output_form(a) == "gelu"
    (g0,) = torch.autograd.grad((torch.nn.functional.gelu(x) ** 2).sum(), x)
    (g1,) = torch.autograd.grad(product(a, a, CFG).sum(), x)
    assert cosine(g0, g1) >= 0.999


def test_factors_of_other_shapes_or_dtypes_are_refused():
    x, b = _factors()
    with pytest.raises(ValueError, match="one shape and dtype"):
        product(x, b[..., :1], CFG)
    with pytest.raises(ValueError, match="one shape and dtype"):
        product(x, b.double(), CFG)
