"""slimact on research-code patterns (tests/_research.py: lucidrains' attention with rotary, talking heads, qk-norm
and more of x-transformers' options, MLP-Mixer, Perceiver, a hand-written top-k MoE, mamba-minimal, RWKV-4) and on
unusual training loops (gradient penalties, torch.func per-sample gradients, gradient accumulation, first-order MAML,
PGD on the input embeddings, two losses from one forward, gradients to and hooks on an intermediate tensor, hooks on
the logits of a fused LM loss, attention attribution, a frozen half, an EMA teacher, two views in one step)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimact
from _harness import assert_gradients_close, assert_gradients_equal, estimates
from _research import RWKV, Mamba, MLPMixer, MoEBlock, Perceiver, TinyLM, XBlock
from slimact import zoo

POLICIES = ["tempo", "int8", "mesa"]
_GEN = torch.Generator().manual_seed(0)
IDS = torch.randint(0, 50, (2, 16), generator=_GEN)
IMAGES = torch.randn(2, 3, 16, 16, generator=_GEN)
DATA = torch.randn(2, 20, 24, generator=_GEN)
SEQ = torch.randn(2, 16, 32, generator=_GEN)
PADDED = (torch.randn(2, 10, 32, generator=_GEN), torch.randn(2, 14, 32, generator=_GEN),
          torch.arange(10).expand(2, 10) < torch.tensor([[10], [6]]))  # (x, context, key padding mask)


def lm_loss(logits: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on :data:`IDS`, computed outside the model as research training loops do."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), IDS[:, 1:].reshape(-1))


def mean_square(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


#: name -> (builder, input, loss, {policy: bound on converted/plain bytes kept}, {module: kind} the summary must
#: list under the 8-bit policies). Bounds: the measured ratios (in the comments) with about 15% margin.
MODELS = {
    # causal, dropout 0.1 (tempo 0.703, int8/mesa 0.198)
    "x-transformers": (lambda: TinyLM(causal=True, dropout=0.1), IDS, lm_loss, {"tempo": 0.80, "int8": 0.23},
                       {"transformer.layers.0.0.fn": "attention", "transformer.layers.0.1.fn.net.1": "gelu"}),
    # (0.785, 0.275)
    "rotary": (lambda: TinyLM(causal=True, rotary=True), IDS, lm_loss, {"tempo": 0.90, "int8": 0.32},
               {"transformer.layers.1.0.fn": "attention"}),
    # pre- and post-softmax head mixing by einsum with a [h, h] parameter (0.740, 0.205)
    "talking-heads": (lambda: TinyLM(causal=True, talking_heads=True, dropout=0.1), IDS, lm_loss,
                      {"tempo": 0.85, "int8": 0.24}, {"transformer.layers.0.0.fn": "attention"}),
    # F.normalize'd q, k and a learned temperature (0.842, 0.466)
    "qk-norm": (lambda: TinyLM(causal=True, qk_norm=True), IDS, lm_loss, {"tempo": 0.95, "int8": 0.54},
                {"transformer.layers.0.0.fn": "attention"}),
    # memory key/values, ALiBi, padding mask, fp32 max-subtracted softmax, conv talking heads, gate, cross-attention
    # (0.837, 0.334)
    "x-transformers-options": (XBlock, PADDED, mean_square, {"tempo": 0.95, "int8": 0.38},
                               {"self_attn": "attention", "cross_attn": "attention",
                                "self_attn.pre_softmax_talking_heads": "conv"}),
    # token mixing on the transposed LayerNorm output (0.617, 0.170)
    "mlp-mixer": (MLPMixer, IMAGES, mean_square, {"tempo": 0.71, "int8": 0.20},
                  {"2.norm1": "layernorm", "2.mlp_tokens.0": "linear", "2.mlp_tokens.1": "gelu"}),
    # lucidrains' kernel-1 Conv1d token mixing (0.554, 0.155)
    "mlp-mixer-conv": (lambda: MLPMixer(conv_tokens=True), IMAGES, mean_square, {"tempo": 0.64, "int8": 0.18},
                       {"2.0.fn.0": "conv", "2.0.norm": "layernorm"}),
    # latents expanded over the batch cross-attend the data (0.874, 0.497)
    "perceiver": (Perceiver, DATA, mean_square, {"tempo": 0.97, "int8": 0.57},
                  {"cross_attn.fn": "attention", "cross_attn.norm_context": "layernorm", "layers.0.0.fn": "attention"}),
    # index_select + index_add_ over gated SiLU experts (0.762, 0.337)
    "moe": (MoEBlock, SEQ, mean_square, {"tempo": 0.87, "int8": 0.39},
            {"moe.experts.0": "mlp", "moe.experts.3": "mlp", "attn": "attention"}),
    # Mixtral's one-hot expert mask and x[None, top_x] (same bytes)
    "moe-mixtral": (lambda: MoEBlock(mixtral=True), SEQ, mean_square, {"tempo": 0.87, "int8": 0.39},
                    {"moe.experts.1": "mlp"}),
    # the Python-loop scan keeps most of the bytes, as written (0.931, 0.793)
    "mamba-minimal": (Mamba, IDS, lm_loss, {"tempo": 0.98, "int8": 0.88},
                      {"layers.0.mixer.conv1d": "conv", "layers.0.norm": "rmsnorm",
                       "layers.0.mixer.in_proj": "linear"}),
    # the WKV loop as written; ln1(x) * time_mix kept through the norm's pack (0.837, 0.599; 0.649 as written)
    "rwkv": (RWKV, IDS, lm_loss, {"tempo": 0.93, "int8": 0.62},
             {"blocks.0.ffn.key": "linear", "blocks.0.ln1": "layernorm"}),
}


def _step(model: nn.Module, x: torch.Tensor, loss_fn) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = model(*x) if isinstance(x, tuple) else model(x)
    loss_fn(out).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _judge(policy: str, exact: dict, approx: dict) -> None:
    (assert_gradients_equal if policy == "tempo" else assert_gradients_close)(exact, approx)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", list(MODELS))
def test_a_research_model_trains_as_plain_pytorch_does(name, policy):
    build, x, loss_fn, bounds, kinds = MODELS[name]
    torch.manual_seed(0)
    plain = build().train()
    slim = slimact.convert(copy.deepcopy(plain), policy)
    want_out, want = _step(plain, x, loss_fn)
    got_out, got = _step(slim, x, loss_fn)
    assert torch.equal(got_out, want_out)
    _judge(policy, want, got)
    # What was converted is what the summary says, under the 8-bit policies the attention and MLP modules too.
    modules = dict(slim.named_modules())
    listed = slimact.summary(slim).modules
    assert all(m in modules for m in listed if m != "(loss)")
    if policy != "tempo":
        assert {m: listed.get(m) for m in kinds} == kinds
    bound = bounds["tempo" if policy == "tempo" else "int8"]
    kept = slimact.profile(slim, x, loss_fn=loss_fn).activation_bytes
    assert kept <= bound * slimact.profile(plain, x, loss_fn=loss_fn).activation_bytes
    # (Under "mesa", the first step, as judged above: check's default also judges a step after warming the running
    # estimates, where several of these models at 2 rows fall below the floor as training does; tests/test_check.py.)
    assert slimact.check(plain, x, policy, loss_fn=loss_fn, warmup=0).passed
    slimact.revert(slim)
    back_out, back = _step(slim, x, loss_fn)
    assert torch.equal(back_out, want_out) and back.keys() == want.keys()
    assert all(torch.equal(back[n], want[n]) for n in want)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["talking-heads", "x-transformers-options", "perceiver", "rwkv"])
def test_a_research_model_under_bf16_autocast(name, policy):
    build, x, loss_fn, _, _ = MODELS[name]
    torch.manual_seed(0)
    plain = build().train()
    _, gold = _step(plain, x, loss_fn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_out, want = _step(plain, x, loss_fn)
        got_out, got = _step(slimact.convert(copy.deepcopy(plain), policy), x, loss_fn)
    assert torch.equal(got_out, want_out)
    assert_gradients_close(want, got, gold=gold)


@pytest.mark.parametrize("policy", POLICIES)
def test_attention_attribution_by_a_hook_on_the_map(policy):
    # Chefer et al.'s relevance: the attention map saved in the forward and its gradient by a hook on it; the map is
    # what a routed softmax packs and the next product reads.
    torch.manual_seed(0)
    plain = TinyLM(causal=True, dropout=0.1, save_attn=True).train()
    slim = slimact.convert(copy.deepcopy(plain), policy)
    _step(plain, IDS, lm_loss)
    _step(slim, IDS, lm_loss)
    for a, b in zip(plain.transformer.layers, slim.transformer.layers, strict=True):
        assert torch.equal(b[0].fn.attn, a[0].fn.attn)
        _judge(policy, {"grad": a[0].fn.attn_gradients}, {"grad": b[0].fn.attn_gradients})


# --- LayerNorm's shift invariance under 8-bit codes ---------------------------------------------------------------


@pytest.mark.parametrize("policy", ["int8", "mesa"])
def test_a_shift_that_only_layernorms_read_gets_no_gradient_from_8_bit_codes(policy):
    # MLP-Mixer's token-mixing output bias is added to every channel of its token, and every path from there meets a
    # LayerNorm, which ignores a per-row shift: its exact gradient is zero (plain fp32: float noise, 1e-7 of a
    # typical gradient). The LayerNorm backward restored xn from 8-bit codes with a nonzero row mean, so its grad_x
    # no longer summed to zero and the bias got 0.7-1.8e-3 of a typical gradient (slimact.check failing for seeds 0
    # and 2 under both policies); the restored xn is re-centred now (1e-7).
    for seed in range(3):
        torch.manual_seed(seed)
        plain = MLPMixer().train()
        _, grads = _step(slimact.convert(copy.deepcopy(plain), policy), IMAGES, mean_square)
        typical = torch.stack([g.norm() for g in grads.values()]).median()
        for block in (2, 3):
            assert grads[f"{block}.mlp_tokens.2.bias"].norm() <= 1e-5 * typical, (seed, block)
        assert slimact.check(plain, IMAGES, policy, loss_fn=mean_square, warmup=0).passed, seed  # the first step


def test_a_layernorm_input_gradient_sums_to_zero_per_row_from_8_bit_codes():
    from slimact.functional import norm
    from slimact.policy import Policy

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 48, generator=g) * 3 + 5).requires_grad_()
    w, b = torch.rand(48, generator=g) + 0.5, torch.randn(48, generator=g)
    grad_y = torch.randn(64, 48, generator=g)
    norm(x, w, b, 1e-5, Policy().quant_config("layernorm", 2)).backward(grad_y)
    exact = torch.autograd.grad(F.layer_norm(x, [48], w, b), x, grad_y)[0]
    # Row sums up to 3.4e-3 of the row's gradient norm before; now 3.5e-7 (PyTorch's own: 4.5e-7).
    assert (x.grad.sum(-1).abs() <= 1e-5 * exact.norm(dim=-1)).all()


# --- training loops ------------------------------------------------------------------------------------------------


def _hf(name: str) -> tuple[nn.Module, torch.Tensor]:
    model = zoo.build(name, tiny=True).train()
    return model, zoo.example_inputs(model, 2, 16)["input_ids"]


def _grads(model: nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _both(loop, name: str, policy: str) -> None:
    """``loop(model, ids) -> {name: gradient}`` on the tiny zoo model ``name``, plain and converted, judged."""
    plain, ids = _hf(name)
    slim = slimact.convert(copy.deepcopy(plain), policy)
    _judge(policy, loop(plain, ids), loop(slim, ids))


def _two_losses(model, ids):
    # Two backward passes through one forward's graph: the LM loss (whose head gradients slimact computes in the
    # forward) and a loss on the last hidden state.
    torch.manual_seed(1)
    out = model(input_ids=ids, labels=ids, output_hidden_states=True)
    out.loss.backward(retain_graph=True)
    out.hidden_states[-1].square().mean().backward()
    return _grads(model)


def _intermediate(model, ids):
    # The gradient to an intermediate activation (inputs=[hidden]), then a hook that scales that tensor's gradient.
    torch.manual_seed(1)
    out = model(input_ids=ids, labels=ids, output_hidden_states=True)
    hidden = out.hidden_states[1]
    (to_hidden,) = torch.autograd.grad(out.loss, inputs=[hidden], retain_graph=True)
    hidden.register_hook(lambda g: g * 3.0)
    out.loss.backward()
    return {**_grads(model), "d loss / d hidden": to_hidden}


def _accumulated(model, ids):
    for i in range(2):
        torch.manual_seed(i)
        (model(input_ids=ids[i:i + 1], labels=ids[i:i + 1]).loss / 2).backward()
    return _grads(model)


def _two_views(model, ids):
    # SimCLR-style: one model, two views, an InfoNCE loss over both, one backward.
    torch.manual_seed(1)
    a = model(input_ids=ids, output_hidden_states=True).hidden_states[-1].mean(1)
    b = model(input_ids=ids.flip(1), output_hidden_states=True).hidden_states[-1].mean(1)
    logits = F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).t() / 0.1
    F.cross_entropy(logits, torch.arange(len(ids))).backward()
    return _grads(model)


def _first_order_maml(model, ids):
    # MAML's inner step taken with functional_call on fast weights p - lr * g (non-leaf tensors), the outer loss on
    # another batch differentiated back to the parameters (first order: the inner gradients without create_graph).
    from torch.func import functional_call

    params = dict(model.named_parameters())

    def loss_of(weights, x):
        torch.manual_seed(1)
        return functional_call(model, weights, (), {"input_ids": x, "labels": x}).loss

    grads = torch.autograd.grad(loss_of(params, ids[:1]), list(params.values()))
    loss_of({n: p - 0.1 * g for (n, p), g in zip(params.items(), grads, strict=True)}, ids[1:]).backward()
    return _grads(model)


def _adversarial_embeddings(model, ids):
    # FreeLB/PGD-style: two ascent steps on a perturbation of the input embeddings, by the gradient to it alone.
    emb = model.get_input_embeddings()(ids).detach()
    delta = torch.empty_like(emb).uniform_(-0.01, 0.01, generator=torch.Generator().manual_seed(0)).requires_grad_()
    for _ in range(2):
        torch.manual_seed(1)
        (grad,) = torch.autograd.grad(model(inputs_embeds=emb + delta, labels=ids).loss, delta)
        delta = (delta + 0.01 * grad / grad.norm()).detach().requires_grad_()
    return {"d loss / d delta": grad}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("loop", [_two_losses, _intermediate, _two_views, _adversarial_embeddings],
                         ids=lambda f: f.__name__[1:])
def test_training_loop_patterns_give_plain_gradients(loop, name, policy):
    _both(loop, name, policy)


@pytest.mark.parametrize("policy", ["tempo", "int8"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("loop", [_accumulated, _first_order_maml], ids=lambda f: f.__name__[1:])
def test_loops_calling_the_model_on_one_row_at_a_time(loop, name, policy):
    _both(loop, name, policy)


@pytest.mark.xfail(strict=True, reason="Mesa's running estimate: a call packed with the estimate of the calls before "
                   "saturates where its own range is wider (left as Mesa publishes it; 'int8' is unaffected)")
@pytest.mark.parametrize("loop", [_accumulated, _first_order_maml], ids=lambda f: f.__name__[1:])
def test_mesa_gradient_accumulation_over_small_micro_batches(loop):
    # Calls of one 16-token row: accumulating two, Llama's post-attention norm weight at cosine 0.91 in the first step,
    # 0.97-0.98 after ten steps of fresh batches (a whole batch of 4 rows per call: 0.993-0.997); MAML's outer call on
    # fast weights after the inner one, 0.85 (GPT-2 0.98).
    _both(loop, "llama", "mesa")


@pytest.mark.parametrize("policy", ["tempo", "int8"])
@pytest.mark.parametrize("name", ["llama", "x-transformers", "mamba-minimal"])
def test_a_gradient_penalty_raises_a_clear_error(name, policy):
    # d/dθ |d loss/dθ|^2 needs a double backward, which slimact's Functions refuse by name (plain PyTorch runs it:
    # eager attention for Llama, whose CPU SDPA kernels have no double backward).
    if name == "llama":
        plain = zoo.build("llama", tiny=True, attn="eager").train()
        def loss_of(m):
            return m(input_ids=IDS, labels=IDS).loss
    else:
        build, x, loss_fn, _, _ = MODELS[name]
        plain = build().train()
        def loss_of(m):
            return loss_fn(m(x))

    def penalty(model):
        grads = torch.autograd.grad(loss_of(model), list(model.parameters()), create_graph=True)
        sum(g.square().sum() for g in grads).backward()

    penalty(plain)
    slim = slimact.convert(copy.deepcopy(plain), policy)
    with pytest.raises(RuntimeError, match=r"slimact's .* cannot be differentiated twice.*create_graph=True"):
        penalty(slim)


@pytest.mark.parametrize("policy", ["tempo", "int8"])
@pytest.mark.parametrize("name", ["x-transformers", "perceiver", "rwkv"])
def test_per_sample_gradients_by_vmap_are_pytorchs(name, policy):
    # Opacus-style vmap(grad(functional_call)): slimact steps aside under torch.func (as PyTorch computes).
    from torch.func import functional_call, grad, vmap

    build, x, loss_fn, _, _ = MODELS[name]
    torch.manual_seed(0)
    plain = build().train()
    slim = slimact.convert(copy.deepcopy(plain), policy)

    def per_sample(model):
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, sample):
            out = functional_call(model, p, (sample[None],))
            return mean_square(out) if loss_fn is mean_square else F.cross_entropy(out[0, :-1], sample[1:])

        torch.manual_seed(1)
        return vmap(grad(loss), in_dims=(None, 0), randomness="same")(params, x)

    want, got = per_sample(plain), per_sample(slim)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_frozen_half_keeps_nothing_for_it_and_the_rest_train_as_plain(name):
    def frozen(model):
        for n, p in model.named_parameters():
            if ".0." in n or "wte" in n or "wpe" in n or "embed_tokens" in n:
                p.requires_grad_(False)
        return model

    plain, ids = _hf(name)
    frozen(plain)
    batch = {"input_ids": ids, "labels": ids}
    plain_bytes = slimact.profile(plain, batch).activation_bytes
    for policy in ("tempo", "int8"):
        slim = slimact.convert(copy.deepcopy(plain), policy)
        torch.manual_seed(1)
        plain.zero_grad(set_to_none=True)
        plain(**batch).loss.backward()
        torch.manual_seed(1)
        slim(**batch).loss.backward()
        want, got = _grads(plain), _grads(slim)
        assert not any(".0." in n for n in got)
        _judge(policy, want, got)
        kept = slimact.profile(slim, batch).activation_bytes
        whole = slimact.profile(slimact.convert(_hf(name)[0], policy), batch).activation_bytes
        assert kept < whole  # the frozen layer's weights need no saved input
        if policy == "int8":
            assert kept <= 0.3 * plain_bytes, kept / plain_bytes
        # Progressive unfreezing after convert: the layer now needs its input kept, and gets its gradient.
        for m in (plain, slim):
            m.requires_grad_(True)
            m.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            m(**batch).loss.backward()
        want, got = _grads(plain), _grads(slim)
        assert any(".0." in n for n in got)
        _judge(policy, want, got)
        frozen(plain)


@pytest.mark.parametrize("policy", POLICIES)
def test_an_ema_teacher_and_its_student_both_converted(policy):
    # DINO/BYOL-style: the teacher is a deep copy of the converted student, run under no_grad, moved towards the
    # student by torch._foreach_lerp_ (or p.data.mul_().add_()) after each step.
    def train(student, lerp):
        teacher = copy.deepcopy(student).requires_grad_(False)
        opt = torch.optim.SGD(student.parameters(), lr=0.1)
        targets = []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            view1, view2 = DATA + 0.1 * torch.randn(DATA.shape, generator=g), DATA.flip(1)
            with torch.no_grad():
                target = teacher(view2).softmax(-1)
            torch.manual_seed(step)
            loss = -(target * student(view1).log_softmax(-1)).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                if lerp:
                    torch._foreach_lerp_(list(teacher.parameters()), list(student.parameters()), 0.1)
                else:
                    for t, s in zip(teacher.parameters(), student.parameters(), strict=True):
                        t.data.mul_(0.9).add_(s.data, alpha=0.1)
            targets.append(target)
        return student, teacher, targets

    torch.manual_seed(0)
    plain = Perceiver().train()
    for lerp in (True, False):
        s0, t0, want = train(copy.deepcopy(plain), lerp)
        s1, t1, got = train(slimact.convert(copy.deepcopy(plain), policy), lerp)
        assert slimact.summary(t1).converted
        # The first target is the same teacher's on the same input: PyTorch's forward, bit for bit.
        assert torch.equal(got[0], want[0])
        tol = 1e-4 if policy == "tempo" else 5e-2
        for a, b in zip([*s0.parameters(), *t0.parameters()], [*s1.parameters(), *t1.parameters()], strict=True):
            assert (b - a).norm() <= tol * a.norm().clamp_min(1.0)
        # The teacher's forward under no_grad leaves its state (Mesa's running estimates) as it was.
        state = [b.clone() for b in (*t1.buffers(), *estimates(t1).values())]
        with torch.no_grad():
            t1(DATA)
        assert all(torch.equal(a, b) for a, b in zip(state, (*t1.buffers(), *estimates(t1).values()), strict=True))


def test_summary_does_not_count_a_loss_computed_outside_the_model_as_slimacts():
    # mamba-minimal ties its head to the embedding and returns logits; the training loop computes the loss. The
    # routing would fuse an F.cross_entropy in the model's forward, but none runs there: summary(model, inputs)
    # listed "(loss)" as a converted lmloss and counted the loss's bytes as covered (coverage 23.8%, 22.8% in fact).
    torch.manual_seed(0)
    slim = slimact.convert(Mamba().train(), "int8")
    assert slimact.summary(slim).modules["(loss)"] == "lmloss"  # (without inputs: what convert set up)
    report = slimact.summary(slim, IDS, loss_fn=lm_loss)
    assert "(loss)" not in report.modules and "lmloss" not in report.converted
    assert "no F.cross_entropy" in report.skipped["(loss)"] and report.uncovered["(loss)"] > 0
    # A model whose forward computes its loss still has it fused (nanoGPT, called with targets).
    from _nano import NanoGPT, batch, loss_of

    nano = slimact.convert(NanoGPT().train(), "int8")
    assert slimact.summary(nano, batch(), loss_fn=loss_of).modules["(loss)"] == "lmloss"


# --- hooks on the logits of a fused LM loss ---------------------------------------------------------------------


def _fsdp_pre_backward(grad):
    """Stands for FSDP2's ``FSDPState._pre_backward`` (registered on each output tensor of a sharded module's
    forward): it returns the gradient unchanged."""
    return grad


_fsdp_pre_backward.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_state"


def _hooked_logits(model, ids, how):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = model(input_ids=ids, labels=ids)
    if how == "hook":  # registered after the forward, where the loss was computed (Hugging Face, with labels)
        out.logits.register_hook(lambda g: g * 0.5)
    elif how == "autograd.grad":
        return torch.autograd.grad(out.loss, inputs=[out.logits], allow_unused=True)[0]
    elif how == "retain_grad":
        out.logits.retain_grad()
    elif how == "bookkeeping":  # FSDP2's pre-backward hook on every output of the forward, as it registers it
        out.logits.register_hook(_fsdp_pre_backward)
    else:  # on a view made after the forward: no part of the loss's graph, so the hook sees nothing, in plain too
        out.logits.view(-1, out.logits.shape[-1]).register_hook(lambda g: g * 0.5)
    out.loss.backward()
    return _grads(model), (out.logits.grad if how == "retain_grad" else None)


@pytest.mark.parametrize(("how", "policy"), [
    (how, policy) for how in ("hook", "retain_grad", "autograd.grad") for policy in ("tempo", "int8", "keep_logits")
    # (not autograd.grad with keep_logits: the logits are then computed tensors outside the loss's graph, which
    # slimact cannot intercept after the forward; PyTorch's own 'unused' error, or None where allowed)
    if (how, policy) != ("autograd.grad", "keep_logits")
])
def test_a_hook_on_the_logits_of_a_fused_lm_loss_is_refused_not_ignored(how, policy):
    # The fused LM loss computes its gradients in the forward and never builds the logits (or, with keep_logits,
    # never passes a gradient through them): a hook or retain_grad on output.logits after the forward was silently
    # ignored (tempo: every gradient off by the hook's factor, relative difference 1.0; logits.grad None where plain
    # has it), autograd.grad(loss, inputs=[output.logits], allow_unused=True) gave None. Now a clear error; with the
    # loss excluded, plain's gradients.
    plain, ids = _hf("gpt2")
    if how == "autograd.grad":
        want = _hooked_logits(plain, ids, how)
        with pytest.raises(RuntimeError, match="on logits an LM loss was computed from, after that loss"):
            _hooked_logits(slimact.convert(copy.deepcopy(plain), policy), ids, how)
        written = slimact.convert(copy.deepcopy(plain), slimact.PRESETS["tempo"].replace(exclude=("(loss)",)))
        torch.testing.assert_close(_hooked_logits(written, ids, how), want)
        return
    want, want_logits = _hooked_logits(plain, ids, how)
    pol = slimact.Policy(keep_logits=True) if policy == "keep_logits" else policy
    with pytest.raises(RuntimeError, match="on logits an LM loss was computed from, after that loss"):
        _hooked_logits(slimact.convert(copy.deepcopy(plain), pol), ids, how)
    written = slimact.convert(copy.deepcopy(plain), slimact.PRESETS["tempo"].replace(exclude=("(loss)",)))
    assert "(loss)" not in slimact.summary(written).modules
    got, got_logits = _hooked_logits(written, ids, how)
    assert_gradients_equal(want, got)
    if how == "retain_grad":
        torch.testing.assert_close(got_logits, want_logits)


@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_a_hook_on_a_view_of_the_logits_made_after_the_forward_is_ignored_as_in_plain(policy):
    plain, ids = _hf("llama")
    want, _ = _hooked_logits(plain, ids, "view")
    got, _ = _hooked_logits(slimact.convert(copy.deepcopy(plain), policy), ids, "view")
    _judge(policy, want, got)


@pytest.mark.parametrize("policy", ["tempo", "int8", "keep_logits"])
def test_fsdp2s_own_hook_on_the_logits_of_a_fused_loss_is_let_through(policy):
    # FSDP2 hooks every output of a sharded module's forward (its pre-backward unshard), logits a fused loss was
    # taken from included: the refusal above broke every FSDP2 step of a converted HF model called with labels
    # (tests/test_distributed.py). Such a hook changes no gradient, and is never called on outputs outside the loss's
    # graph: let through, and the step's gradients are plain's.
    plain, ids = _hf("gpt2")
    want, _ = _hooked_logits(plain, ids, "bookkeeping")
    pol = slimact.Policy(keep_logits=True) if policy == "keep_logits" else policy
    got, _ = _hooked_logits(slimact.convert(copy.deepcopy(plain), pol), ids, "bookkeeping")
    _judge("tempo" if policy == "tempo" else "int8", want, got)


def test_an_exclude_pattern_naming_the_loss_leaves_it_as_written():
    # convert reported "(loss)" left alone ("matched by policy exclude patterns") and, in the same summary, converted
    # as "lmloss": the routing fused it all the same.
    plain, ids = _hf("gpt2")
    want, _ = _hooked_logits(plain, ids, "hook")
    slim = slimact.convert(copy.deepcopy(plain), slimact.PRESETS["int8"].replace(exclude=("(loss)",)))
    summary = slimact.summary(slim)
    assert "(loss)" not in summary.modules and "exclude" in summary.skipped["(loss)"]
    got, _ = _hooked_logits(slim, ids, "hook")
    assert_gradients_close(want, got)
    assert all((got[n] - want[n]).norm() <= 0.05 * want[n].norm() for n in want)  # (the hook's factor 0.5 applied)
