"""slimact on diffusion models: diffusers' UNet pieces and the VAE's attention, and DiT (tests/_diffusion.py).

Each model is tiny (widths 32-64, 16x16 latents, batch 2), in training mode with dropout > 0 in places (the
ResNet blocks, the attention output, GEGLU's feed-forward; DiT's attention dropout) and 0 elsewhere. Measured
(fp32, one training step, ``slimact.profile`` bytes over plain's): UNet with SDPA attention 0.756x under
``"tempo"``, 0.162x under ``"int8"`` and ``"mesa"``; UNet with the baddbmm ``AttnProcessor`` 0.841x / 0.194x; the
VAE mid block 0.854x / 0.161x (0.828x / 0.144x with SDPA); DiT 0.658x / 0.263x (fused attention; 0.713x / 0.252x
with timm's explicit ``q @ k^T``; 0.360x / 0.348x under ``"int8"`` before adaLN's modulation, ``norm(x) * (1 +
scale[:, None])``, kept the norm's pack instead of its fp32 output). GroupNorm is converted under ``"int8"`` and
``"mesa"`` (its output kept 8-bit per channel, the pack the SiLU and conv after it reuse: 0.259x / 0.257x / 0.341x /
0.357x before, coverage 0.86 / 0.91 / 0.85 / 0.82, now 0.96 / 0.98 / 1.0 / 1.0); ``"tempo"`` leaves it alone, with
that reason in the summary (its lossless form saves nothing before a lossless SiLU: see
``slimact.policy.PRESETS``).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import _diffusion as D
import slimact
from _harness import assert_gradients_close, assert_gradients_equal, zero_gradients
from slimact._metrics import cosine, sqnr_db
from slimact.check import rounding_tolerance
from slimact.nn import SlimModule

POLICIES = ["tempo", "int8", "mesa"]


def _unet(processor=None):
    torch.manual_seed(0)
    model = D.TinyUNet2DCondition(dropout=0.1, processor=processor)
    return model, (torch.randn(2, 4, 16, 16), torch.tensor([3, 700]), torch.randn(2, 7, 48))


def _vae_mid(processor=None):
    torch.manual_seed(0)
    return D.UNetMidBlock2D(32, groups=8, attention_head_dim=16, dropout=0.1, processor=processor), (
        torch.randn(2, 32, 8, 8),)


def _dit(randomised=False, fused=True):
    torch.manual_seed(0)
    model = D.DiT(fused_attn=fused, attn_drop=0.1)
    if randomised:
        D.randomise_zero_init(model)
    return model, (torch.randn(2, 4, 16, 16), torch.tensor([3, 700]), torch.tensor([1, 7]))


#: name -> (builder, whether a fused attention kernel with dropout runs: forward equal to float rounding only).
MODELS = {
    "unet": (_unet, False),
    "unet-baddbmm": (lambda: _unet(D.AttnProcessor()), False),
    "vae-mid": (lambda: _vae_mid(D.AttnProcessor()), False),
    "vae-mid-sdpa": (_vae_mid, False),
    "dit-zero-init": (_dit, True),
    "dit": (lambda: _dit(randomised=True), True),
    "dit-unfused": (lambda: _dit(randomised=True, fused=False), False),
}
#: Bytes kept over plain's, measured above (fp32), with margin: (tempo, int8 and mesa).
RATIO_BOUNDS = {"unet": (0.80, 0.20), "unet-baddbmm": (0.88, 0.23), "vae-mid": (0.90, 0.20),
                "vae-mid-sdpa": (0.88, 0.18), "dit-zero-init": (0.70, 0.27), "dit": (0.70, 0.27),
                "dit-unfused": (0.76, 0.26)}


def _step(model, inputs, *, autocast=False, forward=None):
    """Output and gradients (every parameter's and the floating inputs') of one training step under a random
    upstream gradient, with the dropout draws of seed 1."""
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = (forward or model)(*xs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype))
    grads = {f"input{i}": x.grad for i, x in enumerate(xs) if x.grad is not None}
    grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return out.detach(), grads


def _assert_same_forward(out, plain_out, fused):
    if fused:  # slimact's attention kernel: PyTorch's forward to float rounding, as slimact.check judges it
        tol = rounding_tolerance(out.dtype)
        torch.testing.assert_close(out, plain_out, rtol=tol, atol=tol * plain_out.abs().max().item())
    else:
        assert torch.equal(out, plain_out)


def _assert_grads(policy, exact, approx):
    (assert_gradients_equal if policy == "tempo" else assert_gradients_close)(exact, approx)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", list(MODELS))
def test_forward_gradients_and_bytes(name, policy):
    build, fused = MODELS[name]
    plain, inputs = build()
    plain.train()
    slim = slimact.convert(copy.deepcopy(plain), policy).train()
    out0, g0 = _step(plain, inputs)
    out1, g1 = _step(slim, inputs)
    _assert_same_forward(out1, out0, fused)
    assert "input0" in g0 and g0.keys() == g1.keys()
    _assert_grads(policy, g0, g1)
    if name == "dit-zero-init":  # adaLN-Zero: only the final linear layer has a gradient, exactly as in plain
        assert {n for n, g in g0.items() if g.abs().max() > 0} == {"final_layer.linear.weight",
                                                                    "final_layer.linear.bias"}
        assert all(torch.equal(g1[n], g0[n]) for n in zero_gradients(g0))
    ratio = (slimact.profile(slim, inputs).activation_bytes
             / slimact.profile(copy.deepcopy(plain), inputs).activation_bytes)
    assert ratio < RATIO_BOUNDS[name][policy != "tempo"], ratio


@pytest.mark.parametrize("policy", ["int8", "mesa"])
def test_dit_modulation_keeps_the_norms_pack(policy):
    """adaLN's ``modulate(norm(x), shift, scale)``, ``norm(x) * (1 + scale[:, None]) + shift[:, None]``: the product
    kept the norm's output in fp32 (4 bytes per element) beside the norm's own 8-bit codes of it; it now keeps those
    codes (no bytes of its own) and ``1 + scale`` exact. Two per block and one in the final layer: 5 x 8 KiB of the
    tiny DiT, 0.360x -> 0.263x of plain's bytes (fused attention), coverage 0.81 -> 0.90. The gates, ``gate[:, None] *
    attn(...)``, multiply a linear layer's output that nothing of slimact keeps: as written (2 per block)."""
    plain, inputs = _dit(randomised=True)
    plain.train()
    slim = slimact.convert(copy.deepcopy(plain), policy).train()
    before, after = (slimact.profile(m, inputs) for m in (copy.deepcopy(plain).train(), slim))
    wide = 2 * 16 * 64 * 4  # [B, T, C] in fp32
    for block in ("blocks.0", "blocks.1", "final_layer"):
        mine = [e for e in after.entries if e.module == block]
        assert not [e for e in mine if e.dtype == torch.uint8]  # (a's codes are the norm's, counted there)
        gated = 0 if block == "final_layer" else 2
        assert len([e for e in mine if e.shape == (2, 16, 64) and e.dtype == torch.float32]) == gated
        assert after.by_module[block] == before.by_module[block] - (2 if gated else 1) * wide
    assert after.activation_bytes / before.activation_bytes < 0.27  # measured 0.2634 (0.3598 before)
    # The scales' gradients (rows of the adaLN linear layers' weight: shift, scale, gate (, shift, scale, gate)), from
    # the norm's 8-bit codes: measured worst SQNR 42.3 dB ("int8"), 39.4 dB ("mesa", stochastic rounding), cosine
    # 0.99995; 44.8 / 40.3 dB before (the fp32 output).
    _, g0 = _step(plain, inputs)
    _, g1 = _step(slim, inputs)
    c = 64
    for name, chunks in (("blocks.0", (1, 4)), ("blocks.1", (1, 4)), ("final_layer", (1,))):
        weight = f"{name}.adaLN_modulation.1.weight"
        for k in chunks:
            exact, approx = g0[weight][k * c : (k + 1) * c], g1[weight][k * c : (k + 1) * c]
            assert cosine(exact, approx) >= 0.9999 and sqnr_db(exact, approx) >= 36, (weight, k)
    if policy == "int8":
        summary = slimact.summary(slim, inputs)
        assert "product" in summary.functional
        assert summary.coverage >= 0.90, summary.coverage  # measured 0.902 (0.806 before)
        assert summary.uncovered["blocks.0"] == after.by_module["blocks.0"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["unet", "vae-mid", "dit"])
