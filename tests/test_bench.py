"""The benchmark harness: memory rows measured by profile, written with their context."""

import csv

import pytest
import torch

from slimact.bench import memory, write_results

pytest.importorskip("transformers")


def test_memory_rows_and_result_files(tmp_path):
    rows = list(memory(["gpt2", "vit-b16"], ("fp32", "bf16"), ("int8", "tempo"), batch=2, seq=32, tiny=True,
                       extra=[("vit-b16", "bf16", "mesa")]))
    assert [(r["model"], r["dtype"], r["policy"]) for r in rows] == [
        ("gpt2", "fp32", "int8"), ("gpt2", "fp32", "tempo"), ("gpt2", "bf16", "int8"), ("gpt2", "bf16", "tempo"),
        ("vit-b16", "fp32", "int8"), ("vit-b16", "fp32", "tempo"), ("vit-b16", "bf16", "int8"),
        ("vit-b16", "bf16", "tempo"), ("vit-b16", "bf16", "mesa"),
    ]
    for r in rows:
        assert 0 < r["kept_mib"] < r["plain_kept_mib"] and r["kept_ratio"] < 1, r
        # kept: activations and the LM loss's gradients computed ahead (GPT-2's); the step's peak holds more
        assert r["kept_ratio"] >= r["activation_ratio"] and (r["gradients_ahead_mib"] > 0) == (r["model"] == "gpt2")
        for side in ("plain_", ""):
            assert 0 < r[f"{side}peak_less_grads_mib"] <= r[f"{side}peak_mib"], r
        assert r["peak_in"] in ("forward", "backward")
        assert r["torch"] and r["date"] and r["machine"]
    assert rows[0]["tokens"] == 32 and rows[4]["tokens"] == "images"
    path = write_results(rows, "memory", tmp_path)
    with path.open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert (tmp_path / "memory.md").read_text().count("\n") == len(rows) + 2


def test_held_bytes_agrees_with_profile_on_an_eager_model():
    import slimact
    from slimact import zoo
    from slimact.bench import held_bytes

    for policy in (None, "int8"):
        model = zoo.build("llama", tiny=True).train()
        if policy:
            slimact.convert(model, policy)
        inputs = zoo.example_inputs(model, 2, 64)
        report = slimact.profile(model, inputs)
        kept = report.activation_bytes + report.gradient_bytes
        held = held_bytes(model, inputs)
        # Two ways of counting the same tensors: storages kept (profile; the LM loss's gradients computed ahead
        # included) and net allocations (held, which also sees the loss and not tensors allocated before the
        # forward): equal to 1%.
        assert abs(held - kept) <= 0.01 * kept + 4096, (policy, kept, held)


def test_set_dropout_sets_the_config_and_the_modules():
    from slimact import zoo
    from slimact.bench import set_dropout

    model = zoo.build("gpt2", tiny=True)
    set_dropout(model, 0.0)
    assert model.config.attn_pdrop == model.config.resid_pdrop == model.config.embd_pdrop == 0.0
    drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(m.p == 0.0 for m in drops)
    model.train()
    x = zoo.example_inputs(model, 2, 16)
    torch.testing.assert_close(model(**x).logits, model(**x).logits)  # no randomness left in training mode


def test_speed_rows_are_interleaved_ratios_with_memory():
    from slimact.bench import speed

    rows = list(speed(["gpt2"], ("tempo", "int8", "checkpoint+int8"), layers=None, batch=2, seq=16, rounds=2,
                      warmup=1, tiny=True, dropout=0.1))
    assert [r["setup"] for r in rows] == ["plain", "tempo", "int8", "checkpoint+int8"]
    assert all(r["dropout"] == 0.1 and r["first_step_s"] > 0 for r in rows)
    assert rows[0]["time_ratio_median"] == 1.0 and rows[0]["memory_ratio"] == 1.0
    assert rows[0]["eval_ratio_median"] == 1.0
    for r in rows[1:]:
        assert r["time_ratio_min"] <= r["time_ratio_median"] <= r["time_ratio_max"]
        assert r["eval_ratio_min"] <= r["eval_ratio_median"] <= r["eval_ratio_max"]
        assert 0 < r["memory_ratio"] < 1


