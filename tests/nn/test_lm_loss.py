"""The LM head and loss of a converted model called with labels never build the ``[tokens, vocab]`` logits
(:mod:`slimact.nn.lm_loss`): per model family, judged from every tensor the step allocates, and the loss
and gradients against the plain model's; without labels or in eval mode the logits are the plain model's."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile
from torch.utils._python_dispatch import TorchDispatchMode

import _nano
import slimact
from _harness import LinearOnlyWeight, assert_gradients_close, assert_gradients_equal, loss_grads, quantised_llama
from slimact import zoo
from slimact.nn.lm_loss import LazyLogits

VOCAB, BATCH, SEQ = 1000, 2, 48
N = BATCH * SEQ  # tokens

FAMILIES = {
    "gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM", "opt": "OPTForCausalLM",
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "phi3": "Phi3ForCausalLM",
    "bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM", "distilbert": "DistilBertForMaskedLM",
}


def _model(family: str):
    config = zoo.tiny_config(family)
    config.vocab_size = VOCAB
    model = zoo.build_auto(FAMILIES[family], config)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[:, :5] = -100  # ignored positions
    return model.train(), ids, labels


class _Allocations(TorchDispatchMode):
    """The shapes of every tensor an aten op returns (forward and backward), and whether one holds the logits:
    a ``[tokens, vocab]`` (or ``[batch, seq, vocab]``) tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.logits_sized: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.dim() >= 2 and t.shape[-1] == VOCAB:
                if t.shape[:-1].numel() == N:
                    self.logits_sized.append((str(func), tuple(t.shape)))
        return out


