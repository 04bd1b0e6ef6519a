"""Hugging Face models under "tempo": the plain model's gradients (to float rounding), fewer bytes, and a
saving from each technique (removing it from the policy keeps more bytes)."""

import pytest
import torch

import slimact
from slimact import PRESETS

transformers = pytest.importorskip("transformers")


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        max_position_embeddings=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )
    ids = torch.randint(0, 96, (2, 32))
    labels = torch.where(torch.rand(2, 32) < 0.3, ids, torch.full_like(ids, -100))
    return transformers.BertForMaskedLM(cfg), {"input_ids": ids, "labels": labels}


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    ids = torch.randint(0, 96, (2, 32))
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    ids = torch.randint(0, 96, (2, 32))
    return transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}


MODELS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama}


def _grads(model, inputs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks
    out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
def test_tempo_is_exact_and_each_technique_saves(name):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.config._attn_implementation = "eager"
    model.train()
    loss0, exact = _grads(model, inputs)
    plain = slimact.profile(model, inputs).activation_bytes
    slimact.convert(model, "tempo")
    kinds = set(slimact.summary(model).converted)
    loss1, approx = _grads(model, inputs)
    torch.testing.assert_close(loss1, loss0)
    assert exact.keys() == approx.keys()
    for n in exact:
        torch.testing.assert_close(approx[n], exact[n], rtol=1e-4, atol=1e-5, msg=n)
    tempo = slimact.profile(model, inputs).activation_bytes
    assert tempo < plain
    expected = {"layernorm", "gelu", "dropout", "lmloss"} if name != "llama" else {"rmsnorm", "mlp", "lmloss"}
    expected.add("attention")
    assert expected <= kinds, kinds
    for kind in sorted(kinds):
        ablated = PRESETS["tempo"].replace(kinds=tuple(k for k in PRESETS["tempo"].kinds if k != kind))
        slimact.convert(model, ablated)
        without = slimact.profile(model, inputs).activation_bytes
        assert without > tempo, f"{kind}: {without} <= {tempo}"
    slimact.convert(model, "tempo")
