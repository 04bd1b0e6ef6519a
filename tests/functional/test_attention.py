"""Attention: the fused path against F.scaled_dot_product_attention, and the eager softmax-dropout-matmul."""

import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import slimact
import slimact.functional._bernoulli as _bernoulli
import slimact.functional.attention as attention_mod
from _emulated_attention import _Emulated
from _harness import estimates
from slimact._metrics import cosine, sqnr_db
from slimact.functional import scaled_dot_product_attention
from slimact.functional.attention import softmax_dropout_matmul
from slimact.quant import QuantConfig, RunningRange


def _reference(scores, v, p, seed):
    torch.manual_seed(seed)
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(scores.dtype)
    probs = nn.functional.dropout(probs, p, p > 0)
    n_rep = scores.shape[1] // v.shape[1]
    return torch.matmul(probs, v.repeat_interleave(n_rep, dim=1))


def _inputs(h=4, h_kv=4, t=9, s=11, d=8, dtype=torch.float32):
    torch.manual_seed(0)
    scores = (torch.randn(2, h, t, s) * 2).to(dtype).requires_grad_(True)
    v = torch.randn(2, h_kv, s, d).to(dtype).requires_grad_(True)
    return scores, v


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("h_kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_lossless_equals_eager_with_the_same_dropout_draws(p, h_kv):
    scores, v = _inputs(h_kv=h_kv)
    ref = _reference(scores, v, p, seed=3)
    g = torch.randn_like(ref)
    g0 = torch.autograd.grad(ref, (scores, v), g)
    torch.manual_seed(3)
    out = softmax_dropout_matmul(scores, v, p)
    g1 = torch.autograd.grad(out, (scores, v), g)
    torch.testing.assert_close(out, ref)
    for a, e in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_8bit_per_head_gradients(dtype):
    scores, v = _inputs(h_kv=2, dtype=dtype)
    ref = _reference(scores, v, 0.1, seed=4)
    g = torch.randn_like(ref)
    g0 = torch.autograd.grad(ref, (scores, v), g)
    torch.manual_seed(4)
    cfg = QuantConfig(group_dim=1, groups=0)
    out = softmax_dropout_matmul(scores, v, 0.1, cfg, cfg)
    g1 = torch.autograd.grad(out, (scores, v), g)
    assert torch.equal(out, ref) or dtype == torch.bfloat16  # grouped bf16 matmul may round differently
    for a, e in zip(g1, g0, strict=True):
        assert sqnr_db(e, a) >= 30


@pytest.mark.parametrize("cfg", [None, QuantConfig(group_dim=1, groups=0)], ids=["lossless", "8-bit"])
def test_one_query_head_broadcast_over_the_key_value_heads_is_pytorchs_call(cfg):
    # PyTorch broadcasts a single query head over H key/value heads (output [B, H, T, D]); slimact raised "pass
    # enable_gqa=True" (a direct call; a routed one ran as written).
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 5, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 4, 6, 16, generator=g, requires_grad=True) for _ in range(2))
    exact = F.scaled_dot_product_attention(q, k, v)
    out = scaled_dot_product_attention(q, k, v, cfg=cfg)
    assert torch.equal(out, exact) and out.shape == (2, 4, 5, 16)
    grad = torch.randn(out.shape, generator=g)
    for a, e in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(exact, (q, k, v), grad),
                    strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["flash", "chunked"])