def _step_allocations(model, *, count_bytes=False, **inputs):
    """Run one step (forward with ``inputs``, backward); ``(output, tensors of the logits' size seen, largest
    single allocation in bytes if count_bytes)``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with (torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True) if count_bytes
          else contextlib.nullcontext()) as prof, _Allocations() as seen:
        out = model(**inputs)
        out.loss.backward()
    if not count_bytes:
        return out, seen.logits_sized, None
    return out, seen.logits_sized, max(e.nbytes() for e in prof.profiler.kineto_results.events()
                                       if e.name() == "[memory]")


@pytest.mark.parametrize("family", FAMILIES)
def test_no_logits_are_built_and_the_step_matches_plain(family):
    plain, ids, labels = _model(family)
    _, plain_seen, _ = _step_allocations(plain, input_ids=ids, labels=labels)
    assert plain_seen  # the detector sees the plain model's logits: the assertions below could fail
    loss0, g0 = loss_grads(plain, {"input_ids": ids, "labels": labels})

    tempo = slimact.convert(copy.deepcopy(plain), "tempo")
    out1, seen, largest = _step_allocations(tempo, count_bytes=True, input_ids=ids, labels=labels)
    assert isinstance(out1.logits, LazyLogits)
    assert not seen, seen
    # Every allocation of the step (chunks, gradients computed ahead) is below one [tokens, vocab] fp32 tensor
    # (the allocator's own events: what no op returns is seen too).
    assert largest < N * VOCAB * 4, largest
    loss1, g1 = loss_grads(tempo, {"input_ids": ids, "labels": labels})
    torch.testing.assert_close(loss1, loss0)
    assert_gradients_equal(g0, g1)

    int8 = slimact.convert(copy.deepcopy(plain), "int8")
    _, seen, _ = _step_allocations(int8, input_ids=ids, labels=labels)
    assert not seen, seen
    loss2, g2 = loss_grads(int8, {"input_ids": ids, "labels": labels})
    torch.testing.assert_close(loss2, loss0)  # the forward is exact under int8 too
    assert_gradients_close(g0, g2)


@pytest.mark.parametrize("family", FAMILIES)
def test_without_labels_or_in_eval_the_logits_are_the_plain_models(family):
    plain, ids, _ = _model(family)
    slim = slimact.convert(copy.deepcopy(plain), "tempo")
    for train in (True, False):
        plain.train(train)
        slim.train(train)
        torch.manual_seed(1)
        ref = plain(input_ids=ids).logits
        torch.manual_seed(1)
        got = slim(input_ids=ids).logits
        assert type(got) is torch.Tensor
        torch.testing.assert_close(got, ref)
    # In eval mode with labels too: the plain model's logits and loss.
    torch.manual_seed(1)
    ref = plain(input_ids=ids, labels=ids)
    torch.manual_seed(1)
    got = slim(input_ids=ids, labels=ids)
    assert type(got.logits) is torch.Tensor
    torch.testing.assert_close(got.logits, ref.logits)
    torch.testing.assert_close(got.loss, ref.loss)


def _pair(family="gpt2", policy="tempo"):
    plain, ids, labels = _model(family)
    return plain, slimact.convert(copy.deepcopy(plain), policy), ids, labels


def test_reading_the_lazy_logits_computes_the_plain_models_with_their_graph():
    plain, slim, ids, labels = _pair()
    torch.manual_seed(1)
    ref = plain(input_ids=ids, labels=labels)
    torch.manual_seed(1)
    out = slim(input_ids=ids, labels=labels)
    lazy = out.logits
    assert lazy.shape == ref.logits.shape and lazy.dtype == ref.logits.dtype and lazy.requires_grad
    assert lazy.fused() is not None  # nothing computed by asking for metadata
    # A loss of the user's own on the logits (here with label smoothing, which Hugging Face's loss does not
    # take) is the plain model's, gradients included.
    mine = F.cross_entropy(lazy.view(-1, VOCAB), labels.view(-1), label_smoothing=0.1)
    ref_mine = F.cross_entropy(ref.logits.view(-1, VOCAB), labels.view(-1), label_smoothing=0.1)
    torch.testing.assert_close(mine, ref_mine)
    g = torch.autograd.grad(mine, slim.lm_head.weight)[0]
    g_ref = torch.autograd.grad(ref_mine, plain.lm_head.weight)[0]
    assert_gradients_equal({"lm_head.weight": g_ref}, {"lm_head.weight": g})
    torch.testing.assert_close(lazy, ref.logits)
    assert lazy.argmax(-1).equal(ref.logits.argmax(-1))


def test_reading_the_logits_after_an_optimizer_step_raises():
    _, slim, ids, labels = _pair()
    out = slim(input_ids=ids, labels=labels)
    out.loss.backward()
    torch.optim.SGD(slim.parameters(), lr=0.1).step()
    with pytest.raises(RuntimeError, match="changed in place since the forward"):
        out.logits.sum()


@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_reading_the_logits_after_a_step_written_through_data_raises(policy):
    # A hand-written optimizer step through .data (p.data -= lr * p.grad) moves no version: nanoGPT's lazy logits,
    # read after it (an accuracy logged after the step), were computed with the new weight, 1.09 off the forward's,
    # with no error.
    torch.manual_seed(0)
    slim = slimact.convert(_nano.NanoGPT().train(), policy)
    idx, targets = _nano.batch()
    logits, loss = slim(idx, targets)
    loss.backward()
    for p in slim.parameters():
        p.data.add_(p.grad, alpha=-1.0)
    with pytest.raises(RuntimeError, match="changed in place since the forward"):
        logits.argmax(-1)


def test_logits_of_a_functional_call_are_those_of_the_substituted_weights():
    # torch.func.functional_call (MAML, model soups, an EMA evaluated through the live module) runs the forward with
    # other tensors in place of the parameters and puts the parameters back on return. The LazyLogits were then
    # computed by the head module's own call, with the parameter that is back in place, not the tensor the forward
    # used: wrong logits (0.40 off at 1.2 on GPT-2) with no error; the loss and its gradients were right.
    from torch.func import functional_call

    plain, slim, ids, labels = _pair()
    outs = []
    for model in (plain, slim):
        swapped = {n: (p.detach() * 1.5 + 0.01).requires_grad_() for n, p in model.named_parameters()}
        torch.manual_seed(1)
        out = functional_call(model, swapped, (), {"input_ids": ids, "labels": labels})
        (g,) = torch.autograd.grad(out.logits.square().mean(), swapped["transformer.wte.weight"])  # (tied: the head)
        outs.append((out.logits.detach(), g))
    (ref, g_ref), (got, g) = outs
    torch.testing.assert_close(got, ref)
    assert_gradients_equal({"lm_head.weight": g_ref}, {"lm_head.weight": g})


def test_a_custom_function_given_the_lazy_logits_backpropagates_exactly():
    # DDP with find_unused_parameters passes every output through its _DDPSink Function: the lazy tensor's own
    # node recomputes the logits in the backward.
    class Sink(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g

    plain, slim, ids, labels = _pair()
    torch.manual_seed(1)
    ref = plain(input_ids=ids, labels=labels).logits
    torch.manual_seed(1)
    lazy = slim(input_ids=ids, labels=labels).logits
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))
    g_ref = torch.autograd.grad((ref * weights).sum(), plain.lm_head.weight)[0]
    g = torch.autograd.grad((Sink.apply(lazy) * weights).sum(), slim.lm_head.weight, retain_graph=True)[0]
    assert_gradients_equal({"lm_head.weight": g_ref}, {"lm_head.weight": g})  # through the whole model
    # First order only, as every slimact Function: a second-order gradient through it is refused, not wrong.
    with pytest.raises(RuntimeError, match=r"\(_Lazy\) cannot be differentiated twice"):
        torch.autograd.grad((Sink.apply(lazy) * weights).sum(), slim.lm_head.weight, create_graph=True)


def test_gemma2_soft_cap_is_applied_per_chunk_and_differentiated():
    plain, slim, ids, labels = _pair("gemma2")
    assert plain.config.final_logit_softcapping
    torch.manual_seed(1)
    ref = plain(input_ids=ids, labels=labels)
    torch.manual_seed(1)
    out = slim(input_ids=ids, labels=labels)
    assert isinstance(out.logits, LazyLogits) and len(out.logits._spec.steps) == 3  # / c, tanh, * c
    torch.testing.assert_close(out.logits, ref.logits)  # within the soft cap, as the plain model's
    assert ref.logits.abs().max() <= plain.config.final_logit_softcapping


def test_num_items_in_batch_divides_the_summed_loss_as_in_plain():
    plain, slim, ids, labels = _pair("llama")
    items = torch.tensor(57)
    ref = plain(input_ids=ids, labels=labels, num_items_in_batch=items)
    out = slim(input_ids=ids, labels=labels, num_items_in_batch=items)
    torch.testing.assert_close(out.loss, ref.loss)
    g_ref = torch.autograd.grad(ref.loss, plain.lm_head.weight)[0]
    g = torch.autograd.grad(out.loss, slim.lm_head.weight)[0]
    assert_gradients_equal({"lm_head.weight": g_ref}, {"lm_head.weight": g})


def test_keep_logits_returns_them_computed_and_still_keeps_no_logits():
    plain, ids, labels = _model("gpt2")
    slim = slimact.convert(copy.deepcopy(plain), slimact.Policy(name="t", quantize=False, keep_logits=True,
                                                                 kinds=slimact.policy.LOSSLESS_KINDS))
    torch.manual_seed(1)
    out = slim(input_ids=ids, labels=labels)
    assert type(out.logits) is torch.Tensor
    torch.manual_seed(1)
    torch.testing.assert_close(out.logits, plain(input_ids=ids, labels=labels).logits)
    kept = slimact.profile(slim, {"input_ids": ids, "labels": labels})
    assert all(e.nbytes < N * VOCAB * 4 for e in kept.entries)


class _TinyLM(torch.nn.Module):
    """An embedding, a head and the loss in its own forward, labels a positional argument; ``logits_bias``: a
    buffer added to the head's output first (Bart's ``final_logits_bias``)."""

    def __init__(self, logits_bias: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)
        self.register_buffer("final_logits_bias", torch.randn(VOCAB) if logits_bias else None)

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids, labels=None):
        logits = self.head(self.embed(ids))
        if self.final_logits_bias is not None:
            logits = logits + self.final_logits_bias
        loss = None if labels is None else F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
        return loss, logits


def test_labels_given_positionally_are_seen():
    model = _TinyLM()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    ref_loss, _ = model(ids, ids)
    slim = slimact.convert(copy.deepcopy(model), "tempo")
    loss, logits = slim(ids, ids)
    assert isinstance(logits, LazyLogits)
    torch.testing.assert_close(loss, ref_loss)
    g_ref = torch.autograd.grad(ref_loss, model.head.weight)[0]
    torch.testing.assert_close(torch.autograd.grad(loss, slim.head.weight)[0], g_ref)
    _, logits = slim(ids)
    assert type(logits) is torch.Tensor


def test_logits_computed_in_the_forward_are_the_converted_heads():
    # Bart and its kin add a bias buffer to the head's output before the loss: the lazy logits are computed
    # there, by the head module itself, so a converted head keeps its input 8-bit as without lazy logits.
    model = _TinyLM(logits_bias=True)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    ref_loss, ref_logits = model(ids, ids)
    kept = {}
    for keep in (False, True):
        policy = slimact.Policy(name="p", keep_logits=keep)
        slim = slimact.convert(copy.deepcopy(model), policy)
        loss, logits = slim(ids, ids)
        assert type(logits) is torch.Tensor
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(logits, ref_logits)
        kept[keep] = slimact.profile(slim, (ids, ids), loss_fn=lambda out: out[0]).activation_bytes
    assert kept[False] == kept[True]


@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_a_bf16_models_loss_is_computed_in_fp32_where_the_model_casts_its_logits(policy):
    # Hugging Face's loss casts the logits to fp32 first; the fused loss applied the cast to each chunk but rounded
    # the loss to h's dtype at the end: a bf16 model's loss came out a bf16 number (6.90625 for plain's 6.90592).
    model, ids, labels = _model("llama")
    plain = model.to(torch.bfloat16)
    slim = slimact.convert(copy.deepcopy(plain), policy)
    losses = []
    for m in (plain, slim):
        torch.manual_seed(1)
        losses.append(m(input_ids=ids, labels=labels).loss.detach())
    assert losses[0].dtype == losses[1].dtype == torch.float32
    torch.testing.assert_close(losses[1], losses[0])


class _TargetsLM(torch.nn.Module):
    """nanoGPT's shape: the loss in the forward on ``targets`` (not ``labels``: the head computes its logits), then
    ``edit`` applied to the head's output ``[B, T, V]`` before the loss, as model code may do in place."""

    def __init__(self, edit):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)
        self.logit_bias = torch.nn.Parameter(torch.randn(VOCAB) / 10)
        self.edit = edit

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids, targets):
        logits = self.head(self.embed(ids))
        self.edit(self, logits)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def _targets_step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, ids)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


