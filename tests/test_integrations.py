"""slimact in a training stack: activation checkpointing, frozen weights and adapters, mixed precision with a
gradient scaler."""

import contextlib
import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import slimact
from _harness import assert_gradients_close, assert_gradients_equal, loss_grads, zero_gradients
from slimact import zoo

pytest.importorskip("transformers")


class _Checkpointed(nn.Module):
    """Each block of a plain Transformer stack run under ``torch.utils.checkpoint``."""

    def __init__(self, reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32), nn.Dropout(0.1))
            for _ in range(3)
        )
        self.reentrant = reentrant
        self.checkpointing = True

    def forward(self, x):
        for block in self.blocks:
            x = x + (checkpoint(block, x, use_reentrant=self.reentrant) if self.checkpointing else block(x))
        return x


def _step(model, x):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    torch.manual_seed(1)
    model(x).square().mean().backward()
    return {"x": x.grad, **{n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_torch_checkpoint_on_a_converted_model(reentrant):
    model = _Checkpointed(reentrant).train()
    x = torch.randn(4, 64, 32)
    model.checkpointing = False
    exact = _step(model, x)
    plain_bytes = slimact.profile(model, x.requires_grad_(True)).activation_bytes
    model.checkpointing = True
    ckpt_bytes = slimact.profile(model, x).activation_bytes
    slim = slimact.convert(copy.deepcopy(model))
    assert_gradients_close(exact, _step(slim, x))
    both = slimact.profile(slim, x).activation_bytes
    slim.checkpointing = False
    slim_bytes = slimact.profile(slim, x).activation_bytes
    # Every block checkpointed: what stays is the blocks' inputs, kept whole by checkpoint either way; slimact
    # shrinks what each block keeps while it is recomputed in the backward (not counted by profile, which
    # measures what the forward leaves). With part of the model outside checkpoints, as in Hugging Face's
    # gradient checkpointing below, the combination is lower than either.
    assert both == ckpt_bytes < slim_bytes < plain_bytes, (both, ckpt_bytes, slim_bytes, plain_bytes)


class _CheckpointedEncoderLayer(nn.Module):
    """A norm-first ``nn.TransformerEncoderLayer`` (batch first, with dropout), checkpointed or not."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, activation="relu", batch_first=True,
                                                norm_first=True)
        self.checkpointing = True

    def forward(self, x):
        return checkpoint(self.layer, x, use_reentrant=False) if self.checkpointing else self.layer(x)


@pytest.mark.parametrize("policy", ["int8", "mesa", "tempo"])
def test_a_checkpointed_norm_first_encoder_layer_trains_as_without_checkpointing(policy):
    # Its attention projects the norm's output through a batch-first view, packing the tensor the view views: in
    # the recompute that tensor showed no grad_fn, the shared-pack cache took it for an input from outside any forward
    # and packed afresh, with other shapes than the forward's, and checkpoint raised CheckpointError where PyTorch
    # trains (found by the fuzz test's seed 1924).
    torch.manual_seed(0)
    model = slimact.convert(_CheckpointedEncoderLayer().train(), policy)
    twin = copy.deepcopy(model)  # (the same running estimates at its first step)
    x = torch.randn(2, 8, 16)
    model.checkpointing = False
    assert_gradients_equal(_step(model, x), _step(twin, x))


@pytest.mark.parametrize("arch, policy", [("llama", "tempo"), ("gpt2", "int8")])
def test_users_own_checkpoint_with_use_cache_trains_as_without(arch, policy):
    """A user's own non-reentrant ``torch.utils.checkpoint`` around each decoder layer, the model called in training
    with ``use_cache=True``: the recompute's cache hands attention the forward's keys and its own (twice as many);
    causal attention without a mask reads only the first ``T`` (transformers' SDPA cuts them so, and trains). slimact
    kept all of them, and the checkpoint refused the recompute (``CheckpointError``: saved keys of another shape).
    Now: the very gradients of the converted model without the checkpoint."""
    from torch.utils.checkpoint import checkpoint
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    class Checkpointed(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, *args, **kwargs):
            return checkpoint(self.layer, *args, use_reentrant=False, **kwargs)

    def grads(wrap):
        torch.manual_seed(0)
        if arch == "llama":
            model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                                                 attn_implementation="sdpa"))
        else:
            model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                               attn_implementation="sdpa"))
        slimact.convert(model.train(), policy)
        layers = model.model.layers if arch == "llama" else model.transformer.h
        if wrap:
            for i, layer in enumerate(layers):
                layers[i] = Checkpointed(layer)
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        model(ids, labels=ids, use_cache=True).loss.backward()
        return {n.replace(".layer.", "."): p.grad for n, p in model.named_parameters() if p.grad is not None}

    torch.testing.assert_close(grads(True), grads(False))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_gradient_checkpointing_on_a_converted_model(name):
    model = zoo.build(name, tiny=True).train()
    inputs = zoo.example_inputs(model, 2, 32)
    _, exact = loss_grads(model, inputs)
    plain_bytes = slimact.profile(model, inputs).activation_bytes
    ckpt = copy.deepcopy(model)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt_bytes = slimact.profile(ckpt, inputs).activation_bytes
    slimact.convert(ckpt)
    _, approx = loss_grads(ckpt, inputs)
    assert_gradients_close(exact, approx)
    both = slimact.profile(ckpt, inputs).activation_bytes
    slim_bytes = slimact.profile(slimact.convert(model), inputs).activation_bytes
    assert both < min(ckpt_bytes, slim_bytes) < plain_bytes, (both, ckpt_bytes, slim_bytes, plain_bytes)


def _bart_with_dropout():
    import transformers

    cfg = transformers.BartConfig(
        vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        dropout=0.1, attention_dropout=0.1, activation_dropout=0.1,
    )
    torch.manual_seed(0)
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    return transformers.BartForConditionalGeneration(cfg).train(), {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("reentrant", [None, False, True])
@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_hugging_face_checkpointing_of_layers_with_dropout_in_their_own_code(policy, reentrant):
    # transformers checkpoints a layer's forward, not its __call__: the recompute in the backward fires no hook of
    # the layer itself. BART's (OPT's, Whisper's) layers call F.dropout in their own forward, which the model's
    # routing mode sent to slimact in the forward pass but not in the recompute, where it ran as written: the
    # non-reentrant checkpoint (transformers' default) raised CheckpointError ("Recomputed values ... have
    # different metadata"). The dropout masks must also be those of the plain model's run (the same seed).
    model, inputs = _bart_with_dropout()
    _, exact = loss_grads(model, inputs)
    slim = slimact.convert(copy.deepcopy(model), policy)
    slim.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs=None if reentrant is None else {"use_reentrant": reentrant})
    _, approx = loss_grads(slim, inputs)
    (assert_gradients_equal if policy == "tempo" else assert_gradients_close)(exact, approx)


def test_frozen_layers_keep_nothing_they_do_not_need():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    for p in model[0].parameters():  # a frozen first layer on an input that needs no gradient: keeps nothing
        p.requires_grad_(False)
    model[2].weight.requires_grad_(False)  # a frozen weight: no input kept for its gradient
    slim = slimact.convert(copy.deepcopy(model))
    x = torch.randn(16, 64)
    by_module = slimact.profile(slim, x).by_module
    assert by_module.get("0", 0) == 0 and by_module.get("1", 0) == 0
    assert by_module.get("2", 0) == 0  # its input gradient needs only the (parameter) weight
    # The GELU keeps its 8-bit input; the last Linear rebuilds the GELU's output from the same codes.
    assert by_module["3"] > 0 and by_module.get("4", 0) == 0


class _LowRank(nn.Module):
    """A LoRA adapter by hand: ``base(x) + up(down(x))``, the base frozen."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.up.weight, std=0.02)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def test_low_rank_adapters_on_a_frozen_llama():
    model = zoo.build("llama", tiny=True).train()
    model.requires_grad_(False)
    for layer in model.model.layers:
        for proj in ("q_proj", "v_proj"):
            setattr(layer.self_attn, proj, _LowRank(getattr(layer.self_attn, proj)))
    inputs = zoo.example_inputs(model, 2, 32)
    _, exact = loss_grads(model, inputs)
    assert exact and all("down" in n or "up." in n for n in exact)
    plain_bytes = slimact.profile(model, inputs).activation_bytes
    slimact.convert(model)
    _, approx = loss_grads(model, inputs)
    assert_gradients_close(exact, approx)
    assert slimact.profile(model, inputs).activation_bytes < 0.5 * plain_bytes


_LORA_TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"], "llama": ["q_proj", "v_proj", "gate_proj", "down_proj"]}


def _peft_model(name: str, policy: str | None, convert_first: bool):
    """A tiny ``name`` with `peft`'s LoRA (rank 4, adapter dropout, its up projections made non-zero so that
    every adapter weight has a gradient), converted under ``policy`` after ``get_peft_model`` or, with
    ``convert_first``, before it and again after (the adapters ``peft`` adds are plain modules)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = zoo.build(name, tiny=True).train()
    if policy is not None and convert_first:
        slimact.convert(model, policy=policy)
    # GPT-2's fused projections are Hugging Face Conv1D, their weights [in, out]: peft's fan_in_fan_out.
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=_LORA_TARGETS[name],
                        fan_in_fan_out=name == "gpt2")
    torch.manual_seed(1)
    model = get_peft_model(model, config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.02)
    return slimact.convert(model, policy=policy) if policy is not None else model


@pytest.mark.parametrize("convert_first", [False, True], ids=["peft-then-convert", "convert-then-peft"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_peft_lora_adapters_on_a_converted_model(name, convert_first):
    """The real `peft` (LoRA on GPT-2's Conv1D projections and on Llama's attention and gated-MLP projections):
    ``"tempo"`` gives the plain adapters' gradients, ``"int8"`` the same at cosine >= 0.99 keeping under half
    the bytes, and ``revert`` gives back the plain peft model, gradients bit for bit."""
    plain = _peft_model(name, None, convert_first)
    inputs = zoo.example_inputs(plain.base_model.model, 2, 32)
    _, exact = loss_grads(plain, inputs)
    trained = {n for n, p in plain.named_parameters() if p.requires_grad}
    assert exact.keys() == trained and all("lora_" in n for n in trained)
    plain_bytes = slimact.profile(plain, inputs).activation_bytes
    for policy in ("tempo", "int8"):
        slim = _peft_model(name, policy, convert_first)
        _, grads = loss_grads(slim, inputs)
        if policy == "tempo":
            assert_gradients_equal(exact, grads)
        else:
            assert_gradients_close(exact, grads)
            assert slimact.profile(slim, inputs).activation_bytes < 0.5 * plain_bytes
        slimact.revert(slim)
        assert not [m for m in slim.modules() if type(m).__module__.startswith("slimact.")]
        _, reverted = loss_grads(slim, inputs)
        assert all(torch.equal(exact[n], reverted[n]) for n in exact)


#: PEFT's other tuners, one per mechanism around a frozen layer: a weight-norm magnitude (DoRA), scaling vectors (IA3),
#: Hadamard and Kronecker products (LoHa, LoKr), orthogonal rotations of the weight (OFT, BOFT), Householder
#: reflections (HRA), shared random projections (VeRA), a spectrum (FourierFT), circulant blocks (C3A), rotations of
#: the output (RoAd), the norms tuned (LN tuning), virtual tokens (prefix, prompt, p-tuning, adaption prompt), a token
#: embedding's rows (trainable tokens), an SVD-style adapter pruned as it trains (AdaLoRA). Config class, arguments
#: (``targets``: Llama's attention and MLP projections).
_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_VIRTUAL = {"num_virtual_tokens": 4, "task_type": "CAUSAL_LM"}
_PEFT_TUNERS = {
    "dora": ("LoraConfig", {"r": 4, "use_dora": True}),
    "ia3": ("IA3Config", {"feedforward_modules": ["down_proj", "up_proj", "gate_proj"]}),
    "loha": ("LoHaConfig", {"r": 4}),
    "lokr": ("LoKrConfig", {"r": 4}),
    "oft": ("OFTConfig", {"r": 0, "oft_block_size": 8}),
    "boft": ("BOFTConfig", {"boft_block_size": 8}),
    "hra": ("HRAConfig", {"r": 4}),
    "vera": ("VeraConfig", {"r": 8}),
    "fourierft": ("FourierFTConfig", {"n_frequency": 16}),
    "c3a": ("C3AConfig", {"block_size": 16}),
    "road": ("RoadConfig", {}),
    "adalora": ("AdaLoraConfig", {"init_r": 4, "target_r": 2, "total_step": 10}),
    "ln_tuning": ("LNTuningConfig", None),
    "prefix": ("PrefixTuningConfig", _VIRTUAL),
    "prompt": ("PromptTuningConfig", _VIRTUAL),
    "ptuning": ("PromptEncoderConfig", {**_VIRTUAL, "encoder_hidden_size": 32}),
    "adaption_prompt": ("AdaptionPromptConfig", {"adapter_len": 4, "adapter_layers": 1, "task_type": "CAUSAL_LM"}),
    "trainable_tokens": ("TrainableTokensConfig", {"token_indices": [1, 2, 3]}),
}


@pytest.mark.parametrize("tuner", list(_PEFT_TUNERS))
def test_peft_tuners_train_as_plain(tuner):
    """Every PEFT tuner wraps or reads the frozen layers slimact converts in a forward of its own: ``check`` of each
    on a tiny Llama passes under ``"tempo"`` and ``"int8"`` (29 tuners on Llama and 19 on GPT-2 probed with peft
    0.21: all pass; these cover each mechanism)."""
    peft = pytest.importorskip("peft")
    cls, kwargs = _PEFT_TUNERS[tuner]
    if not hasattr(peft, cls):
        pytest.skip(f"peft {peft.__version__} has no {cls}")
    if cls in ("LoraConfig", "IA3Config", "LoHaConfig", "LoKrConfig", "OFTConfig", "BOFTConfig", "HRAConfig",
               "VeraConfig", "FourierFTConfig", "C3AConfig", "RoadConfig", "AdaLoraConfig"):
        kwargs = {"target_modules": _PROJECTIONS, **kwargs}
    torch.manual_seed(0)
    base = zoo.build_auto("LlamaForCausalLM", zoo.tiny_config("llama")).train()
    inputs = zoo.tiny_inputs(base, "causal-lm")
    model = peft.get_peft_model(base, getattr(peft, cls)(**(kwargs or {})))
    with torch.no_grad():  # adapters initialised to zero (or to the identity) would leave others without a gradient
        g = torch.Generator().manual_seed(3)
        for p in model.parameters():
            if p.requires_grad and not p.any():
                p.add_(0.02 * torch.randn(p.shape, generator=g))
    for policy in ("tempo", "int8"):
        report = slimact.check(model, inputs, policy)
        assert report.passed, str(report)


@pytest.mark.parametrize("policy", ["int8", "tempo"])
def test_modules_peft_copies_after_convert_share_its_routing_and_revert_leaves_them_plain(policy):
    # peft's modules_to_save deep-copies the modules it names after convert: their hooks, copied with them, took a
    # copy of slimact's routing along (and with it everything the routing holds: GPT-2's LM head, weight and all),
    # which revert did not reach: the "reverted" model kept routing the copied norms (int8: a weight gradient 4e-3
    # from plain's, 227,332 bytes kept where plain keeps 261,892; found by a helper's sweep of peft).
    from peft import LoraConfig, get_peft_model

    from slimact.nn.routing import Routing

    def build(policy):
        torch.manual_seed(0)
        model = zoo.build("gpt2", tiny=True).train()
        if policy is not None:
            slimact.convert(model, policy)
        config = LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, modules_to_save=["ln_f", "ln_1"])
        torch.manual_seed(1)
        return get_peft_model(model, config), model

    plain, _ = build(None)
    inputs = zoo.example_inputs(plain.base_model.model, 2, 16)
    _, exact = loss_grads(plain, inputs)
    slim, base = build(policy)
    routing = base.__dict__["_slimact_root_routing"]
    owners = {id(h.__self__) for name, m in slim.named_modules() if ".modules_to_save." in name
              for h in m._forward_pre_hooks.values() if isinstance(getattr(h, "__self__", None), Routing)}
    assert owners == {id(routing)}  # the copies' hooks are the model's routing's, no copy of it
    slimact.revert(slim)
    assert not [h for m in slim.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())
                if "slimact" in getattr(getattr(h, "func", h), "__module__", "")]
    _, grads = loss_grads(slim, inputs)
    assert_gradients_equal(exact, grads)
    assert slimact.profile(slim, inputs).activation_bytes == slimact.profile(plain, inputs).activation_bytes
    # with inputs too: the converted model's summary, the coverage measured through peft's forward
    with_inputs = slimact.summary(build(policy)[0], inputs)
    assert with_inputs.policy == policy and with_inputs.coverage > 0.5 and "(loss)" in with_inputs.modules


def test_summary_of_a_peft_model_made_after_convert_is_the_converted_models():
    # It read "policy: none: model not converted" above "converted 22 module(s)", and called peft's LoRA Linears,
    # added after convert, "no slimact replacement yet" (found by a helper's sweep of peft).
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = slimact.convert(zoo.build("llama", tiny=True).train(), "int8")
    inner = slimact.summary(base)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    found = slimact.summary(model)
    assert found.policy == "int8" and str(found).startswith("slimact summary (policy: int8)")
    assert found.modules == {("base_model.model." + n if n[0] != "(" else n).removesuffix("."): k
                             for n, k in inner.modules.items()
                             if n.rpartition(".")[2] not in ("q_proj", "v_proj")} | {
        f"base_model.model.{n}.base_layer": "linear" for n, k in inner.modules.items()
        if n.rpartition(".")[2] in ("q_proj", "v_proj")}
    lora = {n: r for n, r in found.skipped.items() if ".lora_" in n}
    assert len(lora) == 8 and all("after convert" in r for r in lora.values())
    assert slimact.summary(model, zoo.example_inputs(base, 2, 16)).policy == "int8"
    slimact.convert(model, "int8")  # as the reason says
    assert all(slimact.summary(model).modules.get(n) == "linear" for n in lora)


def test_summary_of_a_base_unloaded_from_a_converted_peft_model_says_where_it_was_converted():
    # After merge_and_unload of a converted PeftModel the base holds converted modules but not the routing (the
    # wrapper's): summary read "policy: none: model not converted" above "converted 12 module(s)", and called the
    # fused MLPs' down projections "no slimact replacement yet for Linear".
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = slimact.convert(get_peft_model(zoo.build("llama", tiny=True).train(),
                                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"])), "int8")
    found = slimact.summary(model.merge_and_unload())
    assert str(found).startswith("slimact summary (policy: none at this model, which was not converted)")
    assert any("converted as part of another model" in note for note in found.notes)
    assert {r for n, r in found.skipped.items() if n.endswith("down_proj")} == {
        "computed by its parent (a fused gated MLP or attention module)"}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fp16_autocast_with_grad_scaler(name):
    model = zoo.build(name, tiny=True).train()
    inputs = zoo.example_inputs(model, 2, 32)
    gold = loss_grads(model, inputs)[1]
    zeros = zero_gradients(gold)
    slim = slimact.convert(copy.deepcopy(model))
    grads = []
    for m in (model, slim):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        m.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(**inputs).loss
        scaler.scale(loss).backward()
        grads.append({n: p.grad / scaler.get_scale() for n, p in m.named_parameters() if p.grad is not None})
    assert all(torch.isfinite(g).all() for g in grads[1].values())
    assert_gradients_close(grads[0], grads[1], zeros=zeros, gold=gold)
    # Saved codes stay 8-bit whatever the compute dtype: the converted layers keep mostly uint8.
    with torch.autocast("cpu", dtype=torch.float16):
        report = slimact.profile(slim, inputs)
    coded = sum(e.nbytes for e in report.entries if e.dtype == torch.uint8)
    assert coded >= 0.5 * report.activation_bytes


@pytest.mark.parametrize("policy", ["tempo", "int8", pytest.param("mesa", marks=pytest.mark.xfail(
    strict=True, reason="a limit (docs/integrations.md): a batch far wider than the running estimates saturates, "
                        "so the gradient plain's fp16 overflows on comes back finite and small"))])
def test_grad_scaler_skips_the_steps_it_skips_for_plain(policy):
    # One batch 1000x the others: plain's fp16 weight gradients overflow and GradScaler skips the step.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 10))
    slim = slimact.convert(copy.deepcopy(plain), policy)
    skipped = {}
    for name, model in (("plain", plain), ("converted", slim)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)  # (the spike's weight gradients x 4096 overflow)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        skipped[name] = []
        for step in range(5):
            torch.manual_seed(step)
            x, y = torch.randn(64, 32) * (1000.0 if step == 4 else 1.0), torch.randint(0, 10, (64,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            skipped[name].append(scaler.get_scale() < scale)
    assert skipped["plain"] == [False] * 4 + [True]
    assert skipped["converted"] == skipped["plain"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_torch_compile_of_a_converted_model(name):
    import torch._inductor.config as inductor

    # One block: a second repeats the same graphs, and inductor's C++ build of them is most of this test's time.
    model = slimact.convert(zoo.build(name, tiny=True, layers=1).train())
    inputs = zoo.example_inputs(model, 2, 32)
    loss0, eager = loss_grads(model, inputs)
    compiled = torch.compile(model)
    # Inductor draws dropout masks from its own generator unless told to fall back to eager's; the
    # comparison needs the same masks.
    with inductor.patch(fallback_random=True):
        loss1, grads = loss_grads(compiled, inputs)
    grads = {k.removeprefix("_orig_mod."): v for k, v in grads.items()}
    torch.testing.assert_close(loss1, loss0, rtol=1e-4, atol=1e-5)
    assert_gradients_close(eager, grads, min_cosine=0.999)
    torch._dynamo.reset()


class _GeluNewMLP(nn.Module):
    def __init__(self, width: int):
        from transformers.activations import NewGELUActivation

        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(width, 2 * width), nn.Linear(width, 2 * width)
        self.down_proj, self.act_fn = nn.Linear(2 * width, width), NewGELUActivation()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _GeluNewBlock(nn.Module):
    """A pre-norm block whose activations read a module-level float (transformers' gelu_new reads ``math.pi``): in a
    plain MLP (the activation kind) and in a gated one (the mlp kind), after a LayerNorm and an RMSNorm."""

    def __init__(self, width: int = 16):
        from transformers.activations import NewGELUActivation

        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.RMSNorm(width)
        self.fc, self.proj, self.act = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), NewGELUActivation()
        self.mlp = _GeluNewMLP(width)

    def forward(self, x):
        x = x + self.proj(self.act(self.fc(self.norm1(x))))
        return x + self.mlp(self.norm2(x))


@pytest.mark.slow
def test_torch_compile_with_dynamic_shapes():
    # Under dynamic=True dynamo makes module-level floats inputs of the graph, and one read first inside two
    # autograd.Functions failed to trace ("lift_tracked_freevar_to_input should not be called on root
    # SubgraphTracer"): slimact's own constants, then model code's that the Functions run (GPT-2 and T5 v1.1 did).
    # (backend="eager": the failure was dynamo's; inductor's build of these graphs takes minutes.)
    torch.manual_seed(0)
    model = slimact.convert(nn.Sequential(_GeluNewBlock(), _GeluNewBlock()))
    assert set(slimact.summary(model).converted) == {"gelu", "mlp", "layernorm", "rmsnorm", "linear"}
    compiled = torch.compile(model, dynamic=True, backend="eager")
    for tokens in (9, 14):
        x = torch.randn(2, tokens, 16)
        eager, grads = _step(model, x), _step(compiled, x)
        assert_gradients_close(eager, {k.removeprefix("_orig_mod."): v for k, v in grads.items()}, min_cosine=0.999)
    torch._dynamo.reset()


class _SharedBlock(nn.Module):
    """One block applied at three depths (ALBERT's weight sharing written by hand)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.LayerNorm(16))

    def forward(self, x):
        for _ in range(3):
            x = 2 * x + self.block(x)
        return x


@pytest.mark.slow
def test_a_compiled_model_calling_a_block_at_several_depths_compiles_once_under_running_estimates():
    # A compiled pack uses no running estimate (each tensor's own range serves), yet each traced call of the shared
    # block took the next call site and registered that site's estimate buffers: both, read while tracing, were
    # guards that had moved by the next call, so each step recompiled (until dynamo's limit of 8 sent the frames
    # back to eager).
    model = slimact.convert(_SharedBlock().train(), "mesa")
    compiled = torch.compile(model)
    gen = torch.Generator().manual_seed(1)
    compiled(torch.randn(2, 8, 16, generator=gen)).square().mean().backward()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            compiled(torch.randn(2, 8, 16, generator=gen)).square().mean().backward()
    torch._dynamo.reset()


def _graph_breaks(model, inputs) -> tuple[int, list[str]]:
    """Dynamo's graph breaks in ``model``'s forward, and the warnings its tracing raised."""
    torch._dynamo.reset()
    # Dynamo warns once per process per message: forget the ones an earlier test raised.
    torch._dynamo.utils.warn_once_cache.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        breaks = torch._dynamo.explain(lambda **kw: model(**kw).loss)(**inputs).graph_break_count
    torch._dynamo.reset()
    return breaks, [str(w.message).splitlines()[0] for w in seen]


@functools.cache
def _plain_graph_breaks(name: str) -> tuple[int, list[str]]:
    """:func:`_graph_breaks` of the plain one-block model (once per model and process: its cases share it)."""
    model = zoo.build(name, tiny=True, layers=1).train()
    return _graph_breaks(model, zoo.example_inputs(model, 2, 32))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "policy"), [("gpt2", "int8"), ("gpt2", "tempo"),
                                              ("llama", "int8"), ("llama", "mesa")])
def test_a_converted_model_compiles_with_no_more_graph_breaks_or_warnings_than_plain(name, policy):
    # Plain GPT-2 has one break of its own (transformers); slimact adds none: no host syncs in the traced code
    # (range checks become NaN-restoring groups, data-dependent layer choices take the safe branch), no RNG
    # state or seed stream read (dropout in attention is PyTorch's, stochastic rounding draws from the graph),
    # the in-place GELU's table is a constant of the graph. Nor a warning: slimact's memoised helpers (a
    # policy's settings, a clipped config) were functools caches, each of which dynamo met with a warning of
    # "potential silent incorrectness" (five for GPT-2).
    # One block: a break slimact added would be in each (dynamo's tracing of a second is half this test's time).
    plain, plain_warnings = _plain_graph_breaks(name)
    model = zoo.build(name, tiny=True, layers=1).train()
    breaks, warned = _graph_breaks(slimact.convert(model, policy), zoo.example_inputs(model, 2, 32))
    assert breaks == plain
    # Under running estimates, the one warning that they are left aside while compiled (its own test below).
    ours = {w for w in warned if w not in plain_warnings}
    assert ours == ({_RUNNING_TRACED} if policy == "mesa" else set())


_RUNNING_TRACED = ("slimact: under torch.compile, running estimates (policy \"mesa\", scale='running') are neither "
                   "used nor updated: each tensor is packed with its own range, rounded to nearest, as under \"int8\". "
                   "The estimates keep the values they had before compiling; an eager run or slimact.state_dict(model) "
                   "afterwards carries those. Run \"mesa\" eagerly for Mesa's method, or convert with \"int8\" to "
                   "compile.")


@pytest.mark.filterwarnings("ignore:slimact. under torch.compile, running estimates")
def test_a_compiled_stochastic_pack_leaves_pytorchs_generator_alone():
    # Traced, a stochastic pack drew its noise with torch.rand: from PyTorch's generator, so that a compiled "mesa"
    # model's dropout masks were not the compiled plain model's (its forward 0.64 off, its update at cosine 0.42; a
    # sweep, 2026-12-07). It rounds to nearest there.
    import torch._inductor.config as inductor_config

    x = torch.randn(4, 32)
    out = {}
    for policy in ("plain", "mesa"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.5), nn.Linear(64, 8)).train()
        if policy != "plain":
            slimact.convert(model, policy)
        with inductor_config.patch(fallback_random=True):
            compiled = torch.compile(model, backend="aot_eager")
            torch.manual_seed(1)
            y = compiled(x)
            y.square().sum().backward()
        out[policy] = (y.detach(), torch.get_rng_state())
    torch._dynamo.reset()
    torch.testing.assert_close(out["mesa"][0], out["plain"][0])
    assert torch.equal(out["mesa"][1], out["plain"][1])


@pytest.mark.parametrize("policy", ["mesa", "int8"])
def test_compiling_a_model_under_running_estimates_warns_that_they_are_left_aside(policy):
    # Compiled, a pack uses each tensor's own range and moves no estimate (a buffer assigned inside a traced
    # autograd Function is a side effect dynamo cannot keep): silently, "mesa" was "int8" and its estimates froze.
    # The warning is raised while dynamo traces, not in the graph: fullgraph compiles, and the estimates are
    # indeed left as they were.
    torch.manual_seed(0)
    model = slimact.convert(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)), policy)
    model(torch.randn(64, 16)).sum().backward()  # (eager: the estimates are set; 64 rows, not few)
    before = {k: v.clone() for k, v in slimact.state_dict(model)["estimates"].items()}
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            compiled(torch.randn(64, 16)).sum().backward()
    torch._dynamo.reset()
    ours = {str(w.message) for w in seen if str(w.message).startswith("slimact")}
    assert ours == ({_RUNNING_TRACED} if policy == "mesa" else set())
    after = slimact.state_dict(model)["estimates"]
    assert before.keys() == after.keys() and (policy == "int8") == (not before)
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0)


