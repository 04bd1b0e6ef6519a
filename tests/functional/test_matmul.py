import importlib

import pytest
import torch
from torch import nn

import slimact
from _harness import FLOAT_DTYPES, check_against_plain, estimates, saved_ratio
from slimact._metrics import cosine, sqnr_db
from slimact.quant import QuantConfig

CASES = {
    "heads": ((2, 3, 5, 8), (2, 3, 8, 5)),
    "one-token": ((1, 1, 1, 4), (1, 1, 4, 1)),
    "odd": ((3, 7, 13), (3, 13, 5)),
    "broadcast": ((2, 3, 5, 8), (8, 6)),
    "k-transposed": ((2, 3, 5, 8), "kT"),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_matmul_matches_torch(case, dtype):
    a_shape, b_shape = CASES[case]
    a = torch.randn(a_shape)
    b = torch.randn(2, 3, 6, 8).transpose(-1, -2) if b_shape == "kT" else torch.randn(b_shape)
    check_against_plain(slimact.nn.MatMulBase(), a.to(dtype), b.to(dtype))


def test_matmul_keeps_at_most_0_27x():
    assert saved_ratio(slimact.nn.MatMulBase(), torch.randn(4, 4, 64, 64), torch.randn(4, 4, 64, 64)) <= 0.27


def test_head_wise_scales_beat_one_scale_by_20_db():
    torch.manual_seed(0)
    scales = torch.tensor([1e-2, 1.0, 1e2, 1e-1])  # head ranges differ by 10^4
    q = torch.randn(2, 4, 16, 8) * scales.view(1, 4, 1, 1)
    k = torch.randn(2, 4, 16, 8)

    def per_head_sqnr(cfg):
        qq = q.clone().requires_grad_(True)
        kk = k.clone().requires_grad_(True)
        y = slimact.functional.matmul(qq, kk.transpose(-1, -2), cfg, cfg)
        g = torch.randn_like(y)
        (grad_k,) = torch.autograd.grad(y, kk, g)
        exact = (g.transpose(-1, -2) @ q)  # d/dk of q k^T
        return sum(sqnr_db(exact[:, h], grad_k[:, h]) for h in range(4)) / 4

    head_wise = per_head_sqnr(QuantConfig(group_dim=1, groups=0))
    one_scale = per_head_sqnr(QuantConfig(group_dim=None))
    assert head_wise >= 30
    assert head_wise - one_scale >= 20, (head_wise, one_scale)


@pytest.mark.parametrize("form", ["matmul", "einsum"])
def test_heads_concatenating_parts_of_different_sizes_keep_the_small_parts_gradients(form):
    # DAB-DETR's attention written in its own code, q @ k^T on heads concatenating content and position parts of
    # different sizes (as the fused attention's test): one scale per head left the small part's gradients at cosine
    # 0.80 (q) and 0.75 (k); one per 16 channels of a head, along the dim the product contracts, 0.9999.
    g = torch.Generator().manual_seed(0)
    b, h, t, s, d = 2, 4, 24, 40, 32

    def parts(rows):
        large, small = (torch.randn(b, rows, h, d // 2, generator=g) for _ in range(2))
        return torch.cat([large, 0.01 * small], -1).transpose(1, 2).requires_grad_()  # [B, H, T, D]

    q, k = parts(t), parts(s)
    grad = torch.randn(b, h, t, s, generator=g)
    cfg = QuantConfig(group_dim=1, groups=0)
    if form == "matmul":
        y = slimact.functional.matmul(q, k.transpose(-1, -2), cfg, cfg)
    else:
        einsum = importlib.import_module("slimact.functional.matmul").einsum  # (the package's name is a function)
        y = einsum("bhid,bhjd->bhij", q, k, cfg, cfg)
    approx = torch.autograd.grad(y, (q, k), grad)
    exact = (grad.double() @ k.detach().double(), grad.double().transpose(-1, -2) @ q.detach().double())
    for name, a, e in zip("qk", approx, exact, strict=True):
        for part, sl in (("large", slice(0, d // 2)), ("small", slice(d // 2, d))):
            assert cosine(e[..., sl], a[..., sl]) >= 0.99, (name, part, cosine(e[..., sl], a[..., sl]))


class _Attention(nn.Module):
    """Mesa-style hand-written attention: one MatMul module for both products."""

    def __init__(self):
        super().__init__()
        self.mm = slimact.nn.MatMulBase()
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, q, k, v):
        return self.mm(self.softmax(self.mm(q, k.transpose(-1, -2))), v)


def _attention_grads(q, k, v, steps=4):
    model = slimact.convert(_Attention(), "mesa")  # running estimates, one per call site
    for _ in range(steps):
        qkv = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = model(*qkv)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        out.backward(g)
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    torch.matmul(torch.softmax(ref[0] @ ref[1].transpose(-1, -2), -1), ref[2]).backward(g)
    return model, [sqnr_db(r.grad, t.grad) for r, t in zip(ref, qkv, strict=True)]


def test_one_matmul_called_twice_per_step_gets_correct_gradients_for_both(monkeypatch):
    # q @ k^T sees operands of range ~8; p @ v sees probabilities in [0, 1] and v of range ~0.01.
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 16, 8) * 1.5, torch.randn(2, 2, 16, 8) * 1.5, torch.randn(2, 2, 16, 8) * 1e-3
    model, (dq, dk, dv) = _attention_grads(q, k, v)
    assert min(dq, dk, dv) >= 25, (dq, dk, dv)  # three lossy ops in a row (two matmuls and a softmax)
    mm = model.mm
    state = estimates(mm)
    assert (state["_slimact_b_range"] / state["_slimact_b_1_range"]).min() > 100  # two estimates, far apart
    # Counterfactual: one estimate shared by both calls (Mesa's behaviour) ruins the gradients.
    monkeypatch.setattr("slimact.nn._base.MAX_CALL_SITES", 1)
    _, shared = _attention_grads(q, k, v)
    assert min(shared) < 0, shared  # q and k gradients: noise larger than signal


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("b_shape", [(1, 3, 13, 22), (13, 22)], ids=["batch-1", "2d"])
def test_broadcast_operand_gradient_is_rounded_once(dtype, b_shape):
    # An operand broadcast over batch dims gets the sum of the batches' products: rounding each product to
    # fp16/bf16 and then summing them drifted by several roundings where the batches cancel. Accumulated in fp32
    # and rounded once, the gradient of constant operands (restored exactly) is the exact one rounded once.
    a = torch.full((11, 3, 7, 13), 3.25, dtype=dtype, requires_grad=True)
    b = torch.full(b_shape, -0.75, dtype=dtype, requires_grad=True)
    g = torch.randn(11, 3, 7, 22).to(dtype)
    exact = [(g.double() @ b.double().transpose(-1, -2)).sum_to_size(a.shape),
             (a.double().transpose(-1, -2) @ g.double()).sum_to_size(b.shape)]
    cfg = QuantConfig(group_dim=None)
    ours = torch.autograd.grad(slimact.functional.matmul(a, b, cfg, cfg), (a, b), g)
    for x, y in zip(ours, exact, strict=True):
        torch.testing.assert_close(x, y.to(dtype))
