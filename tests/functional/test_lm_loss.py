import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimact
from slimact.functional.lm_loss import _chunks, linear_cross_entropy


def _data(n=300, c=24, v=130, ignored=(3, 7, 250)):
    torch.manual_seed(0)
    h = torch.randn(n, c, requires_grad=True)
    w = (torch.randn(v, c) / c**0.5).requires_grad_(True)
    b = torch.randn(v, requires_grad=True)
    t = torch.randint(0, v, (n,))
    t[list(ignored)] = -100
    return h, w, b, t


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunked", [False, True])
def test_matches_f_cross_entropy(smoothing, reduction, chunked, monkeypatch):
    if chunked:  # several chunks of tokens
        monkeypatch.setattr("slimact.functional.lm_loss.CHUNK_ELEMENTS", 130 * 64)
    h, w, b, t = _data()
    ref = F.cross_entropy(F.linear(h, w, b), t, label_smoothing=smoothing, reduction=reduction)
    g0 = torch.autograd.grad(ref, (h, w, b))
    out = linear_cross_entropy(h, w, b, t, label_smoothing=smoothing, reduction=reduction)
    g1 = torch.autograd.grad(out, (h, w, b))
    torch.testing.assert_close(out, ref)
    for a, e in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, e)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunks_are_as_docs_lm_loss_md_says(dtype):
    # docs/lm_loss.md, "Chunk size": CHUNK_ELEMENTS (2**24, 64 MiB of fp32) logits a chunk, 2/3 of that under a bf16
    # autocast; never all tokens in one chunk from two tokens on; the chunk does not grow with the batch.
    from slimact.functional.lm_loss import CHUNK_ELEMENTS

    assert CHUNK_ELEMENTS * 4 == 64 << 20
    budget = CHUNK_ELEMENTS if dtype == torch.float32 else CHUNK_ELEMENTS * 2 // 3
    vocab = 50257
    for n in (1, 2, 3, 333, 2048, 8192, 65536):
        chunks = list(_chunks(n, vocab, dtype))
        assert chunks[0][0] == 0 and chunks[-1][1] == n  # every token, once, in order
        assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
        assert all((end - start) * vocab <= budget for start, end in chunks)
        if n >= 2:
            assert len(chunks) >= 2
    rows = [max(e - s for s, e in _chunks(n, vocab, dtype)) for n in (8192, 65536)]
    assert rows[0] == rows[1] == budget // vocab

def test_custom_ignore_index_and_divisor():
    h, w, b, t = _data()
    t[t == -100] = 5
    ref = F.cross_entropy(F.linear(h, w, b), t, ignore_index=5, reduction="sum") / 17.0
    out = linear_cross_entropy(h, w, b, t, ignore_index=5, reduction="sum", divisor=17.0)
    torch.testing.assert_close(out, ref)


