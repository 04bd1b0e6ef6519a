"""The benchmark harness: memory rows measured by profile, written with their context."""

import csv

import pytest

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
        assert 0 < r["converted_mib"] < r["plain_mib"] and r["ratio"] < 1, r
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


def test_speed_rows_are_interleaved_ratios_with_memory():
    from slimact.bench import speed

    rows = list(speed(["gpt2"], ("tempo", "int8", "checkpoint+int8"), layers=None, batch=2, seq=16, rounds=2,
                      warmup=1, tiny=True))
    assert [r["setup"] for r in rows] == ["plain", "tempo", "int8", "checkpoint+int8"]
    assert rows[0]["time_ratio_median"] == 1.0 and rows[0]["memory_ratio"] == 1.0
    assert rows[0]["eval_ratio_median"] == 1.0
    for r in rows[1:]:
        assert r["time_ratio_min"] <= r["time_ratio_median"] <= r["time_ratio_max"]
        assert r["eval_ratio_min"] <= r["eval_ratio_median"] <= r["eval_ratio_max"]
        assert 0 < r["memory_ratio"] < 1


def test_ops_rows():
    from slimact.bench import ops

    rows = list(ops(mib=4, rounds=2))
    names = [r["op"] for r in rows]
    assert names[:4] == ["pack 4 MiB fp32", "pack (running estimate) 4 MiB fp32", "unpack 4 MiB fp32",
                         "unpack 4 MiB fp32"]
    assert [r["vs"] for r in rows[:4]] == ["Tensor.copy_", "Tensor.copy_", "Tensor.copy_", "Tensor.clone"]
    assert {"linear fwd+bwd", "gelu fwd+bwd", "attention fwd+bwd"} <= set(names)
    assert all(r["time_ratio_median"] > 0 for r in rows)


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


def test_gpu_script_is_valid_bash_and_its_commands_parse():
    # benchmarks/gpu.sh runs on a CUDA machine only; here: its syntax, and every slimact command it runs is
    # accepted by the command line as written.
    import re
    import shlex
    import subprocess
    from pathlib import Path

    from slimact.cli import build_parser

    script = Path(__file__).parents[1] / "benchmarks" / "gpu.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text().replace("\\\n", " ")
    commands = re.findall(r'-m slimact (bench [^\n]+)', text)
    assert len(commands) == 3
    for command in commands:
        args = build_parser().parse_args(shlex.split(command.replace('"$OUT"', "out")))
        assert args.device == "cuda"


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
