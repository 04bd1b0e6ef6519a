"""A fixed subset of the sweep (``slimact bench --zoo --all``), in the test suite: each architecture built as the
sweep builds it (its config class shrunk in code, random weights, batch 2 x 16) and checked as the sweep checks
it (``slimact.check`` under the default policy: forward equal to plain, every non-negligible gradient at
cosine >= 0.99, negligible ones at noise level, no crash). The subset covers every attention, norm and MLP form
the sweep met; where one of them fails, the sweep's table in ``docs/models.md`` says why."""

from pathlib import Path

import pytest
import torch

import slimact
import slimact.bench
from slimact.check import rounding_tolerance
from slimact.zoo import auto_architectures, build_auto, projection_loss, tiny_config, tiny_inputs

pytest.importorskip("transformers")

#: Architecture class -> the form it stands for.
SUBSET: dict[str, str] = {
    # attention through transformers' AttentionInterface
    "BertForMaskedLM": "multi-head attention, absolute positions, LayerNorm, GELU MLP, dropout",
    "RobertaForMaskedLM": "as BERT, positions offset by the padding index, GELU called in the LM head's code",
    "DistilBertForMaskedLM": "fused-name attention (q_lin...), CrossEntropyLoss module",
    "AlbertForMaskedLM": "factorised embedding, one layer shared by all (a module called twice per step)",
    "ElectraForMaskedLM": "embedding width != hidden width (a projection between)",
    "GPT2LMHeadModel": "Conv1D (transposed Linear), fused qkv, tanh GELU recognised by probe",
    "GPTNeoXForCausalLM": "parallel attention and MLP, rotary on part of each head",
    "PhiForCausalLM": "partial rotary, parallel block, dense GELU MLP",
    "OPTForCausalLM": "ReLU MLP, functional dropout in model code",
    "LlamaForCausalLM": "grouped-query attention, rotary, RMSNorm class, SwiGLU MLP",
    "MistralForCausalLM": "as Llama with a sliding window",
    "Qwen2ForCausalLM": "as Llama with q/k/v biases",
    "Qwen3ForCausalLM": "RMSNorm on queries and keys (per-head norm inside attention)",
    "GemmaForCausalLM": "RMSNorm scaling by 1 + weight, GeGLU (tanh GELU) MLP, scaled embeddings",
    "Gemma2ForCausalLM": "attention logit soft-capping, sandwich norms",
    "Phi3ForCausalLM": "fused qkv and fused gate_up projections",
    "CohereForCausalLM": "LayerNorm without bias, parallel block, logit scale",
    "OlmoForCausalLM": "parameter-free LayerNorm (F.layer_norm in model code)",
    "NemotronForCausalLM": "squared-ReLU MLP, LayerNorm1P (offset weight)",
    "MixtralForCausalLM": "mixture of experts (router, top-2 experts)",
    "Qwen2MoeForCausalLM": "mixture of experts with a shared expert and its gate",
    "GptOssForCausalLM": "eager-only attention with sinks (s_aux) and a sliding window",
    "FalconForCausalLM": "multi-query attention, parallel block (the issue's item 1)",
    "GPTJForCausalLM": "rotary on part of each head (rotary_dim), parallel block",
    "Gemma3ForCausalLM": "sliding-window and global layers (a window shorter than the batch), q/k norms",
    "Llama4ForCausalLM": "chunked attention, global layers without rotary, experts with a shared expert",
    "DeepseekV3ForCausalLM": "multi-head latent attention (low-rank q and kv, rotary on part of a head), group routing",
    "Qwen3NextForCausalLM": "gated DeltaNet linear attention beside gated full attention",
    "JambaForCausalLM": "Mamba layers beside attention layers, experts",
    "DoryForCausalLM": "an nn.Linear subclass with its own forward as LM head (logit scale)",
    # attention computed in model code
    "BloomForCausalLM": "ALiBi, baddbmm scores in model code",
    "GPTNeoForCausalLM": "local (windowed) and global attention layers, no score scaling",
    "MPNetForMaskedLM": "relative position bias in model code",
    "DebertaV2ForMaskedLM": "disentangled attention in model code",
    # encoder-decoders
    "T5ForConditionalGeneration": "T5LayerNorm (RMSNorm), learned relative position bias, ReLU",
    "BartForConditionalGeneration": "encoder-decoder with cross-attention, learned positions",
    "MarianMTModel": "sinusoidal positions, SiLU activation",
    # vision
    "ViTForImageClassification": "patch-embedding Conv2d, pre-norm encoder",
    "BeitForImageClassification": "relative position bias in attention, layer scale",
    "SwinForImageClassification": "windowed attention with a relative position bias, patch merging",
    "ConvNextForImageClassification": "channels-first LayerNorm (permuting in forward), depthwise conv",
    "ResNetForImageClassification": "Conv2d + BatchNorm2d + ReLU",
    # audio
    "Wav2Vec2ForCTC": "convolutional feature encoder with GroupNorm, CTC loss",
    "HubertForCTC": "as wav2vec2 (the issue's item 3)",
    "WhisperModel": "log-mel features through Conv1d, encoder-decoder",
    # base models (no head: a fixed random projection of the output is the loss)
    "BertModel": "a base model with a pooler (Tanh)",
}