def test_check_passes(name, policy):
    # Under "mesa", the first step (warmup=0): after the running estimates are warmed, a time-embedding MLP fed
    # batches of 2 timesteps lags behind its input's range (UNet's linear_1 weight at cosine 0.87 on [3, 700] warmed
    # one timestep at a time; other batches of 2 random timesteps 0.984-0.990, of 4: 0.991-0.997), as in training.
    plain, inputs = MODELS[name][0]()
    report = slimact.check(plain, inputs, policy, warmup=0)
    assert report.passed, str(report)


@pytest.mark.parametrize("policy", ["tempo", "int8"])  # ("mesa" routes what "int8" does)
@pytest.mark.parametrize("name", ["unet", "unet-baddbmm", "vae-mid", "vae-mid-sdpa", "dit", "dit-unfused"])
def test_summary_is_truthful(name, policy):
    """What summary reports converted is converted (a replacement module, or a module whose routed calls keep fewer
    bytes than plain's), and an attention module it reports left alone keeps what plain keeps; GroupNorm is
    converted under "int8" (a slimact module keeping fewer bytes than plain's, coverage then at least 0.95) and left
    alone under "tempo" with the true reason, the plain torch module.

    diffusers' Attention with AttnProcessor2_0 (F.scaled_dot_product_attention, called by the processor) under
    "int8" was reported left alone ("none reached slimact") while its SDPA was routed: 12,336 bytes kept of
    plain's 66,560 in the VAE mid block (coverage reported 0.738, 0.818 true)."""
    plain, inputs = MODELS[name][0]()
    slim = slimact.convert(copy.deepcopy(plain), policy).train()
    summary = slimact.summary(slim, inputs)
    named = dict(slim.named_modules())
    before = slimact.profile(copy.deepcopy(plain).train(), inputs).by_module
    after = slimact.profile(slim, inputs).by_module
    for name_, kind in summary.modules.items():
        if not isinstance(named[name_], SlimModule):  # routed in its own code: it must keep less than plain
            assert kind == "attention", (name_, kind)
            assert after[name_] < before[name_], (name_, after[name_], before[name_])
        else:
            assert named[name_]._slimact_kind == kind
    for name_ in summary.skipped:
        if "Attention" in type(named.get(name_)).__name__:
            assert after[name_] == before[name_], (name_, summary.skipped[name_], after[name_], before[name_])
    norms = [name_ for name_, module in named.items() if isinstance(module, torch.nn.GroupNorm)]
    for name_ in norms:
        if policy == "tempo":
            assert summary.skipped[name_] == "kind 'groupnorm' not enabled by policy 'tempo'"
            assert type(named[name_]) is torch.nn.GroupNorm
        else:
            assert summary.modules[name_] == "groupnorm" and isinstance(named[name_], SlimModule)
            assert after[name_] < before[name_] / 3, (name_, after[name_], before[name_])
    assert bool(norms) == name.startswith(("unet", "vae"))
    if norms and policy == "int8":
        assert summary.coverage >= 0.95, summary.coverage


