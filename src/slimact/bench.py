"""The benchmark harness behind ``slimact bench``: measurements written as result files with their context.

Every table is a list of rows (dicts) written by :func:`write_results` as ``<name>.csv`` and ``<name>.md``
under ``benchmarks/results/``, each row stamped with the machine, the torch version and the date, so a
committed result says where it came from and a rerun on another machine sits beside it.

``memory``: bytes kept for backward (:func:`slimact.profile`) by zoo models, plain and under each policy,
in fp32 and under bf16/fp16 autocast. It is the README's headline table.

``zoo``: per model family, what ``convert`` replaced, the coverage (:func:`slimact.summary` with inputs) and
the bytes kept under ``"int8"`` and ``"tempo"`` (``docs/models.md``).
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import os
import platform
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["environment", "held_bytes", "memory", "write_results", "zoo"]

_LOW = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def environment(device: str = "cpu") -> dict[str, str]:
    """Where a measurement was taken: machine, device, torch version, date."""
    dev = device
    if torch.device(device).type == "cuda":
        dev = torch.cuda.get_device_name(torch.device(device))
    return {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "device": dev,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }


def autocast(device: str, dtype: str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``"bf16"``/``"fp16"``, nothing for ``"fp32"``."""
    if dtype not in _LOW:
        raise ValueError(f"dtype must be one of {list(_LOW)}, got {dtype!r}")
    low = _LOW[dtype]
    return torch.autocast(torch.device(device).type, dtype=low) if low else contextlib.nullcontext()


def memory(
    models: Iterable[str],
    dtypes: Iterable[str] = ("fp32", "bf16"),
    policies: Iterable[str] = ("int8", "tempo"),
    *,
    batch: int = 4,
    seq: int = 512,
    device: str = "cpu",
    extra: Iterable[tuple[str, str, str]] = (),
    tiny: bool = False,
) -> Iterator[dict[str, Any]]:
    """Rows of activation bytes, plain and converted, for each model, dtype and policy (plus the
    ``(model, dtype, policy)`` triples of ``extra``). Models are the zoo's, at their default size; vision
    models take ``batch`` images at their own size and ignore ``seq``; ``tiny``: the zoo's test sizes."""
    import slimact
    from slimact.zoo import build, example_inputs

    dtypes, policies, extra = tuple(dtypes), tuple(policies), tuple(extra)
    for name in models:
        model = build(name, tiny=tiny).to(device)
        inputs = example_inputs(model, batch, seq)
        wanted = [(d, p) for d in dtypes for p in policies] + [(d, p) for m, d, p in extra if m == name]
        for dtype in dict.fromkeys(d for d, _ in wanted):
            with autocast(device, dtype):
                plain = slimact.profile(model, inputs)
            for dt, policy in wanted:
                if dt != dtype:
                    continue
                slimact.convert(model, policy)
                with autocast(device, dtype):
                    converted = slimact.profile(model, inputs)
                slimact.revert(model)
                yield {
                    "model": name,
                    "batch": batch,
                    "tokens": "images" if "pixel_values" in inputs else seq,
                    "dtype": dtype,
                    "policy": policy,
                    "plain_mib": round(plain.activation_bytes / 2**20, 2),
                    "converted_mib": round(converted.activation_bytes / 2**20, 2),
                    "ratio": round(converted.activation_bytes / plain.activation_bytes, 4),
                    **({"cuda_peak_mib": round(converted.cuda_peak_bytes / 2**20, 2)}
                       if converted.cuda_peak_bytes is not None else {}),
                    **environment(device),
                }
        del model


def zoo(
    models: Iterable[str], *, layers: int | None = 2, batch: int = 2, seq: int = 128, device: str = "cpu"
) -> Iterator[dict[str, Any]]:
    """Rows per model family: the converted kinds, the coverage, and the bytes under "int8" and "tempo"."""
    import slimact
    from slimact.zoo import build, example_inputs

    for name in models:
        model = build(name, layers=None if name == "swin" else layers).to(device)
        inputs = example_inputs(model, batch, seq)
        plain = slimact.profile(model, inputs).activation_bytes
        slimact.convert(model, "int8")
        summary = slimact.summary(model, inputs)
        int8 = slimact.profile(model, inputs).activation_bytes
        slimact.convert(model, "tempo")
        tempo = slimact.profile(model, inputs).activation_bytes
        slimact.revert(model)
        yield {
            "model": name,
            "class": type(model).__name__,
            "converted": " ".join(f"{k}:{n}" for k, n in sorted(summary.converted.items())),
            "coverage": round(summary.coverage, 4),
            "plain_mib": round(plain / 2**20, 2),
            "int8_ratio": round(int8 / plain, 4),
            "tempo_ratio": round(tempo / plain, 4),
            "layers": "stages 2,2,6,2" if name == "swin" else layers,
            "batch": batch,
            "tokens": "images" if "pixel_values" in inputs else seq,
            **environment(device),
        }
        del model


def held_bytes(model: torch.nn.Module, inputs: dict[str, Any]) -> int:
    """Bytes a training forward allocates on the CPU and still holds when it returns (what waits for the
    backward, plus the small outputs), measured by ``torch.profiler``'s memory events; then the backward runs.

    Unlike :func:`slimact.profile` it needs no saved-tensor hooks, so it also measures compiled models, whose
    graphs the hooks cannot see into. On eager models the two agree (``benchmarks/integrations.py``).
    """
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(**inputs).loss
    held = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage and e.cpu_parent is None)
    loss.backward()
    return held


def write_results(rows: list[dict[str, Any]], name: str, folder: str | os.PathLike[str] = "benchmarks/results") -> Path:
    """Write ``rows`` as ``<folder>/<name>.csv`` and a Markdown table ``<name>.md``; returns the CSV path."""
    if not rows:
        raise ValueError("no rows to write")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    path = folder / f"{name}.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in rows]
    (folder / f"{name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
