"""Activation bytes of GPT-2 (4 layers, batch 4 x 256) with Hugging Face gradient checkpointing, slimact, and
both; under bf16 autocast too (benchmarks/results/integrations.{csv,md}). And what torch.compile does to the
saving: bytes held after the forward of the zoo's Llama (2 layers, batch 2 x 256) and the peak of its forward
and backward, eager and compiled, plain and "int8", measured by torch.profiler's memory events
(benchmarks/results/compile.{csv,md}). And nanoGPT's and nanochat's models as their repositories write them
(``slimact.zoo.NanoGPT``/``NanoChat`` at their GPT-2-small sizes) and Meta's reference Llama
(``slimact.zoo.MetaLlama``, a Llama of that size, its loss computed outside the model), fp32, batch 4 x 512: bytes
kept and the step's peak, plain, "tempo" and "int8" (benchmarks/results/nano.{csv,md}).

    python benchmarks/integrations.py            # all three
    python benchmarks/integrations.py nano       # one of: integrations, compile, nano
"""

import copy

import transformers

import slimact
from slimact.bench import autocast, environment, write_results
from slimact.zoo import MetaLlama, NanoChat, NanoGPT, build, example_inputs


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


def nano_rows() -> None:
    """Models outside Hugging Face: slimact finds their head by its name (``lm_head``) and their labels by theirs
    (``targets``), routes the norms, attention and activations their own code calls, and fuses the gated MLPs it
    finds by what they compute (Meta's ``w1``, ``w2``, ``w3``)."""
    import torch
    import torch.nn.functional as F

    rows = []
    for name, ctor in (("nanoGPT (GPT-2 small)", NanoGPT), ("nanochat (depth 12)", NanoChat),
                       ("Meta Llama (GPT-2-small size)", MetaLlama)):
        torch.manual_seed(0)
        base = ctor().train()
        head = base.output if ctor is MetaLlama else base.lm_head
        vocab = head.out_features
        idx = torch.randint(0, vocab, (4, 512), generator=torch.Generator().manual_seed(0))
        targets = idx.roll(-1, 1)
        if ctor is MetaLlama:  # the logits; the loss is the training loop's (torchtitan's), outside the model

            def loss_fn(logits, targets=targets):
                return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

            inputs = idx
        else:  # (logits, loss) from nanoGPT, the loss from nanochat

            def loss_fn(out):
                return out[1] if isinstance(out, tuple) else out

            inputs = (idx, targets)
        plain = None
        for policy in ("plain", "tempo", "int8"):
            model = base if policy == "plain" else slimact.convert(copy.deepcopy(base), policy)
            report = slimact.profile(model, inputs, loss_fn=loss_fn, peak=True)
            plain = plain or report
            rows.append({"model": name, "batch": 4, "tokens": 512, "vocab": vocab, "dtype": "fp32",
                         "policy": policy, "kept_mib": round(report.kept_bytes / 2**20, 1),
                         "kept_ratio": round(report.kept_bytes / plain.kept_bytes, 4),
                         "activation_mib": round(report.activation_bytes / 2**20, 1),
                         "peak_mib": round(report.peak_bytes / 2**20, 1),
                         "peak_ratio": round(report.peak_bytes / plain.peak_bytes, 4), **environment()})
            print(name, policy, rows[-1]["kept_mib"], rows[-1]["kept_ratio"], rows[-1]["peak_mib"],
                  rows[-1]["peak_ratio"], flush=True)
            del model
    print("wrote", write_results(rows, "nano"))


if __name__ == "__main__":
    import sys

    parts = {"integrations": main, "compile": compile_rows, "nano": nano_rows}
    for part in sys.argv[1:] or list(parts):
        parts[part]()
