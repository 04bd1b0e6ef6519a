"""Functional calls in model code (F.dropout, F.relu, F.gelu, F.silu) routed through slimact while a converted
model trains: the same forward, the same (or 8-bit-close) gradients, fewer bytes, and nothing routed in eval,
under no_grad, for kinds the policy turns off, or after revert."""

import copy
import importlib
import pickle
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _nano
import slimact
from _harness import backward_nodes, check_against_plain
from slimact._metrics import cosine, sqnr_db


class _Block(nn.Module):
    """Model code calling functional ops directly, as OPT's layers and nn.TransformerEncoderLayer do."""

    def __init__(self, act):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(32, 64), nn.Linear(64, 32), act

    def forward(self, x):
        return self.fc2(F.dropout(self.act(self.fc1(x)), 0.25, self.training))


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    torch.manual_seed(3)
    y = model(x)
    y.square().sum().backward()
    return y.detach(), {"x": x.grad, **{n: p.grad for n, p in model.named_parameters()}}


ACTS = {"relu": F.relu, "torch.relu": torch.relu, "gelu": F.gelu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_functional_calls_are_routed_and_keep_less(act, policy):
    torch.manual_seed(0)
    plain = _Block(ACTS[act]).train()
    x = torch.randn(8, 16, 32)
    y0, g0 = _grads(plain, x)
    before = slimact.profile(plain, x.requires_grad_(True)).by_module["(model)"]
    slim = slimact.convert(copy.deepcopy(plain), policy)
    assert "dropout" in slimact.summary(slim).functional
    y1, g1 = _grads(slim, x)
    assert torch.equal(y0, y1)
    for n in g0:
        if policy == "tempo":
            # The in-place forms invert the output, with a derivative error <= 2e-5 in fp32 away from the
            # minimum (docs/tempo.md); a weight gradient sums 128 rows of it: compare in norm.
            assert (g1[n] - g0[n]).norm() <= 1e-5 * g0[n].norm(), n
        else:
            assert sqnr_db(g0[n], g1[n]) >= 30, n
    after = slimact.profile(slim, x).by_module["(model)"]
    # Plain keeps the activation's input (or output) and dropout's fp32 noise: 8 bytes per element. Masks
    # are 1 bit each; an 8-bit input 1 byte. A lossless smooth form keeps its output (4 bytes) beside its
    # mask, as the next op here (dropout) keeps only a mask: 4.25 of 8 bytes.
    smooth_lossless = policy == "tempo" and act not in ("relu", "torch.relu")
    assert after <= (4.25 / 8 if smooth_lossless else 0.3) * before, (after, before)


def test_nothing_is_routed_in_eval_under_no_grad_when_off_or_after_revert():
    plain = _Block(F.gelu)
    x = torch.randn(4, 32, requires_grad=True)
    slim = slimact.convert(copy.deepcopy(plain))
    plain_bytes = slimact.profile(plain.train(), x).activation_bytes
    off = slimact.convert(copy.deepcopy(plain), slimact.PRESETS["int8"].replace(
        kinds=tuple(k for k in slimact.policy.KINDS if k not in ("dropout", "gelu", "linear"))))
    assert not {"dropout", "gelu"} & set(slimact.summary(off).functional)
    assert slimact.profile(off.train(), x).activation_bytes == plain_bytes
    with torch.no_grad():
        torch.manual_seed(0)
        a = slim.train()(x)
        torch.manual_seed(0)
        b = plain.train()(x)
    assert torch.equal(a, b)
    slim.eval()
    assert torch.equal(slim(x), plain.eval()(x))
    slimact.revert(slim)
    assert slimact.profile(slim.train(), x).activation_bytes == plain_bytes


# Attention computed in a module's own code: its products and softmax routed through slimact's 8-bit Functions.


class _ScoresAttention(nn.Module):
    """Attention written with ``op`` for the scores: ``q @ k^T`` (matmul), ``torch.einsum``, ``torch.bmm`` on
    ``[B * H, T, D]``, or
    ``torch.baddbmm`` with a learned bias (broadcast over queries, as Bloom's ALiBi) and beta/alpha != 1."""

    def __init__(self, op: str, dim: int = 32, heads: int = 4):
        super().__init__()
        self.op, self.heads = op, heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.randn(heads, 1, 16))  # per key, the same for every query

    def forward(self, x):
        b, t, c = x.shape
        h, d = self.heads, c // self.heads
        q, k, v = self.qkv(x).view(b, t, 3, h, d).permute(2, 0, 3, 1, 4)  # 3 x [B, H, T, D]
        if self.op == "matmul":
            probs = (q @ k.transpose(-1, -2) * d**-0.5).softmax(-1)
            out = probs @ v
        elif self.op == "einsum":
            probs = torch.softmax(torch.einsum("bhid,bhjd->bhij", q, k) * d**-0.5, -1)
            out = torch.einsum("bhij,bhjd->bhid", [probs, v])
        else:
            q3, k3, v3 = (y.reshape(b * h, t, d) for y in (q, k, v))
            if self.op == "bmm":
                scores = torch.bmm(q3, k3.transpose(1, 2))
            else:
                scores = self.bias.repeat(b, 1, 1).baddbmm(batch1=q3, batch2=k3.transpose(1, 2), beta=0.5,
                                                          alpha=d**-0.5)
            probs = F.softmax(scores.view(b, h, t, t), dim=-1, dtype=torch.float32)
            out = torch.bmm(probs.view(b * h, t, t), v3).view(b, h, t, d)
        return self.proj(out.transpose(1, 2).reshape(b, t, c))


def _saved(model, x):
    """``[(shape, dtype)]`` of every tensor one forward of ``model`` keeps for the backward."""
    kept, seen = [], set()

    def hook(t):
        if t.untyped_storage().data_ptr() not in seen:  # one storage saved twice is kept once
            seen.add(t.untyped_storage().data_ptr())
            kept.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(hook, lambda t: t):
        model(x)
    return kept


@pytest.mark.parametrize("op", ["matmul", "einsum", "bmm", "baddbmm"])
def test_attention_in_model_code_is_routed_with_pytorchs_forward(op):
    torch.manual_seed(0)
    plain = nn.Sequential(_ScoresAttention(op)).train()
    x = torch.randn(2, 16, 32)
    slim = slimact.convert(copy.deepcopy(plain), "int8")
    assert {"matmul", "softmax"} <= set(slimact.summary(slim).functional)
    assert slimact.summary(slim).modules["0"] == "attention"
    y0, g0 = _grads(plain, x)
    y1, g1 = _grads(slim, x)
    assert torch.equal(y0, y1)  # the very ops the model wrote (a baddbmm is a torch.baddbmm)
    for n in g0:
        if g0[n] is None:  # (the bias of the baddbmm form only)
            assert g1[n] is None, n
        else:
            assert sqnr_db(g0[n], g1[n]) >= 30, n
    maps = [s for s, dtype in _saved(slim, x.requires_grad_(True)) if s[-2:] == (16, 16)]
    # The probabilities once, 8-bit (the softmax's pack, read by the product through a [B * H, T, T] view).
    assert maps == [(2, 4, 16, 16)], maps
    assert all(dtype != torch.float32 for s, dtype in _saved(slim, x) if s[-2:] == (16, 16))


