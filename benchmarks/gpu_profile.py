"""Where a training step's time goes on a CUDA device: ``torch.profiler`` over a few steps of plain, tempo and
int8 (GPT-2, 12 layers, bf16, 8 x 1024 by default), for ``benchmarks/gpu.sh``'s ``profile`` step.

    PYTHONPATH=src python3 benchmarks/gpu_profile.py --out OUT.md [--setups plain tempo int8] [--steps 3]

Per setup, into one Markdown file (rewritten after each setup, so a run cut short keeps what it measured):

- the step's wall time without the profiler (median of ``--steps``), and under it: GPU busy time (the sum of the
  kernels' and copies' durations), kernel launches, and host syncs per step (``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize`` (the harness's one per step included), ``cudaEventSynchronize``, device-to-host
  copies, ``aten::item`` / ``aten::_local_scalar_dense``);
- GPU time by kernel family (matrix products, fused attention, slimact's Triton kernels, inductor's loops, eager
  elementwise and reduction kernels, copies, the optimizer) and by the op that launched it (the nearest slimact
  Function, backward node or optimizer step around it);
- the top CUDA kernels and the top CPU ops by self time;
- one more step under ``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing call, counted by the line
  of Python that made it (the first frame in slimact, else the caller's).

With no CUDA device (or ``--dry``) it writes "no device" to the file and exits 0 (gpu.sh's dry mode).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
            "aten::item", "aten::_local_scalar_dense")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")

#: Kernel families by name (the first match wins).
FAMILIES = (
    ("memcpy DtoH", ("Memcpy DtoH",)),
    ("memcpy/memset other", ("Memcpy", "Memset")),
    ("slimact Triton", ("_quantize_kernel", "_dequantize_kernel", "_stats_kernel", "_finish_kernel",
                        "_estimate_kernel", "_fold_kernel")),
    ("inductor loops", ("triton_",)),
    ("fused attention", ("flash", "fmha", "sdpa", "attention")),
    ("matrix products, fp32 SIMT", ("simt_sgemm",)),
    ("matrix products", ("gemm", "sm90_", "cutlass", "cublas", "nvjet", "xmma", "matmul")),
    ("optimizer", ("multi_tensor_apply", "fused_adam", "FusedAdam")),
    ("softmax", ("softmax",)),
    ("reductions", ("reduce_kernel", "Reduce")),
    ("dropout/RNG", ("fused_dropout", "philox", "distribution")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "CatArrayBatched", "index", "fill")),
)


def family(name: str) -> str:
    for label, keys in FAMILIES:
        if any(k in name for k in keys):
            return label
    return "other"


def _owner(event) -> str:
    """The nearest slimact Function, backward node or optimizer step around a CPU op, else its outermost op."""
    e, top = event, event
    while e is not None:
        name = e.name
        if "evaluate_function" in name or name.startswith("Optimizer.") or (
                name.startswith("_") and "Function" in name):
            return name.replace("autograd::engine::evaluate_function: ", "bwd ")
        top = e
        e = e.cpu_parent
    return top.name


def _device_events(events):
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CUDA]


def _table(rows, header) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def analyse(prof, steps: int, top: int) -> tuple[dict, list[str]]:
    from torch.autograd import DeviceType

    events = prof.events()
    device = _device_events(events)
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    per = 1.0 / steps
    busy_us = sum(e.time_range.elapsed_us() for e in device)
    counts = collections.Counter(e.name for e in cpu)
    launches = sum(counts[n] for n in LAUNCHES)
    syncs = {n: counts[n] * per for n in SYNC_OPS if counts[n]}
    dtoh = sum(1 for e in device if e.name.startswith("Memcpy DtoH")) * per
    summary = {"gpu_busy_ms": busy_us / 1000 * per, "launches": launches * per, "dtoh_copies": dtoh,
               **{f"n_{k}": v for k, v in syncs.items()}}

    lines = [f"- GPU busy (kernels + copies): {busy_us / 1000 * per:.1f} ms per step; {launches * per:.0f} kernel "
             f"launches per step; device-to-host copies: {dtoh:.0f} per step",
             "- host syncs per step: " + (", ".join(f"{k} {v:.0f}" for k, v in syncs.items()) or "none")]

    fam = collections.Counter()
    for e in device:
        fam[family(e.name)] += e.time_range.elapsed_us()
    lines += ["", "GPU time by kernel family (ms per step, share of busy):", ""]
    lines += _table([(k, f"{v / 1000 * per:.2f}", f"{v / max(busy_us, 1):.1%}") for k, v in fam.most_common()],
                    ("family", "ms/step", "share"))

    # kernels attributed to the op that launched them (FunctionEvent.kernels)
    owners = collections.Counter()
    owner_launch = collections.Counter()
    for e in cpu:
        ks = getattr(e, "kernels", None) or []
        if not ks:
            continue
        o = _owner(e)
        owners[o] += sum(k.duration for k in ks)
        owner_launch[o] += len(ks)
    lines += ["", f"GPU time by the op that launched it (top {top}; ms per step, kernels per step):", ""]
    lines += _table([(k, f"{v / 1000 * per:.2f}", f"{owner_launch[k] * per:.0f}") for k, v in owners.most_common(top)],
                    ("op", "ms/step", "kernels/step"))

    kern = collections.defaultdict(lambda: [0.0, 0])
    for e in device:
        kern[e.name][0] += e.time_range.elapsed_us()
        kern[e.name][1] += 1
    rows = sorted(kern.items(), key=lambda kv: -kv[1][0])[:top]
    lines += ["", f"Top {top} CUDA kernels by self time:", ""]
    lines += _table([(n[:110].replace("|", "/"), family(n), f"{t / 1000 * per:.2f}", f"{c * per:.0f}")
                     for n, (t, c) in rows], ("kernel", "family", "ms/step", "calls/step"))

    ops = collections.defaultdict(lambda: [0.0, 0])
    for e in cpu:
        ops[e.name][0] += e.self_cpu_time_total
        ops[e.name][1] += 1
    rows = sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]
    lines += ["", f"Top {top} CPU ops by self time (under the profiler):", ""]
    lines += _table([(n[:110].replace("|", "/"), f"{t / 1000 * per:.2f}", f"{c * per:.0f}") for n, (t, c) in rows],
                    ("op", "self ms/step", "calls/step"))
    return summary, lines


def sync_sources(step) -> list[str]:
    """One step under ``set_sync_debug_mode("warn")``: each synchronizing call counted by the line of Python that
    made it (the innermost frame in slimact, else the innermost outside torch)."""
    import torch

    where = collections.Counter()

    def record(msg) -> None:
        if "synchroniz" not in str(msg.message):
            return
        stack = traceback.extract_stack()[:-1]
        # slimact's frames but its routing mode's __torch_function__ (which every torch call passes through)
        ours = [f for f in stack if "/slimact/" in f.filename.replace("\\", "/") and "routing" not in f.filename]
        mine = ours[-2:] or [f for f in stack if "/torch/" not in f.filename and "warnings" not in f.filename][-1:]
        where[" < ".join(f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}"
                         for f in reversed(mine))] += 1

    old = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        warnings._showwarnmsg_impl = record  # type: ignore[attr-defined]  # restored by catch_warnings
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(sync=False)
        finally:
            torch.cuda.set_sync_debug_mode(old)
    lines = ["", "Synchronizing calls in one step (set_sync_debug_mode('warn'), by the line of Python that made "
             "them; the step's closing torch.cuda.synchronize not run):", ""]
    lines += _table(where.most_common(30) or [("none", 0)], ("line", "count"))
    return lines


def _train_step(model, inputs, dtype: str, device: str):
    import torch

    from slimact.bench import autocast

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(sync: bool = True) -> None:
        opt.zero_grad(set_to_none=True)
        with autocast(device, dtype):
            loss = model(**inputs).loss
        loss.backward()
        opt.step()
        if sync and device == "cuda":
            torch.cuda.synchronize()

    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the Markdown file to write")
    p.add_argument("--model", default="gpt2")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--setups", nargs="+", default=["plain", "tempo", "int8"])
    p.add_argument("--steps", type=int, default=3, help="profiled steps per setup")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--dry", action="store_true", help="write 'no device' and exit (gpu.sh's dry mode)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (CPU ops only)")
    p.add_argument("--tiny", action="store_true", help="the zoo's tiny model (a smoke test)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    import torch

    cuda = args.device == "cuda"
    if args.dry or (cuda and not torch.cuda.is_available()):
        out.write_text("# profile\n\nno device: nothing measured\n")
        print(f"no device; wrote {out}")
        return 0

    import copy

    import slimact
    from slimact.bench import environment, set_dropout
    from slimact.zoo import build, example_inputs

    base = build(args.model, layers=args.layers, tiny=args.tiny).to(args.device)
    set_dropout(base, args.dropout)
    inputs = example_inputs(base, args.batch, args.seq)
    env = environment(args.device)
    doc = [f"# Where the step's time goes: {args.model}, {args.layers} layers, {args.dtype}, {args.batch} x "
           f"{args.seq}, dropout {args.dropout}", "",
           f"{env.get('device')}, torch {env.get('torch')}, {env.get('date')}; {args.steps} profiled steps per "
           f"setup after {args.warmup} warm-up steps (compilation there).", ""]
    head: list[str] = []
    results = []
    for name in args.setups:
        model = copy.deepcopy(base)
        if name != "plain":
            slimact.convert(model, name)
        model.train()
        step = _train_step(model, inputs, args.dtype, args.device)
        t0 = time.perf_counter()
        step()
        first = time.perf_counter() - t0
        for _ in range(args.warmup - 1):
            step()
        walls = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            walls.append(time.perf_counter() - t0)
        wall = statistics.median(walls) * 1000
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            profiled = (time.perf_counter() - t0) * 1000 / args.steps
        try:
            summary, lines = analyse(prof, args.steps, args.top)
            if cuda:
                lines += sync_sources(step)
        except Exception:  # the timings stand; the analysis's error goes into the file
            summary, lines = {"gpu_busy_ms": 0.0, "launches": 0, "dtoh_copies": 0}, ["```", traceback.format_exc(),
                                                                                    "```"]
        del prof
        summary |= {"setup": name, "step_ms": wall, "profiled_step_ms": profiled, "first_step_s": first}
        results.append(summary)
        doc += [f"## {name}", "", f"- step {wall:.1f} ms (median of {args.steps}, no profiler); "
                f"{profiled:.1f} ms under the profiler; first step {first:.2f} s", *lines, ""]
        plain = results[0]["step_ms"]
        head = ["| setup | step ms | x plain | GPU busy ms | busy share | launches | DtoH copies | stream syncs |"
                " item/_local_scalar_dense |", "|---|---|---|---|---|---|---|---|---|"]
        for r in results:
            head.append(
                f"| {r['setup']} | {r['step_ms']:.1f} | {r['step_ms'] / plain:.2f} | {r['gpu_busy_ms']:.1f} | "
                f"{r['gpu_busy_ms'] / r['step_ms']:.0%} | {r['launches']:.0f} | {r['dtoh_copies']:.0f} | "
                f"{r.get('n_cudaStreamSynchronize', 0):.0f} | "
                f"{r.get('n_aten::item', 0):.0f} / {r.get('n_aten::_local_scalar_dense', 0):.0f} |")
        out.write_text("\n".join(doc[:4] + head + [""] + doc[4:]) + "\n")
        print("\n".join(head), flush=True)
        del model, step
        if cuda:
            torch.cuda.empty_cache()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
