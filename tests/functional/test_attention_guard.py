"""The score error guard (:mod:`slimact.functional.attention_guard`): attention whose 8-bit ``q``/``k`` would put
a large error on the scores (QK-normalised, unscaled: Gemma 3n/4, EmbeddingGemma) keeps them exact, so its
gradients stay within the int8 floor; ordinary attention stays 8-bit."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slimact
from slimact.functional.attention_guard import MAX_SCORE_ERROR, checked_score_error, score_error
from slimact.policy import PRESETS
from slimact.quant import QuantConfig


class _QKNormAttention(nn.Module):
    """Self-attention with RMS-normalised q and k and the given score scale (Gemma 4: ``scale = 1.0``)."""

    def __init__(self, dim=64, heads=4, scale=1.0):
        super().__init__()
        self.heads, self.scale = heads, scale
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.RMSNorm(dim // heads)
        self.k_norm = nn.RMSNorm(dim // heads)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = (y.reshape(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        o = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True, scale=self.scale)
        return self.out(o.transpose(1, 2).reshape(b, t, e))


def _cfg():
    return PRESETS["int8"].quant_config("attention", 4)


def _unsafe(q, k, scale, cfg):
    """What the fused attention decides (``functional.attention``): ``None`` where the guard does not check."""
    error = checked_score_error(q, k, scale, cfg)
    return None if error is None else bool(error > MAX_SCORE_ERROR)


def test_normalised_unscaled_scores_keep_q_k_v_exact_and_ordinary_attention_stays_8bit():
    torch.manual_seed(0)
    q, k = F.rms_norm(torch.randn(2, 4, 32, 16), (16,)), F.rms_norm(torch.randn(2, 4, 32, 16), (16,))
    assert score_error(q, k, 1.0, _cfg()) > MAX_SCORE_ERROR
    assert _unsafe(q, k, 1.0, _cfg()) is True
    assert _unsafe(q, k, 16**-0.5 / 8, _cfg()) is False  # the same tensors, a small scale
    q, k = 0.3 * torch.randn(2, 4, 32, 16), 0.3 * torch.randn(2, 2, 32, 16)  # GQA: 2 key heads
    assert _unsafe(q, k, None, _cfg()) is False
    assert _unsafe(q, k, None, None) is None
    # judged at 8 bits: a narrow width chosen by the policy is not overridden
    two_bit = dataclasses.replace(_cfg(), bits=2)
    assert checked_score_error(q, k, None, two_bit) == checked_score_error(q, k, None, _cfg())


def test_qk_normalised_unscaled_attention_passes_the_int8_floor():
    # EmbeddingGemma2 (q_norm/k_norm, scaling 1.0): before the guard its q_norm, k_norm, q_proj, k_proj and
    # embedding gradients were at cosine ~0.96 under "int8".
    from _harness import tiny_auto
    from slimact.zoo import projection_loss, tiny_inputs

    model = tiny_auto("EmbeddingGemma2TextModel", "embedding_gemma2_text")
    report = slimact.check(model, tiny_inputs(model, "base"), "int8", loss_fn=projection_loss)
    assert report.passed, report


def test_ordinary_attention_keeps_its_codes():
    # 1/sqrt(D) (here smaller still) and small q/k: not made exact for nothing.
    torch.manual_seed(0)
    x = torch.randn(2, 32, 64)
    plain = _QKNormAttention(scale=0.02)
    converted = slimact.convert(_QKNormAttention(scale=0.02), "int8")
    converted.load_state_dict(plain.state_dict())
    ratio = slimact.profile(converted, x).activation_bytes / slimact.profile(plain, x).activation_bytes
    assert ratio < 0.5


def test_summary_names_attention_the_guard_kept_exact():
    # Its attention bytes are about plain's, while summary called it converted and said nothing (the README's
    # "not yet reported by summary"; x-transformers' qk-norm attention under int8, found by a sweep).
    torch.manual_seed(0)
    x = torch.randn(2, 32, 64)
    for scale, named in ((1.0, True), (0.02, False)):
        model = slimact.convert(nn.Sequential(_QKNormAttention(scale=scale)), "int8")
        notes = [n for n in slimact.summary(model, x).notes if "kept q, k, v exact" in n]
        assert bool(notes) == named and (not named or notes[0].startswith("attention in 0 ")), notes


def test_attention_the_guard_kept_exact_is_not_counted_as_covered():
    # Qwen3's QK-normalised q and k with 1/sqrt(D): estimated score error 0.016 at 8 bits rounded to nearest
    # ("int8"), 0.022 with stochastic rounding ("mesa"), past MAX_SCORE_ERROR. Its attention (transformers'
    # AttentionInterface) then kept q, k, v exact, plain's bytes, while summary counted it converted: 99.4% coverage.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, vocab_size=300, max_position_embeddings=64)
    ids = torch.randint(0, 300, (2, 64))
    batch = {"input_ids": ids, "labels": ids}
    attention = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    reports = {}
    for policy in ("int8", "mesa"):
        model = slimact.convert(transformers.Qwen3ForCausalLM(cfg), policy)
        reports[policy] = report = slimact.summary(model, batch)
        guarded = any("kept q, k, v exact" in n for n in report.notes)
        assert guarded == (policy == "mesa"), report.notes
        assert all(("score guard" in report.skipped.get(name, "")) == guarded for name in attention), report.skipped
    assert reports["mesa"].coverage < reports["int8"].coverage - 0.05


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["query", "key"])
@pytest.mark.parametrize("cfg", [QuantConfig(group_dim=1, groups=0), QuantConfig(group_dim=1, groups=2),
                                 QuantConfig(groups=1)], ids=["per-head", "head-groups", "whole"])
@pytest.mark.parametrize("size", ["small", "compiled"])
def test_a_non_finite_query_or_key_makes_the_error_non_finite(bad, where, cfg, size):
    # The fused attention's NaN/inf check under an 8-bit policy (on the CPU too, for its flash kernel) is read off
    # this error (no pass of its own); from MIN_NUMEL elements the per-head statistics are one compiled loop, over
    # [B, T, H, D] memory seen as [B, H, T, D] as attention's q and k are.
    from slimact.quant import inductor

    gen = torch.Generator().manual_seed(0)
    t = 8 if size == "small" else inductor.MIN_NUMEL // 64

    def qk():
        q = torch.randn(2, t, 4, 16, generator=gen).transpose(1, 2)
        return q, torch.randn(2, t, 2, 16, generator=gen).transpose(1, 2)  # grouped-query too

    q, k = qk()
    assert (q.numel() >= inductor.MIN_NUMEL) == (size == "compiled")
    (q if where == "query" else k)[1, 1, 3, 5] = bad
    assert not torch.isfinite(checked_score_error(q, k, 0.25, cfg))
    assert torch.isfinite(checked_score_error(*qk(), 0.25, cfg))