class _ParameterProduct(nn.Module):
    """Products with a parameter (a view of one) and with a tensor that needs no gradient."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 8))
        self.register_buffer("table", torch.randn(16, 8))

    def forward(self, x):
        return (x @ self.weight.t()) @ self.table


class _ParameterAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _ParameterProduct()

    def forward(self, x):
        return self.inner(x)


def test_only_operands_that_need_a_gradient_are_packed():
    torch.manual_seed(0)
    plain = _ParameterAttention().train()
    x = torch.randn(4, 5, 8, requires_grad=True)
    slim = slimact.convert(copy.deepcopy(plain), "int8")
    kept = _saved(slim, x)
    # x @ weight^T: x packed for the weight's gradient, the weight kept as it is (no 8-bit copy of it);
    # (.) @ table: the table needs no gradient, so the left operand is not kept; the table itself is.
    assert [s for s, dtype in kept if dtype == torch.uint8] == [(4, 5, 8)], kept
    # Beside x's codes and its 4 scale pairs (one per [4] index), only the weight (as weight.t()) and the table.
    assert {s for s, dtype in kept if dtype != torch.uint8} == {(4,), (8, 16), (16, 8)}, kept
    assert slimact.profile(slim, x).activation_bytes < slimact.profile(plain, x).activation_bytes
    y0, g0 = _grads(plain, x)
    y1, g1 = _grads(slim, x)
    assert torch.equal(y0, y1)
    torch.testing.assert_close(g1["x"], g0["x"])  # from the exact weight and table
    assert sqnr_db(g0["inner.weight"], g1["inner.weight"]) >= 30


def test_attention_routes_off_in_eval_no_grad_float64_and_by_policy():
    torch.manual_seed(0)
    plain = nn.Sequential(_ScoresAttention("matmul"), _ScoresAttention("matmul")).train()
    x = torch.randn(2, 16, 32, requires_grad=True)
    plain_bytes = slimact.profile(plain, x).activation_bytes
    slim = slimact.convert(copy.deepcopy(plain), "int8")
    routed = slimact.profile(slim, x).activation_bytes
    assert routed < 0.4 * plain_bytes
    assert not any(dtype == torch.uint8 and s[-2:] == (16, 16) for s, dtype in _saved(slim.eval(), x))
    with torch.no_grad():
        assert torch.equal(slim.train()(x), plain(x))
    wide, xd = copy.deepcopy(plain).double(), x.double()
    plain_wide = slimact.profile(wide, xd).activation_bytes
    assert slimact.profile(slimact.convert(wide, "int8"), xd).activation_bytes == plain_wide
    # Per kind and by name: off for matmul and softmax, or for the first module only.
    off = slimact.PRESETS["int8"].replace(kinds=tuple(k for k in slimact.policy.KINDS
                                                      if k not in ("matmul", "softmax")))
    assert not {"matmul", "softmax"} & set(slimact.summary(slimact.convert(copy.deepcopy(plain), off)).functional)
    first_off = slimact.convert(copy.deepcopy(plain), slimact.PRESETS["int8"].replace(exclude=("0",)))
    maps = [s for s, dtype in _saved(first_off, x) if s[-2:] == (16, 16)]
    assert sorted(str(dtype) for s, dtype in _saved(first_off, x) if s[-2:] == (16, 16)) == [
        "torch.float32", "torch.uint8"], maps
    assert slimact.summary(first_off).skipped["0"].startswith("excluded (filter_fn or an exclude pattern)")


class _GatherAttention(nn.Module):
    """Relative scores gathered from a ``[N, T, 2 * span]`` table of content-to-position products, as DeBERTa."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(12, 8))

    def forward(self, x):  # x: [N, T, 8]
        table = torch.matmul(x, self.pos.t())  # [N, T, 12]
        index = (torch.arange(6)[None, :] - torch.arange(6)[:, None] + 6).clamp(0, 11).expand(x.shape[0], 6, 6)
        return torch.gather(table, -1, index).softmax(-1)


def test_gather_keeps_only_its_index_and_is_exact_under_tempo():
    torch.manual_seed(0)
    plain = nn.Sequential(_GatherAttention()).train()
    x = torch.randn(3, 6, 8)
    slim = slimact.convert(copy.deepcopy(plain), "tempo")
    y0, g0 = _grads(plain, x)
    y1, g1 = _grads(slim, x)
    assert torch.equal(y0, y1)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], msg=n)
    kept = _saved(slim, x.requires_grad_(True))
    assert ((3, 6, 12), torch.float32) in _saved(plain, x)  # PyTorch's gather keeps the whole table
    assert ((3, 6, 12), torch.float32) not in kept and not any(dtype == torch.uint8 for _, dtype in kept), kept


@pytest.mark.parametrize("form", ["bmm", "baddbmm", "einsum", "einsum-outer"])
def test_routed_product_backwards_are_pytorchs_when_kept_exact(form):
    mm = importlib.import_module("slimact.functional.matmul")  # (the package's ``matmul`` is the function)
    torch.manual_seed(0)
    a, b = torch.randn(6, 5, 8, requires_grad=True), torch.randn(6, 8, 7, requires_grad=True)
    bias = torch.randn(6, 1, 7, requires_grad=True)  # broadcast over the rows, as Bloom's ALiBi
    calls = {
        "bmm": (lambda: torch.bmm(a, b), lambda: mm.bmm(a, b, None, None)),
        "baddbmm": (lambda: torch.baddbmm(bias, a, b, beta=0.5, alpha=0.25),
                    lambda: mm.baddbmm(bias, a, b, None, None, beta=0.5, alpha=0.25)),
        "einsum": (lambda: torch.einsum("nij,njk->nik", a, b), lambda: mm.einsum("nij,njk->nik", a, b, None, None)),
        "einsum-outer": (lambda: torch.einsum("nij,nkl->nijkl", a, b),
                         lambda: mm.einsum("nij,nkl->nijkl", a, b, None, None)),
    }
    plain, slim = calls[form]
    y0, y1 = plain(), slim()
    assert torch.equal(y0, y1)
    g = torch.randn_like(y0)
    inputs = (a, b, bias) if form == "baddbmm" else (a, b)
    for g0, g1 in zip(torch.autograd.grad(y0, inputs, g), torch.autograd.grad(y1, inputs, g), strict=True):
        torch.testing.assert_close(g1, g0)
    # an implicit output is written out as torch.einsum reads it (the letters appearing once), a repeated index is not
    assert mm.einsum_terms("nij,njk", a, b) == ("nij", "njk", "ik") and mm.einsum_terms("nii,nik->nk", a, b) is None


