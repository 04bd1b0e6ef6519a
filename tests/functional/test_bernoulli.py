"""slimact's CPU bernoulli_ kernel: bit for bit torch's bernoulli_, and the generator left as torch leaves it."""

import warnings

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import slimact.functional._bernoulli as bern


def _advanced(seed: int, words: int) -> torch.Generator:
    gen = torch.Generator().manual_seed(seed)
    if words:
        torch.empty(words, dtype=torch.int32).random_(generator=gen)  # one 32-bit word each
    return gen


def _aten_draws(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name == "aten::bernoulli_" for e in prof.events())


@pytest.fixture
def kernel():
    fn = bern._load()
    if fn is None:  # no C compiler here: bernoulli_ runs (tested below); the kernel's own tests cannot
        pytest.skip("no C compiler to build the kernel")
    return fn


# sizes around the generator's 624-word blocks (312 draws each) from states at, before and after a twist
@pytest.mark.parametrize("words", [0, 1, 311, 623, 624, 625, 5001])
@pytest.mark.parametrize("n", [bern.MIN_NUMEL, bern.MIN_NUMEL + 1, 312 * 100 + 157, 4 * 12 * 64 * 64])
@pytest.mark.parametrize("p", [0.9, 0.5, 0.1, 1.0 / 3, 0.0, 1.0, 1 - 2.0**-53, 2.0**-53])
def test_the_kernel_draws_bernoulli_s_mask_and_leaves_the_generator_as_it_does(kernel, words, n, p):
    ours, theirs = _advanced(words, words), _advanced(words, words)
    expected = torch.empty(n, dtype=torch.uint8).bernoulli_(p, generator=theirs)
    out = torch.empty(n, dtype=torch.uint8)
    assert _aten_draws(lambda: bern.bernoulli_(out, p, ours)) == 0  # the kernel drew it
    assert torch.equal(out, expected)
    assert torch.equal(ours.get_state(), theirs.get_state())
    assert torch.equal(torch.rand(1000, generator=ours), torch.rand(1000, generator=theirs))


def test_the_default_generator_and_a_multidimensional_mask(kernel):
    torch.manual_seed(11)
    expected = torch.empty(4, 12, 64, 64, dtype=torch.uint8).bernoulli_(0.9)
    after = torch.rand(5)
    torch.manual_seed(11)
    out = bern.bernoulli_(torch.empty(4, 12, 64, 64, dtype=torch.uint8), 0.9)
    assert torch.equal(out, expected) and torch.equal(torch.rand(5), after)


@pytest.mark.parametrize("case", ["small", "strided", "bool", "reference-backend"])
def test_everything_else_is_bernoulli_s_own_draw(case, monkeypatch):
    n = bern.MIN_NUMEL
    out = {"small": torch.empty(n - 1, dtype=torch.uint8),
           "strided": torch.empty(2 * n, dtype=torch.uint8)[::2],
           "bool": torch.empty(n, dtype=torch.bool)}.get(case, torch.empty(n, dtype=torch.uint8))
    if case == "reference-backend":
        monkeypatch.setenv("SLIMACT_BACKEND", "reference")
    ours, theirs = _advanced(1, 7), _advanced(1, 7)
    expected = out.clone().bernoulli_(0.8, generator=theirs)
    assert _aten_draws(lambda: bern.bernoulli_(out, 0.8, ours)) == 1
    assert torch.equal(out, expected) and torch.equal(ours.get_state(), theirs.get_state())


@pytest.mark.parametrize("why", ["no-compiler", "self-check-fails"])
def test_without_a_working_kernel_bernoulli_runs(why, monkeypatch):
    monkeypatch.setattr(bern, "_kernel", None)
    if why == "no-compiler":
        monkeypatch.setattr(bern, "_build", lambda: None)
    else:
        if bern._build() is None:
            pytest.skip("no C compiler to build the kernel")
        monkeypatch.setattr(bern, "_self_check", lambda fn: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, theirs = _advanced(2, 0), _advanced(2, 0)
        out = torch.empty(bern.MIN_NUMEL, dtype=torch.uint8)
        assert _aten_draws(lambda: bern.bernoulli_(out, 0.7, ours)) == 1
    assert torch.equal(out, torch.empty_like(out).bernoulli_(0.7, generator=theirs))
    assert [str(w.message) for w in caught if "bernoulli_" in str(w.message)] == (
        [] if why == "no-compiler" else
        ["slimact: the CPU dropout mask kernel differs from this torch's bernoulli_; bernoulli_ is used"])


def test_the_kernel_refuses_a_state_it_does_not_know_and_writes_nothing(kernel):
    state = torch.Generator().manual_seed(0).get_state()
    for left, nxt in ((0, 0), (700, 0), (10, 620), (1, 625)):
        bad = state.clone()
        bad[8:12] = torch.tensor([left], dtype=torch.int32).view(torch.uint8)
        bad[16:24] = torch.tensor([nxt], dtype=torch.int64).view(torch.uint8)
        before = bad.clone()
        out = torch.zeros(100, dtype=torch.uint8)
        assert kernel(bad.data_ptr(), out.data_ptr(), 100, 1 << 52) == -1
        assert torch.equal(bad, before) and not out.any()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_a_converted_gpt2_draws_the_plain_models_dropout_masks_through_the_kernel(kernel, policy, attn, monkeypatch):
    # End to end at a size the kernel takes (attention's [2, 4, 128, 128] and the residual dropouts' [2, 128, 128]):
    # the converted step's loss is the plain one's (the forward is exact, the masks the same), "tempo"'s gradients
    # are PyTorch's to float rounding, and the generator ends where the plain step leaves it.
    transformers = pytest.importorskip("transformers")
    import slimact
    from _harness import loss_grads

    cfg = transformers.GPT2Config(vocab_size=96, n_embd=128, n_layer=2, n_head=4, n_positions=160, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).train()
    model.config._attn_implementation = attn
    ids = torch.randint(0, 96, (2, 128), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}
    loss0, exact = loss_grads(model, inputs)
    after0 = torch.get_rng_state()
    slimact.convert(model, policy)
    draws, original = [], bern._draw
    monkeypatch.setattr(bern, "_draw", lambda *a: draws.append(a[1].numel()) or original(*a))
    loss1, approx = loss_grads(model, inputs)
    assert torch.equal(torch.get_rng_state(), after0)
    assert sorted(set(draws)) == [2 * 128 * 128, 2 * 4 * 128 * 128]  # the residual dropouts and attention's
    torch.testing.assert_close(loss1, loss0)
    if policy == "tempo":
        for name in exact:
            torch.testing.assert_close(approx[name], exact[name], rtol=1e-4, atol=1e-5, msg=name)