_LOGIT_EDITS = {
    "div_": lambda m, z: z.div_(2.0),  # a temperature
    "add_param_": lambda m, z: z.add_(m.logit_bias),  # a learned bias, added in place
    "retain_grad": lambda m, z: (z.retain_grad(), setattr(m, "logits", z)),
}


@pytest.mark.parametrize("edit", list(_LOGIT_EDITS))
@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_logits_changed_in_place_or_retaining_their_grad_get_plains_gradients(edit, policy):
    # The fused loss takes its gradients through the head's input and weight, not the logits' own graph: on
    # logits scaled in place (div_) it gave the unscaled gradients (0 dB); a parameter added in place got no
    # gradient; logits.retain_grad() got none. The loss runs as written there now.
    torch.manual_seed(0)
    model = _TargetsLM(_LOGIT_EDITS[edit])
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    slim = slimact.convert(copy.deepcopy(model), policy)
    loss0, g0 = _targets_step(model, ids)
    loss1, g1 = _targets_step(slim, ids)
    torch.testing.assert_close(loss1, loss0)
    (assert_gradients_equal if policy == "tempo" else assert_gradients_close)(g0, g1)
    if edit == "retain_grad":
        torch.testing.assert_close(slim.logits.grad, model.logits.grad)


_HEAD_HOOKS = {  # a user's forward hook on the LM head (a deepcopy of the model copies it with the head's `calls` list)
    "logit_bias": lambda bias: lambda m, args, z: z + bias,
    "vocab_mask": lambda bias: lambda m, args, z: z.masked_fill(bias > 1.0, -1e4),
    "clamp": lambda bias: lambda m, args, z: z.clamp(-0.3, 0.3),
    "scale_in_place": lambda bias: lambda m, args, z: z.div_(2.0),
    "logging": lambda bias: lambda m, args, z: m.calls.append(z.detach().float().abs().mean().item()),
}


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("hook", list(_HEAD_HOOKS))
def test_a_hook_on_the_lm_head_is_applied_once_and_differentiated(hook, when):
    # With labels the head returned lazy logits, and a hook on it (a logit bias, a vocabulary mask, a clamp) made
    # them compute by calling the head again: the hook ran twice (the bias added twice: loss 4.93 -> 5.55 on
    # GPT-2), and a hook registered before convert had its output tracked as the head's product, so the fused
    # loss differentiated F.linear(h) without the mask (gradient cosine 0.73). The loss now runs as written.
    torch.manual_seed(0)
    bias = torch.randn(VOCAB)
    model = _TinyLM()
    model.head.calls = []
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    if when == "before":
        model.head.register_forward_hook(_HEAD_HOOKS[hook](bias))
    slim = slimact.convert(copy.deepcopy(model), "tempo")
    if when == "after":
        for m in (model, slim):
            m.head.register_forward_hook(_HEAD_HOOKS[hook](bias))
    out = []
    for m in (model, slim):
        m.zero_grad(set_to_none=True)
        loss, _ = m(ids, ids)
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (loss0, g0), (loss1, g1) = out
    torch.testing.assert_close(loss1, loss0)
    assert_gradients_equal(g0, g1)
    assert slim.head.calls == pytest.approx(model.head.calls) and len(model.head.calls) == (hook == "logging")