class _DroppedAttention(nn.Module):
    """Probabilities dropped (by ``F.dropout``, or a converted ``nn.Dropout``) before ``@ v``; ``touch``: changed
    in place in between, so that they are no longer the softmax's output times the mask."""

    def __init__(self, functional: bool, touch: bool, p: float = 0.3):
        super().__init__()
        self.functional, self.touch, self.p = functional, touch, p
        self.qkv, self.drop = nn.Linear(32, 96), nn.Dropout(p)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        probs = (q @ k.transpose(-1, -2)).softmax(-1)
        dropped = F.dropout(probs, self.p, self.training) if self.functional else self.drop(probs)
        if self.touch:
            dropped[..., 0] = 0.5
        return (dropped @ v).sum(1)


# p = 0: the dropout returns the probabilities themselves (PyTorch refuses a change to them in place).
@pytest.mark.parametrize(("touch", "p"), [(False, 0.3), (True, 0.3), (False, 0.0)],
                         ids=["as-dropped", "changed-in-place", "p=0"])
@pytest.mark.parametrize("functional", [True, False], ids=["F.dropout", "nn.Dropout"])
def test_dropped_probabilities_are_kept_once_with_the_mask(functional, touch, p):
    torch.manual_seed(0)
    plain = _DroppedAttention(functional, touch, p).train()
    x = torch.randn(2, 16, 32)
    slim = slimact.convert(copy.deepcopy(plain), "int8")
    y0, g0 = _grads(plain, x)
    y1, g1 = _grads(slim, x)
    assert torch.equal(y0, y1)
    for n in g0:
        assert sqnr_db(g0[n], g1[n]) >= 30, n
    maps = [s for s, dtype in _saved(slim, x.requires_grad_(True)) if dtype == torch.uint8 and s[-2:] == (16, 16)]
    # Once (the softmax's pack, the product restoring probs * mask / (1 - p)); a changed tensor is packed anew.
    assert len(maps) == (2 if touch else 1), maps


class _SdpaAttention(nn.Module):
    """Attention written in model code around F.scaled_dot_product_attention (timm's, Falcon's)."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)  # [B, H, T, D]
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))


def _sdpa_grads(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_sdpa_in_model_code_is_routed_through_slimact_attention(policy):
    from _harness import assert_gradients_close

    torch.manual_seed(0)
    plain = nn.Sequential(_SdpaAttention(), _SdpaAttention()).train()
    slim = slimact.convert(copy.deepcopy(plain), policy)
    x = torch.randn(2, 32, 64)
    out0, g0 = _sdpa_grads(plain, x)
    out1, g1 = _sdpa_grads(slim, x)
    torch.testing.assert_close(out1, out0, rtol=1e-5, atol=1e-6)  # the CPU flash kernel on the same q, k, v
    if policy == "tempo":
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)
    else:
        assert_gradients_close(g0, g1)
        attn = slimact.profile(slim, x).by_kind.get("attention", 0)
        assert attn and attn < 0.3 * slimact.profile(plain, x).by_kind["attention"]
    assert "attention" in slimact.summary(slim).functional


class _MultiQueryPadded(nn.Module):
    """Falcon's attention with ALiBi, in miniature: one key/value head broadcast over the query heads (PyTorch runs
    that on its math path) and an additive mask filled with finfo.min, whose left-padded query rows mask every key."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.q, self.proj = heads, nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim // heads)

    def forward(self, x):
        b, t, c = x.shape
        d = c // self.heads
        q = self.q(x).view(b, t, self.heads, d).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 1, 2 * d).transpose(1, 2).split(d, -1)  # [B, 1, T, D] each
        keep = torch.ones(b, 1, t, t, dtype=torch.bool).tril()
        keep[-1, :, :, : t // 2] = False  # the last sequence left-padded: its first t/2 query rows see no key
        mask = torch.zeros(b, 1, t, t).masked_fill(~keep, torch.finfo(torch.float32).min)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_padded_rows_of_a_multi_query_sdpa_get_plains_gradients(policy):
    # The routed call ran PyTorch's CPU flash kernel, whose backward rebuilds a row masked with finfo.min only as
    # probabilities of 1 instead of 1/S (its fp32 log-sum-exp keeps nothing of log S at -3.4e38): the forward
    # was plain's, the gradients off by a relative 1.9 (tempo), cosine 0.72 (int8).
    from _harness import assert_gradients_close

    torch.manual_seed(0)
    plain = _MultiQueryPadded().train()
    slim = slimact.convert(copy.deepcopy(plain), policy)
    x = torch.randn(2, 6, 32)
    out0, g0 = _sdpa_grads(plain, x)
    out1, g1 = _sdpa_grads(slim, x)
    torch.testing.assert_close(out1, out0)
    if policy == "tempo":
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)
    else:
        assert_gradients_close(g0, g1)
    assert "attention" in slimact.summary(slim).functional


class _MaskedSdpa(nn.Module):
    """F.scaled_dot_product_attention in model code with a mask of its own (``mask_shape``), optionally causal too."""

    def __init__(self, mask_shape, is_causal=False, dim=32, heads=4, t=6):
        super().__init__()
        self.heads, self.is_causal, self.qkv, self.proj = heads, is_causal, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        gen = torch.Generator().manual_seed(5)
        mask = torch.rand(*mask_shape[:-2], t, t, generator=gen) > 0.4
        mask[..., 0] = True  # every query row sees a key
        self.register_buffer("mask", mask)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)  # [B, H, T, D]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.is_causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


@pytest.mark.parametrize("policy", ["tempo", "int8"])
@pytest.mark.parametrize(("mask_shape", "is_causal"), [((4, 6, 6), False), ((1, 6, 6), False), ((6, 6), True)],
                         ids=["heads-mask", "one-mask", "mask-and-causal"])
