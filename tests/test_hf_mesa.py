"""Hugging Face models converted with "mesa": every gradient close to the exact one, bytes down to <= 0.30x."""

import pytest
import torch

import slimact
from _harness import assert_gradients_close, loss_grads, tiny_hf
from slimact.nn import SlimModule

pytest.importorskip("transformers")


KINDS = {
    "bert": {"linear", "layernorm", "gelu", "dropout", "attention"},
    "gpt2": {"linear", "layernorm", "gelu", "dropout", "attention"},
    "vit": {"linear", "layernorm", "gelu", "dropout", "attention"},
    "llama": {"linear", "rmsnorm", "mlp", "attention"},  # gated MLP and grouped-query attention
}


@pytest.mark.parametrize("name", list(KINDS))
def test_mesa_gradients_close_and_bytes_down(name):
    torch.manual_seed(0)
    model, inputs = tiny_hf(name)
    model.config._attn_implementation = "eager"
    model.train()
    _, exact = loss_grads(model, inputs)
    plain = slimact.profile(model, inputs)
    slimact.convert(model, "mesa")
    converted_names = {n for n, m in model.named_modules() if isinstance(m, SlimModule)}
    kinds = slimact.summary(model).converted
    assert KINDS[name] <= set(kinds), kinds
    for _ in range(3):  # let the running estimates settle as in training
        _, approx = loss_grads(model, inputs)
    assert_gradients_close(exact, approx)
    conv = slimact.profile(model, inputs)
    before = sum(b for m, b in plain.by_module.items() if m in converted_names)
    after = sum(b for m, b in conv.by_module.items() if m in converted_names)
    assert after <= 0.30 * before, (after, before)