@pytest.mark.slow
def test_attention_with_sinks_and_keys_that_are_the_values_compiles_with_no_graph_break():
    # DeepSeek V4's attention: sinks, and its keys are its values (attention_interface(self, q, kv, kv, ...)): dynamo
    # traces no autograd Function handed one tensor twice, a graph break at every layer (24 in the 3-layer tiny model).
    from slimact.zoo import build_auto, tiny_config, tiny_inputs

    config = tiny_config("deepseek_v4")
    # (two layers: each attention type, heavily compressed and compressed sparse, and each MLP type, once)
    config.num_hidden_layers = 2
    config.layer_types, config.mlp_layer_types = config.layer_types[:2], config.mlp_layer_types[:2]
    assert len(set(config.layer_types)) == len(set(config.mlp_layer_types)) == 2
    torch.manual_seed(0)
    model = build_auto("DeepseekV4ForCausalLM", config).train()
    inputs = tiny_inputs(model, "causal-lm")
    slim = slimact.convert(copy.deepcopy(model), "tempo")
    torch._dynamo.reset()
    _, want = loss_grads(model, inputs)
    _, got = loss_grads(torch.compile(slim, backend="aot_eager", fullgraph=True), inputs)  # (plain's has no break)
    torch._dynamo.reset()
    assert_gradients_equal(want, {n.removeprefix("_orig_mod."): g for n, g in got.items()})


