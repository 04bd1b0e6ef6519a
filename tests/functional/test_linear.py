import importlib

import pytest
import torch
import torch.nn.functional as F

from _harness import estimates
from slimact._metrics import sqnr_db
from slimact.functional import linear
from slimact.quant import QuantConfig, RunningRange

# The module, not the function of the same name that slimact.functional exports.
flinear = importlib.import_module("slimact.functional.linear")
CFG = QuantConfig(groups=8, clamp_groups=True)  # as the default policy builds it: 8 groups at most


def _grads(fn, x, w, b):
    x, w, b = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    y = fn(x, w, b)
    g = torch.randn_like(y)
    y.backward(g)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "x_shape,out",
    [((1, 1, 64), 48), ((4, 33, 7), 5), ((2, 17, 96), 128), ((300, 31), 9)],
    ids=["one-token", "odd", "3d", "2d-odd"],
)
@pytest.mark.parametrize("contiguous", [True, False])
def test_linear_matches_torch(x_shape, out, dtype, contiguous):
    x = torch.randn(x_shape)
    if not contiguous:
        x = torch.randn(*x_shape[:-2], x_shape[-1], x_shape[-2]).transpose(-1, -2)
    x = x.to(dtype)
    w = (torch.randn(out, x_shape[-1]) / x_shape[-1] ** 0.5).to(dtype)
    b = torch.randn(out).to(dtype)
    torch.manual_seed(1)
    y0, gx0, gw0, gb0 = _grads(F.linear, x, w, b)
    torch.manual_seed(1)
    y1, gx1, gw1, gb1 = _grads(lambda x, w, b: linear(x, w, b, CFG), x, w, b)
    assert torch.equal(y0, y1)  # forward is PyTorch's own
    torch.testing.assert_close(gx1, gx0)  # grad_x needs only W: exact
    torch.testing.assert_close(gb1, gb0)
    assert sqnr_db(gw0, gw1) >= 30


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("rows,fin,fout", [(5, 16, 0), (5, 0, 8), (0, 0, 8)], ids=["no-out", "no-in", "empty"])
def test_zero_features_give_torchs_zero_gradients(rows, fin, fout, transposed):
    # A layer of 0 input or output features (a pruned head, a config's 0-width branch): the backward reshaped to
    # (-1, 0), which raised where PyTorch's backward returns empty and zero gradients.
    x, w, b = torch.randn(rows, fin), torch.randn(fout, fin), torch.randn(fout)
    torch.manual_seed(1)
    y0, *g0 = _grads(F.linear, x, w, b)
    torch.manual_seed(1)
    y1, *g1 = _grads(lambda x, w, b: linear(x, w, b, CFG, transposed=transposed), x,
                     w.t().contiguous() if transposed else w, b)
    torch.testing.assert_close(y1, y0)
    for name, a, e in zip(("x", "w", "b"), g1, g0, strict=True):
        torch.testing.assert_close(a.t() if transposed and name == "w" else a, e, msg=name)


def test_conv1d_layout_matches_addmm():
    x = torch.randn(3, 11, 24, requires_grad=True)
    w = torch.randn(24, 40, requires_grad=True)  # Conv1D: [in, out]
    b = torch.randn(40, requires_grad=True)
    ref = torch.addmm(b, x.view(-1, 24), w).view(3, 11, 40)
    y = linear(x, w, b, CFG, transposed=True)
    assert torch.equal(y, ref)
    g = torch.randn_like(y)
    gx0, gw0 = torch.autograd.grad(ref, (x, w), g)
    gx1, gw1 = torch.autograd.grad(y, (x, w), g)
    torch.testing.assert_close(gx1, gx0)
    assert gw1.shape == w.shape and sqnr_db(gw0, gw1) >= 30


def test_frozen_weight_packs_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(flinear, "pack", lambda *a, **k: calls.append(1))
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(6, 8)  # frozen
    y = linear(x, w, None, CFG)
    y.sum().backward()
    assert calls == []
    torch.testing.assert_close(x.grad, torch.ones(4, 6) @ w)


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_no_grad_modes_do_not_pack(monkeypatch, ctx):
    monkeypatch.setattr(flinear, "pack", lambda *a, **k: pytest.fail("packed without a backward"))
    x, w = torch.randn(4, 8), torch.randn(6, 8, requires_grad=True)
    with ctx():
        assert torch.equal(linear(x, w, None, CFG), F.linear(x, w))


