"""Hugging Face models converted with "mesa": every gradient close to the exact one, bytes down to <= 0.30x."""

import pytest
import torch

import slimact
from slimact._metrics import cosine
from slimact.nn import SlimModule

transformers = pytest.importorskip("transformers")


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        max_position_embeddings=64,
    )
    model = transformers.BertForMaskedLM(cfg)
    ids = torch.randint(0, 96, (2, 32))
    return model, {"input_ids": ids, "labels": ids}


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 96, (2, 32))
    return model, {"input_ids": ids, "labels": ids}


def _vit():
    cfg = transformers.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256, num_labels=10,
    )
    model = transformers.ViTForImageClassification(cfg)
    return model, {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.randint(0, 10, (4,))}


MODELS = {"bert": _bert, "gpt2": _gpt2, "vit": _vit}


def _grads(model, inputs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks
    model(**inputs).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
def test_mesa_gradients_close_and_bytes_down(name):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.config._attn_implementation = "eager"
    model.train()
    exact = _grads(model, inputs)
    plain = slimact.profile(model, inputs)
    slimact.convert(model, "mesa")
    converted_names = {n for n, m in model.named_modules() if isinstance(m, SlimModule)}
    kinds = slimact.summary(model).converted
    assert {"linear", "layernorm", "gelu", "dropout"} <= set(kinds), kinds
    for _ in range(3):  # let the running estimates settle as in training
        approx = _grads(model, inputs)
    assert exact.keys() == approx.keys()
    # A gradient that is zero in exact arithmetic (the key bias: softmax ignores a per-row shift; the
    # embeddings of tokens not in the batch) is noise on both sides: cosine means nothing there. With 8-bit
    # q, k and output the cancellation is no longer exact; the residue is quantisation noise, a fraction of
    # a step (1/255) of a typical gradient.
    typical = torch.stack([g.norm() for g in exact.values()]).median()
    for n in exact:
        if exact[n].norm() <= 1e-6 * typical:
            assert approx[n].norm() <= 1e-3 * typical, n
        else:
            assert cosine(exact[n], approx[n]) >= 0.99, n
    conv = slimact.profile(model, inputs)
    before = sum(b for m, b in plain.by_module.items() if m in converted_names)
    after = sum(b for m, b in conv.by_module.items() if m in converted_names)
    assert after <= 0.30 * before, (after, before)