def test_a_compiled_converted_model_propagates_non_finite_activations():
    # Under compile a pack cannot fall back to an exact copy (that is a host sync): a group whose range is not
    # finite is restored as NaN, so the gradient is NaN wherever eager slimact's (and PyTorch's) is, never a
    # finite value made up from undefined codes.
    torch.manual_seed(0)
    model = slimact.convert(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)))
    x = torch.randn(8, 16)
    x[3, 5] = float("nan")

    def grads(m):
        m.zero_grad()
        m(x).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    eager = grads(model)
    compiled = grads(torch.compile(model))
    assert torch.isnan(eager["0.weight"]).any() and torch.isnan(eager["2.weight"]).any()
    for n, g in eager.items():
        assert torch.isnan(compiled[n])[torch.isnan(g)].all(), n
    torch._dynamo.reset()


def test_hugging_face_trainer_trains_and_checkpoints_a_converted_model(tmp_path):
    pytest.importorskip("accelerate")
    from safetensors.torch import load_file
    from transformers import Trainer, TrainingArguments

    model = zoo.build("gpt2", tiny=True).train()
    plain = copy.deepcopy(model)
    slimact.convert(model)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (16, 32), generator=g)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3,
                             save_steps=4, logging_steps=1, report_to=[], use_cpu=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert result.global_step == 4
    state = load_file(tmp_path / "checkpoint-4" / "model.safetensors")
    # Hugging Face drops the tied head weight from the file; load it as from_pretrained would.
    plain.load_state_dict(state, strict=False)
    missing = set(plain.state_dict()) - set(state)
    assert missing <= {"lm_head.weight"}, missing
    reloaded = slimact.convert(copy.deepcopy(plain))
    for name, p in model.named_parameters():
        assert torch.equal(dict(plain.named_parameters())[name], p), name
        assert torch.equal(dict(reloaded.named_parameters())[name], p), name
    # Strict both ways between the converted model and the plain one.
    plain.load_state_dict(model.state_dict(), strict=True)
    reloaded.load_state_dict(plain.state_dict(), strict=True)