@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_summary_drops_timm_attention_whose_sdpa_branch_did_not_run(policy):
    """timm's Attention mentions F.scaled_dot_product_attention, but with fused_attn off it computes q @ k^T,
    softmax and @ v, which a lossless policy leaves as written: summary reported it converted under "tempo" (its
    40,960 bytes per block, plain's, counted as covered: coverage 82.0% where 55.0% is true). Under "int8" its
    products and softmaxes are routed, and it is converted."""
    plain, inputs = _dit(randomised=True, fused=False)
    slim = slimact.convert(copy.deepcopy(plain), policy).train()
    summary = slimact.summary(slim, inputs)
    before = slimact.profile(copy.deepcopy(plain).train(), inputs).by_module["blocks.0.attn"]
    after = slimact.profile(slim, inputs).by_module["blocks.0.attn"]
    if policy == "tempo":
        assert after == before
        assert "blocks.0.attn" not in summary.modules
        assert "none reached slimact" in summary.skipped["blocks.0.attn"]
        assert summary.coverage < 0.6
    else:
        assert after < before / 4
        assert summary.modules["blocks.0.attn"] == "attention"
    # The fused branch is routed (q, k, v kept by slimact's attention): reported converted, under either policy.
    fused, _ = _dit(randomised=True)
    slim = slimact.convert(fused, policy).train()
    assert slimact.summary(slim, inputs).modules["blocks.0.attn"] == "attention"