@pytest.mark.parametrize("layout", ["heads", "tokens"])  # [B, H, T, D] memory, or [B, T, H, D] seen as heads
def test_8bit_heads_concatenating_parts_of_different_sizes_keep_the_small_parts_gradients(dropout_p, layout,
                                                                                           monkeypatch):
    # Conditional DETR's cross-attention concatenates per head a content part and a position part 100x smaller
    # (its second decoder layer, [q_content, q_sine]), MLA [q_nope, q_pe]. With one scale per head the small part
    # of q and k got a few codes of the large part's step, and the gradients of the other's small part (which reach
    # its projection) were at cosine 0.80 (q) and 0.75 (k) here (0.9999 now); a tiny Conditional DETR's k_pos_proj
    # weight gradient at cosine 0.81.
    g = torch.Generator().manual_seed(0)
    b, h, t, s, d = 2, 4, 24, 40, 32

    def parts(rows):
        large, small = (torch.randn(b, rows, h, d // 2, generator=g) for _ in range(2))
        x = torch.cat([large, 0.01 * small], -1)
        x = x.transpose(1, 2)  # [B, H, T, D] view of [B, T, H, D] memory, as a projection's output split into heads
        return (x.contiguous() if layout == "heads" else x).requires_grad_()

    q, k, v = parts(t), parts(s), parts(s)
    grad = torch.randn(b, h, t, d, generator=g)

    def grads(cfg, dtype=torch.float32):
        torch.manual_seed(1)
        args = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        if cfg is False:
            out = F.scaled_dot_product_attention(*args, dropout_p=dropout_p)
        else:
            out = scaled_dot_product_attention(*args, dropout_p=dropout_p, cfg=cfg)
        return torch.autograd.grad(out, args, grad.to(dtype))

    exact = grads(False, torch.float64)
    approx = grads(PER_HEAD)
    for name, a, e in zip("qkv", approx, exact, strict=True):
        for part, sl in (("large", slice(0, d // 2)), ("small", slice(d // 2, d))):
            assert cosine(e[..., sl], a[..., sl]) >= 0.99, (name, part, cosine(e[..., sl], a[..., sl]))
    # What is packed: q, k as [B, T, H * D] with a group per 16 channels of a head, v per head (its channels are
    # summed over together: blocks would only copy it); under running estimates (Mesa's scheme) one scale per
    # head, as published.
    packs, real = [], attention_mod.pack_many
    monkeypatch.setattr(attention_mod, "pack_many",
                        lambda items, **kw: packs.append([(x.shape, c) for x, c, _ in items]) or real(items, **kw))
    args = [x.detach().requires_grad_() for x in (q, k, v)]
    running = QuantConfig(group_dim=1, groups=0, scale="running")
    scaled_dot_product_attention(*args, dropout_p=dropout_p, cfg=running,
                                 state={n: RunningRange(nn.Module(), f"_{n}") for n in "qkv"}).sum().backward()
    scaled_dot_product_attention(*args, dropout_p=dropout_p, cfg=PER_HEAD).sum().backward()
    assert [c.group_dim for _, c in packs[0]] == [1, 1, 1]  # running: per head
    assert [(shape, c.group_dim, c.groups) for shape, c in packs[1]] == [
        ((b, t, h * d), -1, h * d // 16), ((b, s, h * d), -1, h * d // 16), ((b, h, s, d), 1, 0)]


def test_keeps_probabilities_once_mask_as_bits_and_values_unrepeated():
    scores, v = _inputs(h=8, h_kv=2, t=64, s=64)

    class Wrap(nn.Module):
        def forward(self, s, vv, fused):
            if fused:
                return softmax_dropout_matmul(s, vv, 0.1)
            return _reference(s, vv, 0.1, seed=0)

    fused = slimact.profile(Wrap(), (scores, v, True)).activation_bytes
    plain = slimact.profile(Wrap(), (scores, v, False)).activation_bytes
    tt = 2 * 8 * 64 * 64
    assert fused == tt * 4 + tt // 8 + v.numel() * 4  # P, mask bits, v [B, H_kv, S, D]
    assert plain >= 2 * tt * 4 + v.numel() * 4 * 4  # P, the dropped P (and a mask), v repeated x4


def test_hf_attention_routing_and_revert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    slimact.convert(model, "mesa")  # running estimates: buffers on the attention modules too
    assert model.config._attn_implementation == "slimact"
    assert slimact.summary(model).converted["attention"] == 1
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    slimact.revert(model)
    assert model.config._attn_implementation == "eager"
    assert not any("slimact" in n for m in model.modules() for n in vars(m))
    assert not estimates(model)  # revert drops the running estimates


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_padded_batches_match_eager(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "bert":
        model = transformers.BertModel(transformers.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    else:
        model = transformers.LlamaModel(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    model.config._attn_implementation = "eager"
    ids = torch.randint(1, 64, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    slimact.convert(model, "tempo")
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()])


PER_HEAD = QuantConfig(group_dim=1, groups=0)

CASES = [  # (heads, kv heads, query length, key length, head size, mask)
    (4, 4, 1, 1, 40, "none"),
    (4, 4, 7, 7, 64, "causal"),
    (12, 4, 129, 129, 80, "causal"),  # grouped-query attention
    (4, 4, 7, 9, 40, "bool"),  # padding, with a fully padded row
    (12, 4, 129, 129, 64, "bool"),
    (4, 2, 7, 7, 80, "additive"),
]


def _case(h, h_kv, t, s, d, mask, dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, L, d, generator=gen).to(dtype) for n, L in ((h, t), (h_kv, s), (h_kv, s)))
    kw = {"enable_gqa": h != h_kv}
    if mask == "causal":
        kw["is_causal"] = True
    elif mask == "bool":
        m = torch.rand(2, 1, t, s, generator=gen) > 0.3
        m[1, :, 0, :] = False  # a fully padded row: must give 0, not NaN
        kw["attn_mask"] = m
    elif mask == "additive":
        kw["attn_mask"] = torch.randn(2, 1, 1, s, generator=gen).to(dtype)
    return q, k, v, kw


def _run(fn, q, k, v, g, **kw):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, **kw)
    out.backward(g)
    return out.detach(), (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("cfg", [None, PER_HEAD], ids=["tempo", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_torch(case, dtype, cfg):
    q, k, v, kw = _case(*case, dtype)
    g = torch.randn((*q.shape[:-1], v.shape[-1])).to(dtype)
    out0, g0 = _run(F.scaled_dot_product_attention, q, k, v, g, **kw)
    out1, g1 = _run(lambda *a, **k_: scaled_dot_product_attention(*a, **k_, cfg=cfg), q, k, v, g, **kw)
    assert not any(t.isnan().any() for t in (out1, *g1))
    torch.testing.assert_close(out1, out0)  # the forward is the kernel's own
    if cfg is None:  # lossless: the kernel's own backward on the exact tensors
        for a, e in zip(g1, g0, strict=True):
            torch.testing.assert_close(a, e)
        return
    scale = g0[2].float().norm()  # v's gradient: never zero in exact arithmetic
    for name, a, e in zip("qkv", g1, g0, strict=True):
        if e.float().norm() <= 1e-5 * scale:  # zero in exact arithmetic (softmax over one key): float noise
            assert a.float().norm() <= 1e-3 * scale, name
        else:
            assert sqnr_db(e, a) >= 25, name


@pytest.mark.parametrize("cfg", [None, PER_HEAD], ids=["tempo", "int8"])
def test_dropout_replays_torchs_draws(cfg):
    q, k, v, kw = _case(4, 2, 33, 33, 40, "bool", torch.float32)
    g = torch.randn(q.shape)
    torch.manual_seed(7)
    out0, g0 = _run(F.scaled_dot_product_attention, q, k, v, g, dropout_p=0.2, **kw)
    torch.manual_seed(7)
    out1, g1 = _run(lambda *a, **k_: scaled_dot_product_attention(*a, **k_, cfg=cfg), q, k, v, g,
                    dropout_p=0.2, **kw)
    torch.testing.assert_close(out1, out0)  # the same seed gives the same forward: the same mask
    for a, e in zip(g1, g0, strict=True):
        if cfg is None:
            torch.testing.assert_close(a, e)  # and a backward consistent with it
        else:
            assert sqnr_db(e, a) >= 25


@pytest.mark.parametrize("cfg", [None, PER_HEAD], ids=["tempo", "int8"])
@pytest.mark.parametrize(("p", "dv"), [(0.2, 16), (0.0, 12)], ids=["dropout", "value-heads-of-another-width"])
def test_the_chunked_path_in_bf16_gives_torchs_output_bit_for_bit(p, dv, cfg):
    # The chunked path (taken with dropout, or value heads of another width than the query's) rounded the
    # probabilities to bf16 before the dropout and the product with v; PyTorch's math kernel, which
    # F.scaled_dot_product_attention runs there, keeps them in fp32 and rounds the output once: outputs 1 ulp apart
    # (7.8e-3 at values near 1.7), in a converted model's forward too.
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 24, 16, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(2, 4, 24, dv, generator=gen).bfloat16()
    g = torch.randn(2, 4, 24, dv, generator=gen).bfloat16()
    torch.manual_seed(7)
    out0, g0 = _run(F.scaled_dot_product_attention, q, k, v, g, dropout_p=p, is_causal=True)
    torch.manual_seed(7)
    out1, g1 = _run(lambda *a, **k_: scaled_dot_product_attention(*a, **k_, cfg=cfg), q, k, v, g, dropout_p=p,
                    is_causal=True)
    assert torch.equal(out1, out0)
    for a, e in zip(g1, g0, strict=True):
        if cfg is None:
            torch.testing.assert_close(a, e)
        else:
            assert sqnr_db(e, a) >= 25


_EMPTY = """
import torch, torch.nn.functional as F
from slimact.functional import scaled_dot_product_attention
from slimact.quant import QuantConfig
for b, h, t, s, d in [(2, 4, 0, 7, 8), (2, 4, 5, 0, 8), (2, 0, 5, 7, 8), (2, 4, 5, 7, 0)]:
    for p in (0.0, 0.2):
        for cfg in (None, QuantConfig(group_dim=1, groups=0)):
            grads = []
            for fn in (F.scaled_dot_product_attention, lambda *a, **k: scaled_dot_product_attention(*a, **k, cfg=cfg)):
                q, k, v = (torch.ones(b, h, n, d, requires_grad=True) for n in (t, s, s))
                out = fn(q, k, v, dropout_p=p)
                out.sum().backward()
                grads.append((out, q.grad, k.grad, v.grad))
            for a, e in zip(*grads):
                torch.testing.assert_close(a, e, equal_nan=True)
print("ok")
"""


def test_attention_over_no_query_key_or_head_is_torchs_own():
    # Run apart: before, PyTorch's CPU flash kernel, given no query row, no key row or no head, died of SIGFPE and took
    # the whole process with it (F.scaled_dot_product_attention returns an empty or zero output there); with dropout
    # the chunked path raised (amax over no key, a division by no head), and a head size of 0 failed computing the
    # default scale. Now such calls are PyTorch's own.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _EMPTY], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-2000:])


class _Call(nn.Module):
    def __init__(self, fn, **kw):
        super().__init__()
        self.fn, self.kw = fn, kw

    def forward(self, q, k, v):
        return self.fn(q, k, v, **self.kw)


def test_keeps_no_sequence_by_sequence_tensor_and_0_30x_of_torch():
    t, d = 256, 64
    q, k, v = (torch.randn(2, 8, t, d, requires_grad=True) for _ in range(3))
    mask = torch.rand(2, 1, 1, t) > 0.1
    plain = slimact.profile(_Call(F.scaled_dot_product_attention, is_causal=True), (q, k, v))
    ours = slimact.profile(_Call(scaled_dot_product_attention, is_causal=True, cfg=PER_HEAD), (q, k, v))
    for e in ours.entries:
        assert sum(1 for n in e.shape if n == t) < 2, e  # nothing [.., T, S]
    assert ours.activation_bytes <= 0.30 * plain.activation_bytes
    masked = slimact.profile(_Call(scaled_dot_product_attention, attn_mask=mask, cfg=PER_HEAD), (q, k, v))
    assert all(sum(1 for n in e.shape if n == t) < 2 for e in masked.entries)


def test_argument_errors():
    q = torch.randn(1, 4, 3, 8, requires_grad=True)
    k = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="enable_gqa"):
        scaled_dot_product_attention(q, k, k)
    with pytest.raises(ValueError, match="either attn_mask or is_causal"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool), is_causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask", ["bool", "none"])
def test_one_key_value_head_broadcast_without_enable_gqa_is_pytorchs_forward(mask, dtype):
    # Falcon's multi-query attention calls F.scaled_dot_product_attention with key/value of one head, broadcast,
    # no enable_gqa: PyTorch's CPU call then runs its math kernel. Routed as grouped-query attention, slimact ran the
    # CPU flash kernel (PyTorch's choice with enable_gqa): outputs 3e-7 apart in fp32, 0.008 in bf16 (Falcon's bf16
    # logits 0.004 apart from plain's under "tempo").
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 16, generator=gen).to(dtype)
    k, v = (torch.randn(2, 1, 16, 16, generator=gen).to(dtype) for _ in range(2))
    m = torch.ones(16, 16, dtype=torch.bool).tril().expand(2, 1, 16, 16) if mask == "bool" else None
    g = torch.randn(2, 4, 16, 16, generator=gen).to(dtype)
    out0, g0 = _run(F.scaled_dot_product_attention, q, k, v, g, attn_mask=m)
    out1, g1 = _run(scaled_dot_product_attention, q, k, v, g, attn_mask=m)
    assert torch.equal(out1, out0)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b)

    class MultiQuery(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    slim = slimact.convert(nn.Sequential(MultiQuery()), "tempo")
    out2, _ = _run(slim[0], q, k, v, g)
    assert torch.equal(out2, out0)


@pytest.mark.parametrize("heads", [(1, 4), (4, 1)], ids=["one key head", "one value head"])
@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_key_and_value_broadcast_each_on_its_own_train_as_pytorch(policy, heads):
    # PyTorch broadcasts key and value each on its own: one key head with four value heads is a valid call. Since
    # slimact's attention took one key head as a broadcast (0510484) it ran it, and its backward failed ("shape
    # '[2, 4, 5, 8]' is invalid for input of size 1280") where PyTorch's trains. Such a call is PyTorch's own.
    from slimact.policy import resolve

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=gen)
    k, v = (torch.randn(2, h, 5, 8, generator=gen) for h in heads)
    g = torch.randn(2, 4, 5, 8, generator=gen)
    out0, g0 = _run(F.scaled_dot_product_attention, q, k, v, g)
    out1, g1 = _run(scaled_dot_product_attention, q, k, v, g, cfg=resolve(policy).quant_config("attention", 4))
    assert torch.equal(out1, out0)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_fp16_on_the_cpu_is_pytorchs_forward(policy, mask):
    # fp16 on the CPU took slimact's chunked path, whose output was an fp16 ulp or two (2.4e-4-9.8e-4) from the
    # flash kernel PyTorch's own call runs there: a converted tiny Llama's fp16 logits were 2.4e-4 from plain's
    # under "tempo", whose forward is PyTorch's bit for bit. fp16 runs that kernel as fp32 and bf16 do.
    from slimact.policy import resolve

    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(2, 4, 7, 8, generator=gen).half() for _ in range(4))
    kw = {"is_causal": True} if mask == "causal" else {}
    if mask == "bool":
        kw["attn_mask"] = torch.rand(7, 7, generator=gen) > 0.3
    elif mask == "float":
        kw["attn_mask"] = torch.randn(2, 1, 7, 7, generator=gen).half()
    out0, g0 = _run(F.scaled_dot_product_attention, q, k, v, g, **kw)
    out1, g1 = _run(scaled_dot_product_attention, q, k, v, g, cfg=resolve(policy).quant_config("attention", 4), **kw)
    assert torch.equal(out1, out0)
    if policy == "tempo":
        for a, b in zip(g1, g0, strict=True):
            torch.testing.assert_close(a, b)


MASK_SHAPES = [(1, 4, 9, 9), (2, 4, 9, 9), (4, 9, 9), (2, 1, 1, 9), (9, 9)]


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("cfg", [None, PER_HEAD], ids=["lossless", "8bit"])
def test_a_learned_mask_gets_its_gradient(shape, p, cfg):
    # Swin and T5 add a learned position bias through the mask: it must keep learning, summed over the dims
    # it broadcasts along.
    q, k, v = (torch.randn(2, 4, 9, 16, requires_grad=True) for _ in range(3))
    bias = torch.randn(*shape, requires_grad=True)
    upstream = torch.randn(2, 4, 9, 16)
    grads = []
    for fn, kw in ((F.scaled_dot_product_attention, {}), (scaled_dot_product_attention, {"cfg": cfg})):
        torch.manual_seed(3)
        out = fn(q, k, v, attn_mask=bias * 1.0, dropout_p=p, **kw)
        grads.append(torch.autograd.grad(out, (q, k, v, bias), upstream))
    for name, g0, g1 in zip("qkvm", *grads, strict=True):
        if cfg is None:
            torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-5, msg=name)
        else:
            assert sqnr_db(g0, g1) >= 30, name


@pytest.mark.parametrize("dead_row", [False, True], ids=["bias", "a-fully-masked-row"])
@pytest.mark.parametrize(("shape", "kind", "h_kv"), [((2, 4, 9, 9), "learned", 4), ((4, 9, 9), "learned", 2),
                                                     ((9, 9), "learned", 4), ((4, 9, 9), "fixed", 4),
                                                     ((4, 9, 9), "bool", 4), ((2, 1, 9, 9), "bool", 4)],
                         ids=["learned-4d", "learned-3d-gqa", "learned-2d", "fixed-3d", "bool-3d", "bool-4d"])
@pytest.mark.parametrize("cfg", [None, PER_HEAD], ids=["tempo", "int8"])
def test_a_call_pytorch_runs_through_its_math_kernel_gives_its_output_bit_for_bit(cfg, shape, kind, h_kv, dead_row):
    # PyTorch's CPU call without dropout runs its math kernel for a mask that needs a gradient (a learned
    # relative-position bias written in model code) and for a mask of a shape its flash kernel refuses ([H, T, S]);
    # the chunked blocks and the flash kernel gave outputs an ulp off it (fp32: 1.5e-7). A boolean mask is handed
    # to that kernel as PyTorch's call hands it (as is, it read it otherwise: outputs 1.0 off).
    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 16, requires_grad=True)
    k, v = (torch.randn(2, h_kv, 9, 16, requires_grad=True) for _ in range(2))
    if kind == "bool":
        mask = torch.rand(shape) > 0.3
        mask[..., 3, :] = not dead_row
        mask[..., 0] = True if not dead_row else mask[..., 0]
    else:
        bias = (0.5 * torch.randn(*shape)).requires_grad_(kind == "learned")
        fill = torch.zeros(shape)
        if dead_row:
            fill[..., 3, :] = float("-inf")
        mask = bias + fill
    upstream = torch.randn(2, 4, 9, 16)
    outs, grads = [], []
    for fn, kw in ((F.scaled_dot_product_attention, {}), (scaled_dot_product_attention, {"cfg": cfg})):
        torch.manual_seed(1)
        out = fn(q, k, v, attn_mask=mask, enable_gqa=h_kv != 4, **kw)
        outs.append(out)
        grads.append(torch.autograd.grad(out, (q, k, v, bias) if kind == "learned" else (q, k, v), upstream))
    assert torch.equal(outs[1], outs[0])
    for name, g0, g1 in zip("qkvm", *grads, strict=False):
        if cfg is None:
            torch.testing.assert_close(g1, g0, msg=name)
        else:
            assert sqnr_db(g0, g1) >= 25, name


@pytest.mark.parametrize("shape", [(9, 9), (1, 1, 9, 9), (2, 1, 1, 9), (2, 4, 9, 9)])
@pytest.mark.parametrize("cfg", [None, PER_HEAD], ids=["tempo", "int8"])
def test_an_fp32_mask_with_bf16_inputs_gives_torchs_output_bit_for_bit(cfg, shape):
    # F.scaled_dot_product_attention takes a float32 mask with bf16 q, k, v and its CPU flash kernel reads it as
    # fp32; slimact's CPU flash path cast it to bf16 first (_additive): outputs 1 bf16 ulp off (7.8e-3), gradients
    # within rounding. The mask now reaches the kernel as it is.
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = torch.randn(shape)
    upstream = torch.randn(2, 4, 9, 16, dtype=torch.bfloat16)
    outs, grads = [], []
    for fn, kw in ((F.scaled_dot_product_attention, {}), (scaled_dot_product_attention, {"cfg": cfg})):
        out = fn(q, k, v, attn_mask=mask, **kw)
        outs.append(out)
        grads.append(torch.autograd.grad(out, (q, k, v), upstream))
    assert torch.equal(outs[1], outs[0])
    for name, g0, g1 in zip("qkv", *grads, strict=True):
        if cfg is None:
            torch.testing.assert_close(g1, g0, msg=name)
        else:
            assert sqnr_db(g0.float(), g1.float()) >= 25, name


class _Biased(nn.Module):
    def __init__(self, fn, **kw):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(1, 4, 64, 64))
        self.fn, self.kw = fn, kw

    def forward(self, q, k, v):
        return self.fn(q, k, v, attn_mask=self.bias, **self.kw)


def test_a_learned_mask_keeps_nothing_of_size_t_by_s():
    inputs = tuple(torch.randn(2, 4, 64, 16, requires_grad=True) for _ in range(3))
    plain = slimact.profile(_Biased(F.scaled_dot_product_attention), inputs).activation_bytes
    slim = slimact.profile(_Biased(scaled_dot_product_attention, cfg=PER_HEAD), inputs)
    # The mask is the parameter itself (not counted); q, k, v at 8 bits, nothing [T, S].
    assert all(e.shape[-2:] != (64, 64) for e in slim.entries), slim.entries
    assert slim.activation_bytes <= 0.3 * plain


@pytest.mark.parametrize("cfg", [None, PER_HEAD], ids=["tempo", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transposed_query_key_value_give_torchs_output(dtype, cfg):
    # The CPU flash kernel reads the head dim as contiguous: q, k, v seen through transposed strides (last-dim
    # stride != 1) gave a wrong output, up to 1e33, before they were made contiguous for it. For such strides
    # F.scaled_dot_product_attention itself runs its math kernel, and so does slimact's forward since (its output
    # bit for bit; the flash kernel on contiguous copies rounds otherwise in bf16).
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 5, generator=gen).to(dtype).transpose(-1, -2).contiguous().transpose(-1, -2)
               for _ in range(3))
    assert q.stride(-1) != 1
    g = torch.randn(2, 4, 8, 5, generator=gen).to(dtype)
    out0, g0 = _run(F.scaled_dot_product_attention, q, k, v, g)
    out1, g1 = _run(lambda *a: scaled_dot_product_attention(*a, cfg=cfg), q, k, v, g)
    assert torch.equal(out1, out0)
    for name, a, e in zip("qkv", g1, g0, strict=True):
        if cfg is None:
            torch.testing.assert_close(a, e, msg=name)
        else:
            assert sqnr_db(e, a) >= 25, name


@pytest.mark.parametrize("cfg", [None, QuantConfig(group_dim=1, groups=0)], ids=["lossless", "8-bit"])
@pytest.mark.parametrize("where", ["query", "key of one"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_in_the_query_or_key_reaches_the_output(bad, where, cfg):
    # PyTorch's CPU flash kernel drops NaN from its output where a row's scores are all NaN: a NaN in the query,
    # or in the key of a one-key row (F.scaled_dot_product_attention on CPU does too, torch 2.13). Its math path,
    # and slimact, give NaN in that row. The check makes no isfinite pass: one sum of each (lossless), or the
    # score guard's error, non-finite then (8-bit).
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    s = 1 if where == "key of one" else 4
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, s, 8), torch.randn(1, 2, s, 8)
    (q if where == "query" else k)[0, 1, 0, 3] = bad
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = scaled_dot_product_attention(q.requires_grad_(True), k, v, cfg=cfg)
    whole = {tuple(q.shape), tuple(k.shape)}  # (the packer's own checks read its [groups] ranges)
    assert not [e for e in prof.events() if e.name == "aten::isfinite" and tuple(e.input_shapes[0]) in whole]
    with sdpa_kernel(SDPBackend.MATH):
        exact = F.scaled_dot_product_attention(q.detach().double(), k.double(), v.double())
    assert torch.equal(torch.isfinite(out), torch.isfinite(exact))
    assert not torch.isfinite(out[0, 1, 0]).any()


@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["flash", "chunked"])
def test_masked_keys_stay_masked_when_the_allowed_ones_score_minus_inf(dropout_p):
    # Masked keys took the dtype's minimum added to their score: where every allowed key scored -inf (-inf in k),
    # the masked keys won the softmax, a finite output made of values the mask excluded. Masked is -inf now, as
    # PyTorch converts a boolean mask: such a row has nothing to attend to, and gets 0 (PyTorch's flash kernel).
    q, k, v = torch.rand(1, 1, 3, 4) + 0.5, torch.rand(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    k[0, 0, 1, 2] = -float("inf")  # key 1 scores -inf for every query
    mask = torch.zeros(1, 1, 3, 5, dtype=torch.bool)
    mask[0, 0, 0, 1] = True  # query 0 may see key 1 only
    mask[0, 0, 1:, :] = True
    torch.manual_seed(0)
    out = scaled_dot_product_attention(q.requires_grad_(True), k, v, attn_mask=mask, dropout_p=dropout_p)
    torch.manual_seed(0)
    ref = F.scaled_dot_product_attention(q.detach(), k, v, attn_mask=mask, dropout_p=dropout_p)
    assert torch.equal(out[0, 0, 0], torch.zeros(4)), out[0, 0, 0]
    torch.testing.assert_close(out[0, 0, 1:], ref[0, 0, 1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_a_fully_masked_row_of_an_additive_mask_gives_zero_and_finite_gradients(dtype):
    # A row of -inf only: log-sum-exp -inf made its probabilities exp(-inf - -inf) = NaN in the chunked path,
    # and the NaN reached every key's gradient. PyTorch gives the row 0.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen).to(dtype) for _ in range(3))
    mask = torch.zeros(1, 1, 4, 4, dtype=dtype)
    mask[0, 0, 1] = -float("inf")
    g = torch.randn(1, 2, 4, 8, generator=gen).to(dtype)
    out0, g0 = _run(F.scaled_dot_product_attention, q, k, v, g, attn_mask=mask)
    out1, g1 = _run(scaled_dot_product_attention, q, k, v, g, attn_mask=mask, dropout_p=0.0)
    assert torch.equal(out1[0, :, 1], torch.zeros_like(out1[0, :, 1]))
    for a, e in zip((out1, *g1), (out0, *g0), strict=True):
        assert torch.isfinite(a).all()
        if dtype == torch.float32:  # fp16: PyTorch's math path rounds its intermediates to fp16, this one not
            torch.testing.assert_close(a, e)


@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, -1e9], ids=["finfo-min", "-1e9"])
@pytest.mark.parametrize("h_kv", [4, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("cfg", [None, PER_HEAD], ids=["tempo", "int8"])
def test_a_row_masked_with_a_finite_fill_gets_the_math_paths_gradients(fill, h_kv, cfg):
    # Hugging Face masks with finfo.min: a left-padded row of a causal model (here query rows 0-2 of the second
    # sequence) has every key at the fill, and PyTorch's math path gives it uniform probabilities and their
    # gradient. The CPU flash kernel's backward recomputes them as exp(score - lse) from an fp32 lse of -3.4e38,
    # which kept nothing of log(S): each probability came back 1, not 1/S, and the q, k, v gradients were off by
    # up to S times (Falcon with ALiBi, whose multi-query keys PyTorch runs on the math path: a relative 4 to 11).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=gen)
    k, v = (torch.randn(2, h_kv, 6, 8, generator=gen) for _ in range(2))
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    keep[1, :, :, :3] = False
    mask = torch.zeros(2, 1, 6, 6).masked_fill(~keep, fill)
    g = torch.randn(2, 4, 6, 8, generator=gen)
    with sdpa_kernel([SDPBackend.MATH]):
        out0, g0 = _run(F.scaled_dot_product_attention, q, k, v, g, attn_mask=mask, enable_gqa=h_kv != 4)
    out1, g1 = _run(scaled_dot_product_attention, q, k, v, g, attn_mask=mask, enable_gqa=h_kv != 4, cfg=cfg)
    torch.testing.assert_close(out1, out0)
    for name, a, e in zip("qkv", g1, g0, strict=True):
        if cfg is None:
            torch.testing.assert_close(a, e, msg=lambda m, name=name: f"{name}: {m}")
        else:
            assert cosine(a, e) >= 0.99, name


def test_probabilities_of_tied_keys_with_huge_scores_are_exact():
    # fp16 inputs with outliers: scores of 1e8 in fp32, where exp(s - lse) with lse rounded to fp32's ulp of 8
    # gave two tied keys 0.47 each instead of 0.5 (the output 3250 for 3440). The chunked path now takes
    # exp(s - max) / sum, as torch.softmax does.
    from slimact.functional import scaled_dot_product_attention

    q = torch.full((1, 1, 1, 1), 1e4, dtype=torch.float16)
    k = torch.ones(1, 1, 9, 1, dtype=torch.float16)
    k[..., 3, 0] = k[..., 7, 0] = 1e4
    v = torch.zeros(1, 1, 9, 1, dtype=torch.float16)
    v[..., 7, 0] = 6880
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = scaled_dot_product_attention(q, k, v, scale=1.0)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0))
    assert out.item() == 3440


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_constant_keys_with_dropout_give_a_query_gradient_at_noise_level(dtype):
    # Equal keys: every score is equal, and the query's gradient is zero in exact arithmetic. The chunked
    # backward took rowsum(P * dP) as rowsum(dO * O) from the output rounded to the dtype: a residue of an ulp
    # of O, which the keys multiplied into a q gradient of 1e-3 (PyTorch: 6e-8). From the fp32 rows: noise.
    torch.manual_seed(0)
    q = torch.randn(1, 2, 3, 4).to(dtype).requires_grad_()
    k = torch.full((1, 2, 21, 4), 3.25, dtype=dtype, requires_grad=True)
    v = torch.randn(1, 2, 21, 4).to(dtype).requires_grad_()
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.2)
    out.backward(torch.randn(out.shape).to(dtype))
    assert q.grad.float().norm() <= 1e-3 * v.grad.float().norm()


def test_rows_as_compiled_loops_equal_the_eager_passes(monkeypatch):
    # With dropout, the chunked path computes whole [T, S] grids (the draw is one, as F.dropout's).
    dropout_p = 0.1
    from slimact.quant import inductor

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 256, 32, generator=gen).requires_grad_() for _ in range(3))  # rows of 256 keys
    up = torch.randn(2, 4, 256, 32, generator=gen)
    calls = []
    original = inductor.fused
    monkeypatch.setattr(inductor, "fused", lambda *a: calls.append(r := original(*a)) or r)

    def run():
        torch.manual_seed(7)  # the same dropout draws
        out = scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, cfg=None)
        return out, *torch.autograd.grad(out, (q, k, v), up)

    fused = run()
    assert calls and all(c is not None for c in calls)  # the compiled loops ran (probabilities, backward rows)
    monkeypatch.setattr(inductor, "fused", lambda *a: None)
    eager = run()
    # The same fp32 math; the compiled row sums and exp round differently: float rounding of sums over a row.
    for a, b in zip(fused, eager, strict=True):
        assert (a - b).norm() <= 1e-6 * b.norm()