def _block_stack(wrap=None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.Dropout(0.1))
    if wrap is not None:
        wrap(model)
    return model.train()


def _three_steps(plain: nn.Module, slim: nn.Module, x: torch.Tensor, policy: str, hooks=contextlib.nullcontext):
    """Three steps of each, from the same dropout draws; each step's gradients compared (equal to float rounding
    under "tempo", normwise as ``slimact.check`` judges it)."""
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    for seed in range(3):
        grads = []
        for model in (plain, slim):
            model.zero_grad(set_to_none=True)
            xi = x.detach().requires_grad_(True)
            torch.manual_seed(seed)
            with hooks():
                out = model(xi)
            (out * upstream).sum().backward()
            grads.append({"x": xi.grad, **{n: p.grad for n, p in model.named_parameters() if p.grad is not None}})
        assert grads[0].keys() == grads[1].keys()
        if policy == "tempo":
            assert_gradients_equal(*grads)
        else:
            assert_gradients_close(*grads)


_PARAMETRIZED = {
    "weight_norm": lambda m: nn.utils.parametrizations.weight_norm(m[1]),
    "orthogonal": lambda m: nn.utils.parametrizations.orthogonal(m[3]),
    "spectral_norm": lambda m: nn.utils.parametrizations.spectral_norm(m[1]),
    "old spectral_norm (pre-hook)": lambda m: nn.utils.spectral_norm(m[1]),
    "old weight_norm (pre-hook)": lambda m: nn.utils.weight_norm(m[3]),
}


