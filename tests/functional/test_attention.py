import pytest
import torch
from torch import nn

import slimact
from slimact._metrics import sqnr_db
from slimact.functional.attention import softmax_dropout_matmul
from slimact.quant import QuantConfig


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
    slimact.convert(model, "int8")
    assert model.config._attn_implementation == "slimact"
    assert slimact.summary(model).converted["attention"] == 1
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    slimact.revert(model)
    assert model.config._attn_implementation == "eager"
    assert not any("slimact" in n for m in model.modules() for n in vars(m))


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