@pytest.mark.parametrize("bad", ["query", "key", "value"])
def test_a_non_finite_query_key_or_value_keeps_all_three_exact(bad):
    # Which scores are NaN depends on the exact values of all three (-inf * 0 is NaN, -inf times a restored
    # 1e-40 is not): where one must be kept exact, the others are too, and the gradient's NaN are PyTorch's.
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    {"query": q, "key": k, "value": v}[bad][0, 1, 2, 3] = float("-inf")
    report = slimact.profile(_Call(scaled_dot_product_attention, cfg=PER_HEAD),
                             tuple(t.requires_grad_() for t in (q, k, v)))
    exact = [e for e in report.entries if e.shape == tuple(q.shape) and e.dtype == torch.float32]
    assert len(exact) == 3 and all(e.dtype != torch.uint8 for e in report.entries)
    clean = [torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3)]
    assert torch.uint8 in {e.dtype for e in slimact.profile(_Call(scaled_dot_product_attention, cfg=PER_HEAD),
                                                             tuple(clean)).entries}


# ---------------------------------------------------------------------------------------------------------
# PyTorch's fused CUDA kernels: the dispatch and the Function on CPU, with CPU emulations of the CUDA ops
# substituted (same signatures and returns); then the real kernels on a GPU.



@pytest.fixture
def emulated(monkeypatch):
    # (with monkeypatch, not emulated_fused_attention: a test undoes it to see the CPU's own choice)
    emu = _Emulated()
    monkeypatch.setattr(attention_mod, "_fused_device", lambda device: True)
    monkeypatch.setattr(attention_mod, "FUSED_OPS", emu.ops())
    return emu


