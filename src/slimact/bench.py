"""The benchmark harness behind ``slimact bench``: measurements written as result files with their context.

Every table is a list of rows (dicts) written by :func:`write_results` as ``<name>.csv`` and ``<name>.md``
under ``benchmarks/results/``, each row stamped with the machine, the torch version and the date, so a
committed result says where it came from and a rerun on another machine sits beside it.

``memory``: bytes kept for backward (:func:`slimact.profile`) by zoo models, plain and under each policy,
in fp32 and under bf16/fp16 autocast. It is the README's headline table.

``zoo``: per model family, what ``convert`` replaced, the coverage (:func:`slimact.summary` with inputs) and
the bytes kept under ``"int8"`` and ``"tempo"`` (``docs/models.md``).

``speed``: a full training step (forward, backward, AdamW step) of plain PyTorch and of each setup (a preset,
per-layer activation checkpointing, both), timed interleaved in one process (plain, setup 1, setup 2, ...;
setup 1, setup 2, ..., plain; ...: each round starts one later) after warm-up: per round the ratio of each
setup's time to that round's plain time, reported as the median and the spread (min, max) over the rounds,
with the activation bytes of each setup and the peak
of its forward and backward (:func:`peak_bytes`), so time and memory sit on one plane. Shared machines are
noisy: only ratios measured this way are reported, never an absolute time on its own.

``throughput``: samples per second at one memory budget. :func:`slimact.fit` gives each setup (plain, each
policy) its largest batch under the budget, measured (weights, optimizer state and the step's
:func:`peak_bytes`, which sees every temporary); the steps at those batches are timed interleaved and each
round's samples-per-second ratio against plain is reported. This is where the
memory is spent: Tempo's +16% on BERT-Large came from the larger batch the memory bought, not a faster step.

``ops``: per-op micro-benchmarks: pack (of the tensor's own range, and under a running estimate) and unpack of a
64 MiB fp32 tensor against ``Tensor.copy_`` of the same tensor (bandwidth ratio), and each Function's forward +
backward against its PyTorch counterpart.
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

from slimact.profile import peak_bytes

__all__ = ["environment", "held_bytes", "memory", "ops", "peak_bytes", "speed", "throughput", "write_results", "zoo"]

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
                    # The LM loss's gradients, computed in the forward (not activations; see slimact.profile).
                    "gradients_ahead_mib": round(converted.gradient_bytes / 2**20, 2),
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
    backward, gradients computed ahead included, plus the small outputs), measured by ``torch.profiler``'s
    memory events; then the backward runs.

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


def _setups(model: torch.nn.Module, names: Iterable[str]) -> dict[str, torch.nn.Module]:
    """Copies of ``model`` per setup name: ``"plain"``, a policy, ``"checkpoint"`` (Hugging Face gradient
    checkpointing of every layer), or ``"checkpoint+<policy>"``."""
    import copy

    import slimact

    out = {}
    for name in names:
        m = copy.deepcopy(model)
        ckpt, _, policy = name.partition("+") if name.startswith("checkpoint") else ("", "", name)
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if policy and policy != "plain":
            slimact.convert(m, policy)
        out[name] = m.train()
    return out


def speed(
    models: Iterable[str],
    setups: Iterable[str] = ("tempo", "int8", "checkpoint", "checkpoint+int8"),
    *,
    layers: int | None = 4,
    batch: int = 4,
    seq: int = 256,
    rounds: int = 7,
    warmup: int = 2,
    device: str = "cpu",
    tiny: bool = False,
    dtype: str = "fp32",
) -> Iterator[dict[str, Any]]:
    """Rows per model and setup: the median and spread of (setup step time / plain step time) over
    ``rounds`` interleaved rounds, the same for an inference forward (eval mode, ``no_grad``: ``eval_ratio_*``),
    and the activation bytes of each; ``dtype`` ``"bf16"``/``"fp16"`` runs the forwards under autocast."""
    import statistics

    import slimact
    from slimact.zoo import build, example_inputs

    names = ["plain", *setups]
    for name in models:
        base = build(name, layers=layers, tiny=tiny).to(device)
        inputs = example_inputs(base, batch, seq)
        runs = _setups(base, names)
        times = _interleaved({key: _train_step(m, inputs, device, dtype) for key, m in runs.items()}, rounds, warmup,
                             device)
        # Inference (eval mode, no_grad): a converted model must cost what the plain one does.
        evals = _interleaved({key: _eval_forward(m, inputs, device, dtype) for key, m in runs.items()}, rounds,
                             warmup, device)
        with autocast(device, dtype):
            plain_bytes = slimact.profile(runs["plain"], inputs).activation_bytes
            plain_peak = peak_bytes(runs["plain"], inputs)
        for key in names:
            with autocast(device, dtype):
                kept = plain_bytes if key == "plain" else slimact.profile(runs[key], inputs).activation_bytes
                peak = plain_peak if key == "plain" else peak_bytes(runs[key], inputs)
            yield {
                "model": name, "layers": layers, "batch": batch, "tokens": seq, "dtype": dtype, "setup": key,
                **_ratios(times[key], times["plain"]),
                "plain_step_ms_median": round(1000 * statistics.median(times["plain"]), 1),
                **_ratios(evals[key], evals["plain"], "eval_ratio"),
                "rounds": rounds, "activation_mib": round(kept / 2**20, 2),
                "memory_ratio": round(kept / plain_bytes, 4), "peak_mib": round(peak / 2**20, 2),
                "peak_ratio": round(peak / plain_peak, 4), **environment(device),
            }


def throughput(
    models: Iterable[str],
    budget: int | str,
    policies: Iterable[str] = ("int8", "tempo"),
    *,
    layers: int | None = 4,
    seq: int = 256,
    rounds: int = 5,
    warmup: int = 1,
    max_batch: int | None = None,
    device: str = "cpu",
    tiny: bool = False,
    dtype: str = "fp32",
) -> Iterator[dict[str, Any]]:
    """Rows per model and setup (``"plain"`` first): the largest batch measured to fit ``budget``
    (:func:`slimact.fit`; timed at most at ``max_batch``), the memory measured there, and the median and spread
    of (samples per second) / (plain's samples per second) over ``rounds`` interleaved rounds."""
    import copy
    import statistics

    import slimact
    from slimact.fit import fit, parse_bytes
    from slimact.zoo import build, example_inputs

    budget = parse_bytes(budget)
    names = ["plain", *policies]
    for name in models:
        base = build(name, layers=layers, tiny=tiny).to(device).train()
        with autocast(device, dtype):
            report = fit(base, lambda b, m=base: example_inputs(m, b, seq), budget, policies=tuple(names))
        fits = {r.policy: r for r in report.rows}
        batches = {k: min(r.max_batch, max_batch or r.max_batch) for k, r in fits.items()}
        steps = {}
        for key, batch in batches.items():
            if batch > 0:
                model = copy.deepcopy(base)
                if key != "plain":
                    slimact.convert(model, key)
                steps[key] = _train_step(model, example_inputs(base, batch, seq), device, dtype)
        times = _interleaved(steps, rounds, warmup, device) if "plain" in steps else {}
        for key in names:
            batch, used = batches[key], fits[key].measured_peak
            row = {"model": name, "layers": layers, "tokens": seq, "dtype": dtype, "setup": key,
                   "budget_mib": round(budget / 2**20, 1), "fit_batch": fits[key].max_batch, "batch": batch,
                   "fit_measured_mib": None if used is None else round((report.static + used) / 2**20, 1)}
            if key in times:
                # per round: (batch / t) / (plain's batch / plain's t)
                rates = [batch / t for t in times[key]]
                plain_rates = [batches["plain"] / t for t in times["plain"]]
                row |= {**_ratios(rates, plain_rates, "samples_per_s_ratio"),
                        "plain_step_ms_median": round(1000 * statistics.median(times["plain"]), 1)}
            yield {**row, "rounds": rounds, **environment(device)}
        del steps  # the copies and their optimizer state, before the next model


def _train_step(model: torch.nn.Module, inputs: dict[str, Any], device: str, dtype: str = "fp32") -> Any:
    """A closure running one training step (forward under ``dtype``'s autocast, backward, AdamW step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    cuda = torch.device(device).type == "cuda"

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast(device, dtype):
            loss = model(**inputs).loss
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()

    return step


def _eval_forward(model: torch.nn.Module, inputs: dict[str, Any], device: str, dtype: str = "fp32") -> Any:
    """A closure running one inference forward (eval mode, ``no_grad``), leaving the model's mode as found."""
    cuda = torch.device(device).type == "cuda"

    def forward() -> None:
        was = model.training
        model.eval()
        try:
            with torch.no_grad(), autocast(device, dtype):
                model(**inputs)
        finally:
            model.train(was)
        if cuda:
            torch.cuda.synchronize()

    return forward


def _interleaved(fns: dict[str, Any], rounds: int, warmup: int = 2, device: str = "cpu") -> dict[str, list[float]]:
    import time

    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    keys = list(fns)
    for r in range(rounds):
        # Each round starts one setup later (plain, A, B; A, B, plain; ...): no setup always runs right after
        # the same one (whose frees and cache state it would inherit).
        for k in keys[r % len(keys):] + keys[: r % len(keys)]:
            fn = fns[k]
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times[k].append(time.perf_counter() - start)
    return times


def ops(*, mib: int = 64, rounds: int = 7, device: str = "cpu") -> Iterator[dict[str, Any]]:
    """Rows of per-op micro-benchmarks (see the module docstring): ratios measured interleaved."""

    from slimact.quant import QuantConfig, RunningRange, backend_for, pack, unpack

    x = torch.randn(mib * 2**20 // 4, device=device).reshape(-1, 1024)
    dst = torch.empty_like(x)
    cfg = QuantConfig(group_dim=-1, groups=8)
    packed = pack(x, cfg, share=False)
    # Under a running estimate (initialised here by a first pack) the GPU pack reads x once, with no host sync.
    running, state = QuantConfig(group_dim=-1, groups=8, scale="running"), RunningRange(torch.nn.Module(), "_x")
    pack(x, running, state, share=False)
    times = _interleaved({
        "copy_": lambda: dst.copy_(x),
        "clone": lambda: x.clone(),
        "pack": lambda: pack(x, cfg, share=False),
        "pack (running estimate)": lambda: pack(x, running, state, share=False),
        "unpack": lambda: unpack(packed),
    }, rounds, device=device)
    # The unpack returns a new tensor: on CPU a fresh 64 MiB allocation is first touched page by page, which
    # costs more than the copy itself unless huge pages are on (PyTorch's THP_MEM_ALLOC_ENABLE=1); clone()
    # pays the same, so the unpack is also set against it.
    env = {**environment(device), "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE", "0")}
    pairs = ("pack", "copy_"), ("pack (running estimate)", "copy_"), ("unpack", "copy_"), ("unpack", "clone")
    for key, base in pairs:
        ratios = _ratios(times[key], times[base])
        yield {"op": f"{key} {mib} MiB fp32", "vs": f"Tensor.{base}", **ratios,
               "bandwidth_vs_copy": round(1 / ratios["time_ratio_median"], 4), "rounds": rounds,
               "backend": backend_for(x), **env}
    yield from _function_rows(rounds, device)


def _ratios(times: list[float], base: list[float], name: str = "time_ratio") -> dict[str, float]:
    """``<name>_median``, ``_min`` and ``_max`` of the per-round ratios of two interleaved timings."""
    import statistics

    ratios = [a / b for a, b in zip(times, base, strict=True)]
    return {f"{name}_median": round(statistics.median(ratios), 4), f"{name}_min": round(min(ratios), 4),
            f"{name}_max": round(max(ratios), 4)}


def _function_rows(rounds: int, device: str) -> Iterator[dict[str, Any]]:
    """Each slimact Function's forward + backward against its PyTorch counterpart, at Transformer sizes."""

    import torch.nn.functional as F

    from slimact.functional import activation, dropout, linear, norm, scaled_dot_product_attention
    from slimact.policy import Policy

    pol = Policy()
    x = torch.randn(4, 256, 768, device=device, requires_grad=True)
    w = torch.randn(3072, 768, device=device, requires_grad=True)
    ln_w = torch.ones(768, device=device, requires_grad=True)
    q, k, v = (torch.randn(4, 12, 256, 64, device=device, requires_grad=True) for _ in range(3))
    cases = {
        "linear": (lambda: F.linear(x, w), lambda: linear(x, w, None, pol.quant_config("linear", 3))),
        "gelu": (lambda: F.gelu(x), lambda: activation(x, "gelu", pol.quant_config("gelu", 3), fn=F.gelu)),
        "gelu (tempo)": (lambda: F.gelu(x), lambda: activation(x, "gelu", None, fn=F.gelu)),
        "layernorm": (lambda: F.layer_norm(x, (768,), ln_w),
                      lambda: norm(x, ln_w, None, 1e-5, pol.quant_config("layernorm", 3))),
        "dropout": (lambda: F.dropout(x, 0.1), lambda: dropout(x, 0.1)),
        "attention": (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                      lambda: scaled_dot_product_attention(q, k, v, is_causal=True,
                                                           cfg=pol.quant_config("attention", 4))),
    }
    for name, (plain, slim) in cases.items():
        # A dense upstream gradient, as a model's next layer hands back (sum().backward() would give an expanded
        # one, which no real backward sees and which sends contiguity-checking fast paths elsewhere).
        grad = torch.randn_like(plain().detach())

        def run(fn, grad=grad):
            return lambda: fn().backward(grad)

        times = _interleaved({"plain": run(plain), "slimact": run(slim)}, rounds, device=device)
        yield {"op": f"{name} fwd+bwd", "vs": "PyTorch", **_ratios(times["slimact"], times["plain"]),
               "rounds": rounds, **environment(device)}


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
