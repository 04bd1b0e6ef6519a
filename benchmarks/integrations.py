"""Activation bytes of GPT-2 (4 layers, batch 4 x 256) with Hugging Face gradient checkpointing, slimact, and
both; under bf16 autocast too (benchmarks/results/integrations.{csv,md}). And what torch.compile does to the
saving: bytes held after the forward of the zoo's Llama (2 layers, batch 2 x 256) and the peak of its forward
and backward, eager and compiled, plain and "int8", measured by torch.profiler's memory events
(benchmarks/results/compile.{csv,md}).

    python benchmarks/integrations.py
"""

import copy

import transformers

import slimact
from slimact.bench import autocast, environment, write_results
from slimact.zoo import build, example_inputs


def main() -> None:
    transformers.logging.set_verbosity_error()
    rows = []
    for dtype in ("fp32", "bf16"):
        base = build("gpt2", layers=4).train()
        inputs = example_inputs(base, 4, 256)
        ckpt = copy.deepcopy(base)
        ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        setups = {
            "plain": base,
            "checkpointing": ckpt,
            "int8": slimact.convert(copy.deepcopy(base)),
            "checkpointing + int8": slimact.convert(copy.deepcopy(ckpt)),
            "tempo": slimact.convert(copy.deepcopy(base), "tempo"),
            "checkpointing + tempo": slimact.convert(copy.deepcopy(ckpt), "tempo"),
        }
        plain = None
        for name, model in setups.items():
            with autocast("cpu", dtype):
                n = slimact.profile(model, inputs).activation_bytes
            plain = plain or n
            rows.append({"model": "gpt2 (4 layers)", "batch": 4, "tokens": 256, "dtype": dtype, "setup": name,
                         "activation_mib": round(n / 2**20, 2), "ratio": round(n / plain, 4), **environment()})
            print(rows[-1]["dtype"], name, rows[-1]["activation_mib"], rows[-1]["ratio"], flush=True)
    print("wrote", write_results(rows, "integrations"))
    compile_rows()


def compile_rows() -> None:
    import torch

    from slimact.bench import held_bytes, peak_bytes

    base = build("llama", layers=2).train()
    inputs = example_inputs(base, 2, 256)
    rows = []
    for policy in ("plain", "int8"):
        model = copy.deepcopy(base) if policy == "plain" else slimact.convert(copy.deepcopy(base), policy)
        report = slimact.profile(model, inputs)
        measured = {
            "eager (slimact.profile)": (report.activation_bytes, report.gradient_bytes, None),
            "eager": (held_bytes(model, inputs), None, peak_bytes(model, inputs)),
        }
        compiled = torch.compile(model)
        held_bytes(compiled, inputs)  # compiles
        measured["compiled"] = (held_bytes(compiled, inputs), None, peak_bytes(compiled, inputs))
        for mode, (held, ahead, peak) in measured.items():
            rows.append({"model": "llama (2 layers)", "batch": 2, "tokens": 256, "policy": policy, "mode": mode,
                         "held_mib": round(held / 2**20, 2),
                         "gradients_ahead_mib": "" if ahead is None else round(ahead / 2**20, 2),
                         "peak_mib": "" if peak is None else round(peak / 2**20, 2), **environment()})
            print(policy, mode, rows[-1]["held_mib"], rows[-1]["peak_mib"], flush=True)
        torch._dynamo.reset()
    print("wrote", write_results(rows, "compile"))


if __name__ == "__main__":
    main()