def test_sdpa_with_a_3d_mask_or_a_mask_and_is_causal_runs_as_plain_does(mask_shape, is_causal, policy):
    # A [H, T, S] mask (broadcast right-aligned by F.scaled_dot_product_attention) reached PyTorch's CPU flash kernel,
    # which takes 2 or 4 dims only: "Attention mask dim in {2, 4}" where the plain call ran. A mask with
    # is_causal=True (plain's CPU flash kernel applies both) raised slimact's "pass either attn_mask or is_causal".
    from _harness import assert_gradients_close

    torch.manual_seed(0)
    plain = nn.Sequential(_MaskedSdpa(mask_shape, is_causal)).train()
    slim = slimact.convert(copy.deepcopy(plain), policy)
    x = torch.randn(2, 6, 32)
    out0, g0 = _sdpa_grads(plain, x)
    out1, g1 = _sdpa_grads(slim, x)
    torch.testing.assert_close(out1, out0, rtol=1e-5, atol=1e-6)
    if policy == "tempo":
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)
    else:
        assert_gradients_close(g0, g1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_sdpa_with_a_float_mask_of_another_dtype_than_the_query_is_refused_as_in_pytorch(dtype):
    # PyTorch refuses it ("Expected attn_mask dtype to be bool or float or to match query dtype"); slimact's attention
    # had cast it and run: a model developed converted failed once reverted, or in eval mode.
    torch.manual_seed(0)
    model = nn.Sequential(_MaskedSdpa((6, 6), False)).train()
    model[0].mask = model[0].mask.to(dtype)
    slim = slimact.convert(copy.deepcopy(model), "int8")
    x = torch.randn(2, 6, 32)
    for m in (model, slim):
        with pytest.raises(RuntimeError, match="attn_mask dtype"):
            m(x)
    # Under autocast PyTorch casts a float32 mask to the bf16 queries': routed, as before (q, k, v kept 8-bit)
    model[0].mask = model[0].mask.float()
    slim = slimact.convert(copy.deepcopy(model), "int8")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(slim(x), model(x))
        assert torch.uint8 in {e.dtype for e in slimact.profile(slim, x).entries}


class _JaggedBlock(nn.Module):
    """Attention over variable-length sequences as a jagged nested tensor (torch.nested): F.scaled_dot_product_attention
    takes them, so do nn.Linear, nn.LayerNorm, F.gelu and F.dropout."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.norm = heads, nn.LayerNorm(dim)
        self.q, self.k, self.v, self.fc = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        h = self.norm(x)
        q, k, v = (f(h).unflatten(-1, (self.heads, -1)).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)
        return x + F.dropout(F.gelu(self.fc(y)), 0.1, self.training)


@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_nested_tensors_run_as_written(policy):
    # slimact's Functions view, pack and index a tensor's data, which a nested tensor does not allow: a converted
    # model fed jagged sequences raised where the plain one ran (int8's Linear: "Attempted to access the data pointer
    # on an invalid python storage"; tempo's routed F.scaled_dot_product_attention: NotImplementedError for the CPU
    # flash kernel; F.gelu on a jagged tensor: "view(): cannot view shape (2, j1, 16) as [-1]"). Such calls and
    # modules now run as written.
    torch.manual_seed(0)
    plain = _JaggedBlock().train()
    slim = slimact.convert(copy.deepcopy(plain), policy)
    x = torch.nested.nested_tensor([torch.randn(3, 32), torch.randn(5, 32)], layout=torch.jagged)
    grads = []
    for model in (plain, slim):
        torch.manual_seed(1)
        out = model(x).values()
        out.square().sum().backward()
        grads.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (out0, g0), (out1, g1) = grads
    assert torch.equal(out1, out0)
    for n in g0:
        assert torch.equal(g1[n], g0[n]), n


def test_sdpa_in_an_excluded_module_runs_as_written():
    plain = nn.Sequential(_SdpaAttention(), _SdpaAttention()).train()
    x = torch.randn(2, 32, 64)
    slim = slimact.convert(copy.deepcopy(plain), "int8", filter_fn=lambda m, name: not name.startswith("1"))
    by_module = slimact.profile(slim, x).by_module
    plain_by_module = slimact.profile(plain, x).by_module
    assert by_module["1"] == plain_by_module["1"]  # attention kept as PyTorch keeps it
    assert by_module["0"] < 0.3 * plain_by_module["0"]


@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_a_functions_own_ops_do_not_pass_through_the_routing_mode(policy, monkeypatch):
    # The routing mode is on for the whole training forward of a converted model, and every torch call it sees runs
    # its Python handler. The calls inside slimact's Functions (the pack's ops, the Linear's own F.linear, the
    # activation's) are not model code: the Functions run their forwards with the mode off. Before, a Linear-GELU-
    # Linear step at 8 bits passed 382 calls through it (CPU reference pack), tempo 22; now the modules' own few
    # attribute reads before their Function (and the step's seed stream) remain, among them each module's is_nested,
    # layout and is_meta of its input (a nested, sparse or meta tensor runs the plain module): 9 here.
    from slimact.nn import routing

    seen = []
    original = routing._Mode.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):
        seen.append(getattr(func, "__name__", str(func)))
        return original(self, func, types, args, kwargs)

    model = slimact.convert(nn.Sequential(nn.Linear(64, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 64)), policy)
    monkeypatch.setattr(routing._Mode, "__torch_function__", counted)
    model.train()(torch.randn(2, 8, 64, requires_grad=True)).sum().backward()
    assert len(seen) <= 19 and not {"amax", "gelu", "ge", "view", "reshape"} & set(seen), seen
    # int8: neither Linear's F.linear is seen (it runs inside the Function); tempo leaves the Linears plain
    assert seen.count("linear") == (2 if policy == "tempo" else 0), seen


def test_the_mode_passes_calls_it_neither_routes_nor_follows_straight_through(monkeypatch):
    # Most calls the mode sees (the ops inside slimact's own Functions, tensor attribute reads) are neither routed
    # nor aliases of the head's output for the LM loss to follow: they run as written without reaching the loss
    # tracker, which sees only aliases, routed calls, and calls made once lazy logits exist (which it answers).
    from slimact import zoo
    from slimact.convert import _ROUTE_ATTR
    from slimact.nn.lm_loss import _ALIASES, LossTracker

    config = zoo.tiny_config("gpt2")
    model = zoo.build_auto("GPT2LMHeadModel", config).train()
    ids = torch.randint(3, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    slim = slimact.convert(model, "int8")
    routing = slim.__dict__[_ROUTE_ATTR]
    followed = []
    original = LossTracker.seen
    monkeypatch.setattr(LossTracker, "seen",
                        lambda self, func, *a: followed.append((func, self.lazy_made)) or original(self, func, *a))
    loss = slim(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert any(func in _ALIASES for func, _ in followed)
    assert all(func in _ALIASES or func in routing.handlers or lazy for func, lazy in followed)


class _Outer(nn.Module):
    """A model calling another model in its forward that it does not own as a submodule (a teacher, a model
    held in a list): ``fc`` -> GELU -> ``inner``."""

    def __init__(self, inner):
        super().__init__()
        self.fc, self.inner = nn.Linear(32, 32), [inner]

    def forward(self, x):
        return self.inner[0](F.gelu(self.fc(x)))


def _gelu_grad_fns(block):
    """The ``grad_fn`` of each output of ``block.act`` (``_Block``'s activation), recorded by a forward hook."""
    seen = []
    block.act = _Recorded(block.act, seen)
    return seen


class _Recorded(nn.Module):
    def __init__(self, fn, seen):
        super().__init__()
        self.fn, self.seen = fn, seen

    def forward(self, x):
        y = self.fn(x)
        self.seen.append(type(y.grad_fn).__name__)
        return y


@pytest.mark.parametrize("inner_state", ["excluded", "eval"])
def test_a_converted_model_called_in_anothers_forward_keeps_its_own_decisions(inner_state):
    # The outer model's mode routed every call the inner model's own routing left as written: the GELU of a
    # module the inner policy excludes, or of an inner model in eval, came out 8-bit (_ActivationFunction).
    torch.manual_seed(0)
    inner = _Block(F.gelu)
    seen = _gelu_grad_fns(inner)
    policy = slimact.PRESETS["int8"].replace(exclude=("act",)) if inner_state == "excluded" else "int8"
    inner = slimact.convert(inner, policy)
    if inner_state == "eval":
        inner.eval()
    x = torch.randn(4, 32, requires_grad=True)
    inner(x)
    outer = slimact.convert(_Outer(inner), "int8").train()
    outer(x)
    assert seen == ["GeluBackward0", "GeluBackward0"]
    assert F.gelu(x).grad_fn.name() == "GeluBackward0"  # and the mode left with the forward


def test_a_module_the_user_excluded_is_reported_left_alone_even_where_its_code_calls_a_routed_function():
    # nanoGPT's attention calls F.scaled_dot_product_attention: the summary counted an excluded one as converted
    # (its calls ran as written, rightly); its own LayerNorm module, whose F.layer_norm is routed, as left alone.
    slim = slimact.convert(_nano.NanoGPT(), "int8", filter_fn=lambda module, name: name != "transformer.h.0.attn")
    summary = slimact.summary(slim)
    assert "transformer.h.0.attn" not in summary.modules
    assert summary.skipped["transformer.h.0.attn"].startswith("excluded (filter_fn or an exclude pattern)")
    assert summary.modules["transformer.h.1.attn"] == "attention"
    assert summary.modules["transformer.h.0.ln_1"] == "layernorm" and "transformer.h.0.ln_1" not in summary.skipped
    dtypes = {}
    for e in slimact.profile(slim, _nano.batch(), loss_fn=_nano.loss_of).entries:
        dtypes.setdefault(e.module, set()).add(e.dtype)
    assert torch.uint8 not in dtypes["transformer.h.0.attn"] and torch.uint8 in dtypes["transformer.h.1.attn"]
    assert torch.uint8 in dtypes["transformer.h.0.ln_1"]



def _square(t, how):
    if how == "pow":
        return t.pow(2)
    return t**2 if how == "**" else t.square() if how == "square" else torch.square(t)


_SQUARES = ("square", "torch.square", "pow", "**")


class _SquaredReLUMLP(nn.Module):
    """An MLP whose activation is written in its code as the ``square`` (spelled one of :data:`_SQUARES`) of
    ``F.relu`` (nanochat's, modded-nanogpt's), or of the projection itself (``relu=False``)."""

    def __init__(self, square: str, relu: bool = True):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(32), nn.Linear(32, 128), nn.Linear(128, 32)
        self.square, self.relu = square, relu

    def forward(self, x):
        h = self.up(self.norm(x))
        return self.down(_square(F.relu(h) if self.relu else h, self.square))


@pytest.mark.parametrize("policy", ["int8", "tempo"])
@pytest.mark.parametrize("square", _SQUARES)
def test_squared_relu_in_model_code_keeps_no_fp32_copy_of_the_relu(square, policy):
    # F.relu was routed (a 1-bit mask) but square kept the ReLU's fp32 output for its backward: 4 bytes per
    # element of the MLP's widest tensor. Now squared ReLU: 8-bit (int8) or nothing beyond the square's output,
    # which the next Linear keeps anyway (tempo).
    torch.manual_seed(0)
    plain = _SquaredReLUMLP(square).train()
    x = torch.randn(4, 16, 32, requires_grad=True)
    slim = check_against_plain(plain, x, policy=policy, exact=policy == "tempo")
    # (and as much after a pickle round trip: Tensor.__pow__, a route, is a function pickle cannot name)
    for model in (slim, pickle.loads(pickle.dumps(slim))):
        fp32 = [e.module for e in slimact.profile(model, x).entries
                if e.shape[-1] == 128 and e.dtype == torch.float32]
        assert fp32 == ([] if policy == "int8" else ["(model)"]), fp32  # tempo: the square's output, once


@pytest.mark.parametrize("policy", ["int8", "tempo"])
def test_the_square_of_a_tensor_no_relu_made_runs_as_written(policy):
    # Squared ReLU's backward takes its input as non-negative (2 relu(x); tempo: sqrt of the output): on the
    # square of a signed tensor it would drop (int8) or flip (tempo) the gradient of every negative element.
    torch.manual_seed(0)
    x = torch.randn(4, 16, 32, requires_grad=True)
    check_against_plain(_SquaredReLUMLP("square", relu=False).train(), x, policy=policy, exact=policy == "tempo")


class _InlineGate(nn.Module):
    """A block whose gated unit is written in its own forward (no MLP module to fuse): ``act(g) * u`` with the
    activation a call (``how="silu"``, ``"gelu"``), a module (``"module"``), or a product that is not a gate's
    (``"broadcast"``, ``"scalar"``, ``"in-place after"``, ``"promoted"``)."""

    def __init__(self, how: str):
        super().__init__()
        self.norm, self.g, self.u, self.down = nn.LayerNorm(32), nn.Linear(32, 96), nn.Linear(32, 96), nn.Linear(96, 32)
        self.act, self.how = nn.GELU(), how

    def forward(self, x):
        h = self.norm(x)
        g, u = self.g(h), self.u(h)
        if self.how == "silu":
            p = F.silu(g) * u
        elif self.how == "gelu":
            p = u * F.gelu(g, approximate="tanh")
        elif self.how == "module":
            p = torch.mul(self.act(g), u)
        elif self.how == "broadcast":
            p = F.silu(g) * u[..., :1]
        elif self.how == "scalar":
            p = F.silu(g) * 0.5 + u
        elif self.how == "promoted":
            p = F.silu(g) * u.double()
            p = p.float()
        else:  # "in-place after": the activation's output changed before the product
            a = F.silu(g)
            a.mul_(2)
            p = a * u
        return x + self.down(p)


@pytest.mark.parametrize("policy", ["int8", "tempo"])
@pytest.mark.parametrize("how", ["silu", "gelu", "module"])
def test_a_gate_written_in_model_code_keeps_its_factors_8_bit(how, policy):
    # The product kept both factors in fp32, 8 bytes per element of the block's widest tensor, beside the
    # activation's 8-bit input. Now the up projection's 8-bit codes, and the activation's output through its
    # input's (tempo: as written, nothing to compress losslessly).
    from _harness import _step, assert_gradients_equal

    torch.manual_seed(0)
    plain = _InlineGate(how).train()
    x = torch.randn(4, 16, 32, requires_grad=True)
    if policy == "int8":
        slim = check_against_plain(plain, x, policy=policy)
    else:  # (the lossless GELU's gradient is rebuilt from its output: equal normwise, as tempo's gradients are)
        slim = slimact.convert(copy.deepcopy(plain), policy)
        (out0, g0), (out1, g1) = _step(plain, (x,), seed=1), _step(slim, (x,), seed=1)
        assert torch.equal(out0, out1)
        assert_gradients_equal(g0, g1)
    wide = [e for e in slimact.profile(slim, x).entries if e.shape[-1] == 96]
    fp32 = [e for e in wide if e.dtype == torch.float32]
    if policy == "int8":
        assert not fp32 and sum(e.nbytes for e in wide) == 3 * x.shape[0] * x.shape[1] * 96  # g, u, the product
    else:
        assert fp32  # (tempo keeps the factors as PyTorch does)


@pytest.mark.parametrize("how", ["broadcast", "scalar", "in-place after", "promoted"])
def test_a_product_that_is_not_a_gates_runs_as_written(how):
    torch.manual_seed(0)
    plain = _InlineGate(how).train()
    x = torch.randn(4, 16, 32, requires_grad=True)
    check_against_plain(plain, x, policy="int8")
    slim = slimact.convert(copy.deepcopy(plain), "int8")
    assert not any(type(n).__name__ == "_ProductFunctionBackward" for n in backward_nodes(slim(x)))


def test_t5s_gated_gelu_keeps_its_product_8_bit():
    # T5 v1.1, Flan-T5, mT5: act(wi_0(h)) * wi_1(h), then a dropout, then wo; no fusable block (the dropout).
    transformers = pytest.importorskip("transformers")
    from _harness import assert_gradients_close, loss_grads

    cfg = transformers.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=96, num_layers=1, num_heads=4,
                                feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    plain = transformers.T5ForConditionalGeneration(cfg).train()
    ids = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    slim = slimact.convert(copy.deepcopy(plain), "int8")
    loss0, g0 = loss_grads(plain, inputs)
    loss1, g1 = loss_grads(slim, inputs)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    assert_gradients_close(g0, g1)
    kept = {m: slimact.profile(m, inputs).by_module for m in (plain, slim)}
    ff = "encoder.block.0.layer.1.DenseReluDense"
    assert kept[slim][ff] <= kept[plain][ff] / 4  # the two fp32 factors: 1 byte per element each, and scales


class _GroupRMSNormGated(nn.Module):
    """Mamba2's ``MambaRMSNormGated`` with a group per head: ``s * silu(z)``, then RMS-normed per head."""

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads

    def forward(self, s, z):
        g = (s * F.silu(z)).unflatten(-1, (self.heads, -1))
        return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-6)).flatten(-2)