@pytest.mark.filterwarnings("ignore:.*weight_norm.*deprecated:FutureWarning")
@pytest.mark.parametrize("policy", ["tempo", "int8"])
@pytest.mark.parametrize("how", list(_PARAMETRIZED))
def test_parametrized_weights_are_differentiated_as_in_torch(how, policy):
    # The weight is computed at each access (new style: a property of the Parametrized<Class> made by parametrize;
    # old style: set by a forward pre-hook); spectral norm's power iteration runs once per call, as in plain.
    plain, slim = _block_stack(_PARAMETRIZED[how]), _block_stack(_PARAMETRIZED[how])
    slimact.convert(slim, policy)
    _three_steps(plain, slim, torch.randn(4, 6, 16), policy)
    for (name, b0), b1 in zip(plain.named_buffers(), slim.buffers(), strict=False):
        assert torch.equal(b0, b1), name  # spectral norm's u, v


class _Counted(nn.Module):
    """A parametrization counting its evaluations (a weight drawn at each access would be drawn that often)."""

    calls = 0

    def forward(self, w):
        _Counted.calls += 1
        return w * 1.5


_COUNTED_LAYERS = {
    "linear": (lambda: nn.Linear(8, 8), (2, 3, 8)),
    "conv1d": (lambda: nn.Conv1d(4, 4, 3), (2, 4, 9)),
    "conv2d": (lambda: nn.Conv2d(4, 4, 3), (2, 4, 6, 6)),
    "layernorm": (lambda: nn.LayerNorm(8), (2, 3, 8)),
    "rmsnorm": (lambda: nn.RMSNorm(8), (2, 3, 8)),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), (2, 4, 5)),
    "batchnorm": (lambda: nn.BatchNorm1d(4), (2, 4, 5)),
}