def _saved(fn):
    """Run ``fn`` and return the tensors autograd saved for its backward."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("given", [False, True], ids=["computed", "given-logits"])
def test_keeps_only_the_gradients_it_computed_ahead(given):
    from slimact.functional._saving import is_gradient

    h, w, b, t = _data()
    logits = F.linear(h, w, b)
    ref = F.cross_entropy(logits, t)
    g0 = torch.autograd.grad(ref, (h, w, b))
    out, saved = _saved(lambda: linear_cross_entropy(h, w, b, t, logits=logits if given else None))
    # grad_h [300, 24], grad_W [130, 24], grad_b [130]: no logits, no copy of h.
    assert sorted(tuple(x.shape) for x in saved) == [(130,), (130, 24), (300, 24)]
    assert all(is_gradient(x) for x in saved)
    torch.testing.assert_close(out, ref)
    for a, e in zip(torch.autograd.grad(out, (h, w, b)), g0, strict=True):
        torch.testing.assert_close(a, e)


def test_given_logits_are_what_the_loss_is_computed_from():
    # The model's own head output is used as F.cross_entropy would use it (here bf16 logits, as autocast
    # gives), not recomputed from h in another precision.
    h, w, b, t = _data()
    logits = F.linear(h, w, b).bfloat16()
    ref = F.cross_entropy(logits.float(), t)
    out = linear_cross_entropy(h, w, b, t, logits=logits)
    torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError, match="logits must be"):
        linear_cross_entropy(h, w, b, t, logits=logits[:5])


def test_backward_scales_and_can_run_twice():
    # The gradients computed ahead are multiplied by the incoming gradient (a scaled loss: gradient
    # accumulation, GradScaler), into new tensors: a second backward (retain_graph) sees them unchanged.
    h, w, b, t = _data()
    ref = torch.autograd.grad(F.cross_entropy(F.linear(h, w, b), t) * 0.25, (h, w, b))
    out = linear_cross_entropy(h, w, b, t) * 0.25
    first = torch.autograd.grad(out, (h, w, b), retain_graph=True)
    second = torch.autograd.grad(out, (h, w, b))
    for a, c, e in zip(first, second, ref, strict=True):
        torch.testing.assert_close(a, e)
        assert torch.equal(a, c)


def test_frozen_head_keeps_no_weight_gradient():
    h, w, b, t = _data()
    w, b = w.detach(), b.detach()
    ref = torch.autograd.grad(F.cross_entropy(F.linear(h, w, b), t), h)[0]
    out, saved = _saved(lambda: linear_cross_entropy(h, w, b, t))
    assert [tuple(x.shape) for x in saved] == [(300, 24)]
    torch.testing.assert_close(torch.autograd.grad(out, h)[0], ref)


class TinyLM(nn.Module):
    """A head and an inline CrossEntropyLoss, as BERT's MLM head writes it."""

    def __init__(self, v=130, c=24):
        super().__init__()
        self.embed = nn.Embedding(v, c)
        self.head = nn.Linear(c, v)

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids, labels):
        logits = self.head(self.embed(ids))
        return nn.CrossEntropyLoss()(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def test_routing_keeps_no_tokens_by_vocab_tensor_and_matches():
    torch.manual_seed(0)
    ids, labels = torch.randint(0, 130, (4, 50)), torch.randint(0, 130, (4, 50))
    model = TinyLM()
    plain = slimact.profile(model, (ids, labels))
    model.zero_grad()
    ref = model(ids, labels)
    ref.backward()
    g0 = {n: p.grad.clone() for n, p in model.named_parameters()}
    slimact.convert(model, "tempo")
    assert slimact.summary(model).converted.get("lmloss") == 1
    conv = slimact.profile(model, (ids, labels))
    vocab_sized = [e for e in conv.entries if e.nbytes >= 200 * 130 * 4]
    assert not vocab_sized, vocab_sized
    assert any(e.nbytes >= 200 * 130 * 4 for e in plain.entries)  # PyTorch keeps the log-softmax output
    model.zero_grad()
    out = model(ids, labels)
    out.backward()
    torch.testing.assert_close(out, ref)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, g0[n])


def test_routing_falls_back_when_it_cannot_apply():
    torch.manual_seed(0)
    model = slimact.convert(TinyLM(), "tempo")
    ids, labels = torch.randint(0, 130, (2, 8)), torch.randint(0, 130, (2, 8))
    logits = model.head(model.embed(ids))
    weights = torch.rand(130)
    plain = F.cross_entropy(logits.view(-1, 130), labels.view(-1), weight=weights)
    assert torch.isfinite(plain)  # outside the model's forward: PyTorch's own path, untouched
    slimact.revert(model)
    assert not hasattr(model, "_slimact_root_loss")


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_non_finite_hidden_states_give_torchs_nan(bad, smoothing):
    # A token whose logits hold +inf (or only -inf) has a NaN log-softmax in F.cross_entropy; torch.logsumexp
    # gave inf there, so the loss was inf instead of NaN and weight-gradient entries stayed finite where
    # PyTorch's are NaN.
    h, w, b, t = _data(n=12, c=6, v=9, ignored=(3,))
    h = h.detach().clone()
    h[5, 2] = bad
    h.requires_grad_(True)
    ref = F.cross_entropy(F.linear(h, w, b), t, label_smoothing=smoothing)
    g0 = torch.autograd.grad(ref, (h, w, b))
    out = linear_cross_entropy(h, w, b, t, label_smoothing=smoothing)
    g1 = torch.autograd.grad(out, (h, w, b))
    torch.testing.assert_close(out, ref, equal_nan=True)
    for a, e in zip(g1, g0, strict=True):
        assert torch.equal(torch.isfinite(a), torch.isfinite(e))
        torch.testing.assert_close(a, e, equal_nan=True)