class _MixerTail(nn.Module):
    """Mamba2's mixer tail at test size: the scan output ``s = y + D * x`` (``D`` one learned scale per head, ``y``
    small beside it, as at init), gated and RMS-normed per head in a norm module."""

    def __init__(self, heads: int = 4, width: int = 16, ssm: float = 0.02):
        super().__init__()
        self.heads, self.width, self.ssm = heads, width, ssm
        self.wx, self.wz, self.wy = (nn.Linear(32, heads * width) for _ in range(3))
        self.D = nn.Parameter(torch.ones(heads))
        self.norm = _GroupRMSNormGated(heads)
        self.out = nn.Linear(heads * width, 32)

    def forward(self, h):
        x, z, y = (w(h).unflatten(-1, (self.heads, self.width)) for w in (self.wx, self.wz, self.wy))
        s = (self.ssm * y + self.D[:, None] * x).flatten(-2)
        return h + self.out(self.norm(s, z.flatten(-2)))


def test_a_product_in_a_norms_own_code_runs_as_written():
    # The norm removes every per-head scale of its input, so D's gradient is the small remainder of a cancellation
    # (the norm's gradient is orthogonal to its input per head, and s is nearly D * x). Routed, the product's backward
    # gave the scan output grad_p * silu_hat(z), whose 8-bit error does not cancel: D's gradient at cosine 0.92 here
    # (seed 2), 0.90-0.98 in the tiny Mamba2ForCausalLM. A product in a norm module's own code runs as written.
    from slimact._metrics import cosine

    torch.manual_seed(2)
    plain = _MixerTail().train()
    slim = slimact.convert(copy.deepcopy(plain), "int8")
    x = torch.randn(4, 16, 32)
    grads = []
    for model in (plain, slim):
        model(x).pow(2).sum().backward()
        grads.append(model.D.grad)
    assert cosine(*grads) >= 0.999
    assert not any(type(n).__name__ == "_ProductFunctionBackward" for n in backward_nodes(slim(x)))


