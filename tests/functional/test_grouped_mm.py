"""The experts' grouped product: PyTorch's forward bit for bit, the input's gradient exact, the weights' at 8 bits."""

import pytest
import torch

import slimact
from slimact._metrics import sqnr_db
from slimact.functional.grouped_mm import grouped_mm
from slimact.quant import QuantConfig

transformers_moe = pytest.importorskip("transformers.integrations.moe")
CFG = QuantConfig(groups=8, clamp_groups=True)  # as the default policy builds it for a linear's input
OFFS = torch.tensor([10, 10, 25, 40], dtype=torch.int32)  # 4 experts over 40 rows, the second one with none


def _ops():
    return {"torch._grouped_mm": torch._grouped_mm,
            "grouped_mm_fallback": torch.ops.transformers.grouped_mm_fallback}


def _case(dtype, transposed, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 64, generator=gen).to(dtype).requires_grad_()
    # (transformers keeps [E, N, K] weights and passes their transpose, a view)
    w = (torch.randn(4, 32, 64, generator=gen) if transposed else torch.randn(4, 64, 32, generator=gen)) / 8
    w = w.to(dtype).requires_grad_()
    return x, w, torch.randn(40, 32, generator=gen).to(dtype)


@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk-view"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", list(_ops()))
def test_the_grouped_product_is_pytorchs_forward_with_an_exact_input_gradient(op, dtype, transposed):
    fn = _ops()[op]
    x, w, g = _case(dtype, transposed)
    weight = w.transpose(-2, -1) if transposed else w
    want = fn(x, weight, offs=OFFS)
    want_grads = torch.autograd.grad(want, (x, w), g)
    got = grouped_mm(x, weight, OFFS, CFG, fn)
    got_grads = torch.autograd.grad(got, (x, w), g)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_grads[0], want_grads[0], rtol=0, atol=0)  # W is kept as it is
    assert sqnr_db(want_grads[1].float(), got_grads[1].float()) >= 30
    assert torch.equal(got_grads[1][1], torch.zeros_like(got_grads[1][1]))  # the expert with no rows
    exact = grouped_mm(x, weight, OFFS, None, fn)  # cfg None: x kept exact, PyTorch's gradients
    for a, e in zip(torch.autograd.grad(exact, (x, w), g), want_grads, strict=True):
        torch.testing.assert_close(a, e)


def test_the_grouped_product_keeps_its_input_at_8_bits_and_nothing_for_frozen_experts():
    x, w, _ = _case(torch.float32, False)

    class Call(torch.nn.Module):
        def __init__(self, fn, weight):
            super().__init__()
            self.fn, self.weight = fn, weight

        def forward(self, t):
            return self.fn(t, self.weight)

    def kept(fn, weight):
        # (a loss whose gradient is no expanded tensor: PyTorch's own _grouped_mm backward refuses one, torch 2.13)
        report = slimact.profile(Call(fn, weight), (x.detach().requires_grad_(),), loss_fn=lambda y: (y * y).sum())
        return sorted((e.dtype, e.shape) for e in report.entries if e.shape == (40, 64))

    assert kept(lambda t, wt: torch._grouped_mm(t, wt, offs=OFFS), w) == [(torch.float32, (40, 64))]
    assert kept(lambda t, wt: grouped_mm(t, wt, OFFS, CFG), w) == [(torch.uint8, (40, 64))]
    assert kept(lambda t, wt: grouped_mm(t, wt, OFFS, CFG), w.detach()) == []  # W needs no gradient: no x
