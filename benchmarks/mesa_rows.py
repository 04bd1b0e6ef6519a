"""``"mesa"`` at few rows per batch: the worst gradient cosine ``slimact.check`` finds at 2, 8 and 32 rows, judged as
the sweep judges (``slimact bench --zoo --all --policy mesa``: the step after warming the running estimates on 8 fresh
batches of the same kind, other seeds, and the first step; the worse of the two per parameter). Each model is the
sweep's tiny one (``slimact.zoo.tiny_config``; 16 tokens a row, 32 x 32 images). Writes
``benchmarks/results/mesa_rows.md`` (docs/models.md, "The sweep under ``"mesa"``"). Run:
``OMP_NUM_THREADS=1 python benchmarks/mesa_rows.py``.
"""

from pathlib import Path

from slimact.check import check
from slimact.zoo import build_auto, projection_loss, tiny_config, tiny_inputs

MODELS = (
    ("Llama", "llama", "LlamaForCausalLM", "causal-lm"),
    ("GPT-2", "gpt2", "GPT2LMHeadModel", "causal-lm"),
    ("BERT", "bert", "BertForMaskedLM", "masked-lm"),
    ("OLMo-2", "olmo2", "Olmo2ForCausalLM", "causal-lm"),
    ("BlenderbotSmall", "blenderbot-small", "BlenderbotSmallForConditionalGeneration", "seq2seq-lm"),
    ("ResNet", "resnet", "ResNetForImageClassification", "image-classification"),
)
ROWS = (2, 8, 32)


def worst_cosine(model_type: str, architecture: str, task: str, rows: int) -> str:
    """The worst cosine over the parameters judged by cosine, ``(below)`` where the check fails."""
    model = build_auto(architecture, tiny_config(model_type)).train()
    inputs = tiny_inputs(model, task, batch=rows)
    warm = [tiny_inputs(model, task, batch=rows, seed=s) for s in range(1, 9)]
    report = check(model, inputs, "mesa", loss_fn=projection_loss, batches=warm)
    worst = min(p.cosine for p in report.params if not p.negligible)
    return f"{worst:.4f}" + ("" if report.passed else " (below)")


def main() -> None:
    lines = ["| model | " + " | ".join(f"{r} rows" for r in ROWS) + " |", "|---" * (len(ROWS) + 1) + "|"]
    for name, model_type, architecture, task in MODELS:
        lines.append(f"| {name} | " + " | ".join(worst_cosine(model_type, architecture, task, r) for r in ROWS) + " |")
        print(lines[-1], flush=True)
    out = Path(__file__).parent / "results" / "mesa_rows.md"
    out.write_text("Worst gradient cosine under \"mesa\" (benchmarks/mesa_rows.py)\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
