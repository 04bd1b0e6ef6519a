"""``slimact demo``: train the same small Transformers plainly and converted, on real data, and compare.

Two tasks, both on data that ships with the environment (no network):

* text: a byte-level GPT-2 (Hugging Face ``GPT2LMHeadModel``, 4 layers, width 128) on the Python standard
  library's own source files (found with ``sysconfig``), the last 10% held out;
* vision: a ViT (``ViTForImageClassification``, 4 layers, width 64, 2x2 patches) on scikit-learn's
  handwritten digits (``load_digits``), 20% held out, with accuracy.

Each task trains three times from the same seed on the same batches, with the same dropout draws: plain
PyTorch, ``"tempo"`` and ``"int8"``. Reported per run: the final training loss (mean of the last 20 steps),
the held-out loss (and accuracy), the activation bytes one step keeps (``slimact.profile``), and the median
step time. Written to the output folder: ``demo.png`` (loss curves and activation bytes), ``demo.md`` and
``demo.csv``.
"""

from __future__ import annotations

import csv
import functools
import statistics
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = ["POLICIES", "TASKS", "RunResult", "run_demo"]

POLICIES = ("plain", "tempo", "int8")


@dataclass
class RunResult:
    task: str
    policy: str
    losses: list[float] = field(default_factory=list)
    final_loss: float = float("nan")
    heldout_loss: float = float("nan")
    accuracy: float | None = None
    activation_bytes: int = 0
    step_time_s: float = float("nan")


# ------------------------------------------------------------------------------------------------ data