def test_the_heads_input_changed_in_place_before_a_lazy_loss_raises():
    # A frozen head (plain PyTorch then keeps only its weight, and allows the change): the lazy logits stand for
    # the head's product on h as it was, which is gone; the fused loss computed them from the changed h.
    class _Mutating(_TinyLM):
        def forward(self, ids, labels=None):
            h = self.embed(ids)
            logits = self.head(h)
            h.mul_(0.5)
            return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1)), logits

    model = _Mutating().requires_grad_(False)
    model.embed.requires_grad_(True)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    slim = slimact.convert(copy.deepcopy(model), "tempo")
    with pytest.raises(RuntimeError, match="input was changed in place after the head's call"):
        slim(ids, ids)


@pytest.mark.parametrize("keep_logits", [False, True])
def test_int32_labels_are_refused_as_pytorch_refuses_them(keep_logits):
    # F.cross_entropy takes int64 (or uint8) targets only; the fused loss took int32 ones and trained on them.
    model = _TinyLM()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    slim = slimact.convert(copy.deepcopy(model), slimact.Policy(name="p", keep_logits=keep_logits))
    for m in (model, slim):
        with pytest.raises(RuntimeError, match="expected target dtype to be Long"):
            m(ids, ids.int())


class _Wrapped(torch.nn.Module):
    """A training wrapper holding the LM (its ``lm_head`` one level down), the targets passed through."""

    def __init__(self):
        super().__init__()
        self.model = _nano.NanoGPT()

    def forward(self, idx, targets=None):
        return self.model(idx, targets)