@pytest.mark.parametrize("policy", ["tempo", "int8", "mesa"])
@pytest.mark.parametrize("layer", list(_COUNTED_LAYERS))
def test_a_parametrized_weight_is_computed_as_often_as_plain_computes_it(layer, policy):
    # A converted conv read its weight for its rank, then for the product: spectral norm's power iteration ran twice
    # a call (the forward 2e-3 off plain's after 5 steps), a weight drawn at each access was drawn twice (1.25 off);
    # a converted RMSNorm read it, then its own forward did again (a sweep, 2026-12-07).
    make, shape = _COUNTED_LAYERS[layer]
    counts = []
    for convert in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Identity(), make()).train()
        nn.utils.parametrize.register_parametrization(model[1], "weight", _Counted())
        if convert:
            slimact.convert(model, policy)
        _Counted.calls = 0
        model(torch.randn(shape)).square().sum().backward()
        counts.append(_Counted.calls)
    assert counts[1] == counts[0] == 1


@pytest.mark.parametrize("policy", ["tempo", "int8"])
@pytest.mark.parametrize("layer", ["Conv2d(16, 16, 3)", "Linear(144, 32)"])
def test_spectral_norm_of_any_width_converts_and_trains_as_plain(layer, policy):
    # Spectral norm's _SpectralNorm (named Norm, with an eps, no parameter) was probed as a hand-written norm: its
    # power iteration on a [2, 3, 48] probe resized its _u buffer, and convert crashed ("The size of tensor a (2) must
    # match the size of tensor b (16)") for any layer 144 wide. Parametrizations are not probed.
    torch.manual_seed(0)
    inner = nn.Conv2d(16, 16, 3) if layer.startswith("Conv") else nn.Linear(144, 32)
    plain = nn.Sequential(nn.utils.parametrizations.spectral_norm(inner), nn.GELU()).train()
    slim = slimact.convert(copy.deepcopy(plain), policy)
    assert slimact.summary(slim).converted
    x = torch.randn(2, 16, 6, 6) if layer.startswith("Conv") else torch.randn(4, 144)
    for model in (plain, slim):
        model(x).square().sum().backward()
    for (name, b0), b1 in zip(plain.named_buffers(), slim.buffers(), strict=True):
        assert torch.equal(b0, b1), name
    grads = [{n: p.grad for n, p in m.named_parameters()} for m in (plain, slim)]
    (assert_gradients_equal if policy == "tempo" else assert_gradients_close)(*grads)