def test_input_without_grad_still_gives_weight_grad():
    x = torch.randn(16, 8)
    w = torch.randn(6, 8, requires_grad=True)
    linear(x, w, None, CFG).pow(2).sum().backward()
    w2 = w.detach().clone().requires_grad_(True)
    F.linear(x, w2).pow(2).sum().backward()
    assert sqnr_db(w2.grad, w.grad) >= 30


def test_running_scale_called_twice_per_step_uses_each_calls_snapshot():
    # One module, two calls in one step with ranges 1e3 apart: each backward must restore its codes with
    # the estimate that call packed with, not the live one the other call moved (Mesa's backward read live
    # state, so the first call was restored with the second call's scale).
    owner = torch.nn.Module()
    state = RunningRange(owner, "_x")
    cfg = QuantConfig(groups=4, scale="running", decay=0.9)
    w = torch.randn(12, 32, requires_grad=True)
    x_small, x_big = torch.randn(64, 32) * 1e-2, torch.randn(64, 32) * 10
    for _ in range(3):  # the estimate has seen only small data
        linear(x_small, w, None, cfg, state)
    y1 = linear(x_small, w, None, cfg, state)
    lo1, hi1 = estimates(owner)["_x_lo"].clone(), estimates(owner)["_x_lo"] + estimates(owner)["_x_range"]
    y2 = linear(x_big, w, None, cfg, state)
    lo2, hi2 = estimates(owner)["_x_lo"].clone(), estimates(owner)["_x_lo"] + estimates(owner)["_x_range"]
    assert (hi2 - lo2).min() > 10 * (hi1 - lo1).max()  # the second call moved the estimate a lot
    g1, g2 = torch.randn_like(y1), torch.randn_like(y2)
    gw1 = torch.autograd.grad(y1, w, g1)[0]
    gw2 = torch.autograd.grad(y2, w, g2)[0]
    assert sqnr_db(g1.t() @ x_small, gw1) >= 30
    # Running mode saturates at the estimate it packs with, the one it found (call 1's): call 2 is exact up to
    # rounding for its input clamped there.
    per_channel = torch.arange(32) * 4 // 32
    clamped = torch.maximum(torch.minimum(x_big, hi1[per_channel]), lo1[per_channel])
    assert sqnr_db(g2.t() @ clamped, gw2) >= 30


def test_nan_input_shows_in_weight_grad_as_in_torch():
    x = torch.randn(5, 8)
    x[2, 3] = float("nan")
    w = torch.randn(4, 8, requires_grad=True)
    linear(x, w, None, CFG).sum().backward()
    w2 = w.detach().clone().requires_grad_(True)
    F.linear(x, w2).sum().backward()
    assert torch.equal(w.grad.isnan(), w2.grad.isnan())
    torch.testing.assert_close(w.grad, w2.grad, equal_nan=True)


def test_linear_keeps_at_most_0_27x():
    from _harness import saved_ratio

    assert saved_ratio(torch.nn.Linear(256, 256), torch.randn(256, 256)) <= 0.27


def test_hf_conv1d_keeps_at_most_0_27x():
    transformers = pytest.importorskip("transformers")
    from _harness import saved_ratio

    assert saved_ratio(transformers.pytorch_utils.Conv1D(256, 256), torch.randn(256, 256)) <= 0.27


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("cfg", [None, CFG], ids=["exact", "int8"])
def test_under_autocast_the_backward_products_run_in_the_autocast_dtype_as_torchs(transposed, cfg):
    # An fp32 input (a LayerNorm's output under autocast) multiplied in bf16: PyTorch's weight gradient is the bf16
    # product of the autocast copies. slimact's was an fp32 product of x_hat and the gradient (on an H200, fp32 SIMT
    # GEMMs took 40 ms of GPT-2's 191 ms int8 step).
    from _ops import Ops

    torch.manual_seed(0)
    x = torch.randn(4, 64, 96, requires_grad=True)
    w = (torch.randn(96, 48) if transposed else torch.randn(48, 96)).requires_grad_(True)
    b = torch.randn(48, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        y = linear(x, w, b, cfg, transposed=transposed)
        plain = F.linear(x, w.t() if transposed else w, b)
    g = torch.randn_like(y)
    with Ops() as ops:
        (gw,) = torch.autograd.grad(y, w, g)
    products = ops.products
    (gw0,) = torch.autograd.grad(plain, w, g)
    assert products and all(d == (torch.bfloat16, torch.bfloat16) for d in products), products
    assert gw.dtype == torch.float32  # the weight's
    if cfg is None:
        torch.testing.assert_close(gw, gw0, rtol=1.6e-2, atol=1e-2)  # the same bf16 product, to its rounding
    else:
        assert sqnr_db(gw0, gw) >= 30