@pytest.mark.parametrize("name", ["unet", "vae-mid", "dit"])
def test_state_dict_unchanged_and_revert_exact(name):
    plain, inputs = MODELS[name][0]()
    plain.train()
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    out0, g0 = _step(plain, inputs)
    for policy in POLICIES:
        slim = slimact.convert(copy.deepcopy(plain), policy)
        converted = slim.state_dict()
        assert list(converted) == list(state) and all(torch.equal(converted[k], state[k]) for k in state)
        _step(slim.train(), inputs)  # (running estimates gathered: revert must drop them too)
        slimact.revert(slim)
        assert all(type(a) is type(b) for a, b in zip(plain.modules(), slim.modules(), strict=True))
        out1, g1 = _step(slim, inputs)
        assert torch.equal(out1, out0)
        assert g1.keys() == g0.keys() and all(torch.equal(g1[k], g0[k]) for k in g0)


@pytest.mark.parametrize("policy", ["tempo", "int8"])
@pytest.mark.parametrize("name", ["unet", "vae-mid", "dit", "dit-unfused"])
def test_autocast_bf16(name, policy):
    """Under bf16 autocast: the forward is plain's under autocast; every gradient as close to the fp32 one as
    cosine 0.99, or as plain's own bf16 gradient is (a key bias, zero in exact arithmetic, is bf16 noise)."""
    build, fused = MODELS[name]
    plain, inputs = build()
    plain.train()
    _, gold = _step(plain, inputs)
    out0, g0 = _step(plain, inputs, autocast=True)
    slim = slimact.convert(copy.deepcopy(plain), policy).train()
    out1, g1 = _step(slim, inputs, autocast=True)
    _assert_same_forward(out1, out0, fused)
    assert_gradients_close(g0, g1, zeros=zero_gradients(gold), gold=gold)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["unet", "vae-mid", "dit"])
def test_gradient_checkpointing(name, policy):
    """diffusers' gradient checkpointing of the UNet blocks (and of DiT's blocks): non-reentrant
    torch.utils.checkpoint, against the plain model checkpointed alike."""
    build, fused = MODELS[name]
    plain, inputs = build()
    if name == "unet":
        plain.enable_gradient_checkpointing()
    else:
        plain.gradient_checkpointing = True
    plain.train()
    slim = slimact.convert(copy.deepcopy(plain), policy).train()
    out0, g0 = _step(plain, inputs)
    out1, g1 = _step(slim, inputs)
    _assert_same_forward(out1, out0, fused)
    _assert_grads(policy, g0, g1)


