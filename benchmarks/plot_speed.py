"""Memory against step time, from benchmarks/results/speed.csv: one point per model and setup (plain, each
preset, per-layer checkpointing, checkpointing with "int8"); top row the activation bytes kept for the
backward, bottom row the step's peak (forward and backward, everything allocated). Writes
benchmarks/results/speed.png.

    python benchmarks/plot_speed.py
"""

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = Path(__file__).with_name("results")


def main() -> None:
    rows = list(csv.DictReader((RESULTS / "speed.csv").open()))
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 8), squeeze=False)
    memories = (("memory_ratio", "activation bytes / plain"), ("peak_ratio", "peak bytes / plain"))
    for row, (column, label) in zip(axes, memories, strict=True):
        for ax, model in zip(row, models, strict=True):
            for r in (r for r in rows if r["model"] == model):
                x, y = float(r["time_ratio_median"]), float(r[column])
                err = [[x - float(r["time_ratio_min"])], [float(r["time_ratio_max"]) - x]]
                ax.errorbar(x, y, xerr=err, fmt="o", capsize=3)
                ax.annotate(r["setup"], (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
            first = next(r for r in rows if r["model"] == model)
            ax.set_title(f"{model}, {first['layers']} layers, batch {first['batch']} x {first['tokens']}")
            ax.set_xlabel("step time / plain (median, min-max over rounds)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    fig.suptitle(f"{rows[0]['device']}, torch {rows[0]['torch']}, {rows[0]['date']}")
    fig.tight_layout()
    fig.savefig(RESULTS / "speed.png", dpi=120)
    print("wrote", RESULTS / "speed.png")


if __name__ == "__main__":
    main()
