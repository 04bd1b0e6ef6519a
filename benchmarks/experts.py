"""Mixture-of-experts layers: bytes kept for the backward, plain, converted with a part of the experts run as written
(what ``convert`` did before it took it), and converted, under ``"int8"``, fp32, on the CPU, a batch of 2 x ``SEQ``
tokens:

* a Mixtral of GPT-2-small widths (768 wide, 12 query heads over 4 key/value heads, 4 layers, 8 experts of 2048 of
  which 2 per token, vocabulary 50257) under transformers' default experts implementation (``grouped_mm``), with
  its experts' grouped products as written;
* a gpt-oss of the same widths (4 experts of 2048 of which 2 per token, sliding windows of 128 every other layer;
  as ``benchmarks/attention_sinks.py``), with its clamped gated unit (``_apply_gate``) as written.

Writes ``benchmarks/results/experts.csv`` and ``.md`` (docs/models.md, "Mixture-of-experts layers"); and
``experts_speed.csv``: the two Functions' forward + backward against PyTorch's (``slimact bench --ops``'s rows, GPT-2
widths), and a training step of the gpt-oss above with a 512-token vocabulary (its layers, not its head, dominate),
2 x 256 tokens, converted and with its gate as written, each against plain's: ratios of interleaved rounds. Run:
``OMP_NUM_THREADS=2 python benchmarks/experts.py``.
"""

import contextlib
import copy
import importlib
from unittest import mock

import torch
import transformers

import slimact
from slimact.bench import _function_rows, _interleaved, _ratios, environment, write_results
from slimact.nn.routing import Routing
from slimact.profile import Report

SEQ = (512, 1024)


def mixtral() -> torch.nn.Module:
    config = transformers.MixtralConfig(
        vocab_size=50257, hidden_size=768, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=12,
        num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).train()


def gpt_oss() -> torch.nn.Module:
    config = transformers.GptOssConfig(
        vocab_size=50257, hidden_size=768, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=12,
        num_key_value_heads=4, head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
        max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GptOssForCausalLM(config).train()


def gate_as_written() -> contextlib.AbstractContextManager:
    """``convert`` within it leaves experts' clamped gates as written (no form recognised)."""
    return mock.patch.object(importlib.import_module("slimact.convert"), "gate_form", lambda module: None)


# model name, builder, the part run as written in the first converted row, and how
MODELS = [
    ("Mixtral (4 layers, 768 wide, 8 experts, top 2)", mixtral, "grouped products as written",
     # (the route's handler declining every call: the calls run as the model wrote them)
     lambda: mock.patch.object(Routing, "_grouped_mm", lambda self, *args, **kwargs: None)),
    ("gpt-oss (4 layers, 768 wide, 4 experts, top 2)", gpt_oss, "gate as written", gate_as_written),
]


def experts_bytes(report: Report) -> int:
    """What the experts modules (and their activations) keep."""
    return sum(e.nbytes for e in report.entries if ".experts" in e.module or e.module.endswith("experts"))


def main() -> None:
    write_results(memory(), "experts")
    write_results(speed(), "experts_speed")


def memory() -> list[dict]:
    rows = []
    for name, build, label, as_written in MODELS:
        plain = build()
        assert plain.config._experts_implementation == "grouped_mm"
        for seq in SEQ:
            ids = torch.randint(1, 50257, (2, seq), generator=torch.Generator().manual_seed(0))
            inputs = {"input_ids": ids, "labels": ids}
            base = slimact.profile(plain, inputs)
            for experts, context in ((label, as_written()), ("converted", contextlib.nullcontext())):
                with context:  # (the route binds its handlers, and the gates are set, at conversion)
                    model = slimact.convert(copy.deepcopy(plain), "int8")
                    report = slimact.profile(model, inputs)
                rows.append({
                    "model": name, "tokens": f"2 x {seq}", "policy": "int8", "experts": experts,
                    "plain_kept_mib": round(base.kept_bytes / 2**20, 2),
                    "kept_mib": round(report.kept_bytes / 2**20, 2),
                    "kept_ratio": round(report.kept_bytes / base.kept_bytes, 4),
                    "plain_experts_mib": round(experts_bytes(base) / 2**20, 2),
                    "experts_mib": round(experts_bytes(report) / 2**20, 2),
                    **environment("cpu"),
                })
                print(rows[-1])
    return rows


def speed(rounds: int = 11) -> list[dict]:
    rows = list(_function_rows(rounds, "cpu", 1024, only=("grouped matmul (experts)", "clamped gated unit (experts)")))
    config = gpt_oss().config
    config.vocab_size = 512
    torch.manual_seed(0)
    plain = transformers.GptOssForCausalLM(config).train()
    ids = torch.randint(1, 512, (2, 256), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}
    with gate_as_written():
        as_written = slimact.convert(copy.deepcopy(plain), "int8")
    models = {"plain": plain, "converted": slimact.convert(copy.deepcopy(plain), "int8"),
              "gate as written": as_written}

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            model(**inputs).loss.backward()
        return run

    times = _interleaved({name: step(m) for name, m in models.items()}, rounds)
    for name in ("converted", "gate as written"):
        rows.append({"op": f"gpt-oss step (vocab 512, 2 x 256), int8, {name}", "vs": "plain",
                     **_ratios(times[name], times["plain"]), "rounds": rounds, **environment("cpu")})
    for row in rows:
        print(row)
    return rows


if __name__ == "__main__":
    main()