def test_mamba2s_gated_norm_passes_the_check():
    pytest.importorskip("transformers")
    from slimact import zoo

    for seed in range(3):
        torch.manual_seed(seed)
        plain = zoo.build_auto("Mamba2ForCausalLM", zoo.tiny_config("mamba2"), seed=seed).train()
        report = slimact.check(plain, zoo.tiny_inputs(plain, "causal-lm", seed=seed))
        assert report.passed, str(report)


def test_an_attention_block_compiled_on_its_own_runs_its_calls_as_written():
    # A block compiled on its own (block.compile(), torch.compile of a submodule) runs inside the routing mode its
    # model's eager forward entered, and dynamo traced the mode's routes: Bloom's routed bmm failed to compile
    # (BackendCompilerFailed: 'NoneType' object has no attribute 'size', the route's tensor._base). The compiled
    # block's calls run as written, as in a wholly compiled model; its modules stay converted.
    transformers = pytest.importorskip("transformers")
    from _harness import assert_gradients_close, loss_grads

    cfg = transformers.BloomConfig(vocab_size=96, hidden_size=32, n_layer=1, n_head=4, hidden_dropout=0.0,
                                   attention_dropout=0.0)
    plain = transformers.BloomForCausalLM(cfg).train()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    slim = slimact.convert(copy.deepcopy(plain), "int8")
    slim.transformer.h[0].compile(backend="aot_eager")
    loss0, g0 = loss_grads(plain, inputs)
    loss1, g1 = loss_grads(slim, inputs)
    torch.testing.assert_close(loss1, loss0)
    assert_gradients_close(g0, g1)