_ARCHS = {arch: (task, model_type) for task, model_type, arch in auto_architectures()}


def test_the_subset_is_in_the_sweep():
    assert set(SUBSET) <= set(_ARCHS), set(SUBSET) - set(_ARCHS)


@pytest.mark.parametrize("arch", list(SUBSET))
def test_architecture_within_the_floors(arch):
    task, model_type = _ARCHS[arch]
    model = build_auto(arch, tiny_config(model_type)).train()
    report = slimact.check(model, tiny_inputs(model, task), "int8", loss_fn=projection_loss)
    assert report.passed, f"{arch} ({SUBSET[arch]}):\n{report}"


def test_one_hang_or_hard_crash_becomes_a_row_and_the_sweep_goes_on(monkeypatch):
    import os
    import time

    from slimact import bench

    def hangs(task, model_type, arch, progress, policy):
        progress("plain")
        progress("check")  # the plain step took no time, slimact's part started: a hang there is slimact's
        time.sleep(60)

    monkeypatch.setattr(bench, "sweep_one", hangs)
    row = bench._sweep_isolated(("causal-lm", "llama", "LlamaForCausalLM"), timeout=2)
    assert row["outcome"] == "crash" and "no result after 2 s" in row["detail"]

    def dies(task, model_type, arch, progress, policy):
        progress("check")
        os._exit(3)  # as a segfault would: no row comes back

    monkeypatch.setattr(bench, "sweep_one", dies)
    row = bench._sweep_isolated(("causal-lm", "llama", "LlamaForCausalLM"), timeout=30)
    assert row["outcome"] == "crash" and "process died (exit 3)" in row["detail"]


def test_the_table_goes_into_its_section_and_the_document_is_kept(tmp_path):
    import csv

    from slimact.bench import SWEEP_COLUMNS, write_sweep_docs

    path = tmp_path / "zoo_all.csv"
    rows = [{"architecture": "A", "task": "base", "outcome": "ok", "kept_ratio": "0.2"},
            {"architecture": "B", "task": "ctc", "outcome": "crash", "detail": "slimact: E: x|y"}]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SWEEP_COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(rows)
    doc = tmp_path / "models.md"
    doc.write_text("# Models\n\nexisting text\n")
    write_sweep_docs(path, doc)
    write_sweep_docs(path, doc)  # rewritten in place, not appended twice
    text = doc.read_text()
    assert text.startswith("# Models\n\nexisting text\n") and text.count("## Every architecture") == 1
    assert "**1 ok**, **0 below floor**, **1 crash**, **0 skipped**" in text
    assert text.index("`B`") < text.index("`A`") and "x\\|y" in text  # failures first; pipes escaped


def test_a_plain_model_that_is_not_deterministic_is_skipped_with_that_reason(monkeypatch):
    # A model whose plain step gives another result from the same RNG state (one drawing noise outside torch's
    # RNG, or whose output length flips on rounding) is no reference: the sweep says so instead of "forward
    # differs".
    from slimact import bench

    calls = []

    def drifting(model, inputs):
        out = model(**inputs)
        calls.append(1)
        out["loss"] = out["loss"] + 0.01 * len(calls)
        return out

    monkeypatch.setattr(bench, "_call_model", drifting)
    row = bench.sweep_one(*next(a for a in auto_architectures() if a[2] == "LlamaForCausalLM"))
    assert row["outcome"] == "skipped" and "not deterministic" in row["detail"], row


def test_a_lossless_policy_is_judged_by_the_lossless_floor_and_its_bytes_are_its_own():
    # Under "tempo" the row says so, the gradients are judged equal to plain's to float rounding (the largest
    # relative difference is recorded: the lossless floor's measure), and the kept bytes are tempo's.
    from slimact import bench

    arch = next(a for a in auto_architectures() if a[2] == "LlamaForCausalLM")
    row = bench.sweep_one(*arch, policy="tempo")
    assert row["outcome"] == "ok" and row["policy"] == "tempo", row
    assert float(row["max_rel_diff"]) <= rounding_tolerance(torch.float32)
    int8 = bench.sweep_one(*arch)
    assert int8["policy"] == "int8" and int8["kept_kib"] < row["kept_kib"] < row["plain_kib"]


