"""Converted models in the training patterns that went wrong (issue 18): double backward, in-place activation
modules, in-place ops on a layer's output (wav2vec2/HuBERT for CTC), empty batches."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import slimact
from _harness import assert_gradients_close, assert_gradients_equal, gradients, tiny_hf
from slimact._metrics import sqnr_db
from slimact.functional.activation import FORMS, INPLACE_ERROR_BOUNDS, MINIMUM, reference

POLICIES = ["tempo", "int8"]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))


class _Encoder(nn.Module):
    """Attention and norms: a Transformer encoder layer (nn.MultiheadAttention, LayerNorm, GELU) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation="gelu", batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.norm(self.layer(x)))


MODELS = {"mlp": (_mlp, (16, 8)), "encoder": (_Encoder, (2, 6, 32))}


def _first_order(model, x):
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _penalty(model, x):
    """The gradient of a gradient penalty: d/dθ |d loss / dθ|^2 (double backward; PyTorch's CPU flash attention
    has no double backward, its math attention has)."""
    model.zero_grad(set_to_none=True)
    params = list(model.parameters())
    with sdpa_kernel(SDPBackend.MATH):
        grads = torch.autograd.grad(model(x).square().sum(), params, create_graph=True)
    sum(g.square().sum() for g in grads).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("policy", POLICIES)
def test_double_backward_raises_a_clear_error_and_first_order_stays_right(policy, name):
    build, shape = MODELS[name]
    plain = build().train()
    x = torch.randn(shape)
    slim = slimact.convert(copy.deepcopy(plain), policy)
    assert slimact.summary(slim).converted
    exact, approx = _first_order(plain, x), _first_order(slim, x)
    if policy == "tempo":
        for n in exact:
            torch.testing.assert_close(approx[n], exact[n], rtol=1e-4, atol=1e-5, msg=n)
    else:
        assert_gradients_close(exact, approx)
    with pytest.raises(RuntimeError, match=r"cannot be differentiated twice.*filter_fn.*set_detect_anomaly"):
        _penalty(slim, x)
    # Reverted: PyTorch's own double backward again, equal to the plain model's.
    slimact.revert(slim)
    want, got = _penalty(plain, x), _penalty(slim, x)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_recomputation_is_no_double_backward(reentrant):
    # Checkpointing runs the forward again inside the backward (with grad mode on): that must not trip the guard.
    from torch.utils.checkpoint import checkpoint

    plain = _Encoder().train()
    slim = slimact.convert(copy.deepcopy(plain), "tempo")
    x = torch.randn(2, 6, 32, requires_grad=True)  # (a reentrant checkpoint needs an input that requires grad)
    exact = _first_order(plain, x)
    slim.zero_grad()
    checkpoint(slim, x, use_reentrant=reentrant).square().sum().backward()
    for n, p in slim.named_parameters():
        torch.testing.assert_close(p.grad, exact[n], rtol=1e-4, atol=1e-5, msg=n)


# --- in-place activation modules ---------------------------------------------------------------------------


class _InplaceActivation(nn.Module):
    """An activation module writing its result into its input (valid in plain PyTorch: the formula reads a copy),
    with an ``inplace`` attribute as torch's modules have, or (``announced=False``) nothing saying so."""

    def __init__(self, form: str, announced: bool = True) -> None:
        super().__init__()
        self.form = form
        if announced:
            self.inplace = True

    def forward(self, x):
        return x.copy_(reference(self.form, x.clone()))


class _Net(nn.Module):
    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, x):
        h = x * 1.0
        y = self.act(h)
        # model code reading h after the activation wrote into it (as with the plain module, h is y now)
        return y * 2 + h.square()


#: name -> (form, module factory)
ACTIVATIONS = {
    "nn.SiLU": ("silu", lambda: nn.SiLU(inplace=True)),
    "nn.ReLU": ("relu", lambda: nn.ReLU(inplace=True)),
    **{f"module-{form}": (form, lambda form=form: _InplaceActivation(form)) for form in FORMS},
    "silu-unannounced": ("silu", lambda: _InplaceActivation("silu", announced=False)),
}


def _points(form: str) -> torch.Tensor:
    """Points on every segment of the activation: both sides of its minimum, the far tails, -3, 0, (1.1, 3.0)."""
    x = torch.cat([torch.linspace(-8, 8, 321), torch.tensor([-3.0, -1.0, 0.5, 1.5, 2.5])])
    if form in MINIMUM:
        x = torch.cat([x, MINIMUM[form] + torch.tensor([-0.3, -0.05, 0.05, 0.3])])
    return x[x != 0]  # the derivative of ReLU at 0 is a convention