def _cfg_unet(model):
    def guided(x, t, ctx):  # a pipeline's classifier-free guidance: unconditional and conditional halves, one batch
        noise_uncond, noise_text = model(torch.cat([x] * 2), t.repeat(2), torch.cat([torch.zeros_like(ctx), ctx])
                                         ).chunk(2)
        return noise_uncond + 7.5 * (noise_text - noise_uncond)
    return guided


def _cfg_dit(model):
    def guided(x, t, y):  # DiT's sample.py: the null class is num_classes
        return model.forward_with_cfg(torch.cat([x, x]), t.repeat(2), torch.cat([y, torch.full_like(y, 10)]), 4.0)
    return guided


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["unet", "dit"])
def test_classifier_free_guidance_batch(name, policy):
    """The doubled batch of classifier-free guidance: trained through (as guidance distillation does), and in
    eval under no_grad bit-equal to plain's."""
    build, fused = MODELS[name]
    guidance = _cfg_unet if name == "unet" else _cfg_dit
    plain, inputs = build()
    plain.train()
    slim = slimact.convert(copy.deepcopy(plain), policy).train()
    out0, g0 = _step(plain, inputs, forward=guidance(plain))
    out1, g1 = _step(slim, inputs, forward=guidance(slim))
    _assert_same_forward(out1, out0, fused)
    _assert_grads(policy, g0, g1)
    plain.eval()
    slim.eval()
    with torch.no_grad():
        assert torch.equal(guidance(slim)(*inputs), guidance(plain)(*inputs))


@pytest.mark.parametrize("name", list(MODELS))
def test_eval_no_grad_bit_equal(name):
    plain, inputs = MODELS[name][0]()
    plain.eval()
    with torch.no_grad():
        want = plain(*inputs)
    for policy in POLICIES:
        slim = slimact.convert(copy.deepcopy(plain), policy).eval()
        with torch.no_grad():
            assert torch.equal(slim(*inputs), want), policy


@pytest.mark.parametrize("policy", POLICIES)
def test_baddbmm_scores_ignore_the_uninitialised_input(policy):
    """AttnProcessor's scores: torch.baddbmm(torch.empty(...), q, k^T, beta=0, alpha=scale). With the uninitialised
    tensor full of NaN (what torch.empty may hold), nothing of it reaches the output or any gradient."""

    class NaNAttention(D.Attention):
        def get_attention_scores(self, query, key, attention_mask=None):  # diffusers' code, its empty NaN-filled
            dtype = query.dtype
            baddbmm_input = torch.full((query.shape[0], query.shape[1], key.shape[1]), float("nan"),
                                       dtype=query.dtype, device=query.device)
            attention_scores = torch.baddbmm(baddbmm_input, query, key.transpose(-1, -2), beta=0, alpha=self.scale)
            if self.upcast_softmax:
                attention_scores = attention_scores.float()
            return attention_scores.softmax(dim=-1).to(dtype)

    plain, inputs = _vae_mid(D.AttnProcessor())
    plain.attentions[0].__class__ = NaNAttention
    plain.train()
    slim = slimact.convert(copy.deepcopy(plain), policy).train()
    out0, g0 = _step(plain, inputs)
    out1, g1 = _step(slim, inputs)
    assert out0.isfinite().all() and torch.equal(out1, out0)
    assert all(g.isfinite().all() for g in g1.values())
    _assert_grads(policy, g0, g1)


def test_geglu_product_keeps_8bit_factors():
    """GEGLU's ``hidden * F.gelu(gate)`` (halves of one projection) goes through the product route under "int8":
    the feed-forward's first part keeps 8-bit codes, under a third of plain's bytes."""
    plain, inputs = _unet()
    slim = slimact.convert(copy.deepcopy(plain), "int8").train()
    where = "mid_block.attentions.0.transformer_blocks.0.ff.net.0"
    before = slimact.profile(copy.deepcopy(plain).train(), inputs).by_module[where]
    report = slimact.profile(slim, inputs)
    assert report.by_module[where] < before / 3, (report.by_module[where], before)
    assert {e.dtype for e in report.entries if e.module == where} <= {torch.uint8, torch.float32}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["unet", "vae-mid"])