@pytest.mark.parametrize("policy", ["tempo", "int8"])
@pytest.mark.parametrize("hooks", ["save_on_cpu", "own pack/unpack"])
def test_saved_tensor_hooks_around_a_converted_model(hooks, policy):
    def to_cpu_and_back():
        return torch.autograd.graph.saved_tensors_hooks(lambda t: (t.device, t.to("cpu", copy=True)),
                                                        lambda packed: packed[1].to(packed[0]))

    ctx = (lambda: torch.autograd.graph.save_on_cpu()) if hooks == "save_on_cpu" else to_cpu_and_back
    plain = _block_stack()
    slim = slimact.convert(copy.deepcopy(plain), policy)
    _three_steps(plain, slim, torch.randn(4, 6, 16), policy, hooks=ctx)


_MHA = {
    "kdim/vdim": ({"kdim": 12, "vdim": 12}, {"need_weights": False}),
    "add_bias_kv": ({"add_bias_kv": True}, {"need_weights": False}),
    "add_zero_attn": ({"add_zero_attn": True}, {"need_weights": False}),
    "weights per head": ({}, {"need_weights": True, "average_attn_weights": False}),
}


@pytest.mark.parametrize("policy", ["tempo", "int8"])
@pytest.mark.parametrize("case", list(_MHA))
def test_multihead_attention_calls_slimact_does_not_cover_run_its_own_code(case, policy):
    built, called = _MHA[case]
    torch.manual_seed(0)
    plain = nn.MultiheadAttention(16, 4, **built).train()  # (no dropout: the per-head weights are returned)
    slim = slimact.convert(copy.deepcopy(plain), policy)
    q = torch.randn(5, 3, 16, requires_grad=True)
    kv = torch.randn(7, 3, built.get("kdim", 16))
    for model in (plain, slim):
        out, weights = model(q, kv, kv, **called)
        assert torch.equal(out, plain(q, kv, kv, **called)[0])
        if weights is not None:
            assert weights.shape == (3, 4, 5, 7 + built.get("add_zero_attn", False) + built.get("add_bias_kv", False))