_NANO = {"nanogpt": _nano.NanoGPT, "nanogpt-by-hand": lambda: _nano.NanoGPT(flash=False), "nanochat": _nano.NanoChat,
         "wrapped-nanogpt": _Wrapped}


@pytest.mark.parametrize("policy", ["tempo", "int8"])
@pytest.mark.parametrize("name", list(_NANO))
def test_a_head_named_lm_head_and_a_targets_argument_make_the_lm_loss_outside_hugging_face(name, policy):
    # nanoGPT's and nanochat's heads were not found (no get_output_embeddings) and their targets were not labels:
    # their [tokens, vocab] logits (and nanochat's soft cap's tanh output) were kept in fp32.
    torch.manual_seed(0)
    plain = _NANO[name]().train()
    slim = slimact.convert(copy.deepcopy(plain), policy)
    assert slimact.summary(slim).modules["(loss)"] == "lmloss"
    idx, targets = _nano.batch()
    losses, grads = [], []
    for model in (plain, slim):
        torch.manual_seed(1)
        output = model(idx, targets)
        if model is slim and "gpt" in name:
            assert isinstance(output[0], LazyLogits)
        _nano.loss_of(output).backward()
        losses.append(_nano.loss_of(output).detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0])
    (assert_gradients_equal if policy == "tempo" else assert_gradients_close)(grads[0], grads[1])
    entries = slimact.profile(slim, (idx, targets), loss_fn=_nano.loss_of).entries
    assert not [e for e in entries if e.shape[-1] == _nano.VOCAB and not e.gradient]


def test_two_modules_named_lm_head_are_no_lm_loss():
    # Which of the two is this model's head is a guess: the loss runs as written.
    pair = torch.nn.ModuleList([_nano.NanoGPT(), _nano.NanoGPT()])
    assert "(loss)" not in slimact.summary(slimact.convert(pair, "int8")).modules


