"""Experts modules' clamped gated unit (gpt-oss's ``_apply_gate`` and its kin) computed by slimact: which gates the
probe admits, models trained through it, and how it is installed and removed."""

import copy
import importlib
import io

import pytest
import torch
from torch import nn

import slimact
from _harness import assert_gradients_close, assert_gradients_equal, loss_grads
from slimact.functional.clamped_glu import GateForm
from slimact.nn.clamped_glu import GATE_ATTR, Gate, gate_form


class _Experts(nn.Module):
    """An experts module as transformers writes them: ``_apply_gate`` between the up and down projections."""

    def __init__(self, limit=7.0, alpha=1.702):
        super().__init__()
        self.up = nn.Parameter(torch.randn(8, 16) / 4)
        self.down = nn.Parameter(torch.randn(8, 8) / 4)
        self.limit, self.alpha = limit, alpha

    def _apply_gate(self, gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu

    def forward(self, x):
        return self._apply_gate(x @ self.up) @ self.down


class _Halves(_Experts):  # MiniMax M3's and the privacy filter's: halves, not interleaved
    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1.0) * glu


class _Silu(_Experts):  # Hunyuan V4's, GLM-5 Next's, DeepSeek V4's
    def __init__(self):
        super().__init__(limit=10.0)
        del self.alpha
        self.swiglu_limit = self.limit
        del self.limit

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(min=None, max=self.swiglu_limit)
        up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return nn.functional.silu(gate) * up


class _ActThenClamp(_Silu):  # Step 3.7's: the activation before the clamp
    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate).clamp(max=self.swiglu_limit) * up.clamp(-self.swiglu_limit, self.swiglu_limit)