class _CheckpointedMethod(nn.Module):
    """A block that checkpoints a method of its own (not a module's call): its F.gelu and F.dropout are model code
    made directly in the checkpointed function."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 32)

    def _inner(self, x):
        return self.b(F.dropout(F.gelu(self.a(x)), 0.1, self.training))

    def forward(self, x):
        return x + torch.utils.checkpoint.checkpoint(self._inner, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_calls_in_a_checkpointed_function_route_alike_in_the_forward_and_the_recompute(policy, reentrant):
    # The calls made directly in a checkpointed function were routed in the forward pass (the model's mode is on)
    # and ran as written in the recompute (no module call begins it, so nothing entered the mode): the
    # non-reentrant checkpoint raised CheckpointError ("A different number of tensors was saved"). They now run
    # as written in both passes; the modules called there are converted and route their own calls as before.
    torch.manual_seed(0)
    plain = nn.Sequential(_CheckpointedMethod(reentrant), _CheckpointedMethod(reentrant)).train()
    x = torch.randn(2, 8, 32)
    slim = slimact.convert(copy.deepcopy(plain), policy)
    y0, g0 = _grads(plain, x)  # (the same dropout draws: _grads seeds before the forward)
    y1, g1 = _grads(slim, x)
    assert torch.equal(y0, y1)
    for n in g0:
        if policy == "tempo":
            torch.testing.assert_close(g1[n], g0[n], msg=n)
        else:
            assert sqnr_db(g0[n], g1[n]) >= 30, n


class _GatedDropoutMLP(nn.Module):
    """A gated MLP with a dropout on its product (so not fused): ``act(gate) * up`` is a product routed in its code."""

    def __init__(self, width: int):
        super().__init__()
        self.gate, self.up = nn.Linear(width, 2 * width), nn.Linear(width, 2 * width)
        self.down, self.act, self.drop = nn.Linear(2 * width, width), nn.GELU(), nn.Dropout(0.3)

    def forward(self, x):
        return self.down(self.drop(self.act(self.gate(x)) * self.up(x)))


class _Core(nn.Module):
    """An attention's core as a module of its own (x-transformers' ``Attend``): its products and softmax are routed as
    the calls of the attention module that calls it."""

    def forward(self, q, k, v):
        return F.softmax(q @ k.transpose(-1, -2) * 8**-0.5, -1) @ v


class _SelfAttention(nn.Module):  # ("Attention" in its name: the calls in its code, its core's too, are routed)
    def __init__(self, checkpointed: bool):
        super().__init__()
        self.qkv, self.out, self.core, self.checkpointed = nn.Linear(16, 48), nn.Linear(16, 16), _Core(), checkpointed

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)  # [B, H, T, D] each
        y = (torch.utils.checkpoint.checkpoint(self.core, q, k, v, use_reentrant=False) if self.checkpointed
             else self.core(q, k, v))
        return self.out(y.transpose(1, 2).reshape(2, 5, 16))


class _Excluded(nn.Module):
    """A block the user leaves alone (filter_fn) that checkpoints a gated MLP of its own: the calls in the MLP's code
    run as written, as everywhere below a module left alone."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.mlp, self.norm, self.checkpointed = _GatedDropoutMLP(16), nn.LayerNorm(16), checkpointed

    def forward(self, x):
        f = torch.utils.checkpoint.checkpoint(self.mlp, x, use_reentrant=False) if self.checkpointed else self.mlp(x)
        return self.norm(x + f)


class PreNorm(nn.Module):  # (vit-pytorch's and lucidrains' wrapper: "Norm" in its name, a block, not a norm)
    def __init__(self, checkpointed: bool):
        super().__init__()
        self.norm, self.fn, self.checkpointed = nn.LayerNorm(16), _GatedDropoutMLP(16), checkpointed

    def forward(self, x):
        h = self.norm(x)
        return x + (torch.utils.checkpoint.checkpoint(self.fn, h, use_reentrant=False) if self.checkpointed
                    else self.fn(h))


_CALLERS = {"excluded block": _Excluded, "attention": _SelfAttention, "PreNorm": PreNorm}


@pytest.mark.parametrize("caller", list(_CALLERS))
def test_a_checkpointed_module_recomputes_its_calls_as_where_the_forward_called_it(caller):
    # How a call routes depends on where its module was called from: below a module the user left alone (as
    # written), in an attention module's code (routed). A non-reentrant checkpoint's recompute calls the module
    # alone, and routed what the forward had run as written or the reverse: CheckpointError where PyTorch trains.
    # And a block named after the norm it holds (PreNorm) counted as a norm, in whose code products run as written:
    # its checkpointed MLP's product was routed in the recompute only. Checkpointed or not, the same gradients.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _CALLERS[caller](checkpointed=False), nn.Linear(16, 16)).train()
    plain = copy.deepcopy(model)
    slim = slimact.convert(model, "int8", filter_fn=lambda module, name: not isinstance(module, _Excluded))
    x = torch.randn(2, 5, 16)
    y0, g0 = _grads(slim, x)
    slim[1].checkpointed = True
    y1, g1 = _grads(slim, x)
    assert torch.equal(y0, y1)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=0, atol=0, msg=n)
    if caller == "PreNorm":  # it keeps what the same block under another name keeps (its product's fp32 factors)
        plain[1].__class__ = type("Block", (PreNorm,), {})
        renamed = slimact.convert(plain, "int8")
        slim[1].checkpointed = False
        kept = [slimact.profile(m, x.requires_grad_(True)).activation_bytes for m in (slim, renamed)]
        assert kept[0] == kept[1]