def _qkv(h=4, h_kv=4, t=24, s=24, d=16, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, n, L, d, generator=gen).to(dtype) for n, L in ((h, t), (h_kv, s), (h_kv, s)))


DISPATCH = [  # (dtype, t, s, d, mask, dropout, expected kind)
    (torch.bfloat16, 24, 24, 16, None, 0.0, "flash"),
    (torch.float16, 24, 24, 16, "causal", 0.1, "flash"),
    (torch.bfloat16, 24, 30, 16, "causal", 0.0, "efficient"),  # flash's causal is bottom-right for T != S
    (torch.float32, 24, 24, 16, None, 0.0, "efficient"),
    (torch.bfloat16, 24, 30, 16, "bool", 0.1, "efficient"),
    (torch.float32, 24, 30, 16, "additive", 0.0, "efficient"),
    (torch.bfloat16, 24, 24, 16, "learned", 0.0, None),
    (torch.bfloat16, 24, 24, 12, None, 0.0, None),  # head size not a multiple of 8
    (torch.bfloat16, 24, 24, 16, "nan", 0.0, None),
    (torch.bfloat16, 24, 24, 16, None, 1.0, None),
    (torch.float64, 24, 24, 16, None, 0.0, None),
]


@pytest.mark.parametrize("case", DISPATCH, ids=lambda c: f"{str(c[0])[6:]}-{c[1]}x{c[2]}-d{c[3]}-{c[4]}-p{c[5]}")
def test_fused_dispatch_picks_the_kernel(case, emulated, monkeypatch):
    dtype, t, s, d, mask, p, expected = case
    q, k, v = _qkv(4, 2, t, s, d, dtype)
    m, causal = None, mask == "causal"
    if mask == "bool":
        m = torch.rand(2, 1, t, s) > 0.3
    elif mask in ("additive", "learned"):
        m = torch.randn(1, 4, t, s).to(dtype).requires_grad_(mask == "learned")
    elif mask == "nan":
        q[0, 1, 2, 3] = float("nan")
    assert attention_mod.fused_kernel(q, k, v, m, p, causal, mask == "learned") == expected
    if expected is None:
        return
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = scaled_dot_product_attention(q, k, v, m, p, causal, enable_gqa=True)
    assert type(out.grad_fn).__name__ == "_FusedAttentionBackward"
    out.float().sum().backward()
    assert [(kind, step) for kind, step, _ in emulated.log] == [(expected, "forward"), (expected, "backward")]
    assert all(info["dtype"] == dtype for _, _, info in emulated.log)  # run in the inputs' dtype, no upcast
    monkeypatch.undo()  # on the CPU itself: never the CUDA kernels
    assert attention_mod.fused_kernel(q.detach(), k, v, m, p, causal, False) is None


@pytest.mark.parametrize("cfg", [None, PER_HEAD], ids=["tempo", "int8"])
def test_a_fused_call_reads_the_host_once_for_the_score_guard_and_the_nan_check(cfg, emulated):
    # On CUDA each host read drains the stream: the score guard's flag and the fused kernels' NaN/inf check of q
    # and k are read together (were two reads), then the pack of q, k, v reads its flags once (int8 only).
    from _host import HostReads

    q, k, v = (x.requires_grad_() for x in _qkv(dtype=torch.bfloat16))
    with HostReads() as reads:
        out = scaled_dot_product_attention(q, k, v, cfg=cfg)
    assert type(out.grad_fn).__name__ == "_FusedAttentionBackward"
    assert reads.count == (1 if cfg is None else 2)
    # The same read still keeps the fused kernels out of a NaN/inf in q or k (int8: read off the guard's error)
    for which, bad in (("q", float("nan")), ("k", float("inf")), ("q", -float("inf")), ("k", float("nan"))):
        q2, k2 = q.detach().clone(), k.detach().clone()
        (q2 if which == "q" else k2)[0, 1, 2, 3] = bad
        out = scaled_dot_product_attention(q2.requires_grad_(), k2, v, cfg=cfg)
        assert type(out.grad_fn).__name__ != "_FusedAttentionBackward", (which, bad)


@pytest.mark.parametrize("dead_row", [False, True], ids=["padding", "a-fully-masked-row"])
@pytest.mark.parametrize("cfg", [None, PER_HEAD], ids=["tempo", "int8"])
def test_a_masked_fused_call_reads_the_host_once_too(cfg, dead_row, emulated):
    # Whether the mask has fully masked rows was a read of its own (two per masked call, three under int8): it is
    # read with the guard's and the NaN/inf check's flags. The rows are still zeroed where there are any.
    from _host import HostReads

    q, k, v = (x.requires_grad_() for x in _qkv(dtype=torch.bfloat16))
    mask = torch.ones(2, 1, 24, 24, dtype=torch.bool)
    mask[:, :, :, 20:] = False  # padded keys
    if dead_row:
        mask[1, :, 5] = False
    with HostReads() as reads:
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask, cfg=cfg)
    assert type(out.grad_fn).__name__ == "_FusedAttentionBackward"
    assert reads.count == (1 if cfg is None else 2)
    ref = F.scaled_dot_product_attention(q.detach().float(), k.float(), v.float(), attn_mask=mask).nan_to_num(0)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(out[1, :, 5] == 0, torch.full_like(out[1, :, 5], dead_row, dtype=torch.bool))