class _GateOnlyClamped(_Experts):
    def _apply_gate(self, gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu


class _Unclamped(_Experts):  # Beam's: silu(gate) * up, no limit (routed as an activation and a product)
    def __init__(self):
        super().__init__()
        del self.limit

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up


class _Softcapped(_Experts):
    def _apply_gate(self, gate_up):
        return super()._apply_gate(torch.tanh(gate_up / 30) * 30)


@pytest.mark.parametrize(("cls", "expected"), [
    (_Experts, GateForm(True, 7.0, 1.702, 1.0)),
    (_Halves, GateForm(False, 7.0, 1.702, 1.0)),
    (_Silu, GateForm(False, 10.0, None, 0.0)),
    (_ActThenClamp, None),
    (_GateOnlyClamped, None),
    (_Unclamped, None),
    (_Softcapped, None),
], ids=lambda v: getattr(v, "__name__", "") if isinstance(v, type) else "")
def test_the_probe_admits_a_gate_only_where_it_is_one_of_the_forms(cls, expected):
    torch.manual_seed(0)
    assert gate_form(cls()) == expected


def test_a_gate_set_on_the_instance_is_left_as_written():
    experts = _Experts()
    experts._apply_gate = lambda gate_up: gate_up[..., ::2]
    assert gate_form(experts) is None


class _Moe(nn.Module):
    def __init__(self, cls=_Experts):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.experts = cls()

    def forward(self, x):
        return self.experts(self.proj(x) * 8)  # (* 8: values beyond the limit)


def test_install_revert_reconvert_pickle_exclude_and_eval():
    torch.manual_seed(0)
    plain = _Moe()
    x = torch.randn(4, 6, 8)
    slim = slimact.convert(copy.deepcopy(plain), "int8")
    assert isinstance(slim.experts.__dict__[GATE_ATTR], Gate)
    assert "clamped gated unit computed by slimact" in slimact.summary(slim).skipped["experts"]
    out = slim(x)
    assert type(slim.experts._apply_gate(torch.randn(3, 16, requires_grad=True)).grad_fn).__name__ == (
        "_ClampedGLUBackward")
    torch.testing.assert_close(out, plain(x), rtol=0, atol=0)  # the forward is the model's
    slimact.convert(slim, "tempo")  # again: one gate, the new policy's
    assert isinstance(slim.experts.__dict__[GATE_ATTR], Gate)
    loaded = torch.load(io.BytesIO(_saved(slim)), weights_only=False)
    assert isinstance(loaded.experts.__dict__[GATE_ATTR], Gate)
    (l0, g0), (l1, g1) = _step(plain, x), _step(loaded, x)
    torch.testing.assert_close(l1, l0)
    assert_gradients_equal(g0, g1)
    slimact.revert(slim)
    assert GATE_ATTR not in slim.experts.__dict__
    left = slimact.convert(copy.deepcopy(plain), "int8", filter_fn=lambda m, name: name != "experts")
    assert GATE_ATTR not in left.experts.__dict__
    by_pattern = slimact.convert(copy.deepcopy(plain), slimact.Policy(exclude=("experts",)))
    assert GATE_ATTR not in by_pattern.experts.__dict__
    no_silu = slimact.convert(copy.deepcopy(plain), slimact.Policy(kinds=("linear",)))
    assert GATE_ATTR not in no_silu.experts.__dict__
    slim = slimact.convert(copy.deepcopy(plain), "int8").eval()
    with torch.no_grad():
        torch.testing.assert_close(slim(x), plain(x), rtol=0, atol=0)


@pytest.mark.parametrize("reloaded", [False, True], ids=["fresh", "unpickled"])
def test_an_experts_module_copied_into_the_model_after_convert_is_plain_after_revert(reloaded):
    # peft's modules_to_save deep-copies the experts module: the copy kept slimact's Gate through revert and went on
    # packing its gated unit 8-bit (a helper's review: GPT-OSS, a gradient 2.5e-3 from plain's); and where the model
    # had been unpickled, the copy's hooks were a routing of their own revert did not reach.
    torch.manual_seed(0)
    plain, x = _Moe(), torch.randn(4, 6, 8)
    slim = slimact.convert(copy.deepcopy(plain), "int8")
    if reloaded:
        slim = torch.load(io.BytesIO(_saved(slim)), weights_only=False)
    slim.experts = copy.deepcopy(slim.experts)
    slimact.revert(slim)
    assert not [m for m in slim.modules() if GATE_ATTR in m.__dict__]
    assert not [h for m in slim.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    (l0, g0), (l1, g1) = _step(plain, x), _step(slim, x)
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    assert_gradients_equal(g0, g1)


def _step(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _saved(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    return buf.getvalue()


GATE_MODELS = [("gpt_oss", "GptOssForCausalLM"), ("hy_v4", "HYV4ForCausalLM"),
               ("deepseek_v4", "DeepseekV4ForCausalLM")]


@pytest.mark.parametrize("policy", ["tempo", "int8"])
@pytest.mark.parametrize(("model_type", "cls"), GATE_MODELS, ids=[m for m, _ in GATE_MODELS])
def test_models_with_a_clamped_gate_train_through_it_and_keep_less(model_type, cls, policy, monkeypatch):
    from slimact.zoo import build_auto, tiny_config, tiny_inputs

    torch.manual_seed(0)
    plain = build_auto(cls, tiny_config(model_type)).train()
    inputs = tiny_inputs(plain, "causal-lm", padded=True)
    slim = slimact.convert(copy.deepcopy(plain), policy)
    gated = [m for m in slim.modules() if isinstance(m.__dict__.get(GATE_ATTR), Gate)]
    assert gated
    (loss0, g0), (loss1, g1) = loss_grads(plain, inputs), loss_grads(slim, inputs)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    if policy == "tempo":
        assert_gradients_equal(g0, g1)
    else:
        assert_gradients_close(g0, g1)

    def experts(model):
        return sum(e.nbytes for e in slimact.profile(model, inputs).entries if e.module.endswith("experts"))

    monkeypatch.setattr(importlib.import_module("slimact.convert"), "gate_form", lambda module: None)
    as_written = experts(slimact.convert(copy.deepcopy(plain), policy))
    assert experts(slim) < as_written


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_gate_and_shared_masks_under_gradient_checkpointing(reentrant):
    # A checkpointed layer's recompute (in the backward, outside any forward) packs its masks per call and runs the
    # gate again: the same saved shapes as its first forward, and plain's gradients.
    from slimact.zoo import build_auto, tiny_config, tiny_inputs

    config = tiny_config("gpt_oss")
    config.num_hidden_layers, config.layer_types = 4, ["sliding_attention", "full_attention"] * 2
    torch.manual_seed(0)
    plain = build_auto("GptOssForCausalLM", config).train()
    inputs = tiny_inputs(plain, "causal-lm", padded=True)
    slim = slimact.convert(copy.deepcopy(plain), "tempo")
    slim.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    (loss0, g0), (loss1, g1) = loss_grads(plain, inputs), loss_grads(slim, inputs)
    torch.testing.assert_close(loss1, loss0)
    assert_gradients_equal(g0, g1)


def test_a_limit_set_after_convert_is_the_one_clamped_at():
    # The gate's form was probed with the module's limit at convert time: one set after (a schedule, a config
    # loaded into the module) was ignored, the forward clamping at the old limit. Now the gate runs as written,
    # with a warning, and a second convert probes the new limit.
    torch.manual_seed(0)
    plain = _Moe()
    x = torch.randn(4, 6, 8)
    slim = slimact.convert(copy.deepcopy(plain), "tempo")
    for model in (plain, slim):
        model.experts.limit = 3.0
    with pytest.warns(UserWarning, match="changed since convert probed its _apply_gate"):
        (l1, g1) = _step(slim, x)
    (l0, g0) = _step(plain, x)
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    assert_gradients_equal(g0, g1)
    slimact.convert(slim, "tempo")
    assert slim.experts.__dict__[GATE_ATTR].form.limit == 3.0
    (l2, g2) = _step(slim, x)
    torch.testing.assert_close(l2, l0, rtol=0, atol=0)
    assert_gradients_equal(g0, g2)
