"""Every model family of the zoo, converted with the default policy: a training step runs, every gradient is
close to the plain model's, ``revert`` gives the plain model back exactly, the ``state_dict`` never changes,
and >= 95% of the plain activation bytes sit in converted modules. Also under bf16 autocast, and "tempo"."""

import pytest
import torch

import slimact
from _harness import assert_gradients_close, loss_grads, zero_gradients
from slimact import zoo

pytest.importorskip("transformers")

FAMILIES = list(zoo.MODELS)


def _tiny(name):
    model = zoo.build(name, tiny=True).train()
    return model, zoo.example_inputs(model, 2, 32)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_state(model, expected):
    now = model.state_dict()
    assert now.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(now[k], v), k


def test_the_zoo_has_every_family_of_the_issue():
    assert set(FAMILIES) == {
        "bert-base", "roberta", "distilbert", "gpt2", "gpt-neox", "opt", "llama", "mistral", "qwen2", "gemma", "phi3",
        "vit-b16", "deit", "swin", "t5", "torch-encoder",
    }


@pytest.mark.parametrize("name", FAMILIES)
def test_family_converts_trains_and_reverts(name):
    model, inputs = _tiny(name)
    before = _state(model)
    params = list(model.parameters())
    loss0, exact = loss_grads(model, inputs)

    slimact.convert(model)  # the default policy
    assert list(model.parameters()) == params
    _assert_same_state(model, before)
    loss1, approx = loss_grads(model, inputs)
    torch.testing.assert_close(loss1, loss0)  # the LM loss is summed in chunks: float rounding apart
    assert_gradients_close(exact, approx)
    report = slimact.summary(model, inputs)
    assert report.coverage >= 0.95, str(report)
    assert {"linear", "attention"} <= set(report.converted), report.converted

    slimact.revert(model)
    _assert_same_state(model, before)
    loss2, again = loss_grads(model, inputs)
    assert torch.equal(loss2, loss0)
    assert again.keys() == exact.keys()
    for n in exact:
        assert torch.equal(again[n], exact[n]), n