@pytest.mark.parametrize("cfg", [None, PER_HEAD], ids=["tempo", "int8"])
def test_a_row_masked_with_a_finite_fill_keeps_out_of_the_fused_kernels_in_the_same_read(cfg, emulated):
    # The CUDA kernels rebuild probabilities from their log-sum-exp as the CPU flash kernel does (see
    # test_a_row_masked_with_a_finite_fill_gets_the_math_paths_gradients): such a call takes the chunked path. A
    # mask whose rows all keep a key stays fused, the flag read with the others (one read, two under int8).
    from _host import HostReads

    q, k, v = (x.requires_grad_() for x in _qkv(dtype=torch.float32))
    mask = torch.zeros(2, 1, 24, 24)
    mask[:, :, :, 20:] = torch.finfo(torch.float32).min  # padded keys
    for dead in (False, True):
        m = mask.clone()
        if dead:
            m[1, :, 5] = torch.finfo(torch.float32).min
        with HostReads() as reads:
            out = scaled_dot_product_attention(q, k, v, attn_mask=m, cfg=cfg)
        assert (type(out.grad_fn).__name__ == "_FusedAttentionBackward") != dead
        if not dead:
            assert reads.count == (1 if cfg is None else 2)


@pytest.mark.parametrize("cfg", [None, PER_HEAD], ids=["tempo", "int8"])
def test_a_fused_call_launches_few_ops_of_its_own(cfg, emulated):
    # On CUDA each aten op is at least one launch. Outside the pack and the kernels, the fused path's forward runs the
    # NaN/inf check (one fp32 sum of q and of k: 5 ops, was isfinite of both and their all: 12 ops, 8 of them
    # full-size; under int8 read off the score guard's error instead: 2 ops), the score guard (int8: 16 ops, was
    # 24) and their one read; its backward only makes grad_out contiguous.
    import sys

    from _ops import Ops

    def skipped():  # the emulated kernels' own ops, and the pack's (slimact.quant: not this Function's)
        frame = sys._getframe(2)
        while frame is not None and not frame.f_globals.get("__name__", "").startswith("slimact.quant"):
            frame = frame.f_back
        return emulated.inside or frame is not None

    q, k, v = (x.requires_grad_() for x in _qkv(dtype=torch.bfloat16))
    with Ops(skipped) as forward:
        out = scaled_dot_product_attention(q, k, v, is_causal=True, cfg=cfg)
    grad = torch.ones_like(out)
    with Ops(skipped) as backward:
        out.backward(grad)
    assert type(out.grad_fn).__name__ == "_FusedAttentionBackward"
    assert sum(forward.work.values()) <= (6 if cfg is None else 20), forward.work  # were 14 and 38
    assert sum(backward.work.values()) <= 3, backward.work


@pytest.mark.parametrize("case", ["finite", "nan-q", "inf-k", "-inf-q", "inf-q-and--inf-k", "huge"])
def test_the_nan_check_flags_every_non_finite_query_or_key(case):
    # The check sums each in fp32: a NaN/inf makes the total non-finite, also +inf in one and -inf in the other
    # (their sum is NaN). Finite values whose sum overflows fp32 are flagged too: they take the exact chunked path.
    q, k, _ = _qkv(dtype=torch.bfloat16)
    if case == "nan-q":
        q[1, 2, 3, 4] = float("nan")
    elif case == "inf-k":
        k[0, 0, 0, 0] = float("inf")
    elif case == "-inf-q":
        q[0, 3, 1, 2] = -float("inf")
    elif case == "inf-q-and--inf-k":
        q[0, 0, 0, 0], k[1, 1, 1, 1] = float("inf"), -float("inf")
    elif case == "huge":
        q = torch.full_like(q, 3e38)
    assert attention_mod._not_finite(q, k).dim() == 0
    assert bool(attention_mod._not_finite(q, k)) == (case != "finite")