@pytest.mark.parametrize("first_read", ["no_grad", "inference_mode"])
def test_logits_first_read_without_grad_still_carry_their_graph(first_read):
    # nanoGPT called with targets returns lazy logits; a metric read under no_grad (an accuracy, logged) computed and
    # cached them without a graph, so a loss term taken on them afterwards (a z-loss) had no gradient at all:
    # requires_grad False, the head's gradient that of the LM loss alone (off by 5.6e-4 at 6.9e-2), no error; the same
    # under inference_mode. The logits are computed as the forward would have, with their graph.
    torch.manual_seed(0)
    plain = _nano.NanoGPT().train()
    slim = slimact.convert(copy.deepcopy(plain), "tempo")
    idx, targets = _nano.batch()
    grads, z_terms = [], []
    for model in (plain, slim):
        torch.manual_seed(1)
        logits, loss = model(idx, targets)
        with torch.no_grad() if first_read == "no_grad" else torch.inference_mode():
            accuracy = (logits.argmax(-1) == targets).float().mean()
        z = logits.logsumexp(-1).pow(2).mean()
        z_terms.append(z)
        (loss + 1e-2 * z).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        assert 0 <= accuracy.item() <= 1
    assert z_terms[1].requires_grad
    torch.testing.assert_close(z_terms[1], z_terms[0])
    assert_gradients_equal(grads[0], grads[1])


@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=...)"])
def test_the_logits_gradient_of_another_loss_term_is_plains_that_of_the_fused_loss_refused(how):
    # A z-loss on output.logits after a labels call computes the logits with their graph: its gradient with respect
    # to them (autograd.grad(z, inputs=[logits]), z.backward(inputs=[logits])) is plain's, where it raised the
    # fused loss's error (no gradient of the fused loss was asked for). Asked of the fused loss (alone or in a sum),
    # the same clear error: that gradient never passes through the logits.
    model, ids, labels = _model("gpt2")
    slim = slimact.convert(copy.deepcopy(model), "tempo")

    def logits_grad(m, with_loss):
        torch.manual_seed(1)
        out = m(input_ids=ids, labels=labels)
        z = out.logits.logsumexp(-1).pow(2).mean()
        total = out.loss + z if with_loss else z
        if how == "autograd.grad":
            return torch.autograd.grad(total, inputs=[out.logits])[0]
        total.backward(inputs=[out.logits])
        return out.logits.grad

    torch.testing.assert_close(logits_grad(slim, False), logits_grad(model, False))
    with pytest.raises(RuntimeError, match="on logits an LM loss was computed from, after that loss"):
        logits_grad(slim, True)


@pytest.mark.parametrize("keep_logits", [False, True])
def test_the_refusal_of_a_hook_after_the_loss_says_how_the_logits_were_had(keep_logits):
    # With keep_logits the head computes the logits in the forward: the refusal said "the [tokens, vocab] logits
    # never built" of logits the user holds. It now says the loss's gradient skips them.
    model, ids, labels = _model("gpt2")
    slim = slimact.convert(model, slimact.Policy(keep_logits=keep_logits))
    out = slim(input_ids=ids, labels=labels)
    with pytest.raises(RuntimeError, match="on logits an LM loss was computed from, after that loss") as error:
        out.logits.register_hook(lambda g: g * 0.5)
        out.loss.backward()
    assert ("never built" in str(error.value)) == (not keep_logits)
    assert ("the logits were computed" in str(error.value)) == keep_logits


