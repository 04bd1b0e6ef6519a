"""The clamped gated unit of experts (gpt-oss's and its kin's): the model's forward, plain's gradient without
compression (to float rounding), SQNR floors at 8 bits, the clamps' gradients where the model's are, and what it
keeps."""

import pytest
import torch

from slimact._metrics import cosine, sqnr_db
from slimact.functional.clamped_glu import GateForm, clamped_glu
from slimact.quant import QuantConfig

ROWS = QuantConfig(groups=8, clamp_groups=True)  # as the default policy builds it for a rank-2 [S, 2I] tensor
FORMS = {
    "gpt-oss": GateForm(interleaved=True, limit=7.0, alpha=1.702, offset=1.0),
    "halves-sigmoid": GateForm(interleaved=False, limit=7.0, alpha=1.702, offset=1.0),  # MiniMax M3, privacy filter
    "silu": GateForm(interleaved=False, limit=10.0, alpha=None, offset=0.0),  # Hunyuan V4, GLM-5 Next, DeepSeek V4
}


def _as_written(form: GateForm, x: torch.Tensor) -> torch.Tensor:
    """The models' code (gpt-oss's ``_apply_gate``, Hunyuan V4's), for the form."""
    if form.interleaved:
        gate, up = x[..., ::2], x[..., 1::2]
    else:
        gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=form.limit)
    up = up.clamp(min=-form.limit, max=form.limit)
    if form.alpha is None:
        return torch.nn.functional.silu(gate) * up
    glu = gate * torch.sigmoid(gate * form.alpha)
    return (up + 1) * glu


def _case(scale: float, dtype=torch.float32, rows=64, width=256):
    x = (torch.randn(rows, width, generator=torch.Generator().manual_seed(0)) * scale).to(dtype).requires_grad_()
    g = torch.randn(rows, width // 2, generator=torch.Generator().manual_seed(1)).to(dtype)
    return x, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", FORMS)
def test_uncompressed_it_is_the_models_unit_forward_bit_for_bit_and_its_gradient(name, dtype):
    form = FORMS[name]
    x, g = _case(4.0, dtype)  # (6% of the elements beyond the limits)
    want = _as_written(form, x)
    (want_grad,) = torch.autograd.grad(want, x, g)
    got = clamped_glu(x, form, None)
    (got_grad,) = torch.autograd.grad(got, x, g)
    assert type(got.grad_fn).__name__ == "_ClampedGLUBackward"
    assert torch.equal(got, want)
    if dtype == torch.float32:
        torch.testing.assert_close(got_grad, want_grad)  # (the closed form rounds otherwise than autograd's chain)
    else:  # bf16: plain rounds each of its ops to bf16, the closed form computes in fp32: at least as close to exact
        x64 = x.detach().double().requires_grad_()
        (exact,) = torch.autograd.grad(_as_written(form, x64), x64, g.double())
        assert (got_grad.double() - exact).norm() <= (want_grad.double() - exact).norm()


@pytest.mark.parametrize("scale", [1.0, 4.0])
@pytest.mark.parametrize("name", FORMS)
def test_at_8_bits_the_forward_is_exact_and_the_gradient_within_the_floors(name, scale):
    form = FORMS[name]
    x, g = _case(scale)
    want = _as_written(form, x)
    (want_grad,) = torch.autograd.grad(want, x, g)
    got = clamped_glu(x, form, ROWS)
    (got_grad,) = torch.autograd.grad(got, x, g)
    assert torch.equal(got, want)
    assert sqnr_db(want_grad, got_grad) >= 30.0
    assert cosine(want_grad, got_grad) >= 0.999


def test_at_8_bits_the_clamps_pass_no_gradient_where_the_models_pass_none():
    # A restored element within half a step of a limit may lie on its other side: the clamps' gradients are taken at
    # the exact input (kept as bits). Without them, gpt-oss's unit at 6% clamped elements fell to 24.8 dB.
    form = FORMS["gpt-oss"]
    x, g = _case(4.0)
    gate, up = x.detach()[:, ::2], x.detach()[:, 1::2]
    (got_grad,) = torch.autograd.grad(clamped_glu(x, form, ROWS), x, g)
    assert (got_grad[:, ::2][gate > form.limit] == 0).all() and (gate > form.limit).any()
    cut_up = (up > form.limit) | (up < -form.limit)
    assert (got_grad[:, 1::2][cut_up] == 0).all() and cut_up.any()
    # and where the model's clamps pass the gradient, it passes (a restored element beyond a limit included)
    (want_grad,) = torch.autograd.grad(_as_written(form, x), x, g)
    assert sqnr_db(want_grad, got_grad) >= 35.0


def _saved_bytes(fn, x):
    total = []

    def pack_hook(t):
        total.append(t.untyped_storage().nbytes() if t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
                     else t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        y = fn(x)
    return y, sum(total)


@pytest.mark.parametrize("name", ["gpt-oss", "silu"])
def test_it_keeps_its_input_alone(name):
    form = FORMS[name]
    x, _ = _case(1.0)
    x = x * 1.0  # (a non-leaf, as the up projection's output)
    n = x.numel()
    _, plain = _saved_bytes(lambda t: _as_written(form, t), x)
    _, exact = _saved_bytes(lambda t: clamped_glu(t, form, None), x)
    _, packed = _saved_bytes(lambda t: clamped_glu(t, form, ROWS), x)
    assert plain >= (4 if form.alpha is None else 6) * (n // 2) * 4  # (see the module docstring)
    assert exact == n * 4
    assert packed <= n + n // 8 + 2 * 8 * n // 32  # codes, clamp bits, scales of groups of 32


def test_without_a_gradient_it_is_the_form_itself():
    form = FORMS["gpt-oss"]
    x, _ = _case(1.0)
    with torch.no_grad():
        out = clamped_glu(x, form, ROWS)
    assert out.grad_fn is None and torch.equal(out, _as_written(form, x.detach()))