def _generate(model, inputs):
    ids = inputs["input_ids"]
    kwargs = {} if model.config.is_encoder_decoder else {"attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        return model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("policy", ["tempo", "int8"])
@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_generation_between_training_steps(name, policy):
    """A rollout or a sample between steps (RL fine-tuning, an eval callback): ``generate`` with its cache,
    in eval mode and in train mode under ``no_grad`` (dropout off), gives plain's tokens, and the training
    step after it plain's loss and gradients (equal under tempo, close under int8)."""
    plain = zoo.build(name, tiny=True)
    for module in plain.modules():  # dropout off everywhere, modules and the floats attention code reads
        for attr, value in list(vars(module).items()):
            if "dropout" in attr and isinstance(value, float):
                setattr(module, attr, 0.0)
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    slim = slimact.convert(copy.deepcopy(plain), policy)
    inputs = zoo.example_inputs(plain, 2, 8)
    runs = []
    for model in (plain, slim):
        tokens = [_generate(model.eval(), inputs), _generate(model.train(), inputs)]
        runs.append((tokens, *loss_grads(model, inputs)))
    (tokens0, loss0, grads0), (tokens1, loss1, grads1) = runs
    assert torch.equal(tokens0[0], tokens0[1])  # dropout is off: train mode generates eval mode's tokens
    for a, b in zip(tokens0, tokens1, strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(loss1, loss0)
    if policy == "tempo":
        assert_gradients_equal(grads0, grads1)
    else:
        assert_gradients_close(grads0, grads1)


@pytest.mark.parametrize("policy", ["tempo", "int8"])
def test_prepare_qat_after_convert_warns_for_each_module_it_skipped(policy):
    # torch.ao's eager prepare_qat maps modules by exact class: after convert it gave slimact's Linears and LayerNorms
    # no fake quantization or observer, and the model trained without quantization-aware training, silently (a sweep,
    # 2026-12-07: forward 5e-3 off the QAT model's). Before convert it is as plain, and nothing is said.
    import torch.ao.quantization as q

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4), nn.Dropout(0.1))

    def prepared(model):
        model.train()
        model.qconfig = q.get_default_qat_qconfig("fbgemm")
        return q.prepare_qat(model, inplace=True)

    x = torch.randn(8, 16)
    after = prepared(slimact.convert(copy.deepcopy(base), policy))
    with pytest.warns(UserWarning, match="runs after slimact.convert") as record:
        after(x).sum().backward()
    skipped = {str(w.message).split(" slimact")[0] for w in record if "runs after slimact.convert" in str(w.message)}
    assert skipped == ({"a LayerNorm"} if policy == "tempo" else {"a Linear", "a LayerNorm"}), skipped
    before = slimact.convert(prepared(copy.deepcopy(base)), policy)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*runs after slimact.convert")
        before(x).sum().backward()