@pytest.mark.parametrize("name", FAMILIES)
def test_family_trains_a_few_optimizer_steps(name):
    model, inputs = _tiny(name)
    slimact.convert(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("name", FAMILIES)
def test_family_under_bf16_autocast(name):
    model, inputs = _tiny(name)
    gold = loss_grads(model, inputs)[1]
    zeros = zero_gradients(gold)  # zero in exact arithmetic: found in fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss0, exact = loss_grads(model, inputs)
        slimact.convert(model)
        loss1, approx = loss_grads(model, inputs)
    torch.testing.assert_close(loss1, loss0, rtol=1e-2, atol=0.0)
    assert_gradients_close(exact, approx, zeros=zeros, gold=gold)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_under_tempo_is_exact_and_keeps_less(name):
    model, inputs = _tiny(name)
    loss0, exact = loss_grads(model, inputs)
    plain = slimact.profile(model, inputs).activation_bytes
    slimact.convert(model, "tempo")
    loss1, approx = loss_grads(model, inputs)
    torch.testing.assert_close(loss1, loss0)
    for n in exact:
        torch.testing.assert_close(approx[n], exact[n], rtol=1e-4, atol=1e-6, msg=n)
    assert slimact.profile(model, inputs).activation_bytes < plain


# --- The sweep's shrinker (``tiny_config``): rules, on configurations alone (no weights) ---


def test_shrinker_keeps_one_layer_of_each_kind_and_remaps_layer_lists():
    values = {"num_hidden_layers": 8, "layer_types": ["sliding", "sliding", "sliding", "full"] * 2,
              "no_rope_layers": [1, 1, 1, 0] * 2, "intermediate_size": [4096] * 8, "moe_layers": [1, 3, 5, 7],
              "per_layer_config": {"03": {"head_dim": 512}, "07": {"head_dim": 512}}, "block_types": ["a", "a", "b"]}
    out = zoo._per_layer(values, {})
    # Kinds: (sliding, rope, dense) at 0, (sliding, rope, moe) at 1, (full, no rope, moe, own config) at 3.
    assert out["num_hidden_layers"] == 3
    assert out["layer_types"] == ["sliding", "sliding", "full"]
    assert out["no_rope_layers"] == [1, 1, 0]
    assert out["intermediate_size"] == [zoo._TINY_ATTRS["intermediate_size"]] * 3
    assert out["moe_layers"] == [1, 2]
    assert out["per_layer_config"] == {"02": {"head_dim": zoo._TINY_ATTRS["head_dim"]}}
    assert out["block_types"] == ["a", "b"]  # a cycle: each kind once


def test_shrinker_validates_nested_layer_types_and_keeps_both_attention_kinds():
    config = zoo.tiny_config("gemma3")  # its text config's 26 layer types used to fail validation
    assert config.text_config.layer_types == ["sliding_attention", "full_attention"]
    text = zoo.tiny_config("llama4_text")  # chunked rotary layers and a global layer without rotary
    assert text.layer_types == ["chunked_attention", "full_attention"] and text.no_rope_layers == [1, 0]
    assert not text.use_cache and not config.text_config.use_cache  # hybrid models' caches fail a training step


def test_shrinker_sets_sizes_models_need_consistently():
    assert zoo.tiny_config("gptj").rotary_dim <= zoo.tiny_config("gptj").n_embd // zoo.tiny_config("gptj").n_head
    mla = zoo.tiny_config("deepseek_v3")
    assert mla.head_dim == mla.qk_rope_head_dim  # the rotary embedding's width is MLA's rotary part
    assert zoo.tiny_config("deepseek_v2").num_experts_per_tok == 2  # None in the default: topk(k=None)
    assert zoo.tiny_config("ministral").head_dim == 16
    mamba = zoo.tiny_config("bamba")
    assert mamba.mamba_n_heads * mamba.mamba_d_head == mamba.mamba_expand * mamba.hidden_size
    jamba = zoo.tiny_config("jamba")
    assert jamba.attn_layer_period == jamba.expert_layer_period == 2  # both kinds within 2 layers


def test_shrinker_fits_multimodal_rotary_sections_to_the_shrunk_head():
    # Sections in the configuration (Cosmos3-Edge's on head_dim, HY-V4-VL's on MLA's rotary part), sections only
    # model code names (Qwen2-VL's), and on a partially rotary head (GLM-4V-MoE's factor 0.5): they sum to the
    # head's rotary frequencies, each section kept.
    for model_type, width in (("cosmos3_edge_text", "head_dim"), ("hy_v4_vl_text", "qk_rope_head_dim")):
        config = zoo.tiny_config(model_type)
        section = config.rope_parameters["mrope_section"]
        assert sum(section) == getattr(config, width) // 2 and min(section) > 0, (model_type, section)
    qwen = zoo.tiny_config("qwen2_vl_text")
    assert qwen.rope_parameters["mrope_section"] == [2, 3, 3]  # [16, 24, 24] of its model code, on 16-wide heads
    glm = zoo.tiny_config("glm4v_moe_text")
    assert sum(glm.rope_parameters["mrope_section"]) == 16 // 2 // 2


def test_shrinker_keeps_sizes_consistent_across_sub_configs_and_stages():
    glm5 = zoo.tiny_config("glm5_next_text")
    assert glm5.qk_rope_head_dim == 0  # its sparse attention has no rotary part: 0 is kept, not shrunk to 8
    docling, inkling = zoo.tiny_config("granite_docling"), zoo.tiny_config("inkling2")
    assert docling.vision_config.out_hidden_size == docling.text_config.hidden_size  # the tower's output width
    assert inkling.vision_config.text_hidden_size == inkling.text_config.hidden_size
    audio = zoo.tiny_config("muse_spark_audio")
    assert audio.num_hidden_layers == len(audio.depths) == len(audio.hidden_sizes)  # its layer count counts stages
    assert zoo.tiny_config("molmo2").adapter_config.vision_feature_layer == [1, 0]
    apertus = zoo.tiny_config("apertus1p5")  # image then audio codes in the vocabulary
    assert apertus.audio_token_offset + apertus.audio_config.codebook_size <= apertus.text_config.vocab_size


def test_shrinker_caps_routing_however_spelled_and_fills_sizes_a_checkpoint_names():
    for model_type in ("bailing_hybrid", "kimi_linear"):  # num_experts_per_token, num_expert_group: 8 of 4 experts
        config = zoo.tiny_config(model_type)
        assert config.num_experts_per_token <= config.num_experts and config.num_expert_group == 1, model_type
    qwen4 = zoo.tiny_config("qwen4_exp_text")  # indexed attention layers, whose indexer's sizes default to None
    assert "indexed_attention" in qwen4.layer_types and qwen4.indexer_budget < 16
    compass = zoo.tiny_config("cohere_compass_text")  # per-layer-type rotary parameters, none by default
    assert set(compass.layer_types) <= set(compass.rope_parameters)


@pytest.mark.parametrize("arch, model_type", [
    ("Apertus1p5Model", "apertus1p5"), ("Glm4vModel", "glm4v"), ("JanusModel", "janus"),
    ("Florence2Model", "florence2"), ("EfficientNetModel", "efficientnet"), ("MuseSparkModel", "muse_spark"),
    ("Qwen4ExpForCausalLM", "qwen4_exp"), ("CohereCompassForCausalLM", "cohere_compass"), ("VJEPA2Model", "vjepa2"),
    ("BitModel", "bit"), ("Swin2SRModel", "swin2sr"), ("ReformerModel", "reformer"),
])
def test_shrinker_builds_within_the_tiny_bound(arch, model_type):
    # Each failed validation or was over zoo._MAX_TINY_PARAMS (a width or a scaling the shrinker did not know: a
    # VQ image tokenizer's channels, a vision tower's output width, EfficientNet's compound scaling...).
    with torch.device("meta"):
        model = _transformers_class(arch)(zoo._own_config(_transformers_class(arch), zoo.tiny_config(model_type)))
    assert sum(p.numel() for p in model.parameters()) <= zoo._MAX_TINY_PARAMS


def test_shrinker_gives_detr_a_resnet_backbone_and_pvt_heads_that_divide_its_stages():
    # DETR's kind named a timm ResNet-50 (timm is not installed: skipped); PVT's heads per stage (1, 2, 5, 8) did
    # not divide the shrunk stage widths (skipped: "hidden size not a multiple of the number of attention heads").
    for arch, model_type in (("DetrModel", "detr"), ("DeformableDetrModel", "deformable_detr")):
        config = zoo.tiny_config(model_type)
        assert config.backbone_config.model_type == "resnet"
        with torch.device("meta"):
            model = _transformers_class(arch)(config)
        assert sum(p.numel() for p in model.parameters()) <= zoo._MAX_TINY_PARAMS
    pvt = zoo.tiny_config("pvt")
    assert all(w % h == 0 for w, h in zip(pvt.hidden_sizes, pvt.num_attention_heads, strict=True))


def test_inputs_include_what_forward_requires():
    # An image-text model whose forward requires token ids beside its main input (images), and an audio encoder
    # requiring its features' mask: both were skipped ("missing 1 required positional argument").
    class TwoInputs(torch.nn.Module):
        main_input_name = "pixel_values"

        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"vocab_size": 10, "num_channels": 3, "image_size": 8})()

        def forward(self, pixel_values, input_ids, attention_mask=None):
            return pixel_values

    class Masked(TwoInputs):
        main_input_name = "input_features"

        def forward(self, input_features, input_features_mask):
            return input_features

    inputs = zoo.tiny_inputs(TwoInputs(), "base")
    assert inputs["pixel_values"].shape == (2, 3, 8, 8) and inputs["input_ids"].shape == (2, 16)
    assert int(inputs["input_ids"].max()) < 10 and "attention_mask" not in inputs  # optional: left to the model
    masked = zoo.tiny_inputs(Masked(), "base")
    assert masked["input_features_mask"].shape == masked["input_features"].shape[:2]
    assert masked["input_features_mask"].all()

    class Series(TwoInputs):  # a time series model (PatchTST's): values over its context, per channel
        main_input_name = "past_values"

        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"context_length": 32, "num_input_channels": 3})()

        def forward(self, past_values):
            return past_values

    series = zoo.tiny_inputs(Series(), "base")["past_values"]
    assert series.shape == (2, 32, 3) and series.is_floating_point()  # (token ids before: skipped)