def test_speed_vocab_sets_the_vocabulary_and_rows_record_the_load():
    from slimact.bench import speed

    rows = list(speed(["gpt2", "llama"], ("tempo",), layers=None, batch=2, seq=16, rounds=1, warmup=1, tiny=True,
                      vocab=50))
    assert [(r["model"], r["setup"]) for r in rows] == [("gpt2", "plain"), ("gpt2", "tempo"), ("llama", "plain"),
                                                        ("llama", "tempo")]
    assert all(r["vocab"] == 50 for r in rows)
    assert all(isinstance(r["load_start"], float) and isinstance(r["load_end"], float) for r in rows)
    default = next(speed(["gpt2"], (), layers=None, batch=2, seq=16, rounds=1, warmup=1, tiny=True))
    assert default["vocab"] == 96  # the zoo's tiny vocabulary, as built


def test_block_ops_table_has_per_op_times_and_calls_per_setup(tmp_path, capfd):
    from slimact.bench import block_ops
    from slimact.cli import main

    rows = list(block_ops(("tempo", "int8"), batch=2, seq=16, rounds=2, warmup=1, tiny=True))
    assert [r["op"] for r in rows[:3]] == ["(wall)", "(total)", "(not in ops)"]
    for r in rows:
        assert {"plain_ms", "plain_calls", "tempo_ms", "tempo_calls", "int8_ms", "int8_calls"} <= r.keys()
    ops = {r["op"]: r for r in rows[3:]}
    # The plain block runs PyTorch's ops only; the converted ones run slimact's Functions (profiled by name).
    assert any(r["plain_calls"] > 0 for name, r in ops.items() if name.startswith("aten::"))
    slim = [r for name, r in ops.items() if name.startswith("_") and name.endswith("Function")]
    assert slim and all(r["plain_calls"] == 0 for r in slim)
    assert any(r["tempo_calls"] > 0 for r in slim) and any(r["int8_calls"] > 0 for r in slim)
    assert all(r[f"{k}_ms"] >= 0 for r in rows[1:] for k in ("plain", "tempo", "int8"))
    # Ordered by the largest excess over plain.
    excess = [max(r["tempo_ms"], r["int8_ms"], r["plain_ms"]) - r["plain_ms"] for r in rows[3:]]
    assert excess == sorted(excess, reverse=True)
    capfd.readouterr()
    assert main(["bench", "--speed", "--ops-table", "--tiny", "--batch", "2", "--seq", "16", "--rounds", "1",
                 "--policies", "tempo", "--out", str(tmp_path)]) == 0
    assert "USDT" not in capfd.readouterr().err  # (torch 2.13's Kineto at each profiler start and stop, silenced)
    with (tmp_path / "speed_ops.csv").open() as f:
        written = list(csv.DictReader(f))
    assert written[0]["op"] == "(wall)" and "tempo_ms" in written[0] and "int8_ms" not in written[0]