class _CastLM(torch.nn.Module):
    """An embedding, a head and, with labels, the loss on the logits cast to ``dtype`` first."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)
        self.dtype = dtype

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids, labels=None):
        logits = self.head(self.embed(ids))
        loss = None if labels is None else F.cross_entropy(logits.to(self.dtype).view(-1, VOCAB), labels.view(-1))
        return loss, logits


@pytest.mark.parametrize("keep_logits", [False, True], ids=["lazy", "computed"])
def test_a_loss_on_logits_cast_to_float64_is_computed_in_float64(keep_logits):
    # The fused loss computes in fp32: on logits the model casts to float64 (for a loss summed over many tokens) it
    # gave a float64 number with fp32's error (1.2e-8 off plain's 6.98). The loss runs as written there now.
    torch.manual_seed(0)
    model = _CastLM(torch.float64)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    slim = slimact.convert(copy.deepcopy(model), slimact.Policy(name="t", quantize=False, keep_logits=keep_logits))
    out = []
    for m in (model, slim):
        loss, _ = m(ids, ids)
        out.append((loss, torch.autograd.grad(loss, m.head.weight)[0]))
    (loss0, g0), (loss1, g1) = out
    assert loss1.dtype == torch.float64
    torch.testing.assert_close(loss1, loss0, rtol=1e-15, atol=0)
    assert_gradients_equal({"head.weight": g0}, {"head.weight": g1})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_view_of_the_lazy_logits_as_another_dtype_reinterprets_their_bits(dtype):
    # logits.view(torch.int32) (a bitwise comparison of two runs' logits) gave lazy logits of the float dtype,
    # whose values were the logits themselves, not their bits.
    torch.manual_seed(0)
    model = _TinyLM().to(dtype)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    slim = slimact.convert(copy.deepcopy(model), "tempo")
    _, ref = model(ids, ids)
    _, lazy = slim(ids, ids)
    assert isinstance(lazy, LazyLogits)
    views = [torch.int32] if dtype == torch.float32 else [torch.int16, torch.float16]
    for view in views:
        bits = lazy.view(view)
        assert bits.dtype == view
        assert torch.equal(bits, ref.view(view))


class _MaskedViewLM(_TinyLM):
    """The loss on a view of the logits taken before the logits are masked in place (token 0 never predicted)."""

    def forward(self, ids, labels=None):
        logits = self.head(self.embed(ids))
        flat = logits.view(-1, VOCAB)
        logits[..., 0] = -1e4
        return F.cross_entropy(flat, labels.view(-1)), logits


_WRITES = {  # a write in place through the logits or a view of them, then a read through the other
    "parent_written": lambda lg: (lg.view(-1, VOCAB), lg.mul_(0.5))[0],
    "view_written": lambda lg: (lg.view(-1, VOCAB).mul_(0.5), lg)[1],
}


def _tempo_as_plain(model, loss_of) -> None:
    """``loss_of(m, ids)`` for ``model`` and a ``"tempo"`` copy of it: the same loss, and the embedding's and the
    head's gradients equal to float rounding."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    slim = slimact.convert(copy.deepcopy(model), "tempo")
    out = []
    for m in (model, slim):
        loss = loss_of(m, ids)
        grads = torch.autograd.grad(loss, [m.embed.weight, m.head.weight])
        out.append((loss, dict(zip(("embed", "head"), grads, strict=True))))
    (loss0, g0), (loss1, g1) = out
    torch.testing.assert_close(loss1, loss0)
    assert_gradients_equal(g0, g1)


@pytest.mark.parametrize("where", ["model", *_WRITES])
def test_a_view_of_the_lazy_logits_shares_their_elements(where):
    # A view of lazy logits computed its own logits: a write through the logits (a mask, a temperature in place)
    # after the view was taken did not show in it, nor a write through the view in the logits, as they do in
    # PyTorch. A loss on the view taken before the mask was fused from the unmasked product (loss 1.9e-2 off
    # plain's for lg.div_(2) on a nanoGPT-style model, gradient cosine 0.98); KL terms read unscaled logits.
    def loss_of(m, ids):
        loss, logits = m(ids, ids)
        return loss if where == "model" else loss + F.log_softmax(_WRITES[where](logits), -1)[..., 0].mean()

    torch.manual_seed(0)
    _tempo_as_plain(_MaskedViewLM() if where == "model" else _TinyLM(), loss_of)


def test_summary_of_a_loss_it_computes_as_written_says_so():
    # The summary said no F.cross_entropy on the head's logits ran in the forward, where one did (on logits cast to
    # float64, with class weights) and was computed as written.
    model = _CastLM(torch.float64)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    slim = slimact.convert(model, "tempo")
    why = slimact.summary(slim, (ids, ids), loss_fn=lambda out: out[0]).skipped["(loss)"]
    assert "computes as written" in why and "class weights" in why


_CONSTANTS = {  # a target taken from the logits under no_grad (a distillation target, a reference)
    "div": lambda lg: (lg / 2.0).view(-1, VOCAB),
    "view": lambda lg: lg.view(-1, VOCAB),
    "tanh": lambda lg: 10.0 * torch.tanh(lg.view(-1, VOCAB) / 10.0),
}