def test_a_text_only_class_gets_its_own_sub_config():
    config = zoo.tiny_config("llama4")
    assert type(zoo._own_config(_transformers_class("Llama4ForCausalLM"), config)) is type(config.text_config)
    assert zoo._own_config(_transformers_class("Llama4ForConditionalGeneration"), config) is config


def _transformers_class(name):
    import transformers

    return getattr(transformers, name)


def test_shrinker_windows_are_shorter_than_the_batch_and_audio_codes_come_per_codebook():
    assert zoo.tiny_config("mistral").sliding_window < 16  # the batch's 16 tokens: the window's mask matters
    assert zoo.tiny_config("llama4_text").attention_chunk_size < 16
    with torch.device("meta"):
        decoder = zoo.build_auto("MusicgenForCausalLM", zoo.tiny_config("musicgen"))
    config = decoder.config
    inputs = zoo.tiny_inputs(decoder, "causal-lm", batch=2, seq=16)
    assert inputs["input_ids"].shape == (2 * config.num_codebooks, 16)
    assert inputs["labels"].shape == (2, 16, config.num_codebooks)


def test_a_video_model_gets_a_clip_of_frames():
    with torch.device("meta"):
        model = zoo.build_auto("VJEPA2Model", zoo.tiny_config("vjepa2"))
    video = zoo.tiny_inputs(model, "base")["pixel_values_videos"]  # were token ids of its vocabulary-less config
    assert video.shape == (2, 4, 3, model.config.crop_size, model.config.crop_size) and video.is_floating_point()