def test_ops_rows():
    from slimact.bench import bandwidth, ops

    rows = list(ops(mib=4, rounds=2, lm_tokens=16, sizes=[1 / 64]))
    names = [r["op"] for r in rows]
    assert names[:4] == ["pack 4 MiB fp32", "pack (running estimate) 4 MiB fp32", "unpack 4 MiB fp32",
                         "unpack 4 MiB fp32"]
    assert [r["vs"] for r in rows[:4]] == ["Tensor.copy_", "Tensor.copy_", "Tensor.copy_", "Tensor.clone"]
    assert {"linear fwd+bwd", "gelu fwd+bwd", "attention fwd+bwd", "lm head + loss fwd+bwd"} <= set(names)
    assert all(r["time_ratio_median"] > 0 for r in rows)
    # Bandwidth per layout: copy_, pack and unpack, GB/s counting bytes read and written.
    # On the CPU (the compiled loops' backend) the reference's pack and unpack too; at each size asked for
    # (4 MiB, then 1/64 MiB = 4096 elements).
    per_layout = [r for r in rows if "gb_per_s" in r]
    assert [r["op"] for r in per_layout] == [f"{op} {mib} MiB fp32, {layout}" for mib in ("4", "0.015625")
                                             for layout in ("whole tensor", "channel groups", "per head")
                                             for op in ("copy_", "pack", "unpack", "pack (reference)",
                                                        "unpack (reference)")]
    assert all(r["gb_per_s"] > 0 for r in per_layout)
    assert per_layout[10]["shape"] == "1x16x1024x64" and per_layout[25]["shape"] == "1x16x4x64"
    assert all(per_layout[i]["time_ratio_median"] == 1.0 for i in range(0, 30, 5))  # copy_, each layout's base
    assert not any("kernel_ms" in r for r in per_layout)  # the kernels' own device time: on a GPU only
    with pytest.raises(ValueError, match="4 KiB rows"):
        next(bandwidth(mib=0.001))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_bandwidth_rows_have_the_kernels_device_time():
    from slimact.bench import bandwidth

    rows = list(bandwidth(mib=4, rounds=2, device="cuda"))
    assert len(rows) == 9 and all(r["kernel_ms"] > 0 and r["kernel_gb_per_s"] > 0 for r in rows)
    assert all(rows[i]["kernel_ratio"] == 1.0 for i in (0, 3, 6))
    # The kernels alone are never slower than the wall time around them.
    assert all(r["kernel_ms"] <= r["ms_median"] * 1.05 for r in rows)


def test_kernel_probe_finds_the_triton_kernels_equal_to_the_reference():
    # On CPU the kernels run under TRITON_INTERPRET=1 (conftest), at the probe's tiny shapes.
    pytest.importorskip("triton")
    from slimact.bench import kernels

    rows = list(kernels(tiny=True))
    assert len(rows) == 3 * 2 * 7  # 3 layouts x 2 dtypes x (group_stats + 3 modes x 2 kernels)
    assert {(r["layout"], r["dtype"]) for r in rows} == {
        (lay, dt) for lay in ("whole tensor", "channel groups", "per head") for dt in ("bfloat16", "float32")}
    coded = [r for r in rows if r["kernel"] != "group_stats"]
    assert {(r["bits"], r["rounding"]) for r in coded} == {(8, "nearest"), (8, "stochastic seed 1234"), (4, "nearest")}
    for r in coded:
        assert r["code_mismatches"] == r["max_code_diff"] == r["restored_mismatches"] == 0, r
        assert r["dequantize_mismatches"] == 0, r
    for r in rows:
        if r["kernel"] == "group_stats":
            assert r["range_mismatches"] == 0 and r["magnitude_max_rel_diff"] < 1e-5, r


def test_kernel_probe_counts_a_wrong_code(monkeypatch):
    # The probe must see a mismatch: a kernel whose codes are off by one somewhere.
    pytest.importorskip("triton")
    from slimact.bench import kernels
    from slimact.quant import triton as tk

    real = tk.quantize

    def off_by_one(x, layout, lo, step, bits, seed):
        codes = real(x, layout, lo, step, bits, seed).clone()
        codes.view(-1)[0] ^= 1
        return codes

    monkeypatch.setattr(tk, "quantize", off_by_one)
    rows = [r for r in kernels(tiny=True) if r["kernel"] == "quantize+dequantize"]
    assert all(r["code_mismatches"] >= 1 and r["max_code_diff"] >= 1 and r["restored_mismatches"] >= 1 for r in rows)


def test_peak_bytes_counts_temporaries_and_a_converted_gpt2_peaks_lower():
    import slimact
    from slimact import zoo
    from slimact.bench import peak_bytes

    # The real vocabulary (50257) at 2 layers, 2 x 64 tokens: the LM loss computes its weight gradient
    # ([50257, 768], 147 MiB) in the forward; the step's peak must still be below the plain model's, which
    # materialises the logits, their log-softmax and their gradients.
    model = zoo.build("gpt2", layers=2).train()
    inputs = zoo.example_inputs(model, 2, 64)
    plain = peak_bytes(model, inputs)
    slimact.convert(model, "int8")
    report = slimact.profile(model, inputs)
    converted = peak_bytes(model, inputs)
    assert report.gradient_bytes >= 50257 * 768 * 4
    assert report.activation_bytes + report.gradient_bytes <= converted < plain