def test_the_device_capability_is_asked_once_per_device(monkeypatch):
    # Asked twice per attention call before (the fused-device and head-size checks), each a Python call into CUDA.
    from unittest import mock

    attention_mod._capability.cache_clear()
    asked = mock.Mock(return_value=(9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", asked)
    try:
        device = torch.device("cuda", 0)
        for _ in range(3):
            assert attention_mod._fused_device(device) and attention_mod._max_head_dim(device) == 256
        assert asked.call_count == 1
    finally:
        attention_mod._capability.cache_clear()


def _exact_grads(q, k, v, g, mask, keep, p, causal):
    """float64 attention (grouped-query by repeating k, v: autograd sums their gradients back) with ``keep``."""
    rep = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    bias, live = attention_mod._additive(mask, torch.float64), 1.0
    if mask is not None:  # a fully masked row gives 0 (PyTorch's convention), and no gradient
        live = mask.any(-1, keepdim=True)
        bias = bias.masked_fill(~live, 0.0)
    ke, ve = kd.repeat_interleave(rep, 1), vd.repeat_interleave(rep, 1)
    out, _ = _Emulated()._attend(qd, ke, ve, bias, p, causal, q.shape[-1] ** -0.5, keep)
    out = out * live
    gq, gk, gv = torch.autograd.grad(out, (qd, ke, ve), g.double())
    # the gradients of the repeated heads, each rounded to the dtype (as the kernels return them), summed over
    # each group's repeats
    gk, gv = (x.to(q.dtype).unflatten(1, (-1, rep)).sum(2) for x in (gk, gv))
    return out, (gq, gk, gv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("h_kv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_fused_tempo_backward_gets_the_forwards_output_lse_and_seed(dtype, h_kv, p, emulated):
    q, k, v = _qkv(4, h_kv, 24, 30, 16, dtype)
    mask = torch.rand(2, 1, 24, 30, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[1, :, 3] = False  # a fully masked row: 0 out, and no gradient through it
    g = torch.randn(2, 4, 24, 16).to(dtype)
    out, grads = _run(lambda *a: scaled_dot_product_attention(*a, attn_mask=mask, dropout_p=p, enable_gqa=True,
                                                                cfg=None), q, k, v, g)
    (kind, _, fwd), (_, _, bwd) = emulated.log
    assert kind == "efficient" and [step for _, step, _ in emulated.log] == ["forward", "backward"]  # no recompute
    assert bwd["seed"] == fwd["seed"]  # the kernel's seed and offset, handed on
    assert bwd["out"].data_ptr() == out.data_ptr() and torch.equal(bwd["out"], out)  # the kept output
    assert bwd["lse"].data_ptr() == fwd["lse"].data_ptr()
    assert torch.equal(out[1, :, 3], torch.zeros_like(out[1, :, 3]))
    keep = emulated.masks[fwd["seed"]]
    exact_out, exact = _exact_grads(q, k, v, g, mask, keep, p, False)
    torch.testing.assert_close(out, exact_out.to(dtype))
    # GQA: each kv head's gradient is the sum over its query heads (rounded once, to the dtype)
    for name, a, e in zip("qkv", grads, exact, strict=True):
        torch.testing.assert_close(a, e.to(dtype), msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fused_int8_recomputes_under_the_forwards_rng_state(dtype, emulated):
    q, k, v = _qkv(4, 2, 32, 32, 16, dtype)
    g = torch.randn(2, 4, 32, 16).to(dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.manual_seed(5)
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True, enable_gqa=True, cfg=PER_HEAD)
    torch.rand(100)  # the generator moves on between forward and backward
    state = torch.get_rng_state()
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert torch.equal(torch.get_rng_state(), state)  # the replay forks the generator: it is left as it was
    steps = [step for _, step, _ in emulated.log]
    assert steps == ["forward", "forward", "backward"]  # the backward's own forward: out, lse of restored q, k, v
    fwd, again, bwd = (info for _, _, info in emulated.log)
    assert torch.equal(emulated.masks[fwd["seed"]], emulated.masks[again["seed"]])  # the same dropout draws
    assert bwd["seed"] == again["seed"]  # the recompute's output, lse and seed (checked consistent by the emulation)
    _, exact = _exact_grads(q, k, v, g, None, emulated.masks[fwd["seed"]], 0.1, True)
    for name, a, e in zip("qkv", grads, exact, strict=True):
        assert sqnr_db(e, a) >= 25 and cosine(e, a) >= 0.99, name


class _Allocations(TorchDispatchMode):
    """The shapes and dtypes of the new tensors ops make (views left out), outside the emulated kernels."""

    def __init__(self, emu):
        super().__init__()
        self.emu, self.made = emu, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.emu.inside and not any(r.alias_info is not None for r in func._schema.returns):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, Tensor):
                    self.made.append((func, tuple(t.shape), t.dtype))
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("cfg", [None, PER_HEAD], ids=["tempo", "int8"])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_fused_forward_makes_no_fp32_sequence_by_sequence_tensor(dtype, cfg, p, emulated):
    t, s = 40, 56
    q, k, v = (x.requires_grad_() for x in _qkv(4, 2, t, s, 16, dtype))
    mask = torch.rand(2, 1, t, s) > 0.2
    for kw in ({}, {"attn_mask": mask}):
        with _Allocations(emulated) as mode:
            scaled_dot_product_attention(q, k, v, dropout_p=p, enable_gqa=True, cfg=cfg, **kw)
        assert emulated.log and emulated.log[-1][1] == "forward"
        ts = [(f, sh, dt) for f, sh, dt in mode.made if len(sh) >= 2 and sh[-2] == t and sh[-1] in (s, 64)]
        scores = [x for x in ts if math.prod(x[1]) >= 2 * 4 * t * s]  # [B, H, T, S]: never, in any dtype
        assert not scores, scores
        if dtype != torch.float32:  # an fp32 input's bias is fp32 [B, 1, T, S], as PyTorch's own
            assert not [x for x in ts if x[2] == torch.float32], ts
        else:
            assert all(sh[1] == 1 for _, sh, _ in ts if len(sh) == 4), ts  # the bias only, per batch


# ---- on a GPU: the real kernels

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GPU_CASES = [  # (heads, kv heads, query length, key length, head size, mask)
    (4, 4, 64, 64, 64, "none"),
    (4, 4, 64, 64, 64, "causal"),
    (8, 2, 96, 96, 64, "causal"),  # grouped-query attention
    (8, 2, 40, 50, 128, "none"),
    (4, 4, 40, 50, 64, "bool"),  # keys not a multiple of the bias alignment
    (8, 2, 33, 70, 32, "bool"),
]


def _gpu_case(h, h_kv, t, s, d, mask, dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, L, d, generator=gen).to(dtype).cuda() for n, L in ((h, t), (h_kv, s), (h_kv, s)))
    kw = {"enable_gqa": h != h_kv, "is_causal": mask == "causal"}
    if mask == "bool":
        m = torch.rand(2, 1, t, s, generator=gen) > 0.3
        m[..., 0] = True  # no fully masked row here (see the test of those)
        kw["attn_mask"] = m.cuda()
    return q, k, v, kw


def _same_kernel(kind):
    """``F.scaled_dot_product_attention`` made to run ``kind``'s kernel on k, v repeated to the query's heads, the
    repeats' gradients summed back (one sum over each group, as slimact reduces them): the computation slimact's
    tempo path makes. Called as :func:`_run` calls its ``fn``, it returns the output and the three gradients."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if kind == "flash" else SDPBackend.EFFICIENT_ATTENTION

    def run(q, k, v, g, enable_gqa=False, **kw):
        rep = q.shape[1] // k.shape[1]
        q = q.detach().clone().requires_grad_(True)
        ke, ve = (t.detach().repeat_interleave(rep, 1).requires_grad_(True) for t in (k, v))
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, ke, ve, **kw)
        out.backward(g)
        return out.detach(), (q.grad, *(t.grad.unflatten(1, (-1, rep)).sum(2) for t in (ke, ve)))

    return run


def _normwise_error(a, e):
    return (a.double() - e.double()).norm().item()


@cuda
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_tempo_equals_torch(case, dtype, p):
    q, k, v, kw = _gpu_case(*case, dtype)
    kind = attention_mod.fused_kernel(q, k, v, kw.get("attn_mask"), p, kw["is_causal"], False)
    flash = dtype != torch.float32 and "attn_mask" not in kw and (case[2] == case[3] or not kw["is_causal"])
    assert kind == ("flash" if flash else "efficient")
    g = torch.randn((*q.shape[:-1], v.shape[-1]), device="cuda").to(dtype)
    torch.manual_seed(11)  # the same generator state: the same Philox seed and offset, the same dropout mask
    out0, g0 = _same_kernel(kind)(q, k, v, g, dropout_p=p, **kw)
    torch.manual_seed(11)
    out1, g1 = _run(lambda *a, **k_: scaled_dot_product_attention(*a, **k_, cfg=None), q, k, v, g, dropout_p=p, **kw)
    torch.testing.assert_close(out1, out0)
    for name, a, e in zip("qkv", g1, g0, strict=True):
        torch.testing.assert_close(a, e, msg=name)
    if p == 0:  # and F.scaled_dot_product_attention as it dispatches itself: as near the exact gradient
        _, g2 = _run(F.scaled_dot_product_attention, q, k, v, g, **kw)
        _, exact = _run(F.scaled_dot_product_attention, *(t.double() for t in (q, k, v)), g.double(), **kw)
        for name, a, e, x in zip("qkv", g1, g2, exact, strict=True):
            slack = (1e-5 if dtype == torch.float32 else 1e-6) * x.norm().item()
            assert _normwise_error(a, x) <= 2 * _normwise_error(e, x) + slack, name


@cuda
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_int8_gradients(case, dtype, p):
    q, k, v, kw = _gpu_case(*case, dtype)
    kind = attention_mod.fused_kernel(q, k, v, kw.get("attn_mask"), p, kw["is_causal"], False)
    g = torch.randn((*q.shape[:-1], v.shape[-1]), device="cuda").to(dtype)
    torch.manual_seed(12)
    out0, g0 = _same_kernel(kind)(q, k, v, g, dropout_p=p, **kw)
    torch.manual_seed(12)
    out1, g1 = _run(lambda *a, **k_: scaled_dot_product_attention(*a, **k_, cfg=PER_HEAD), q, k, v, g,
                    dropout_p=p, **kw)
    torch.testing.assert_close(out1, out0)  # the forward is the kernel's own, dropout mask included
    for name, a, e in zip("qkv", g1, g0, strict=True):
        # a backward replaying another mask would be noise here (SQNR near 0 dB)
        assert sqnr_db(e, a) >= 25 and cosine(e, a) >= 0.99, (name, sqnr_db(e, a), cosine(e, a))


@cuda
@pytest.mark.parametrize("cfg", [None, PER_HEAD], ids=["tempo", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_fully_masked_rows_give_zero_and_finite_gradients(dtype, cfg):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 20, 32, generator=gen).to(dtype).cuda() for _ in range(3))
    mask = (torch.rand(2, 1, 20, 20, generator=gen) > 0.3).cuda()
    mask[1, :, 5] = False
    g = torch.randn(2, 4, 20, 32, generator=gen).to(dtype).cuda()
    out, grads = _run(lambda *a: scaled_dot_product_attention(*a, attn_mask=mask, cfg=cfg), q, k, v, g)
    assert torch.equal(out[1, :, 5], torch.zeros_like(out[1, :, 5]))
    assert all(torch.isfinite(t).all() for t in (out, *grads))
    _, exact = _run(lambda *a: scaled_dot_product_attention(*a, attn_mask=mask.cpu(), cfg=None),
                    *(t.double().cpu() for t in (q, k, v)), g.double().cpu())  # CPU chunked float64
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for name, a, e in zip("qkv", grads, exact, strict=True):
        if cfg is None:
            assert _normwise_error(a.cpu(), e) <= tol * e.norm().item(), name
        else:
            assert sqnr_db(e, a.cpu().double()) >= 25 and cosine(e, a.cpu().double()) >= 0.99, name


@cuda
def test_cuda_keeps_no_sequence_by_sequence_tensor():
    t = 256
    q, k, v = (torch.randn(2, 8, t, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1, cfg=PER_HEAD)
    assert type(out.grad_fn).__name__ == "_FusedAttentionBackward"
    for cfg in (None, PER_HEAD):
        report = slimact.profile(_Call(scaled_dot_product_attention, is_causal=True, dropout_p=0.1, cfg=cfg),
                                 (q, k, v))
        assert all(sum(1 for n in e.shape if n == t) < 2 for e in report.entries), report.entries


@pytest.mark.parametrize("threads", [(1, 2), (2, 1), (2, 2)], ids=lambda t: f"fwd{t[0]}-bwd{t[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_backward_redraws_native_dropouts_mask_bit_for_bit(dtype, threads):
    # The CPU's native_dropout draws its mask with bernoulli_ on a tensor of the input's dtype; the chunked
    # backward redraws it straight into a uint8 tensor, on a generator of its own: the same mask element for
    # element (the draw does not depend on the dtype, nor on the thread count), and the default generator
    # advanced by the forward's draw exactly as native_dropout advances it, untouched by the replay.
    before = torch.get_num_threads()
    x = torch.rand(3, 5, 67, 129).to(dtype)
    try:
        torch.set_num_threads(threads[0])
        torch.manual_seed(11)
        state = attention_mod._rng_state(x.device)
        _, mask = torch.native_dropout(x, 0.15, True)
        after = torch.get_rng_state()
        torch.set_rng_state(state)
        keep = torch.empty(x.shape, dtype=torch.uint8).bernoulli_(0.85)  # the forward's fp32 draw
        assert torch.equal(torch.get_rng_state(), after)
        assert torch.equal(keep.bool(), mask)
        torch.set_num_threads(threads[1])
        replayed = attention_mod._replayed_mask(state, tuple(x.shape), dtype, 0.15, x.device)
        assert torch.equal(torch.get_rng_state(), after)
    finally:
        torch.set_num_threads(before)
    assert replayed.dtype == torch.uint8 and torch.equal(replayed.bool(), mask)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_chunked_dropout_in_the_probabilities_loop_equals_native_dropouts(compiled, monkeypatch):
    # The fp32 CPU forward draws the mask into a bool tensor and multiplies it in the probabilities' own loop:
    # the same output bit for bit as softmax then native_dropout, and the same gradients (backward: the mask
    # redrawn into bool, multiplied in the rows' loop, against native_dropout's mask replayed on ones).
    from slimact.quant import inductor

    if not compiled:
        monkeypatch.setattr(inductor, "fused", lambda *a: None)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 256, 32, generator=gen).requires_grad_() for _ in range(3))
    up = torch.randn(2, 4, 256, 32, generator=gen)

    def run():
        torch.manual_seed(7)
        out = scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True, cfg=None)
        return out, *torch.autograd.grad(out, (q, k, v), up), torch.get_rng_state()

    fused = run()
    monkeypatch.setattr(attention_mod, "_bool_draw", lambda device, p: False)
    reference = run()
    for a, b in zip(fused, reference, strict=True):
        assert torch.equal(a, b)


def test_chunked_dropout_makes_no_elementwise_pass_over_the_scores_outside_its_loops(monkeypatch):
    # Per forward + backward of the fp32 CPU chunked path with dropout: one draw each way (uint8, by slimact's
    # bernoulli_ kernel where it is available: no aten bernoulli_ then), and no eager
    # multiply or masking over a [B, H, T, S] tensor: the scale goes on q before the product, the causal mask and
    # the dropout's mask and factor into the compiled rows (before: native_dropout's two multiplies, the scores'
    # scaling and causal masking both ways, and the redrawn fp32 noise's multiply by 1 / (1 - p)).
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 256, 32, generator=gen).requires_grad_() for _ in range(3))
    up = torch.randn(2, 4, 256, 32, generator=gen)
    scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True).backward(up)  # compiles the loops
    draws = []

    def spy(out, p, generator=None):
        draws.append(out.shape)
        return _bernoulli.bernoulli_(out, p, generator)

    monkeypatch.setattr(attention_mod, "bernoulli_", spy)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True).backward(up)
    grid = {(2, 4, 256, 256), (2, 4, 1, 256, 256)}
    events = prof.events()
    assert draws == [(2, 4, 256, 256)] * 2
    assert sum(e.name == "aten::bernoulli_" for e in events) == (0 if _bernoulli._load() else 2)
    passes = [e.name for e in events if e.name in ("aten::mul", "aten::mul_", "aten::div", "aten::div_",
                                                   "aten::masked_fill", "aten::masked_fill_")
              and any(tuple(s) in grid for s in e.input_shapes if s)]
    assert not passes, passes


@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_the_backward_rows_are_written_over_the_blocks_scores_and_dp(dropout_p, monkeypatch):
    # The backward's row loop writes D over the block's scores and dS over its dP (neither is read again): two
    # [B, H, rows, S] fp32 tensors fewer alive at the backward's high-water mark (GPT-2 4 x 256: 6 MiB a layer,
    # its step peak 212.1 -> 188.1 MiB under "int8"). Gradients as before (the other tests of this file).
    seen = []
    original = attention_mod._fused_rows

    def spy(fn, scores, *args):
        out = original(fn, scores, *args)
        if fn.__name__.startswith("_rows_backward"):
            seen.append((out[0].data_ptr() == scores.data_ptr(), out[1].data_ptr() == args[1].data_ptr()))
        return out

    monkeypatch.setattr(attention_mod, "_fused_rows", spy)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 256, 32, generator=gen).requires_grad_() for _ in range(3))
    out = attention_mod._ChunkedAttention.apply(q, k, v, None, True, 32**-0.5, dropout_p, None, None, None)
    out.backward(torch.randn(out.shape, generator=gen))
    assert seen == [(True, True)]


def test_a_single_head_batch_of_one_leaves_the_causal_rows_compiled_for_other_shapes(monkeypatch):
    # torch 2.13's CPU codegen fails on the causal rows' in-place loop for [1, 1, rows, S] blocks (KeyError 'buf1';
    # dynamic sizes are specialised on 1). That failure turned the loop off for every later shape of the process
    # (a RuntimeWarning, ~15 eager passes a block); now it turns off that specialisation only: a batch of two
    # after it still runs the compiled loop. The gradients are the eager rows' either way.
    from slimact.quant import inductor

    monkeypatch.setattr(inductor, "_failed", {})
    monkeypatch.setattr(inductor, "_failed_somewhere", set())
    compiled = []
    original = inductor.fused
    monkeypatch.setattr(inductor, "fused", lambda fn, key, *args: (
        out := original(fn, key, *args), compiled.append((fn.__name__, args[0].shape[0], out is not None)))[0])
    gen = torch.Generator().manual_seed(6)
    for batch in (1, 2):
        q, k, v, up = (torch.randn(batch, 1, 1024, 16, generator=gen) for _ in range(4))
        grads = []
        for fused in (True, False):
            with monkeypatch.context() as m:
                if not fused:
                    m.setattr(inductor, "pays_off", lambda t: False)
                ins = [t.clone().requires_grad_() for t in (q, k, v)]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # (the batch of one's, where torch fails)
                    out = attention_mod._ChunkedAttention.apply(*ins, None, True, 16**-0.5, 0.0, None, None, None)
                    out.backward(up)
            grads.append([t.grad for t in ins])
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b)
    rows = [(b, ok) for name, b, ok in compiled if name == "_rows_backward_in_place"]
    assert {b for b, _ in rows} == {1, 2} and all(ok for b, ok in rows if b == 2)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "learned-mask"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_the_backward_rows_of_a_non_causal_block_compile(dropout_p, masked, kv_heads, monkeypatch):
    # Without a causal limit, writing D over the scores in the rows' compiled loop failed to compile (torch 2.13's
    # inductor CPU codegen: KeyError 'buf1'), which left the loop eager for the process with a RuntimeWarning
    # (BERT, T5, Swin). Such rows write dS over dP only; the gradients are those of the eager rows.
    from slimact.quant import inductor

    monkeypatch.setattr(inductor, "_failed", {})
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 300, 32, generator=gen)
    k, v = (torch.randn(2, kv_heads, 300, 32, generator=gen) for _ in range(2))
    mask = torch.randn(1, 4, 300, 300, generator=gen) if masked else None
    up = torch.randn(2, 4, 300, 32, generator=gen)
    grads = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(inductor, "pays_off", lambda t: False)
        ins = [t.clone().requires_grad_() for t in (q, k, v)] + ([mask.clone().requires_grad_()] if masked else [None])
        torch.manual_seed(5)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="slimact: a compiled loop is unavailable")
            out = attention_mod._ChunkedAttention.apply(*ins, False, 32**-0.5, dropout_p, None, None, None)
            out.backward(up)
        grads.append([t.grad for t in ins if t is not None])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cfg", [None, QuantConfig(group_dim=1, groups=0)], ids=["lossless", "8bit"])
def test_value_heads_of_another_width_than_query_and_key_heads_on_the_cpu(cfg):
    # GLM-5 Next's attention: queries and keys of 8 (no rotary part), values of 16. PyTorch's CPU flash kernel
    # takes one head width only (F.scaled_dot_product_attention picks its math kernel here): slimact's CPU flash
    # path raised "Q/K/V should have the same head size".
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 16, 8, generator=gen).requires_grad_(True) for _ in range(2))
    v = torch.randn(2, 4, 16, 16, generator=gen).requires_grad_(True)
    g = torch.randn(2, 4, 16, 16, generator=gen)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    g0 = torch.autograd.grad(ref, (q, k, v), g)
    out = scaled_dot_product_attention(q, k, v, is_causal=True, cfg=cfg)
    g1 = torch.autograd.grad(out, (q, k, v), g)
    torch.testing.assert_close(out, ref)
    for a, e in zip(g1, g0, strict=True):
        if cfg is None:
            torch.testing.assert_close(a, e)
        else:
            assert cosine(a, e) >= 0.99


# ---------------------------------------------------------------------------------------------------------
# Attention sinks (gpt-oss's): one learned logit per query head joins every row's softmax and meets no value.


def _sinks_reference(q, k, v, mask, causal, scale, sinks, keep=None, p=0.0):
    """``softmax(cat([s, sink]))[..., :-1] @ v`` in float64, as gpt-oss's eager attention computes it; ``keep``: a
    dropout mask over the probabilities (their sink column dropped first)."""
    rep = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(rep, 1) for t in (k, v))
    s = q.double() @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    sink = sinks.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    probs = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    if keep is not None:
        probs = probs * keep / (1 - p)
    return probs @ v


def _sinks_case(mask, dtype=torch.float32, h=4, h_kv=2, t=9, d=16):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, t, d, generator=gen).to(dtype).requires_grad_() for n in (h, h_kv, h_kv))
    sinks = (torch.randn(h, generator=gen) * 2).requires_grad_()
    m = None
    if mask in ("bool", "dead"):
        m = torch.rand(2, 1, t, t, generator=gen) > 0.3
        m[..., 0] = True
        if mask == "dead":
            m[0, 0, 3] = False  # a query row allowed nothing: 0 out, no gradient, as without sinks
    elif mask == "additive":
        m = torch.randn(2, 1, t, t, generator=gen)
    elif mask == "learned":  # (a mask that needs a gradient: the chunked path)
        m = torch.randn(1, h, t, t, generator=gen).requires_grad_()
    g = torch.randn(2, h, t, d, generator=gen).to(dtype)
    return q, k, v, sinks, m, g


SINK_MASKS = ["none", "causal", "bool", "dead", "additive", "learned"]


@pytest.mark.parametrize("fused", [False, True], ids=["cpu", "emulated-cuda"])
@pytest.mark.parametrize("mask", SINK_MASKS)
def test_attention_sinks_under_a_lossless_policy_are_the_eager_attentions(mask, fused, monkeypatch):
    # Each path (PyTorch's CPU flash kernel; the chunked path, for the learned mask; the fused CUDA kernels, emulated)
    # rescales its output by sigmoid(lse - sink) and hands its backward the rescaled output and lse (the kernels
    # recompute the probabilities from them), or adds the sink to each row's sum: the eager attention's output and
    # the gradients of q, k, v, the sinks (and a learned mask), to fp32 rounding.
    if fused:
        emu = _Emulated()
        monkeypatch.setattr(attention_mod, "_fused_device", lambda device: True)
        monkeypatch.setattr(attention_mod, "FUSED_OPS", emu.ops())
    q, k, v, sinks, m, g = _sinks_case(mask)
    causal = mask == "causal"
    out = scaled_dot_product_attention(q, k, v, m, 0.0, causal, 0.3, True, sinks=sinks)
    inputs = (q, k, v, sinks) + ((m,) if mask == "learned" else ())
    grads = torch.autograd.grad(out, inputs, g)
    ref = _sinks_reference(q, k, v, m, causal, 0.3, sinks)
    want = torch.autograd.grad(ref, inputs, g.double())
    if fused and mask != "learned":
        assert {step for _, step, _ in emu.log} == {"forward", "backward"}
    torch.testing.assert_close(out, ref.float())
    for name, a, e in zip(["q", "k", "v", "sinks", "mask"], grads, want, strict=False):
        torch.testing.assert_close(a, e.float(), msg=name)
    assert sinks.grad is None and grads[3].abs().sum() > 0


@pytest.mark.parametrize("fused", [False, True], ids=["cpu", "emulated-cuda"])
@pytest.mark.parametrize("mask", ["causal", "bool"])
def test_attention_sinks_at_8_bits_keep_every_gradient(mask, fused, monkeypatch):
    if fused:
        monkeypatch.setattr(attention_mod, "_fused_device", lambda device: True)
        monkeypatch.setattr(attention_mod, "FUSED_OPS", _Emulated().ops())
    q, k, v, sinks, m, g = _sinks_case(mask)
    out = scaled_dot_product_attention(q, k, v, m, 0.0, mask == "causal", 0.3, True, cfg=PER_HEAD, sinks=sinks)
    grads = torch.autograd.grad(out, (q, k, v, sinks), g)
    ref = _sinks_reference(q, k, v, m, mask == "causal", 0.3, sinks)
    want = torch.autograd.grad(ref, (q, k, v, sinks), g.double())
    torch.testing.assert_close(out, ref.float())  # the forward is exact
    for name, a, e in zip("qkvs", grads, want, strict=True):
        assert sqnr_db(e.float(), a) >= 25, name


@pytest.mark.parametrize("h_kv", [4, 2])
def test_attention_sinks_with_dropout_replay_the_eager_draws(h_kv):
    # The chunked path (dropout on the CPU) draws native_dropout's mask over [B, H, T, S] as eager F.dropout does over
    # the probabilities with their sink column dropped: with the same generator state, the same output and gradients.
    q, k, v, sinks, _, g = _sinks_case("none", h_kv=h_kv)
    torch.manual_seed(7)
    out = scaled_dot_product_attention(q, k, v, None, 0.2, True, 0.3, True, sinks=sinks)
    grads = torch.autograd.grad(out, (q, k, v, sinks), g)
    torch.manual_seed(7)
    ref = attention_mod._attention(q, k, v, None, 0.2, True, 0.3, True, sinks)
    want = torch.autograd.grad(ref, (q, k, v, sinks), g)
    torch.testing.assert_close(out, ref)
    for name, a, e in zip("qkvs", grads, want, strict=True):
        torch.testing.assert_close(a, e, msg=name)


def test_attention_sinks_with_dropout_on_the_fused_kernels_use_their_draws(emulated):
    q, k, v, sinks, _, g = _sinks_case("none", dtype=torch.bfloat16)
    out = scaled_dot_product_attention(q, k, v, None, 0.2, False, 0.3, True, sinks=sinks)
    grads = torch.autograd.grad(out, (q, k, v, sinks), g)
    keep = emulated.masks[0]  # the forward kernel's draw, which its backward replayed
    assert [step for _, step, _ in emulated.log] == ["forward", "backward"]
    ref = _sinks_reference(q, k, v, None, False, 0.3, sinks, keep, 0.2)
    want = torch.autograd.grad(ref, (q, k, v, sinks), g.double())
    torch.testing.assert_close(out, ref.to(out.dtype))
    for name, a, e in zip("qkvs", grads, want, strict=True):
        assert cosine(e.float(), a.float()) >= 0.999, name


def test_attention_sinks_where_nothing_needs_a_gradient_are_the_eager_attentions():
    q, k, v, sinks, m, _ = _sinks_case("bool")
    with torch.no_grad():
        out = scaled_dot_product_attention(q, k, v, m, 0.0, False, 0.3, True, sinks=sinks)
    torch.testing.assert_close(out, _sinks_reference(q, k, v, m, False, 0.3, sinks).float())
    with pytest.raises(ValueError, match=r"sinks must be one floating-point logit per query head, shape \(4,\)"):
        scaled_dot_product_attention(q, k, v, m, enable_gqa=True, sinks=torch.zeros(2))


# What is kept of a mask: bits for a boolean one and for an additive one of 0 and one fill value (transformers' eager
# masks), restored exactly; a broadcast one by its own elements; the same bits for every call of one forward handed
# the same mask (a view of it). Before, an additive mask was kept in full and a boolean one's bits once per layer.
MASKS = ["bool", "finfo.min", "-inf", "zeros", "expanded bool", "expanded additive"]


def _kept_mask_case(kind, t=24, s=24):
    keep = torch.ones(2, 1, t, s, dtype=torch.bool)
    keep[0, :, :, 20:] = False  # padded keys
    if kind in ("bool", "-inf", "expanded bool"):  # a fully masked row (with a finite fill: the chunked path)
        keep[1, :, 3, :] = False
    if kind.startswith("expanded"):
        keep = keep[:1].expand(2, 4, t, s)  # [1, 1, T, S] broadcast to [B, H, T, S]: stride 0
    if kind.endswith("bool"):
        return keep
    fill = {"finfo.min": torch.finfo(torch.float32).min, "-inf": -math.inf, "zeros": 0.0}.get(kind, -1e9)
    mask = torch.zeros(keep[:1, :1].shape if kind.startswith("expanded") else keep.shape)
    mask = mask.masked_fill(~(keep[:1, :1] if kind.startswith("expanded") else keep), fill)
    return mask.expand(2, 4, t, s) if kind.startswith("expanded") else mask


def _saved(out):
    return [x for x in out.grad_fn.saved_tensors if x is not None]


@pytest.mark.parametrize("path", ["flash", "chunked", "fused"])
@pytest.mark.parametrize("kind", MASKS)
def test_a_mask_kept_as_bits_gives_the_gradients_of_the_mask_kept_as_is(kind, path, monkeypatch, request):
    if path == "fused":
        request.getfixturevalue("emulated")
    p = 0.1 if path == "chunked" else 0.0  # (CPU attention with dropout: the chunked path)
    mask = _kept_mask_case(kind)
    q, k, v = (x.requires_grad_() for x in _qkv(dtype=torch.float32))
    g = torch.randn(2, 4, 24, 16, generator=torch.Generator().manual_seed(1))

    def run():
        torch.manual_seed(5)
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return out, _saved(out), torch.autograd.grad(out, (q, k, v), g)

    out, saved, grads = run()
    name = {"flash": "_FlashAttentionCPUBackward", "chunked": "_ChunkedAttentionBackward"}.get(path, "_FusedAttention")
    assert type(out.grad_fn).__name__.startswith(name)
    own = 24 * 24 * (1 if kind.startswith("expanded") else 2)
    assert [x.numel() for x in saved if x.dtype == torch.uint8].count(own // 8) == 1  # (and the chunked path's RNG)
    assert not [x for x in saved if x.shape[-2:] == (24, 24)]
    monkeypatch.setattr(attention_mod, "_mask_bits", lambda mask, one_fill=None: mask)
    out_as_is, saved_as_is, grads_as_is = run()
    assert any(x.shape[-2:] == (24, 24) for x in saved_as_is)
    assert torch.equal(out, out_as_is)
    for a, e in zip(grads, grads_as_is, strict=True):
        assert torch.equal(a, e)


def test_an_additive_mask_of_more_than_one_fill_value_is_kept_as_given():
    mask = _kept_mask_case("finfo.min")
    mask[..., :3] -= 1.5  # a bias (ALiBi's, a relative position's) on top of the padding
    q, k, v = (x.requires_grad_() for x in _qkv(dtype=torch.float32))
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert any(x.data_ptr() == mask.data_ptr() for x in _saved(out))


def test_one_forward_keeps_one_copy_of_a_mask_and_a_changed_mask_anew():
    from slimact.quant import reference

    base = _kept_mask_case("finfo.min", s=30)
    q, k, v = (x.requires_grad_() for x in _qkv(dtype=torch.float32))

    def call():  # a view of the mask, as transformers slices it per layer (a new tensor each call)
        return scaled_dot_product_attention(q, k, v, attn_mask=base[..., :24])

    def bits(out):
        return [x.data_ptr() for x in _saved(out) if x.dtype == torch.uint8]

    reference.begin_stream(0)
    try:
        outs = [call() for _ in range(3)]
        assert len({p for o in outs for p in bits(o)}) == 1
        base[1, :, 7, :5] = torch.finfo(torch.float32).min  # changed in place: its version moves
        changed = call()
        assert bits(changed) != bits(outs[0])
    finally:
        reference.end_stream()
    assert bits(call()) != bits(call())  # outside a converted model's forward: per call
    g = torch.randn_like(changed)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=base[..., :24])
    for a, e in zip(torch.autograd.grad(changed, (q, k, v), g), torch.autograd.grad(expected, (q, k, v), g),
                    strict=True):
        torch.testing.assert_close(a, e)


def test_a_mask_at_the_address_of_one_whose_memory_was_released_is_kept_anew():
    # A mask whose memory is released while it lives on (``mask.data = torch.empty(0)``, memcnn's resize_(0)) left an
    # entry that the next tensor at its address, of the same shape and version, was handed: another mask's bits.
    # Made here without the allocator: another tensor object on the memory the first mask held.
    from slimact.quant import reference

    first = torch.ones(2, 1, 24, 24, dtype=torch.bool)
    first[0, :, :, 20:] = False  # padded keys (version 1, as a tensor made by set_ below starts)
    q, k, v = (x.requires_grad_() for x in _qkv(dtype=torch.float32))
    g = torch.randn(2, 4, 24, 16, generator=torch.Generator().manual_seed(1))
    memory = first.untyped_storage()
    reference.begin_stream(0)
    try:
        scaled_dot_product_attention(q, k, v, attn_mask=first)
        first.data = torch.empty(0, dtype=torch.bool)
        torch.empty(0, dtype=torch.bool).set_(memory, 0, (2, 1, 24, 24), (576, 576, 24, 1)).fill_(True)
        second = torch.empty(0, dtype=torch.bool).set_(memory, 0, (2, 1, 24, 24), (576, 576, 24, 1))
        assert second._version == 1  # the version the first mask was kept at: only its memory tells them apart
        out = scaled_dot_product_attention(q, k, v, attn_mask=second)
    finally:
        reference.end_stream()
    expected = F.scaled_dot_product_attention(q, k, v)  # (the second mask masks nothing)
    torch.testing.assert_close(out, expected)
    for a, e in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(expected, (q, k, v), g),
                    strict=True):
        torch.testing.assert_close(a, e)


def test_a_mask_alive_for_the_whole_run_is_kept_anew_each_forward_and_remembered_once():
    # A mask buffer of the model's (a causal mask registered once) outlives every forward: each forward packs it
    # afresh (it may have changed between steps without its version moving: a refilled numpy array), and what is
    # remembered of it stays one entry, not one per step.
    from slimact.quant import reference

    base = _kept_mask_case("bool")
    q, k, v = (x.requires_grad_() for x in _qkv(dtype=torch.float32))
    kept = []
    for step in range(4):
        reference.begin_stream(step)
        try:
            out = scaled_dot_product_attention(q, k, v, attn_mask=base[..., :24])
            kept.append(next(x for x in _saved(out) if x.dtype == torch.uint8).data_ptr())
        finally:
            reference.end_stream()
        del out
    entries = [key for key in attention_mod._kept_masks if key[1] == base.untyped_storage().data_ptr()]
    assert len(entries) == 1
    del base
    assert not [key for key in attention_mod._kept_masks if key in entries]  # (dropped with the mask)


def test_a_mask_dying_after_the_modules_globals_are_cleared_is_forgotten_without_an_error(monkeypatch):
    # At interpreter exit a mask held by a longer-lived object (another module's globals, a cycle) dies after this
    # module's globals are set to None: its callback read `_kept_masks` there and printed "Exception ignored ...
    # 'NoneType' object has no attribute 'get'" once per mask (68 times at the end of this suite).
    from slimact.quant import reference

    base = _kept_mask_case("bool")
    q, k, v = (x.requires_grad_() for x in _qkv(dtype=torch.float32))
    reference.begin_stream(0)
    try:
        scaled_dot_product_attention(q, k, v, attn_mask=base[..., :24])
    finally:
        reference.end_stream()
    kept = attention_mod._kept_masks
    entries = [key for key in kept if key[1] == base.untyped_storage().data_ptr()]
    assert len(entries) == 1
    monkeypatch.setattr(attention_mod, "_kept_masks", None)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    del base
    assert unraisable == []
    assert entries[0] not in kept