@pytest.mark.parametrize("op", list(_CONSTANTS))
def test_lazy_logits_derived_under_no_grad_are_constants(op):
    # Lazy logits derived under no_grad (lg / T for a target) were computed with their graph when first read, as the
    # logits themselves are: the loss's gradient flowed through the target too (Llama's norm weight at cosine 0.98
    # from plain's for a KL to lg / 2 taken under no_grad).
    wants = []  # (a view taken under no_grad requires grad as its base does, in PyTorch)

    def loss_of(m, ids):
        loss, logits = m(ids, ids)
        with torch.no_grad():
            target = _CONSTANTS[op](logits)
        wants.append(target.requires_grad)
        return loss + ((logits.view(-1, VOCAB) * 2.0 - target) ** 2).mean()

    torch.manual_seed(0)
    _tempo_as_plain(_TinyLM(), loss_of)
    assert wants[1] == wants[0]


class _MetricHeadLM(_TinyLM):
    """The head and its LM loss under no_grad (a metric), and a loss of its own on the hidden states."""

    def forward(self, ids, labels=None):
        h = self.embed(ids)
        with torch.no_grad():
            logits = self.head(h)
        lm = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
        return lm + (h**2).mean(), logits


@pytest.mark.parametrize("keep_logits", [False, True], ids=["lazy", "computed"])
def test_a_head_called_under_no_grad_gives_its_loss_no_gradient(keep_logits):
    # A head called under no_grad in a training forward gave lazy logits (or computed ones the loss was fused from)
    # and the fused loss its gradients through the head's input and weight, which the plain loss on logits without
    # a graph does not have: the embedding's gradient was 1.64 (relative) off plain's here.
    torch.manual_seed(0)
    model = _MetricHeadLM()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    slim = slimact.convert(copy.deepcopy(model), slimact.Policy(name="t", quantize=False, keep_logits=keep_logits))
    out = []
    for m in (model, slim):
        loss, logits = m(ids, ids)
        assert not logits.requires_grad
        out.append((loss, {"embed": torch.autograd.grad(loss, m.embed.weight)[0]}))
    (loss0, g0), (loss1, g1) = out
    torch.testing.assert_close(loss1, loss0)
    assert_gradients_equal(g0, g1)


_CHECKPOINTED = {  # a loss on the logits in a checkpoint of its own (activation checkpointing of the loss)
    "log_softmax": lambda z, t: F.nll_loss(F.log_softmax(z, -1).view(-1, VOCAB), t.view(-1)),
    "view": lambda z, t: F.cross_entropy(z.view(-1, VOCAB), t.view(-1), label_smoothing=0.1),
    "scaled": lambda z, t: F.cross_entropy((z / 2.0).view(-1, VOCAB), t.view(-1)),
}


@pytest.mark.parametrize("loss", list(_CHECKPOINTED))
def test_a_loss_on_lazy_logits_in_a_checkpoint_of_its_own_is_plains(loss):
    # Lazy logits first read inside a non-reentrant checkpoint computed the head there: its saved tensors were packed
    # by the checkpoint in its forward, but not in its recomputation, which read the logits computed then, so the
    # backward raised CheckpointError (a different number of tensors saved). They are computed under the hooks in
    # place at the head's call now, as the plain head's were.
    def loss_of(m, ids):
        _, logits = m(ids, ids)
        return torch.utils.checkpoint.checkpoint(_CHECKPOINTED[loss], logits, ids, use_reentrant=False)

    torch.manual_seed(0)
    _tempo_as_plain(_TinyLM(), loss_of)


@pytest.mark.parametrize("when", ["before convert", "after convert"])
def test_a_head_with_a_quantised_weight_computes_its_loss_as_written(when):
    # torchao's quantize_ quantises every Linear by default, the LM head too: its weight (a tensor subclass that
    # implements F.linear, not mm) met the fused loss's chunked products, NotImplementedError ("Int8Tensor dispatch:
    # ... aten.mm") where PyTorch trained (a Llama under LoRA over a torchao int8 base). Such a head's loss is
    # computed as written: left out at convert, with the reason; and where the weight is quantised after convert.
    def quantise(model):
        model.lm_head.weight = torch.nn.Parameter(LinearOnlyWeight.of(model.lm_head.weight), requires_grad=False)

    slim, (loss0, g0), (loss1, g1) = quantised_llama(quantise, when)
    skipped = slimact.summary(slim).skipped
    if when == "before convert":
        assert "weight is a LinearOnlyWeight (a tensor subclass" in skipped["(loss)"]
    else:
        assert "(loss)" not in skipped
    torch.testing.assert_close(loss1, loss0)  # (the forward is plain's)
    assert_gradients_close(g0, g1)