def _grad(model, x):
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("policy", POLICIES)
def test_an_in_place_activation_module_keeps_what_its_backward_needs(policy, name):
    form, build = ACTIVATIONS[name]
    plain = _Net(build())
    slim = slimact.convert(copy.deepcopy(plain).train(), policy)
    assert isinstance(slim.act, slimact.nn.SlimModule)
    x = _points(form)
    out0, g0 = _grad(plain.train(), x)
    out1, g1 = _grad(slim, x)
    torch.testing.assert_close(out1, out0)  # forward (and its in-place write) as the plain module's
    if form == "relu" or (form == "relu2" and policy == "tempo"):  # (relu2's y' = 2 sqrt(y): sqrt's rounding)
        torch.testing.assert_close(g1, g0)
    elif policy == "tempo":
        # the in-place path's stated bound on y' (fp32), times the factor 2 in _Net's y * 2 + h^2
        radius, far, near = INPLACE_ERROR_BOUNDS[torch.float32]
        err = (g1 - g0).abs() / 2
        assert err.max() <= near and err[(x - MINIMUM[form]).abs() >= radius].max() <= far
    else:
        assert sqnr_db(g0, g1) >= 30


def test_an_unannounced_in_place_activation_refuses_to_keep_its_overwritten_input():
    # Under an 8-bit policy a NaN input keeps x itself; an in-place forward would have overwritten it.
    slim = slimact.convert(_Net(_InplaceActivation("silu", announced=False)).train(), "int8")
    x = torch.tensor([-1.0, float("nan"), 2.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="wrote into its input"):
        slim(x)


# --- wav2vec2 / HuBERT for CTC: in-place masking of a Linear's output ------------------------------------


def _ctc(name: str):
    transformers = pytest.importorskip("transformers")
    cfg = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(32, 32),
               conv_stride=(5, 2), conv_kernel=(10, 3), vocab_size=32, num_conv_pos_embeddings=16,
               num_conv_pos_embedding_groups=2, mask_time_prob=0.2, mask_time_length=4)
    if name == "wav2vec2":
        model = transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(**cfg))
    else:
        model = transformers.HubertForCTC(transformers.HubertConfig(**cfg))
    gen = torch.Generator().manual_seed(0)
    inputs = {"input_values": torch.randn(2, 1600, generator=gen),
              "labels": torch.randint(1, 32, (2, 10), generator=gen)}
    return model.train(), inputs


def _ctc_step(model, inputs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    np.random.seed(1)  # the time masks (SpecAugment) are drawn with numpy
    out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), gradients(model)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["wav2vec2", "hubert"])
def test_ctc_speech_models_train_converted(name, policy):
    model, inputs = _ctc(name)
    loss0, exact = _ctc_step(model, inputs)
    slimact.convert(model, policy)
    loss1, approx = _ctc_step(model, inputs)
    torch.testing.assert_close(loss1, loss0)
    if policy == "tempo":
        assert_gradients_equal(exact, approx)
    else:
        assert_gradients_close(exact, approx)


# --- empty batches -------------------------------------------------------------------------------------------


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.SiLU(),
                         nn.Flatten(), nn.Linear(8 * 6 * 6, 4))


def _outcome(model, inputs):
    """``(output, {name: grad})`` of a training step, or the error it raised."""
    try:
        torch.manual_seed(1)
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        logits = out.logits if hasattr(out, "logits") else out
        logits.sum().backward()
    except RuntimeError as e:
        return e
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["cnn", "gpt2", "llama", "bert"])
def test_an_empty_batch_runs_as_in_pytorch(name, policy):
    if name == "cnn":
        model, inputs = _cnn(), torch.randn(0, 3, 8, 8)
    else:
        model, inputs = tiny_hf(name)
        inputs = {"input_ids": inputs["input_ids"][:0]}
    model.train()
    plain = _outcome(model, inputs)
    slimact.convert(model, policy)
    slim = _outcome(model, inputs)
    if isinstance(plain, Exception):
        # transformers 5's attention reshapes with a -1 next to the empty batch dim: the plain model raises, and
        # the converted one raises the same error, in the model's code, not in slimact's
        assert isinstance(slim, type(plain)) and str(slim) == str(plain)
        return
    assert not isinstance(slim, Exception), slim
    torch.testing.assert_close(slim[0], plain[0])
    for n, g in plain[1].items():
        torch.testing.assert_close(slim[1][n], g, msg=n)


def test_the_double_backward_error_points_to_anomaly_mode_which_names_the_forward_call():
    # The error is raised in the backward, where no module is known; the message suggests anomaly mode, whose
    # warning then gives the forward's traceback: the line of model code that called the converted module.
    slim = slimact.convert(_mlp(), "tempo")
    x = torch.randn(3, 8, requires_grad=True)
    with torch.autograd.set_detect_anomaly(True), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y = slim(x).sum()  # the call named
        with pytest.raises(RuntimeError, match="set_detect_anomaly"):
            torch.autograd.grad(y, x, create_graph=True)
    traces = [str(w.message) for w in seen if "Traceback of forward call" in str(w.message)]
    assert traces and "y = slim(x).sum()  # the call named" in traces[0]