#: Calls of an attention written in model code: (positional form, the same call with PyTorch's keyword names).
_BY_KEYWORD = {
    "torch.matmul(q, other=kt)": (torch.matmul, lambda q, kt: torch.matmul(q, other=kt)),
    "torch.matmul(input=q, other=kt)": (torch.matmul, lambda q, kt: torch.matmul(input=q, other=kt)),
    "q.matmul(other=kt)": (torch.matmul, lambda q, kt: q.matmul(other=kt)),
    "torch.bmm(q, mat2=kt)": (lambda q, kt: torch.bmm(q.flatten(0, 1), kt.flatten(0, 1)).view(2, 2, 5, 5),
                              lambda q, kt: torch.bmm(q.flatten(0, 1), mat2=kt.flatten(0, 1)).view(2, 2, 5, 5)),
    "F.softmax(input=s, dim=-1)": (lambda s: F.softmax(s, -1), lambda s: F.softmax(input=s, dim=-1)),
    "F.gelu(input=y)": (F.gelu, lambda y: F.gelu(input=y)),
}


class _KeywordAttention(nn.Module):  # ("Attention" in its name: its products and softmax are routed)
    def __init__(self, form: str, by_keyword: bool) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)
        self.call = _BY_KEYWORD[form][by_keyword]
        self.at = "softmax" if "softmax" in form else "gelu" if "gelu" in form else "scores"

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)  # [B, H, T, D] each
        at = self.at
        scores = (self.call if at == "scores" else torch.matmul)(q, k.transpose(-1, -2)) * 8**-0.5
        probs = (self.call if at == "softmax" else lambda s: F.softmax(s, -1))(scores)
        y = (probs @ v).transpose(1, 2).reshape(2, 5, 16)
        return self.out((self.call if at == "gelu" else F.gelu)(y))


@pytest.mark.parametrize("form", list(_BY_KEYWORD))
def test_calls_made_with_pytorchs_keyword_names_are_routed_as_positional_ones(form):
    # A handler names its parameters otherwise than PyTorch (_matmul(a, b)): torch.matmul(q, other=kt) under "int8"
    # raised "unexpected keyword argument 'other'" where PyTorch ran; a call with keywords only ran as written,
    # keeping plain's bytes.
    x = torch.randn(2, 5, 16)
    kept = {}
    for keyword in (False, True):
        torch.manual_seed(0)
        plain = _KeywordAttention(form, keyword).train()
        report = slimact.check(plain, x, "int8")
        assert report.passed, report
        kept[keyword] = slimact.profile(slimact.convert(copy.deepcopy(plain), "int8"), x).activation_bytes
    assert kept[True] == kept[False]


def test_a_keyword_a_handler_does_not_take_leaves_the_call_as_written():
    from slimact.nn.routing import _as_handler_call

    def handler(a, b, *, out=None):
        return None

    assert _as_handler_call(torch.bmm, handler, (), {"input": 1, "mat2": 2}) == ((1, 2), {})
    assert _as_handler_call(torch.bmm, handler, (1,), {"mat2": 2, "out": 3}) == ((1, 2), {"out": 3})
    assert _as_handler_call(torch.bmm, handler, (1, 2), {"out_dtype": torch.float32}) is None


# Mixture-of-experts layers: transformers' experts (grouped_mm implementation, its default) compute their up and down
# projections with torch._grouped_mm, or its own fallback op where that cannot run; PyTorch keeps both inputs as they
# are (the up projection's: each token's hidden state once per expert it is routed to).
MOE_MODELS = [("mixtral", "MixtralForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM"),
              ("deepseek_v3", "DeepseekV3ForCausalLM")]


def _experts_kept(model, inputs):
    """``(dtype, columns)`` of the 2-d tensors the experts modules keep (their own code's, not their activations')."""
    report = slimact.profile(model, inputs)
    return sorted((str(e.dtype), e.shape[1]) for e in report.entries
                  if e.module.split(".")[-1] == "experts" and len(e.shape) == 2 and e.shape[1] > 1)


@pytest.mark.parametrize("fallback", [False, True], ids=["torch-grouped-mm", "transformers-fallback"])
@pytest.mark.parametrize(("model_type", "cls"), MOE_MODELS, ids=[m for m, _ in MOE_MODELS])
def test_the_experts_grouped_products_keep_their_inputs_at_8_bits(model_type, cls, fallback, monkeypatch):
    from _harness import assert_gradients_close, loss_grads
    from slimact.zoo import build_auto, tiny_config, tiny_inputs

    moe = importlib.import_module("transformers.integrations.moe")
    if fallback:  # (CUDA before sm80, CPU before torch 2.10, compiling in fp32)
        monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *args: False)
    torch.manual_seed(0)
    plain = build_auto(cls, tiny_config(model_type)).train()
    assert plain.config._experts_implementation == "grouped_mm"
    inputs = tiny_inputs(plain, "causal-lm")
    slim = slimact.convert(copy.deepcopy(plain), "int8")
    calls = []
    real = importlib.import_module("slimact.nn.routing").grouped_mm
    monkeypatch.setattr("slimact.nn.routing.grouped_mm", lambda *a: calls.append(a[-1]) or real(*a))
    (loss0, g0), (loss1, g1) = loss_grads(plain, inputs), loss_grads(slim, inputs)
    torch.testing.assert_close(loss1, loss0)
    assert_gradients_close(g0, g1)
    layers = sum(type(m).__name__.endswith("Experts") for m in plain.modules())
    op = moe.torch.ops.transformers.grouped_mm_fallback if fallback else torch._grouped_mm
    assert len(calls) == 2 * layers and all(c is op for c in calls)  # up and down, per layer
    # Per layer plain keeps in fp32 the up projection's input [S, hidden], the down projection's [S, intermediate], the
    # SwiGLU product's other factor [S, intermediate] and the down projection's output (for the routing weights'
    # gradient); converted, all four at 8 bits (the product's factor as before; the down projection's output since
    # the routing weights' product was routed, its router's gradient within 1e-3 of plain's direction).
    experts = next(m for m in plain.modules() if type(m).__name__.endswith("Experts"))
    hidden, inter = plain.config.hidden_size, experts.down_proj.shape[-1]
    f32, u8 = "torch.float32", "torch.uint8"
    assert Counter(_experts_kept(plain, inputs)) == {(f32, hidden): 2 * layers, (f32, inter): 2 * layers}
    kept = {(u8, hidden): 2 * layers, (u8, inter): 2 * layers}
    routers = [n for n in g0 if n.endswith("gate.weight") and "proj" not in n]
    assert len(routers) == layers and all(cosine(g0[n], g1[n]) >= 0.999 for n in routers)
    assert Counter(_experts_kept(slim, inputs)) == kept
    if fallback:  # a whole converted model pickles (the op, which pickle cannot name, by its name) and still routes
        assert Counter(_experts_kept(pickle.loads(pickle.dumps(slim)), inputs)) == kept