def test_attention_through_diffusers_dispatch_is_routed_as_a_positional_call(name, policy):
    """diffusers' newer processors (Flux, Wan, Qwen-Image, HunyuanVideo, LTX...) call attention through
    ``dispatch_attention_fn``, whose native backend passes every argument of F.scaled_dot_product_attention by keyword
    (``query=``, ``key=``, ``value=``): slimact's routing ran such a call as written, so the attention kept plain's
    bytes under every policy (the VAE mid block's attention under "int8": 66,560 bytes, as plain, where the positional
    call of AttnProcessor2_0 keeps 12,336; tiny Flux 0.395x of plain's bytes, now 0.269x; Qwen-Image's attention,
    82% of what "int8" kept, reported "none reached slimact"). It is now routed as the positional call is: the same
    forward (PyTorch's), the same gradients, the same bytes, and summary reports the module converted."""
    builder = _unet if name == "unet" else _vae_mid
    positional, inputs = builder()
    dispatched, _ = builder(D.AttnProcessorDispatch())
    dispatched.load_state_dict(positional.state_dict())
    attn = next(n for n, m in dispatched.named_modules() if isinstance(m, D.Attention))
    plain_bytes = slimact.profile(copy.deepcopy(dispatched).train(), inputs).by_module[attn]
    results = []
    for model in (positional, dispatched):
        slim = slimact.convert(copy.deepcopy(model), policy).train()
        out, grads = _step(slim, inputs)
        results.append((out, grads, slimact.profile(slim, inputs).by_module[attn], slimact.summary(slim, inputs)))
    (out_p, grads_p, bytes_p, _), (out_d, grads_d, bytes_d, summary) = results
    assert torch.equal(out_d, out_p)
    for key, g in grads_p.items():
        assert torch.equal(grads_d[key], g), key
    assert bytes_d == bytes_p
    if policy != "tempo":
        assert bytes_d < plain_bytes / 3, (bytes_d, plain_bytes)
        assert summary.modules[attn] == "attention", summary.skipped.get(attn)


@pytest.mark.parametrize("dispatch", [False, True], ids=["AttnProcessor2_0", "dispatch"])
def test_summary_reports_diffusers_attention_under_a_lossless_policy_by_what_it_keeps(dispatch):
    """diffusers' Attention computes its attention in its processor's F.scaled_dot_product_attention, which "tempo"
    routes. summary reported it "computes attention in its own code ...: left as written" whatever it kept: under
    PyTorch's math kernel (diffusers' "_native_math" backend) the VAE mid block's attention keeps 49,152 bytes where
    plain's keeps 114,688 (coverage understated). With inputs it is now reported converted where the routed call
    keeps fewer bytes than PyTorch's kernel, and otherwise left alone with that reason (the CPU flash kernel keeps
    what slimact's lossless attention keeps)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    plain, inputs = _vae_mid(D.AttnProcessorDispatch() if dispatch else None)
    attn = next(n for n, m in plain.named_modules() if isinstance(m, D.Attention))
    for math in (True, False):
        with sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext():
            slim = slimact.convert(copy.deepcopy(plain), "tempo").train()
            summary = slimact.summary(slim, inputs)
            before = slimact.profile(copy.deepcopy(plain).train(), inputs).by_module[attn]
            after = slimact.profile(slim, inputs).by_module[attn]
        if math:
            assert after < before / 2, (after, before)
            assert summary.modules.get(attn) == "attention", summary.skipped.get(attn)
        else:
            assert after == before
            assert "run through slimact's attention" in summary.skipped[attn], summary.skipped[attn]