def _fake_sweep(monkeypatch, detail):
    """The sweep over two fake architectures, each row made up (``detail`` in it), no model built."""
    from slimact import bench, zoo

    archs = [("base", "a", "A"), ("base", "b", "B")]
    monkeypatch.setattr(zoo, "auto_architectures", lambda: archs)
    monkeypatch.setattr(bench, "sweep_one", lambda *a, **k: {})  # the parent's warm-up
    monkeypatch.setattr(bench, "_sweep_isolated", lambda arch, timeout, policy: {
        "task": arch[0], "model_type": arch[1], "architecture": arch[2], "outcome": "ok", "detail": detail,
        "kept_ratio": "0.5"})


def test_each_policy_has_its_file_and_its_section_and_a_rerun_replaces_rows(tmp_path, monkeypatch):
    from slimact.bench import _read_sweep, sweep_path
    from slimact.cli import main

    assert sweep_path("int8") == Path("benchmarks/results/zoo_all.csv")
    assert sweep_path("tempo", tmp_path) == tmp_path / "zoo_all_tempo.csv"
    doc = tmp_path / "models.md"
    doc.write_text("# Models\n")
    _fake_sweep(monkeypatch, "first")
    for policy in ("int8", "tempo"):
        assert main(["bench", "--zoo", "--all", "--policy", policy, "--out", str(tmp_path), "--docs", str(doc)]) == 0
    # --models: those architectures run again, their rows replaced, the others kept.
    _fake_sweep(monkeypatch, "second")
    assert main(["bench", "--zoo", "--all", "--policy", "tempo", "--models", "B", "--out", str(tmp_path),
                 "--docs", str(doc)]) == 0
    tempo = _read_sweep(tmp_path / "zoo_all_tempo.csv")
    assert {(r["architecture"], r["policy"], r["detail"]) for r in tempo} == {("A", "tempo", "first"),
                                                                           ("B", "tempo", "second")}
    assert {r["policy"] for r in _read_sweep(tmp_path / "zoo_all.csv")} == {"int8"}
    text = doc.read_text()
    assert text.count("<!-- sweep table: written by slimact bench --zoo --all -->") == 1
    assert text.count("<!-- sweep table (tempo): written by slimact bench --zoo --all --policy tempo -->") == 1
    assert text.count("## The sweep under") == 1 and text.count("## Every architecture") == 1
    tempo_section = text.partition("(tempo): written")[2]
    assert "| max rel diff | tempo kept |" in tempo_section and "second" in tempo_section
    assert "| min cosine | int8 kept |" in text.partition("(tempo): written")[0]
    # A file of one policy is not extended with another's rows.
    with pytest.raises(ValueError, match="another policy"):
        list(slimact.bench.zoo_all(tmp_path / "zoo_all.csv", policy="tempo", resume=True))


def test_the_first_sweeps_file_reads_as_int8(tmp_path):
    # zoo_all.csv was written before the policy column, with the kept bytes as int8_kib and int8_ratio.
    from slimact.bench import _read_sweep

    path = tmp_path / "zoo_all.csv"
    path.write_text("task,architecture,outcome,int8_kib,int8_ratio\nbase,A,ok,1.5,0.25\n")
    assert _read_sweep(path) == [{"task": "base", "architecture": "A", "outcome": "ok", "kept_kib": "1.5",
                                  "kept_ratio": "0.25", "policy": "int8"}]


def test_a_bias_a_layer_norm_removes_keeps_its_zero_gradient_under_int8():
    # GroupViT's token-mixing MLPs end in a bias adding one value to every channel of a token, which the
    # LayerNorms after it remove: its exact gradient is 0 (plain float32: 1e-4, rounding). The 8-bit LayerNorm's
    # backward at a restored normalised input whose channels did not sum to 0 gave it 0.01-0.03, over the size
    # floor (0.006); the restored input is now re-centred, as the exact one is.
    task, model_type = _ARCHS["GroupViTModel"]
    model = build_auto("GroupViTModel", tiny_config(model_type)).train()
    report = slimact.check(model, tiny_inputs(model, task), "int8", loss_fn=projection_loss)
    assert report.passed, str(report)


def test_the_sweep_compiles_in_the_process_that_runs_the_pack(monkeypatch, tmp_path):
    """Inductor's pool of compile workers, started by the parent's warm-up, does not survive the fork: with a cold
    compile cache (a fresh clone) a child needing a kernel the parent had not compiled waited forever, and every such
    architecture under "int8" came back "no result after the time limit". The sweep compiles in-process."""
    import torch._inductor.config as inductor_config

    seen = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # (the warm-up runs with one thread)
    monkeypatch.setattr(slimact.bench, "sweep_one", lambda *a, **k: seen.append(inductor_config.compile_threads))
    # (Not monkeypatch: its undo deletes the setting from torch's config module, which then reads as missing, and
    # every later torch.compile in the process failed with "compile_threads does not exist".)
    with inductor_config.patch(compile_threads=8):
        assert list(slimact.bench.zoo_all(tmp_path / "sweep.csv", only=[])) == []
    assert seen == [1], seen
    assert inductor_config.compile_threads >= 1  # still there for later compiles
