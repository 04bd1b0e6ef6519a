"""The benchmark harness behind ``slimact bench``: measurements written as result files with their context.

Every table is a list of rows (dicts) written by :func:`write_results` as ``<name>.csv`` and ``<name>.md``
under ``benchmarks/results/``, each row stamped with the machine, the torch version and the date, so a
committed result says where it came from and a rerun on another machine sits beside it.

``memory``: bytes kept for backward (:func:`slimact.profile`: activations and the gradients computed ahead,
everything the forward leaves for the backward) and the step's peak (``profile(..., peak=True)``: above what was
allocated before the step, so the parameters are not in it; and less the parameter gradients) by zoo models, plain
and under each policy, in fp32 and under bf16/fp16 autocast. It is the README's headline table.

``zoo``: per model family, what ``convert`` replaced, the coverage (:func:`slimact.summary` with inputs) and
the bytes kept under ``"int8"`` and ``"tempo"`` (``docs/models.md``).

``speed``: a full training step (forward, backward, AdamW step) of plain PyTorch and of each setup (a preset,
per-layer activation checkpointing, both), timed interleaved in one process (plain, setup 1, setup 2, ...;
setup 1, setup 2, ..., plain; ...: each round starts one later) after warm-up: per round the ratio of each
setup's time to that round's plain time, reported as the median and the spread (min, max) over the rounds,
with the activation bytes of each setup and the peak
of its forward and backward (:func:`peak_bytes`), so time and memory sit on one plane. Shared machines are
noisy: only ratios measured this way are reported, never an absolute time on its own. ``vocab`` times the
blocks alone (a small vocabulary: the head and loss, at plain's speed under slimact, no longer hide them).

``speed --ops-table`` (:func:`block_ops`): one GPT-2 block's forward and backward, plain and under each policy,
op by op from ``torch.profiler``'s table (self CPU time and calls per op, medians of interleaved rounds), with
the time outside any op (Python and dispatch): where a converted block's overhead is (``docs/speed.md``).

``throughput``: samples per second at one memory budget. :func:`slimact.fit` gives each setup (plain, each
policy) its largest batch under the budget, measured (weights, optimizer state and the step's
:func:`peak_bytes`, which sees every temporary); the steps at those batches are timed interleaved and each
round's samples-per-second ratio against plain is reported. This is where the
memory is spent: Tempo's +16% on BERT-Large came from the larger batch the memory bought, not a faster step.

``ops``: per-op micro-benchmarks: pack (of the tensor's own range, and under a running estimate) and unpack of a
64 MiB fp32 tensor against ``Tensor.copy_`` of the same tensor (bandwidth ratio), and each Function's forward +
backward against its PyTorch counterpart; and per layout (the whole tensor, channel groups, per head) the
bandwidth of ``copy_``, pack and unpack in GB/s (bytes read plus bytes written; medians, timed with CUDA events
on a GPU).

``kernels``: the Triton kernels (quantize, dequantize, group_stats, quantize_stats) against the reference, the
oracle: per case (shape, dtype, layout, bits, rounding) the count of codes that differ, the largest code
difference, and the count of restored values that differ from the reference's dequantize. On CPU it runs
under ``TRITON_INTERPRET=1`` (set before Triton is imported), at ``tiny`` shapes.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import os
import platform
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from slimact.profile import peak_bytes

__all__ = ["SWEEP_COLUMNS", "bandwidth", "block_ops", "environment", "held_bytes", "kernels", "memory", "ops",
           "peak_bytes", "set_dropout", "speed", "sweep_one", "sweep_path", "throughput", "write_results",
           "write_sweep_docs", "zoo", "zoo_all"]

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
    layers: int | None = None,
) -> Iterator[dict[str, Any]]:
    """Rows of bytes kept for the backward and of the step's peak, plain and converted, for each model, dtype and
    policy (plus the ``(model, dtype, policy)`` triples of ``extra``). Models are the zoo's, at their default size
    (``layers``: that many layers); vision models take ``batch`` images at their own size and ignore ``seq``;
    ``tiny``: the zoo's test sizes.

    Columns: ``kept_*`` everything the forward leaves for the backward (:attr:`slimact.profile.Report.kept_bytes`:
    activations and the LM loss's gradients computed ahead, ``gradients_ahead_mib`` of it; ``activation_ratio``
    without them); ``peak_*`` the step's peak above what was allocated before it (parameters and inputs are not in
    it; on CUDA the allocator's); ``peak_less_grads_*`` the highest of (alive - parameter gradients alive) over the
    step, what issue 20's targets are about; ``peak_in``: the phase of the converted step's peak."""
    import slimact
    from slimact.zoo import build, example_inputs

    def mib(n: int) -> float:
        return round(n / 2**20, 2)

    dtypes, policies, extra = tuple(dtypes), tuple(policies), tuple(extra)
    for name in models:
        model = build(name, layers=layers, tiny=tiny).to(device)
        inputs = example_inputs(model, batch, seq)
        wanted = [(d, p) for d in dtypes for p in policies] + [(d, p) for m, d, p in extra if m == name]
        for dtype in dict.fromkeys(d for d, _ in wanted):
            with autocast(device, dtype):
                if torch.device(device).type == "cuda":  # cuBLAS's workspaces, allocated by a first step, out of it
                    slimact.profile(model, inputs)
                plain = slimact.profile(model, inputs, peak=True)
            for dt, policy in wanted:
                if dt != dtype:
                    continue
                slimact.convert(model, policy)
                with autocast(device, dtype):
                    slimact.profile(model, inputs)  # one-time allocations (tables, caches) out of the peak
                    converted = slimact.profile(model, inputs, peak=True)
                slimact.revert(model)
                less, plain_less = converted.peak_less_parameter_gradients, plain.peak_less_parameter_gradients
                yield {
                    "model": name,
                    "batch": batch,
                    "tokens": "images" if "pixel_values" in inputs else seq,
                    "dtype": dtype,
                    "policy": policy,
                    "plain_kept_mib": mib(plain.kept_bytes),
                    "kept_mib": mib(converted.kept_bytes),
                    "kept_ratio": round(converted.kept_bytes / plain.kept_bytes, 4),
                    # The LM loss's gradients, computed in the forward (in kept_mib; see slimact.profile).
                    "gradients_ahead_mib": mib(converted.gradient_bytes),
                    "activation_ratio": round(converted.activation_bytes / plain.activation_bytes, 4),
                    "plain_peak_mib": mib(plain.peak_bytes),
                    "peak_mib": mib(converted.peak_bytes),
                    "peak_ratio": round(converted.peak_bytes / plain.peak_bytes, 4),
                    "plain_peak_less_grads_mib": mib(plain_less),
                    "peak_less_grads_mib": mib(less),
                    "peak_less_grads_ratio": round(less / plain_less, 4),
                    "peak_in": "forward" if converted.forward_peak.total >= converted.backward_peak.total
                    else "backward",
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


#: Columns of the sweep's CSV (``zoo_all.csv``, ``zoo_all_<policy>.csv``), in order. ``kept_kib`` and
#: ``kept_ratio``: bytes kept for the backward under the row's ``policy`` (lossy or lossless), and over plain's.
#: ``max_rel_diff``: the largest ``||g - g_plain|| / ||g_plain||`` of the gradients judged by direction (the
#: lossless floor's measure, as ``min_cosine`` is the lossy one's).
SWEEP_COLUMNS = (
    "task", "model_type", "architecture", "policy", "outcome", "detail", "forward_max_abs_diff", "min_cosine",
    "max_rel_diff", "params", "negligible", "plain_kib", "kept_kib", "kept_ratio", "converted", "left_alone",
    "error_where", "seconds",
)
#: Columns of the first sweep's file (int8 only, before ``policy``), renamed on reading (:func:`_read_sweep`).
_OLD_SWEEP_COLUMNS = {"int8_kib": "kept_kib", "int8_ratio": "kept_ratio"}


def sweep_path(policy: str = "int8", folder: str | os.PathLike[str] = "benchmarks/results") -> Path:
    """The sweep's default result file for ``policy``: ``zoo_all.csv`` for the default policy (``"int8"``), else
    ``zoo_all_<policy name>.csv``."""
    from slimact.policy import resolve

    name = resolve(policy).name
    return Path(folder) / ("zoo_all.csv" if name == "int8" else f"zoo_all_{name}.csv")


def _read_sweep(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """The rows of a sweep CSV, with the first sweep's file read as today's (its columns renamed, its policy
    ``int8``: the only one it ran)."""
    with Path(path).open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for old, new in _OLD_SWEEP_COLUMNS.items():
            if old in r:
                r[new] = r.pop(old)
        r["policy"] = r.get("policy") or "int8"
    return rows


def _plain_losses(model: torch.nn.Module, inputs: dict) -> list[torch.Tensor]:
    """The losses of two plain training steps of copies of ``model`` from one RNG state (plain must be deterministic
    to be a reference); raises where the step fails or its loss is not finite."""
    import copy

    from slimact.zoo import projection_loss

    losses = []
    for _ in range(2):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            trial = copy.deepcopy(model)
            loss = projection_loss(_call_model(trial, inputs))
            if not torch.isfinite(loss):
                raise ValueError(f"the plain loss is {loss.item()}")
            loss.backward()
            losses.append(loss.detach())
        del trial
    return losses


def _seeded_bytes(model: torch.nn.Module, inputs: dict) -> int:
    """What ``slimact.profile`` counts for a training step of ``model`` drawn from RNG state 0."""
    import slimact
    from slimact.zoo import projection_loss

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return slimact.profile(model, inputs, loss_fn=projection_loss).activation_bytes


def sweep_one(task: str, model_type: str, architecture: str, progress: Any = None,
              policy: str = "int8") -> dict[str, Any]:
    """One architecture of the sweep (see :func:`zoo_all`) under ``policy``: its row. ``progress(stage)`` is
    told each stage reached, so that a caller who stops a hung run knows whether the plain model or slimact
    hung."""
    import copy
    import time
    import traceback

    import slimact
    from slimact.check import check
    from slimact.policy import _running, resolve
    from slimact.zoo import build_auto, projection_loss, tiny_config, tiny_inputs

    start = time.perf_counter()
    pol = resolve(policy)
    row: dict[str, Any] = {"task": task, "model_type": model_type, "architecture": architecture,
                           "policy": pol.name}
    say = progress or (lambda stage: None)

    def failed(outcome: str, stage: str, e: BaseException) -> dict[str, Any]:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        # The innermost slimact frame, and the innermost frame of all where that is elsewhere (model code).
        frames = traceback.extract_tb(e.__traceback__)
        ours = [f for f in frames if "slimact" in f.filename]
        where = [f"{f.filename.rpartition('slimact/')[2]}:{f.lineno}" for f in ours[-1:]]
        if frames and (not ours or frames[-1] is not ours[-1]):
            where.append(f"{frames[-1].filename.rpartition('site-packages/')[2]}:{frames[-1].lineno}")
        where = " > ".join(where)
        return {**row, "outcome": outcome, "detail": f"{stage}: {type(e).__name__}: {first}",
                "error_where": where, "seconds": round(time.perf_counter() - start, 1)}

    say("build")
    try:
        model = build_auto(architecture, tiny_config(model_type)).train()
        inputs = tiny_inputs(model, task)
    except Exception as e:  # the sweep records what transformers cannot build offline at this size
        return failed("skipped", "cannot build at the tiny size", e)
    say("plain")
    padded = True
    try:
        try:
            losses = _plain_losses(model, inputs)
        except Exception:
            if "attention_mask" not in inputs:
                raise
            # Some models cannot take the generic padding mask (Qwen2.5-Omni's thinker then computes its rotary
            # positions from vision tokens its text configuration does not name): their batch is unpadded.
            padded = False
            inputs = tiny_inputs(model, task, padded=False)
            losses = _plain_losses(model, inputs)
    except Exception as e:  # not slimact's: the plain model cannot train on the sweep's generic batch
        return failed("skipped", "the plain model cannot run a training step", e)
    if not torch.equal(losses[0], losses[1]):
        return {**row, "outcome": "skipped",
                "detail": f"the plain model is not deterministic: two runs from one RNG state give losses "
                          f"{losses[0].item():.6g} and {losses[1].item():.6g} (no reference to judge against)",
                "error_where": "", "seconds": round(time.perf_counter() - start, 1)}
    say("check")
    # Under running estimates the judged step follows 8 training-mode calls on fresh batches of the same kind (other
    # seeds), as training's would; mixed from the judged batch's 2 rows (check's fallback) every warm-up batch
    # repeats one row, and per-sample tensors (pooled features, 1 x 1 maps) would show the estimates no spread.
    warm = [tiny_inputs(model, task, seed=s, padded=padded) for s in range(1, 9)] if _running(pol) else None
    try:
        report = check(model, inputs, pol, loss_fn=projection_loss, batches=warm)
        say("profile")
        # Copied before the plain model runs: some keep graph tensors as attributes after a step (RecurrentGemma's
        # recurrent states), which deepcopy refuses.
        converted = slimact.convert(copy.deepcopy(model), pol)
        # Each from one RNG state: a model drawing the sizes of its tensors (VITS's durations) keeps as many bytes
        # in both only from the same draws (unseeded, its int8 row read 1.9x plain's).
        plain, kept = (_seeded_bytes(m, inputs) for m in (model, converted))
    except Exception as e:  # a slimact crash: the point of the sweep is to record it, with where it happened
        return failed("crash", "slimact", e)
    failures = report.failures
    if not report.forward_equal:
        outcome, detail = "below floor", f"forward differs (max abs diff {report.forward_max_abs_diff:.3g})"
    elif failures or report.missing:
        outcome = "below floor"
        detail = "; ".join([f"{p.name} ({p.reason})" for p in failures[:4]]
                           + ([f"{len(failures) - 4} more"] if len(failures) > 4 else [])
                           + [f"gradient in one run only: {', '.join(report.missing[:4])}"] * bool(report.missing))
    else:
        outcome, detail = "ok", ""
    judged = [p for p in report.params if not p.negligible]
    reasons: dict[str, int] = {}
    for reason in (report.summary.skipped if report.summary else {}).values():
        reasons[reason] = reasons.get(reason, 0) + 1
    return {
        **row, "outcome": outcome, "detail": detail,
        "forward_max_abs_diff": f"{report.forward_max_abs_diff:.3g}",
        "min_cosine": round(min(p.cosine for p in judged), 5) if judged else "",
        "max_rel_diff": f"{max(p.diff / p.norm for p in judged):.3g}" if judged else "",
        "params": len(report.params), "negligible": len(report.params) - len(judged),
        "plain_kib": round(plain / 1024, 1), "kept_kib": round(kept / 1024, 1),
        "kept_ratio": round(kept / plain, 4) if plain else "",
        "converted": " ".join(f"{k}:{n}" for k, n in sorted(report.summary.converted.items())),
        "left_alone": "; ".join(f"{n} x {r}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])),
        "error_where": "", "seconds": round(time.perf_counter() - start, 1),
    }


def _call_model(model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
    return model(**inputs)


def _sweep_child(conn: Any, arch: tuple[str, str, str], policy: str) -> None:
    """The forked process of one architecture: stages and the row go back through ``conn``."""
    import warnings

    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    try:
        row = sweep_one(*arch, progress=lambda stage: conn.send(("stage", stage)), policy=policy)
    except BaseException as e:  # anything at all must come back as a row, not as a dead child
        row = {"task": arch[0], "model_type": arch[1], "architecture": arch[2], "outcome": "crash",
               "detail": f"sweep: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    conn.send(("row", row))
    conn.close()


def _sweep_isolated(arch: tuple[str, str, str], timeout: float, policy: str = "int8") -> dict[str, Any]:
    """:func:`sweep_one` in a forked process, stopped after ``timeout`` seconds: a hang or a hard crash of
    one architecture becomes its row (a hang in the plain model's build or step is skipped, in slimact's a
    crash), and the sweep goes on."""
    import multiprocessing
    import time

    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_sweep_child, args=(child, arch, policy), daemon=True)
    start = time.monotonic()
    proc.start()
    child.close()
    stage, row, reached = "start", None, {}
    while row is None:
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            break
        if not parent.poll(min(left, 1.0)):
            if proc.is_alive() or parent.poll(0):
                continue
            break  # died without a row (a segfault, killed for memory)
        try:
            kind, value = parent.recv()
        except EOFError:
            break
        if kind == "stage":
            stage, reached[value] = value, time.monotonic()
        else:
            row = value
    if proc.is_alive():
        proc.kill()
    proc.join()
    if row is not None:
        return row
    base = {"task": arch[0], "model_type": arch[1], "architecture": arch[2], "seconds": round(time.monotonic() - start)}
    if stage in ("start", "build", "plain"):
        return {**base, "outcome": "skipped", "detail": f"the plain model took over {timeout:.0f} s to build or "
                "run a step" if proc.exitcode in (None, -9) else f"{stage}: process died (exit {proc.exitcode})"}
    plain = reached["check"] - reached["plain"] if {"plain", "check"} <= reached.keys() else 0.0
    if proc.exitcode in (None, -9) and 4 * plain > timeout:  # check runs two steps and profile two more
        return {**base, "outcome": "skipped", "detail": f"too slow for the time limit: the plain step takes "
                f"{plain:.0f} s, the check four more within {timeout:.0f} s"}
    what = f"no result after {timeout:.0f} s" if proc.exitcode in (None, -9) else f"process died (exit {proc.exitcode})"
    return {**base, "outcome": "crash", "detail": f"slimact ({stage}): {what}"}


def zoo_all(
    out: str | os.PathLike[str] | None = None,
    *,
    policy: str = "int8",
    timeout: float = 120.0,
    resume: bool = False,
    only: Iterable[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """The sweep: every architecture of :func:`slimact.zoo.auto_architectures`, built tiny from its config class
    (:func:`slimact.zoo.tiny_config`), checked under ``policy`` (:func:`slimact.check`: one training step,
    forward equal to plain, every non-negligible gradient at cosine >= 0.99 under a lossy policy, equal to
    plain's to float rounding under a lossless one such as ``"tempo"``), its kept bytes plain and converted
    under ``policy`` (:func:`slimact.profile`) and what ``summary`` left alone; each in its own process with a
    time limit.

    Rows are appended to the CSV ``out`` (default :func:`sweep_path` of ``policy``) as they come. ``resume``:
    architectures already there are not run again. ``only``: architecture class names to run (default all);
    where ``out`` exists they are run again and replace their rows, and the other rows are kept."""
    from slimact.policy import resolve
    from slimact.zoo import auto_architectures

    name = resolve(policy).name
    path = Path(out) if out is not None else sweep_path(policy)
    path.parent.mkdir(parents=True, exist_ok=True)
    wanted = set(only) if only is not None else None
    env = environment()
    fields = [*SWEEP_COLUMNS, *env]
    kept = _read_sweep(path) if (resume or wanted is not None) and path.exists() else []
    if any(r["policy"] != name for r in kept):
        raise ValueError(f"{path} holds rows of another policy than {name!r}: give another out")
    kept = [r for r in kept if wanted is None or r["architecture"] not in wanted]
    done = {r["architecture"] for r in kept} if resume else set()
    with path.open("w", newline="", encoding="utf-8") as f:  # the kept rows, in today's columns
        writer = csv.DictWriter(f, fieldnames=fields, restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(kept)
    # Compiled packs ("int8" on the CPU) compile in the process that runs them: inductor's pool of compile workers,
    # started by the parent's warm-up below, does not survive the fork, and a child needing a kernel the parent did
    # not compile waited on it forever (every architecture after the first new shape "crashed": no result after the
    # time limit, wherever the compile cache was cold, as in a fresh clone).
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    if torch.get_num_threads() == 1:
        # Warm the parent up once (slimact's and transformers' imports, the first kernels: ~20 s on a busy
        # machine) so that every forked child starts warm. Not with several threads: an OpenMP pool used before a
        # fork can hang the child.
        sweep_one("causal-lm", "llama", "LlamaForCausalLM", policy=policy)
    for arch in auto_architectures():
        if arch[2] in done or (wanted is not None and arch[2] not in wanted):
            continue
        row = {**dict.fromkeys(SWEEP_COLUMNS, ""), "policy": name, **_sweep_isolated(arch, timeout, policy), **env}
        with path.open("a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, fieldnames=fields).writerow(row)
        yield row


#: The sweep's section in the docs per policy: the default policy's markers are the first sweep's.
_SWEEP_MARKERS = ("<!-- sweep table{}: written by slimact bench --zoo --all{} -->", "<!-- end of sweep table{} -->")


def _sweep_markers(policy: str) -> tuple[str, str]:
    """The begin and end markers of ``policy``'s sweep section."""
    if policy == "int8":
        return _SWEEP_MARKERS[0].format("", ""), _SWEEP_MARKERS[1].format("")
    return (_SWEEP_MARKERS[0].format(f" ({policy})", f" --policy {policy}"),
            _SWEEP_MARKERS[1].format(f" ({policy})"))


def _sweep_prose(policy: str, lossless: bool, results: str) -> tuple[str, str, str]:
    """The section's title, its explanation and the name of its judged-gradient column, for ``policy``."""
    from slimact.check import MAX_NORM_RATIO, MIN_COSINE, rounding_tolerance

    floors = (f"(cosine >= {MIN_COSINE} and a norm within {MAX_NORM_RATIO:.0%} of plain's; gradients at noise level "
              "judged by size)")
    if policy == "int8":
        judged_by, rerun = "the default policy", "`slimact bench --zoo --all`"
    else:
        judged_by = f"policy `\"{policy}\"`" + (" (lossless)" if lossless else "")
        rerun = f"`slimact bench --zoo --all --policy {policy}`"
    if lossless:
        floors = (f"(equal to plain's to float rounding: `||g - g_plain|| <= "
                  f"{rounding_tolerance(torch.float32):.1e} ||g_plain||`; gradients at rounding level of the typical "
                  "gradient judged by size; \"max rel diff\" is the largest relative difference of the gradients "
                  "judged by it)")
    title = ("Every architecture transformers can build: the sweep" if policy == "int8"
             else f"The sweep under `\"{policy}\"`" + (": gradients equal to plain's" if lossless else ""))
    text = (
        "Every class in transformers' auto mappings for causal LM, masked LM, seq2seq LM, image classification, "
        "CTC and the base models (`slimact.zoo.auto_architectures`), built from its config class shrunk in code "
        "(`slimact.zoo.tiny_config`: 2 layers, width 64, 4 heads, a 128-token vocabulary, 64 positions, 32 x 32 "
        "images; random weights, no network), one training step on a batch of 2 x 16 tokens (the first padded "
        "over its last 5 where the model takes an `attention_mask`; 2 images, 2 clips of audio), checked by "
        f"`slimact.check` under {judged_by}: **ok** = forward equal to plain to "
        f"float rounding and every gradient within the floors {floors}; **below floor** = the forward differs or "
        "a gradient misses (named); **crash** = slimact "
        "raised (the error's first line, where it was raised) or gave no result in the time limit; **skipped** "
        "= the plain model could not be built at that size or could not run a training step on the generic "
        "batch (the reason: mostly the generic shrinker or batch, not slimact). Base models have no loss: "
        "their first output projected on fixed random weights is the loss. Each architecture runs in its own "
        f"process with a time limit. \"{policy} kept\" is the bytes kept for the backward over plain's "
        f"(`slimact.profile`). Rerun: {rerun} (results in `{results}`).")
    return title, text, "max rel diff" if lossless else "min cosine"


def write_sweep_docs(csv_path: str | os.PathLike[str], doc: str | os.PathLike[str] = "docs/models.md") -> Path:
    """Write the sweep's counts and table (from ``csv_path``) into ``doc``, between the markers of the sweep's
    policy (each policy has its own section): the rest of the document is kept; the section is added at its
    end the first time."""
    from slimact.check import is_lossless
    from slimact.policy import PRESETS

    rows = _read_sweep(csv_path)
    policy = rows[0]["policy"] if rows else "int8"
    # A policy file's rows carry only its name: its table is shown as a lossy policy's (by cosine).
    preset = PRESETS.get(policy)
    lossless = preset is not None and is_lossless(preset)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    env = rows[0] if rows else {}
    begin, end = _sweep_markers(policy)
    results = sweep_path(policy).as_posix() if preset is not None else Path(csv_path).as_posix()
    title, text, judged = _sweep_prose(policy, lossless, results)
    lines = [
        begin, "", text, "",
        f"{len(rows)} architectures ({env.get('machine', '')}, torch {env.get('torch', '')}, {env.get('date', '')}): "
        + ", ".join(f"**{counts.get(k, 0)} {k}**" for k in ("ok", "below floor", "crash", "skipped")) + ".", "",
        f"| architecture | task | outcome | detail | {judged} | {policy} kept | left alone |",
        "|---|---|---|---|---|---|---|",
    ]
    order = {"crash": 0, "below floor": 1, "ok": 2, "skipped": 3}
    for r in sorted(rows, key=lambda r: (order.get(r["outcome"], 4), r["architecture"])):
        cells = [f"`{r['architecture']}`", r["task"], r["outcome"],
                 r["detail"] + (f" ({r['error_where']})" if r.get("error_where") else ""),
                 r.get("max_rel_diff", "") if lossless else r["min_cosine"],
                 f"{float(r['kept_ratio']):.3f}x" if r["kept_ratio"] else "", r["left_alone"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    lines += ["", end]
    path = Path(doc)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    section = "\n".join(lines)
    if begin in old and end in old:
        head, _, rest = old.partition(begin)
        new = head + section + rest.partition(end)[2]
    else:
        new = old.rstrip("\n") + f"\n\n## {title}\n\n" + section + "\n"
    path.write_text(new, encoding="utf-8")
    return path


def held_bytes(model: torch.nn.Module, inputs: dict[str, Any]) -> int:
    """Bytes a training forward allocates on the CPU and still holds when it returns (what waits for the
    backward, gradients computed ahead included, plus the small outputs), measured by ``torch.profiler``'s
    memory events; then the backward runs.

    Unlike :func:`slimact.profile` it needs no saved-tensor hooks, so it also measures compiled models, whose
    graphs the hooks cannot see into. On eager models the two agree (``benchmarks/integrations.py``).
    """
    from torch.profiler import ProfilerActivity

    from slimact.profile import profiled

    model.zero_grad(set_to_none=True)
    with profiled(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
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
    dropout: float | None = None,
    vocab: int | None = None,
) -> Iterator[dict[str, Any]]:
    """Rows per model and setup: the median and spread of (setup step time / plain step time) over
    ``rounds`` interleaved rounds, the same for an inference forward (eval mode, ``no_grad``: ``eval_ratio_*``),
    and the activation bytes of each; ``dtype`` ``"bf16"``/``"fp16"`` runs the forwards under autocast.
    ``dropout`` sets every dropout probability of the model (its config's and its modules'; ``None``: as
    built). ``vocab`` sets the vocabulary (``None``: the model's real one); a small one leaves the head and loss,
    which slimact runs at plain's speed, a small share of the step, so the blocks' overhead shows.
    ``first_step_s`` is each setup's first step, apart from the rounds: it includes compilation (Triton
    kernels, inductor loops) and the allocator's warm-up. ``load_start``/``load_end``: the machine's 1-minute
    load average before and after the model's timing (a shared machine's noise, recorded with the ratios)."""
    import statistics

    import slimact
    from slimact.zoo import build, example_inputs

    names = ["plain", *setups]
    for name in models:
        base = build(name, layers=layers, tiny=tiny, vocab=vocab).to(device)
        if dropout is not None:
            set_dropout(base, dropout)
        inputs = example_inputs(base, batch, seq)
        runs = _setups(base, names)
        first: dict[str, float] = {}
        load_start = _load()
        times = _interleaved({key: _train_step(m, inputs, device, dtype) for key, m in runs.items()}, rounds,
                             max(warmup, 1), device, first=first)
        # Inference (eval mode, no_grad): a converted model must cost what the plain one does.
        evals = _interleaved({key: _eval_forward(m, inputs, device, dtype) for key, m in runs.items()}, rounds,
                             warmup, device)
        load_end = _load()
        with autocast(device, dtype):
            plain_bytes = slimact.profile(runs["plain"], inputs).activation_bytes
            plain_peak = peak_bytes(runs["plain"], inputs)
        for key in names:
            with autocast(device, dtype):
                kept = plain_bytes if key == "plain" else slimact.profile(runs[key], inputs).activation_bytes
                peak = plain_peak if key == "plain" else peak_bytes(runs[key], inputs)
            yield {
                "model": name, "layers": layers, "vocab": getattr(getattr(base, "config", None), "vocab_size", ""),
                "batch": batch, "tokens": seq, "dtype": dtype,
                "dropout": "as built" if dropout is None else dropout, "setup": key,
                **_ratios(times[key], times["plain"]),
                "plain_step_ms_median": round(1000 * statistics.median(times["plain"]), 1),
                "step_ms_median": round(1000 * statistics.median(times[key]), 1),
                "first_step_s": round(first[key], 3),
                **_ratios(evals[key], evals["plain"], "eval_ratio"),
                "rounds": rounds, "activation_mib": round(kept / 2**20, 2),
                "memory_ratio": round(kept / plain_bytes, 4), "peak_mib": round(peak / 2**20, 2),
                "peak_ratio": round(peak / plain_peak, 4), "load_start": load_start, "load_end": load_end,
                **environment(device),
            }


def _load() -> float | str:
    """The 1-minute load average (``""`` where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return ""


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


def set_dropout(model: torch.nn.Module, p: float) -> None:
    """Every dropout probability of ``model`` set to ``p``: its config's (``*pdrop``, ``*dropout*`` floats, for
    code that reads the config at call time) and its ``nn.Dropout`` modules' (which read ``p`` at each call,
    as GPT-2's attention does for the dropout it hands to SDPA)."""
    config = getattr(model, "config", None)
    if config is not None:
        for key, value in list(vars(config).items()):
            if isinstance(value, float) and not isinstance(value, bool) and ("pdrop" in key or "dropout" in key):
                setattr(config, key, p)
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = p


def _interleaved(fns: dict[str, Any], rounds: int, warmup: int = 2, device: str = "cpu",
                 first: dict[str, float] | None = None) -> dict[str, list[float]]:
    """Per key, ``rounds`` times of its function, run interleaved after ``warmup`` calls each; ``first``, if
    given, gets each function's first call's time (compilation included)."""
    import time

    cuda = torch.device(device).type == "cuda"
    for w in range(warmup):
        for key, fn in fns.items():
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            if w == 0 and first is not None:
                first[key] = time.perf_counter() - start
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


def ops(*, mib: float = 64, rounds: int = 7, device: str = "cpu", lm_tokens: int = 1024,
        sizes: Sequence[float] = ()) -> Iterator[dict[str, Any]]:
    """Rows of per-op micro-benchmarks (see the module docstring): ratios measured interleaved; the LM head and
    loss at ``lm_tokens`` tokens, a mixture-of-experts layer's products at ``2 * lm_tokens`` routed ones; the
    per-layout rows (:func:`bandwidth`) also at each of ``sizes`` MiB."""

    from slimact.quant import QuantConfig, RunningRange, backend_for, pack, unpack

    x = torch.randn(_numel(mib), device=device).reshape(-1, 1024)
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
    for size in (mib, *sizes):
        yield from bandwidth(mib=size, rounds=rounds, device=device)
    if torch.device(device).type == "cuda":
        # At 64 MiB the H200 copies in ~40 us, less than a pack's host work: 8x larger, the kernels dominate.
        yield from bandwidth(mib=8 * mib, rounds=rounds, device=device)
    yield from _function_rows(rounds, device, lm_tokens)


def _layouts(numel: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """The three groupings slimact packs with, at ``numel`` elements: shape and config."""
    from slimact.quant import QuantConfig

    heads = (max(1, numel // 2**20), 16, -1, 64)  # [B, H, T, D], a group per head
    return {
        "whole tensor": ((-1, 1024), QuantConfig(group_dim=None)),
        "channel groups": ((-1, 1024), QuantConfig(group_dim=-1, groups=8)),
        "per head": (heads, QuantConfig(group_dim=1, groups=0)),
    }


def _median_seconds(fn: Any, rounds: int, device: str) -> float:
    """Median seconds of ``fn`` over ``rounds`` calls after one warm-up call: CUDA events on a GPU (no host
    clock around asynchronous work), ``perf_counter`` elsewhere."""
    import statistics
    import time

    fn()
    times = []
    cuda = torch.device(device).type == "cuda"
    for _ in range(rounds):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _kernel_seconds(fn: Any, rounds: int, device: str) -> float | None:
    """On a GPU, the device time of ``fn``'s kernels and copies per call (``torch.profiler``, summed over
    ``rounds`` calls after one warm-up): the bandwidth the kernels reach, apart from the host's launch work and
    syncs that the wall time (:func:`_median_seconds`) includes. ``None`` elsewhere."""
    if torch.device(device).type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    from slimact.profile import profiled

    fn()
    torch.cuda.synchronize()
    with profiled(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            fn()
        torch.cuda.synchronize()
    micros = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return micros / 1e6 / rounds


def _numel(mib: float) -> int:
    """fp32 elements in ``mib`` MiB: a whole number of 1024-element rows (every layout of :func:`_layouts`)."""
    numel = int(mib * 2**20) // 4
    if numel <= 0 or numel % 1024:
        raise ValueError(f"{mib} MiB is not a whole number of 4 KiB rows (1024 fp32 elements)")
    return numel


def _gb_per_s(nbytes: int, seconds: float) -> float:
    """GB/s to 4 significant figures (2 decimals read 0.0 for a 16 KiB pack on a loaded CPU)."""
    return float(f"{nbytes / seconds / 1e9:.4g}")


def bandwidth(*, mib: float = 64, rounds: int = 7, device: str = "cpu") -> Iterator[dict[str, Any]]:
    """Per layout (:func:`_layouts`), the bandwidth of ``Tensor.copy_``, pack and unpack of a ``mib`` MiB fp32
    tensor: GB/s counting the bytes read plus the bytes written (copy: 4 + 4 per element; pack: 4 read, 1
    written; unpack: 1 read, 4 written; the per-group scales are negligible), from the median time; on a GPU
    also from the kernels' own device time (``kernel_*`` columns: :func:`_kernel_seconds`). On the CPU, the
    reference's pack and unpack too (``... (reference)``), against the compiled loops."""
    from slimact.quant import backend_for

    numel = _numel(mib)
    env = environment(device)
    for layout, (shape, cfg) in _layouts(numel).items():
        x = torch.randn(numel, device=device).reshape(shape)
        cases = _copy_pack_unpack(x, cfg)
        seconds = {op: _median_seconds(fn, rounds, device) for op, (fn, _) in cases.items()}
        kernels = {op: _kernel_seconds(fn, rounds, device) for op, (fn, _) in cases.items()}
        for op, (_, nbytes) in cases.items():
            row = {"op": f"{op} {mib:g} MiB fp32, {layout}", "vs": "Tensor.copy_",
                   "time_ratio_median": round(seconds[op] / seconds["copy_"], 4),
                   "gb_per_s": _gb_per_s(nbytes, seconds[op]), "ms_median": round(1000 * seconds[op], 4),
                   "shape": "x".join(map(str, x.shape)), "rounds": rounds, "backend": backend_for(x), **env}
            if kernels[op] is not None:
                row.update(kernel_ms=round(1000 * kernels[op], 4), kernel_gb_per_s=_gb_per_s(nbytes, kernels[op]),
                           kernel_ratio=round(kernels[op] / kernels["copy_"], 4))
            yield row
        del x, cases


def _copy_pack_unpack(x: Tensor, cfg: Any) -> dict[str, tuple[Any, int]]:
    """``copy_``, pack and unpack of ``x`` (fp32) as closures, with the bytes each reads plus writes (and, on the
    CPU, the reference's pack and unpack)."""
    from slimact.quant import backend_for, pack, unpack

    dst, packed, n = torch.empty_like(x), pack(x, cfg, share=False), x.numel()
    cases = {"copy_": (lambda: dst.copy_(x), 8 * n), "pack": (lambda: pack(x, cfg, share=False), 5 * n),
             "unpack": (lambda: unpack(packed), 5 * n)}
    if x.device.type == "cpu" and backend_for(x) != "reference":  # (not on a GPU: gpu.sh gives this step 50 s)
        cases["pack (reference)"] = (lambda: pack(x, cfg, backend="reference", share=False), 5 * n)
        cases["unpack (reference)"] = (lambda: unpack(packed, backend="reference"), 5 * n)
    return cases


def kernels(*, device: str = "cpu", tiny: bool = False, seed: int = 0) -> Iterator[dict[str, Any]]:
    """The Triton kernels against the reference (the oracle), per case: ``[8192, 768]`` in bf16 and fp32 as
    the whole tensor and in 8 channel groups, ``[8, 12, 1024, 64]`` per head (``group_dim=1``); 8-bit nearest,
    8-bit stochastic (explicit seed) and 4-bit nearest. Columns: codes that differ (``code_mismatches``, of
    ``elements``), the largest code difference, restored values that differ from the reference's dequantize
    of its own codes (``restored_mismatches``), and the same for the kernels' dequantize of the reference's
    codes alone (``dequantize_mismatches``); ``quantize_stats`` rows compare its fused codes, and
    ``group_stats`` rows its min/max (``range_mismatches``) and the largest relative difference of its
    ``sum sqrt|x|`` (summed in another order). ``tiny``: small shapes, for CPU under ``TRITON_INTERPRET=1``."""
    from slimact.quant import QuantConfig, reference
    from slimact.quant import triton as tk
    from slimact.quant.packing import unpack_bits
    from slimact.quant.reference import PackMeta, group_layout, scale_params

    gen = torch.Generator().manual_seed(seed)
    mat = (64, 48) if tiny else (8192, 768)
    heads = (2, 3, 16, 8) if tiny else (8, 12, 1024, 64)
    cases = [(mat, "whole tensor", QuantConfig(group_dim=None)), (mat, "channel groups", QuantConfig(groups=8)),
             (heads, "per head", QuantConfig(group_dim=1, groups=0))]
    modes = [(8, None, "nearest"), (8, 1234, "stochastic seed 1234"), (4, None, "nearest")]

    def codes_of(c: Tensor, bits: int, numel: int) -> Tensor:
        return (c.reshape(-1) if bits == 8 else unpack_bits(c.reshape(-1), bits, numel)).to(torch.int16)

    def unequal(a: Tensor, b: Tensor) -> int:
        return int((~((a == b) | (a.isnan() & b.isnan()))).sum())

    env = environment(device)
    for shape, layout_name, cfg in cases:
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(shape, generator=gen) * 3 + 0.5).to(dtype).to(device)
            layout = group_layout(x.shape, cfg)
            base = {"shape": "x".join(map(str, shape)), "dtype": str(dtype).removeprefix("torch."),
                    "layout": layout_name, "elements": x.numel()}
            r_lo, r_hi, r_mag = reference.group_stats(x, layout)
            t_lo, t_hi, t_mag = tk.group_stats(x, layout)
            rel = ((t_mag.double() - r_mag.double()).abs() / r_mag.double().abs().clamp_min(1e-30)).max()
            yield {**base, "kernel": "group_stats", "bits": "", "rounding": "",
                   "range_mismatches": unequal(t_lo, r_lo) + unequal(t_hi, r_hi),
                   "magnitude_max_rel_diff": float(rel), **env}
            for bits, rseed, rounding in modes:
                lo, step = scale_params(r_lo, r_hi, (1 << bits) - 1)
                meta = PackMeta(x.shape, dtype, bits, layout, False)
                ref = reference.quantize(x, layout, lo, step, bits, rseed)
                ref_restored = reference.dequantize(ref, meta, lo, step)
                tri = tk.quantize(x, layout, lo, step, bits, rseed)
                fused = tk.quantize_stats(x, layout, lo, step, bits, rseed)[0]
                for kernel, got in (("quantize+dequantize", tri), ("quantize_stats", fused)):
                    diff = (codes_of(got, bits, x.numel()) - codes_of(ref, bits, x.numel())).abs()
                    yield {**base, "kernel": kernel, "bits": bits, "rounding": rounding,
                           "code_mismatches": int((diff != 0).sum()), "max_code_diff": int(diff.max()),
                           "restored_mismatches": unequal(tk.dequantize(got, meta, lo, step), ref_restored),
                           "dequantize_mismatches": unequal(tk.dequantize(ref, meta, lo, step), ref_restored),
                           **env}


def _ratios(times: list[float], base: list[float], name: str = "time_ratio") -> dict[str, float]:
    """``<name>_median``, ``_min`` and ``_max`` of the per-round ratios of two interleaved timings."""
    import statistics

    ratios = [a / b for a, b in zip(times, base, strict=True)]
    return {f"{name}_median": round(statistics.median(ratios), 4), f"{name}_min": round(min(ratios), 4),
            f"{name}_max": round(max(ratios), 4)}


def _function_rows(rounds: int, device: str, lm_tokens: int,
                   only: Sequence[str] | None = None) -> Iterator[dict[str, Any]]:
    """Each slimact Function's forward + backward against its PyTorch counterpart, at Transformer sizes (``only``:
    those cases, by name)."""

    import torch.nn.functional as F

    from slimact.functional import (
        activation,
        dropout,
        linear,
        linear_cross_entropy,
        norm,
        scaled_dot_product_attention,
    )
    from slimact.functional.clamped_glu import GateForm, clamped_glu
    from slimact.functional.grouped_mm import grouped_mm
    from slimact.policy import Policy

    pol = Policy()
    x = torch.randn(4, 256, 768, device=device, requires_grad=True)
    # A mixture-of-experts layer of GPT-2 widths: lm_tokens tokens routed to 2 of 8 experts of 2048 (rows sorted by
    # expert, as many each), the up product, and gpt-oss's clamped gated unit on its [S, 2I] output.
    rows = 2 * lm_tokens
    routed = torch.randn(rows, 768, device=device, requires_grad=True)
    experts = (torch.randn(8, 768, 2048, device=device) * 0.02).requires_grad_()
    offs = (torch.arange(1, 9, device=device) * rows // 8).to(torch.int32)
    gate_up = (torch.randn(rows, 4096, device=device) * 3).requires_grad_()
    gate = GateForm(interleaved=True, limit=7.0, alpha=1.702, offset=1.0)
    w = torch.randn(3072, 768, device=device, requires_grad=True)
    ln_w = torch.ones(768, device=device, requires_grad=True)
    q, k, v = (torch.randn(4, 12, 256, 64, device=device, requires_grad=True) for _ in range(3))
    # GPT-2's head and loss: [tokens, 768] hidden states, a [50257, 768] output embedding.
    h = torch.randn(lm_tokens, 768, device=device, requires_grad=True)
    head = (torch.randn(50257, 768, device=device) * 0.02).requires_grad_()
    target = torch.randint(0, 50257, (lm_tokens,), device=device)
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
        "lm head + loss": (lambda: F.cross_entropy(F.linear(h, head), target),
                           lambda: linear_cross_entropy(h, head, None, target)),
        "grouped matmul (experts)": (lambda: torch._grouped_mm(routed, experts, offs=offs),
                                     lambda: grouped_mm(routed, experts, offs, pol.quant_config("linear", 2))),
        "clamped gated unit (experts)": (lambda: gate(gate_up),
                                         lambda: clamped_glu(gate_up, gate, pol.quant_config("silu", 2))),
    }
    for name, (plain, slim) in cases.items():
        if only is not None and name not in only:
            continue
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


def block_ops(
    setups: Iterable[str] = ("tempo", "int8"),
    *,
    batch: int = 4,
    seq: int = 256,
    rounds: int = 5,
    warmup: int = 2,
    device: str = "cpu",
    tiny: bool = False,
    dropout: float | None = None,
) -> Iterator[dict[str, Any]]:
    """Per op, the self CPU time and the call count of one GPT-2 block's forward + backward (the block alone,
    on a ``[batch, seq, hidden]`` input, a dense upstream gradient), plain and under each setup, from
    ``torch.profiler``'s op table: per setup the median over ``rounds`` interleaved profiled calls of each op's
    self time (ms) and its calls per block. Rows are ordered by the largest excess over plain; a ``(total)``
    row sums the ops, a ``(wall)`` row is the median wall time of the profiled calls and ``(not in ops)`` their
    difference (Python and dispatch outside any op: the cost of slimact's Functions' own code)."""
    import copy
    import statistics
    import time

    from torch.profiler import ProfilerActivity

    import slimact
    from slimact.profile import profiled
    from slimact.zoo import build

    base = build("gpt2", layers=1, tiny=tiny, vocab=128).to(device)
    if dropout is not None:
        set_dropout(base, dropout)
    names = ["plain", *setups]
    blocks = {}
    for key in names:
        m = copy.deepcopy(base)
        if key != "plain":
            slimact.convert(m, key)
        blocks[key] = m.train().transformer.h[0]
    hidden = base.config.n_embd
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, seq, hidden, generator=gen).to(device).requires_grad_()
    grad = torch.randn(batch, seq, hidden, generator=gen).to(device)

    # The model's step counter (a pre-hook on the model, not on the block) brackets each call as the model's
    # forward would: the block's packs draw their seeds from the model's stream, as in the model.
    counters = {id(b): next((c for m in b.modules() if (c := m.__dict__.get("_slimact_steps")) is not None), None)
                for b in blocks.values()}

    def step(block: torch.nn.Module) -> None:
        counter = counters[id(block)]
        if counter is not None:
            counter(block, ())
        out = block(x)
        if counter is not None:
            counter.end(block, (), out)
        (out[0] if isinstance(out, tuple) else out).backward(grad)

    for _ in range(warmup):
        for block in blocks.values():
            step(block)
    self_ms: dict[str, dict[str, list[float]]] = {k: {} for k in names}
    calls: dict[str, dict[str, int]] = {k: {} for k in names}
    wall: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for key in names[r % len(names):] + names[: r % len(names)]:
            with profiled(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                step(blocks[key])
                wall[key].append(1000 * (time.perf_counter() - start))
            seen = set()
            for e in prof.key_averages():
                seen.add(e.key)
                self_ms[key].setdefault(e.key, [0.0] * r).append(e.self_cpu_time_total / 1000)
                calls[key][e.key] = e.count
            for op, times in self_ms[key].items():
                if op not in seen:
                    times.append(0.0)
    ops_all = list(dict.fromkeys(op for k in names for op in self_ms[k]))

    def med(key: str, op: str) -> float:
        return statistics.median(self_ms[key].get(op, [0.0]))

    env = environment(device)
    common = {"batch": batch, "tokens": seq, "dropout": "as built" if dropout is None else dropout,
              "rounds": rounds, "load_end": _load()}
    rows = []
    for op in ops_all:
        row: dict[str, Any] = {"op": op}
        for key in names:
            row[f"{key}_ms"] = round(med(key, op), 3)
            row[f"{key}_calls"] = calls[key].get(op, 0)
        rows.append(row)
    rows.sort(key=lambda r: -max(r[f"{k}_ms"] - r["plain_ms"] for k in names))
    totals: dict[str, Any] = {"op": "(total)"}
    walls: dict[str, Any] = {"op": "(wall)"}
    gaps: dict[str, Any] = {"op": "(not in ops)"}
    for key in names:
        per_round = [sum(times[r] for times in self_ms[key].values()) for r in range(rounds)]
        totals[f"{key}_ms"], totals[f"{key}_calls"] = round(statistics.median(per_round), 3), sum(calls[key].values())
        walls[f"{key}_ms"], walls[f"{key}_calls"] = round(statistics.median(wall[key]), 3), ""
        gaps[f"{key}_ms"] = round(statistics.median(w - t for w, t in zip(wall[key], per_round, strict=True)), 3)
        gaps[f"{key}_calls"] = ""
    for row in [walls, totals, gaps, *rows]:
        yield {**row, **common, **env}