GPU_STEPS = ("device", "kernels", "ops", "speed", "profile", "tests", "check", "throughput")


def test_gpu_script_is_valid_bash_its_commands_parse_and_its_timeouts_fit_8_minutes():
    # benchmarks/gpu.sh runs on a CUDA machine; here: its syntax, every slimact command it runs is accepted by the
    # command line as written, and the steps' timeouts add up to at most 480 s (8 minutes).
    import re
    import shlex
    import subprocess
    from pathlib import Path

    from slimact.cli import build_parser

    script = Path(__file__).parents[1] / "benchmarks" / "gpu.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text().replace("\\\n", " ")
    commands = re.findall(r'-m slimact (bench [^\n]+)', text)
    assert len(commands) == 5  # kernels on cuda and on cpu (dry), ops, speed, throughput
    checks = [c.split(' ||')[0] for c in re.findall(r'-m slimact (check [^\n]+)', text)]
    assert len(checks) == 1  # the tiny GPT-2 and Llama under tempo and int8
    for command in commands + checks:
        args = build_parser().parse_args(shlex.split(command.replace('"$STEPS"', "out")))
        assert args.device in ("cuda", "cpu")
    steps = re.findall(r"^\s*step (\w+) (\d+) [01] ", text, re.M)
    assert [name for name, _ in steps if name != "kernels"] == [s for s in GPU_STEPS if s != "kernels"]
    limits = {name: int(limit) for name, limit in steps}
    assert sum(limits.values()) <= 480, limits


@pytest.mark.slow
def test_gpu_script_dry_run_starts_every_step_and_packs_one_tarball(tmp_path):
    # On a machine with no CUDA device the script runs in dry mode: every step starts (the kernel probe for real,
    # on CPU under Triton's interpreter), and what comes back is one tarball and a summary.
    import os
    import subprocess
    import sys
    import tarfile
    from pathlib import Path

    root = Path(__file__).parents[1]
    out = tmp_path / "out"
    env = {**os.environ, "SLIMACT_GPU_DRY": "1", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(root / "benchmarks" / "gpu.sh"), str(out)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu-results.tar.gz", "summary.txt"]
    with tarfile.open(out / "gpu-results.tar.gz") as tar:
        names = set(tar.getnames())
        kernels_csv = tar.extractfile("steps/kernels.csv").read().decode()
    assert {f"steps/{s}.log" for s in GPU_STEPS} | {"steps/kernels.csv", "steps/summary.txt"} <= names
    assert "code_mismatches" in kernels_csv and len(kernels_csv.splitlines()) == 1 + 3 * 2 * 7
    summary = (out / "summary.txt").read_text()
    for s in GPU_STEPS:
        assert f"== {s:<10} exit 0 " in summary, summary
    assert summary.count("no device") >= 4  # ops, speed, throughput skipped; the device step says so
    with tarfile.open(out / "gpu-results.tar.gz") as tar:
        assert "no device" in tar.extractfile("steps/profile.md").read().decode()  # written in dry mode too


def test_throughput_rows_time_each_setup_at_the_batch_measured_to_fit_the_budget():
    from slimact.bench import throughput

    rows = list(throughput(["gpt2"], "24MiB", ("int8",), layers=None, seq=64, rounds=2, warmup=1, max_batch=30,
                           tiny=True))
    assert [r["setup"] for r in rows] == ["plain", "int8"]
    plain, int8 = rows
    for r in rows:
        assert 0 < r["batch"] == min(r["fit_batch"], 30)
        assert r["fit_measured_mib"] <= r["budget_mib"]  # measured (slimact.fit), not only predicted
        assert r["samples_per_s_ratio_min"] <= r["samples_per_s_ratio_median"] <= r["samples_per_s_ratio_max"]
    assert plain["samples_per_s_ratio_median"] == 1.0
    assert int8["fit_batch"] > plain["fit_batch"]  # the memory won, spent on the batch