def stdlib_bytes(limit: int = 6 << 20) -> Tensor:
    """Up to ``limit`` bytes of the Python standard library's ``.py`` files, in a fixed order, as uint8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if not chunks:
        raise RuntimeError(f"no Python source files found under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8)


def digits() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's 8x8 digits as ``[N, 1, 8, 8]`` floats in [0, 1], split 80/20 with a fixed permutation."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(y))
    return x[:cut], y[:cut], x[cut:], y[cut:]


# ------------------------------------------------------------------------------------------------ tasks


class _Task:
    name: str
    lr: float

    def model(self) -> nn.Module: ...

    def batches(self, steps: int) -> list[dict]: ...

    def heldout(self) -> list[dict]: ...

    def accuracy(self, model: nn.Module) -> float | None:
        return None


class _Text(_Task):
    name, lr = "text", 1e-3

    def __init__(self, seq: int = 128, batch: int = 16) -> None:
        data = stdlib_bytes()
        cut = int(0.9 * len(data))
        self.train, self.held = data[:cut].long(), data[cut:].long()
        self.seq, self.batch = seq, batch

    def model(self) -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=256, n_positions=self.seq, n_embd=128, n_layer=4, n_head=4,
                         bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)

    def _batch(self, data: Tensor, starts: Tensor) -> dict:
        ids = torch.stack([data[s : s + self.seq] for s in starts.tolist()])
        return {"input_ids": ids, "labels": ids}

    def batches(self, steps: int) -> list[dict]:
        gen = torch.Generator().manual_seed(1)
        return [self._batch(self.train, torch.randint(0, len(self.train) - self.seq, (self.batch,), generator=gen))
                for _ in range(steps)]

    def heldout(self) -> list[dict]:
        gen = torch.Generator().manual_seed(2)
        return [self._batch(self.held, torch.randint(0, len(self.held) - self.seq, (self.batch,), generator=gen))
                for _ in range(8)]


class _Digits(_Task):
    name, lr = "digits", 3e-3

    def __init__(self, batch: int = 64) -> None:
        self.x, self.y, self.x_test, self.y_test = digits()
        self.batch = batch

    def model(self) -> nn.Module:
        from transformers import ViTConfig, ViTForImageClassification

        cfg = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=4,
                        num_attention_heads=4, intermediate_size=128, num_labels=10)
        return ViTForImageClassification(cfg)

    def batches(self, steps: int) -> list[dict]:
        gen = torch.Generator().manual_seed(1)
        out = []
        for _ in range(steps):
            idx = torch.randint(0, len(self.y), (self.batch,), generator=gen)
            out.append({"pixel_values": self.x[idx], "labels": self.y[idx]})
        return out

    def heldout(self) -> list[dict]:
        return [{"pixel_values": self.x_test, "labels": self.y_test}]

    def accuracy(self, model: nn.Module) -> float:
        with torch.no_grad():
            logits = model(pixel_values=self.x_test).logits
        return (logits.argmax(-1) == self.y_test).float().mean().item()


# ------------------------------------------------------------------------------------------------ runs


def _train(task: _Task, policy: str, steps: int, seed: int, progress) -> RunResult:
    """One run: ``steps`` AdamW steps with a one-cycle learning rate, then the held-out evaluation."""
    import slimact

    torch.manual_seed(seed)
    model = task.model()
    if policy != "plain":
        slimact.convert(model, policy)
    model.train()
    batches = task.batches(steps)
    result = RunResult(task.name, policy)
    result.activation_bytes = slimact.profile(model, batches[0]).activation_bytes
    opt = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=task.lr, total_steps=steps, pct_start=0.1)
    times = []
    torch.manual_seed(seed + 1)  # the same dropout draws in every run
    for batch in batches:
        start = time.perf_counter()
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
        times.append(time.perf_counter() - start)
        result.losses.append(loss.item())
        progress.update(1)
    result.final_loss = statistics.fmean(result.losses[-20:])
    result.step_time_s = statistics.median(times[3:] or times)
    model.eval()
    with torch.no_grad():
        result.heldout_loss = statistics.fmean(model(**b).loss.item() for b in task.heldout())
    result.accuracy = task.accuracy(model)
    return result


TASKS = ("text", "digits")


def run_demo(out: str | Path = "slimact-out", *, steps: int = 300, quick: bool = False, seed: int = 0,
             device: str = "cpu", tasks: tuple[str, ...] = TASKS) -> list[RunResult]:
    """Run ``tasks`` (both by default) under each of :data:`POLICIES`; write ``demo.png``, ``demo.md``, ``demo.csv``
    to ``out``.

    ``steps`` is the text task's length (the digits task runs 400 steps, its steps being 10x cheaper);
    ``quick`` shortens both (40 and 200 steps, the text task at half its batch) for a run of under a minute.
    """
    from tqdm import tqdm

    if device != "cpu":
        raise ValueError("the demo runs on the CPU (its models are a few MB); --device cpu")
    unknown = set(tasks) - set(TASKS)
    if unknown or not tasks:
        raise ValueError(f"tasks: {sorted(unknown) or 'none given'}; the demo's tasks are {list(TASKS)}")
    text = functools.partial(_Text, batch=8) if quick else _Text
    plan = [(task(), n) for name, task, n in (("text", text, 40 if quick else steps),
                                              ("digits", _Digits, 200 if quick else 400)) if name in tasks]
    results = []
    total = sum(n for _, n in plan) * len(POLICIES)
    with tqdm(total=total, desc="slimact demo", unit="step") as progress:
        for task, n in plan:
            for policy in POLICIES:
                progress.set_postfix_str(f"{task.name} / {policy}")
                results.append(_train(task, policy, n, seed, progress))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_table(results, out)
    plot(results, out / "demo.png")
    return results


# ------------------------------------------------------------------------------------------------ output


_HEADER = ["task", "policy", "final train loss", "held-out loss", "held-out accuracy", "activation bytes / step",
           "vs plain", "median step (ms)"]


def _rows(results: list[RunResult]) -> list[list[str]]:
    plain = {r.task: r for r in results if r.policy == "plain"}
    rows = []
    for r in results:
        base = plain[r.task].activation_bytes
        rows.append([
            r.task, r.policy, f"{r.final_loss:.4f}", f"{r.heldout_loss:.4f}",
            "" if r.accuracy is None else f"{100 * r.accuracy:.1f}%", f"{r.activation_bytes / 2**20:.2f} MiB",
            f"{r.activation_bytes / base:.3f}x", f"{1000 * r.step_time_s:.1f}",
        ])
    return rows


def format_table(results: list[RunResult]) -> str:
    """The results as a Markdown table."""
    rows = _rows(results)
    lines = ["| " + " | ".join(_HEADER) + " |", "|" + "---|" * len(_HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_table(results: list[RunResult], out: Path) -> None:
    (out / "demo.md").write_text(format_table(results) + "\n", encoding="utf-8")
    with open(out / "demo.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(_HEADER)
        writer.writerows(_rows(results))


def plot(results: list[RunResult], path: Path) -> None:
    """Loss curves per task (policies overlaid) and activation bytes per step as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"plain": "#444444", "tempo": "#1f77b4", "int8": "#d62728"}
    tasks = list(dict.fromkeys(r.task for r in results))
    fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(5.2 * (len(tasks) + 1), 4.2))
    units = {"text": "loss (nats per byte)", "digits": "cross-entropy loss (nats)"}
    for ax, task in zip(axes, tasks, strict=False):
        for r in (r for r in results if r.task == task):
            smooth = torch.tensor(r.losses).unfold(0, min(10, len(r.losses)), 1).mean(1)
            ax.plot(range(len(smooth)), smooth.tolist(), label=r.policy, color=colors[r.policy], linewidth=1.4,
                    linestyle="-" if r.policy == "plain" else "--")
        ax.set_title(f"{task}: training loss (10-step mean)")
        ax.set_xlabel("training step")
        ax.set_ylabel(units.get(task, "loss"))
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[-1]
    width = 0.8 / len(POLICIES)
    for i, policy in enumerate(POLICIES):
        values = [next(r.activation_bytes for r in results if r.task == t and r.policy == policy) / 2**20
                  for t in tasks]
        xs = [j + (i - 1) * width for j in range(len(tasks))]
        bars = ax.bar(xs, values, width, label=policy, color=colors[policy])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel("activation bytes kept per step (MiB)")
    ax.set_title("memory kept for the backward pass")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