def test_fp16_weight_gradient_summed_past_65504_before_the_upstream_scales_it_stays_finite():
    # reduction="sum" over 150k tokens: grad_W reaches -75000 before the loss's gradient (0.5) halves it, which
    # PyTorch applies first. Kept in fp16 as it was, it became -inf.
    n = 150_000
    h = torch.ones(n, 1, dtype=torch.float16)
    target = torch.zeros(n, dtype=torch.long)
    grads = []
    for fused in (False, True):
        w = torch.zeros(2, 1, dtype=torch.float16, requires_grad=True)
        b = torch.zeros(2, dtype=torch.float16, requires_grad=True)
        if fused:
            loss = linear_cross_entropy(h, w, b, target, reduction="sum")
        else:
            loss = F.cross_entropy(F.linear(h, w, b), target, reduction="sum")
        loss.backward(torch.tensor(0.5, dtype=torch.float16))
        grads.append((w.grad, b.grad))
    (w_plain, b_plain), (w_ours, b_ours) = grads
    assert torch.isfinite(w_ours).all() and torch.isfinite(b_ours).all()
    torch.testing.assert_close(w_ours, w_plain)
    torch.testing.assert_close(b_ours, b_plain)
    torch.testing.assert_close(w_ours, torch.tensor([[-37500.0], [37500.0]], dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("reduction,divisor", [("mean", None), ("sum", None), ("mean", "tensor")])
def test_no_host_reads_and_the_same_results(dtype, reduction, divisor):
    # The kept-token count (the mean's divisor), a tensor divisor and fp16's overflow scale are decided on the
    # device: no read back to the host (each drained the CUDA stream once per step).
    from _host import HostReads

    h = torch.randn(2, 24, 16, dtype=dtype)
    w = (torch.randn(40, 16) * 0.3).to(dtype).requires_grad_()
    target = torch.randint(0, 40, (48,))
    target[::5] = -100
    div = None if divisor is None else (target != -100).sum() * 1.0
    with HostReads(fail=True):
        loss = linear_cross_entropy(h, w, None, target, reduction=reduction, divisor=div)
        loss.backward()
    w_ref = w.detach().float().requires_grad_()
    ref = F.cross_entropy(F.linear(h.float().reshape(-1, 16), w_ref), target, reduction="sum") / (
        1.0 if reduction == "sum" else (target != -100).sum())
    ref.backward()
    torch.testing.assert_close(loss.float(), ref, **({"rtol": 2e-3, "atol": 2e-3} if dtype == torch.float16 else {}))
    torch.testing.assert_close(w.grad.float(), w_ref.grad, **({"rtol": 2e-3, "atol": 1e-3} if dtype == torch.float16
                                                              else {}))


def test_fp16_overflow_scale_is_the_power_of_two_the_host_computed():
    # _narrow's scale, decided on the device, equals 2 ** ceil(log2(2 * peak / 65504)), exact powers of two included.
    import math

    from slimact.functional.lm_loss import _narrow

    for peak in (100.0, 32752.0, 32753.0, 65504.0, 65536.0, 70000.0, 131008.0, 131072.0, 2.0**40, 3e38):
        g = torch.tensor([0.5, -peak], dtype=torch.float32)
        narrowed, scale = _narrow(g, torch.float16)
        p = abs(float(torch.tensor(peak, dtype=torch.float32)))
        expected = 2.0 ** math.ceil(math.log2(2 * p / 65504.0)) if 65504.0 / 2 < p < math.inf else 1.0
        assert scale.item() == expected, (peak, scale, expected)
        assert torch.isfinite(narrowed).all()
    inf = _narrow(torch.tensor([1.0, math.inf]), torch.float16)[1]
    assert inf.item() == 1.0


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_under_autocast_the_gradient_products_run_in_the_autocast_dtype_as_torchs(bias):
    # PyTorch's own head under autocast multiplies dz with the bf16 copies of W and h. slimact's chunked weight
    # gradient was an fp32 addmm_ of dz and h (in-place ops are not autocast): on an H200, 24 fp32 SIMT GEMMs,
    # 14.4 ms of GPT-2's bf16 8 x 1024 step. Two chunks here (the loss never takes all tokens at once).
    from _ops import Ops

    h, w, b, t = _data()
    b = b if bias else None
    params = (h, w) + ((b,) if bias else ())
    with torch.autocast("cpu", torch.bfloat16):
        ref = F.cross_entropy(F.linear(h, w, b), t)
        with Ops() as ops:
            out = linear_cross_entropy(h, w, b, t)
    grads0 = torch.autograd.grad(ref, params)
    grads = torch.autograd.grad(out, params)
    # 2 chunks x (grad_h, grad_W) products after the 2 head products, all on bf16 operands
    assert len(ops.products) == 6 and all(set(d) == {torch.bfloat16} for d in ops.products), ops.products
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    for a, e in zip(grads, grads0, strict=True):
        assert a.dtype == e.dtype == torch.float32
        # the same bf16 products as PyTorch's, to their rounding (2**-8 relative)
        torch.testing.assert_close(a, e, rtol=1.6e-2, atol=2e-4)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_each_chunk_launches_few_ops(autocast, monkeypatch):
    # Each aten op is at least one kernel launch on CUDA, and GPT-2's loss at 8 x 1024 tokens runs 25 chunks. What
    # depends on the labels only (kept, clamped labels, the per-token scale) is computed once per call, the loss is
    # summed once at the end, grad_W / grad_b start from the first chunk's (no zero-fill), grad_h is written in
    # place, h's rows are cast once under autocast: per chunk 17 ops in fp32 (was 27), 22 under autocast (was 33).
    import slimact.functional.lm_loss as lm
    from _ops import Ops

    h, w, b, t = _data()  # 300 tokens, vocabulary 130

    dtype = torch.bfloat16 if autocast else torch.float32

    def forward_ops(rows):
        # chunks of `rows` tokens (under autocast 2/3 as many logits a chunk: lm._chunks)
        monkeypatch.setattr(lm, "CHUNK_ELEMENTS", rows * 130 * (4 + dtype.itemsize) // 4 if autocast else rows * 130)
        assert len(list(lm._chunks(300, 130, dtype))) == 300 // rows
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast), Ops() as ops:
            out = linear_cross_entropy(h, w, b, t)
        return sum(ops.work.values()), out

    two, out2 = forward_ops(150)
    six, out6 = forward_ops(50)
    assert (six - two) / 4 <= (22 if autocast else 17), (two, six)
    torch.testing.assert_close(out6, out2, rtol=1e-2 if autocast else 1e-6, atol=1e-6)


@pytest.mark.parametrize("given", [False, True], ids=["computed", "given-logits"])
def test_under_autocast_the_forward_peak_is_no_higher_than_in_fp32(given, monkeypatch):
    # The bf16 gradient products once held a second bf16 copy of W through the whole loss (autocast caches one
    # already) and made each chunk's dz^T h a whole [V, C] bf16 temporary before adding it to the fp32 sum:
    # GPT-2's bf16 step peak rose by 175-200 MiB. Under autocast the forward may hold, beyond the fp32 path's
    # peak, autocast's own bf16 copies of W (cached: PyTorch's head makes it too) and of the chunk's rows of h, and
    # no more: the smaller chunks pay for the chunk's bf16 gradient, and the product is summed by slices of the
    # vocabulary.
    vocab, width, tokens = 8000, 1024, 2048
    monkeypatch.setattr("slimact.functional.lm_loss.CHUNK_ELEMENTS", 512 * vocab)  # 4 chunks in fp32, 7 in bf16
    monkeypatch.setattr("slimact.functional.lm_loss.SLICE_ELEMENTS", 128 * vocab)  # a quarter of a chunk

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(vocab, width) * 0.02)

        def forward(self, h, t):
            logits = F.linear(h, self.weight) if given else None
            return linear_cross_entropy(h, self.weight, None, t, logits=logits)

    torch.manual_seed(0)
    h = torch.randn(tokens, width, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,))
    peaks = {}
    for autocast in (False, True):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            report = slimact.profile(Head(), (h, t), loss_fn=lambda loss: loss, peak=True)
        peaks[autocast] = report.forward_peak.total
    rows = max(a_b[1] - a_b[0] for a_b in _chunks(tokens, vocab, torch.bfloat16))
    casts = (vocab + rows) * width * 2
    assert peaks[True] <= peaks[False] + casts, (peaks, casts)


@pytest.mark.parametrize("bad", [-1, -5, 50])
def test_a_target_out_of_bounds_raises_as_in_pytorch(bad):
    # The loss clamps targets to index its chunks: a -1 pad (ignore_index left at -100) or a class id past the
    # vocabulary silently trained on class 0 or the last one, where F.cross_entropy raises.
    h, weight = torch.randn(6, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    target = torch.tensor([1, 2, bad, 3, -100, 4])
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        F.cross_entropy(F.linear(h, weight), target)
    with pytest.raises(RuntimeError, match=r"a target is out of bounds: neither in \[0, 50\) nor ignore_index"):
        linear_cross_entropy(h, weight, None, target)
    target[4] = 0
    torch.testing.assert_close(linear_cross_entropy(h, weight, None, target, ignore_index=bad),  # ignored: fine
                               F.cross_entropy(F.linear(h, weight), target, ignore_index=bad))
