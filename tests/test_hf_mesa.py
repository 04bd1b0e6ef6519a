"""Hugging Face models converted with "mesa": every gradient close to the exact one, bytes down to <= 0.30x."""

import copy

import pytest
import torch

import slimact
from _harness import assert_gradients_close, estimates, loss_grads, tiny_hf
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


def _albert(layers: int):
    """A tiny ALBERT: one encoder layer, its attention included, shared by all ``layers`` depths."""
    import transformers

    cfg = transformers.AlbertConfig(
        vocab_size=96, embedding_size=16, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (2, 16), generator=gen)
    return transformers.AlbertForMaskedLM(cfg), {"input_ids": ids, "labels": ids}


def test_an_attention_module_called_at_every_depth_keeps_one_estimate_per_call():
    """ALBERT runs one attention module at each of its depths, on activations whose range grows with depth. Its
    running estimates are kept per call, as a converted Linear's are: before, the attention function blended all
    six calls into one estimate, which saturated the deeper calls' query and key codes (cosine 0.929 and 0.944 for
    the query and key weights in the first step)."""
    torch.manual_seed(0)
    model, inputs = _albert(6)
    model.train()
    _, exact = loss_grads(model, inputs)
    slimact.convert(model, "mesa")
    for _ in range(3):  # the first step, and the estimates settled
        _, approx = loss_grads(model, inputs)
        assert_gradients_close(exact, approx)
    attention = model.albert.encoder.albert_layer_groups[0].albert_layers[0].attention
    sites = sorted(n for n in estimates(attention) if n.startswith("_slimact_q_") and n.endswith("_lo"))
    assert sites == ["_slimact_q_1_lo", "_slimact_q_2_lo", "_slimact_q_3_lo", "_slimact_q_4_lo",
                     "_slimact_q_5_lo", "_slimact_q_lo"], sites
    slimact.revert(model)
    assert not estimates(attention)
    assert not [k for k in attention.__dict__ if k.startswith("_slimact_")]


def test_albert_called_through_its_backbone_and_head_by_the_training_loop_keeps_one_estimate_per_depth():
    """A training loop that calls the backbone and the head itself (``model.albert(...)``, ``model.predictions(h)``)
    never runs the converted model's forward. Its calls took new call sites step after step: after 4 steps the one
    attention module held 16 query estimates, the last blended over every depth from the third step on (under
    "mesa" after 20 steps of fresh batches: 164 estimates in all, worst gradient at cosine 0.965 from plain's). A
    step now also begins after a backward: the loop keeps the sites the model's own forward keeps, and with
    round-to-nearest running estimates computes its gradients bit for bit (under "mesa": 46 estimates after 20 steps,
    worst cosine 0.991, as through the forward)."""
    torch.manual_seed(0)
    plain, _ = _albert(6)
    policy = slimact.Policy(scale="running")
    by_forward = slimact.convert(copy.deepcopy(plain).train(), policy)
    by_loop = slimact.convert(copy.deepcopy(plain).train(), policy)

    def grads(m, logits, ids):
        m.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1)).backward()
        return [p.grad.clone() for p in m.parameters() if p.grad is not None]

    gen = torch.Generator().manual_seed(3)
    for step in range(4):  # fresh batches
        ids = torch.randint(0, 96, (2, 16), generator=gen)
        expected = grads(by_forward, by_forward(input_ids=ids).logits, ids)
        got = grads(by_loop, by_loop.predictions(by_loop.albert(input_ids=ids.clone()).last_hidden_state), ids)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), step
    attention = by_loop.albert.encoder.albert_layer_groups[0].albert_layers[0].attention
    sites = sorted(n for n in estimates(attention) if n.startswith("_slimact_q") and n.endswith("_lo"))
    assert sites == ["_slimact_q_1_lo", "_slimact_q_2_lo", "_slimact_q_3_lo", "_slimact_q_4_lo",
                     "_slimact_q_5_lo", "_slimact_q_lo"], sites
    assert estimates(by_loop).keys() == estimates(by_forward).keys()