def test_a_vision_tower_of_patch_rows_gets_patches_and_their_grid_and_its_vlm_token_ids():
    with torch.device("meta"):
        tower = zoo.build_auto("Qwen2_5_VisionTransformerPretrainedModel", zoo.tiny_config("qwen2_5_vl_vision"))
        vlm = zoo.build_auto("Qwen2_5_VLModel", zoo.tiny_config("qwen2_5_vl"))
    inputs = zoo.tiny_inputs(tower, "base")  # were pixel_values of 2 images, which its forward does not take
    config = tower.config
    assert inputs["hidden_states"].shape == (2 * 16, 3 * config.temporal_patch_size * config.patch_size**2)
    assert inputs["grid_thw"].tolist() == [[1, 4, 4]] * 2
    assert zoo.tiny_inputs(vlm, "base").keys() == {"input_ids", "attention_mask"}  # a VLM takes image grids too: text


def test_a_dual_encoder_gets_images_and_texts_and_a_vision_tower_its_images():
    with torch.device("meta"):
        clip = zoo.build_auto("CLIPModel", zoo.tiny_config("clip"))
        tower = zoo.build_auto("Idefics3VisionTransformer", zoo.tiny_config("idefics3_vision"))
    inputs = zoo.tiny_inputs(clip, "base")  # were token ids alone: its forward needs the images it scores them on
    assert inputs["input_ids"].shape == (2, 16) and inputs["pixel_values"].shape == (2, 3, 32, 32)
    assert zoo.tiny_inputs(tower, "base").keys() == {"pixel_values"}  # its main_input_name is the default's
    siglip = zoo.tiny_config("siglip")  # its text head projects into the image embeddings' width (768 = 768)
    assert siglip.text_config.projection_size == siglip.vision_config.hidden_size
