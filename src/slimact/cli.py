"""The ``slimact`` command line. Thin: every command is a few calls into the library."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


_DTYPES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}


class _UsageError(ValueError):
    """A command-line value the command cannot use: one line on stderr and exit status 2 (1 is ``check``'s "failed")."""


def _positive(text: str) -> int:
    """An argparse type: an int of at least 1 (a batch, a sequence length, a layer count...)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def _budget(text: str) -> int:
    """An argparse type: a memory size (``8GiB``, ``512MiB``, ``2GB``, bytes)."""
    from slimact.fit import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _model(args: argparse.Namespace):
    """The zoo model ``args.model``, or the Hugging Face model in the local directory ``args.model``."""
    import os

    from slimact.zoo import MODELS, build, load

    if os.path.isdir(args.model):
        return _fit_seq(load(args.model, attn=args.attn).to(args.device), args)
    if args.model not in MODELS:
        raise _UsageError(f"unknown model {args.model!r}: a zoo model ({', '.join(MODELS)}) or a local model "
                          "directory")
    model = build(args.model, layers=args.layers, attn=args.attn, tiny=getattr(args, "tiny", False)).to(args.device)
    return _fit_seq(model, args)


def _fit_seq(model, args: argparse.Namespace):
    """``model``, with ``args.seq`` checked against the positions it has (``--tiny``'s 128: the default 512 had
    crashed every command on a tiny model with a traceback, exit status 1, which is check's "failed"); an unset
    ``--seq`` becomes 512 or the positions, the fewer."""
    config = getattr(model, "config", None)
    limit = next((getattr(config, name) for name in ("n_positions", "max_position_embeddings")
                  if isinstance(getattr(config, name, None), int)), None)
    for name, module in model.named_modules():
        # (RoBERTa's positions start after its padding index: 130 embeddings, 128 positions)
        if name.endswith("position_embeddings") and getattr(module, "padding_idx", None) is not None:
            limit = module.num_embeddings - module.padding_idx - 1
    if config is not None and hasattr(config, "image_size"):
        limit = None  # (images: --seq is not read)
    if getattr(args, "seq", 0) is None:
        args.seq = min(512, limit or 512)
    elif limit is not None and args.seq > limit:
        raise _UsageError(f"--seq {args.seq} is more than the {limit} positions of {args.model}: pass --seq {limit} "
                          "or less")
    return model


def _profile(args: argparse.Namespace) -> int:
    import contextlib

    import torch
    import transformers

    from slimact import convert, profile, revert
    from slimact.zoo import example_inputs

    transformers.logging.set_verbosity_error()  # config notices about random test models are noise here

    model = _model(args)
    inputs = example_inputs(model, args.batch, args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    what = "images" if "pixel_values" in inputs else f"x {args.seq} tokens"
    print(
        f"{args.model}: {n_params / 1e6:.1f}M parameters, batch {args.batch} {what}, {args.device}, "
        f"torch {torch.__version__}, attention {args.attn}, {args.dtype}"
        + (" (autocast)" if _DTYPES[args.dtype] else "")
    )
    low = _DTYPES[args.dtype]
    device_type = torch.device(args.device).type
    autocast = (lambda: torch.autocast(device_type, dtype=getattr(torch, low))) if low else contextlib.nullcontext
    # A first step allocates once (cuBLAS's workspaces; slimact's compiled packs on the CPU: tiny GPT-2's tempo peak
    # read 11x plain's, 0.96x from the second step on): a step before each measured one, out of the peak.
    with autocast():
        profile(model, inputs)
        plain = profile(model, inputs, peak=True)
    convert(model, args.policy)
    with autocast():
        profile(model, inputs)
        converted = profile(model, inputs, peak=True)
    revert(model)
    print(f"\nbytes kept for backward and the step's peak, plain PyTorch vs slimact policy {args.policy!r}:")
    print(plain.compare(converted, by="kind"))
    if args.by_module:
        print()
        print(plain.compare(converted, by="module"))
    return 0


def _dry(args: argparse.Namespace, command: str) -> bool:
    """benchmarks/gpu.sh's dry run (``SLIMACT_GPU_DRY=1`` with no CUDA device): the command line was accepted as
    written; nothing to run on a CUDA device here."""
    import os

    if os.environ.get("SLIMACT_GPU_DRY") == "1" and args.device.startswith("cuda") and not _cuda_available():
        print(f"no device: slimact {command} on {args.device} skipped (SLIMACT_GPU_DRY=1)")
        return True
    return False


def _check(args: argparse.Namespace) -> int:
    if _dry(args, "check"):
        return 0
    import transformers

    from slimact.check import check
    from slimact.zoo import example_inputs

    transformers.logging.set_verbosity_error()
    model = _model(args)
    inputs = example_inputs(model, args.batch, args.seq)
    report = check(model, inputs, args.policy, micro_batch=args.micro_batch)
    print(f"{args.model}: batch {args.batch}" + ("" if "pixel_values" in inputs else f" x {args.seq} tokens"))
    print(report)
    return 0 if report.passed else 1


def _demo(args: argparse.Namespace) -> int:
    import transformers

    from slimact.demo import format_table, run_demo

    transformers.logging.set_verbosity_error()
    results = run_demo(args.out, steps=args.steps, quick=args.quick, seed=args.seed, device=args.device)
    print(format_table(results))
    print(f"\nwrote {args.out}/demo.png, demo.md, demo.csv")
    return 0


def _fit(args: argparse.Namespace) -> int:
    from slimact.policy import _toml_path

    _toml_path(args.out)  # (before the measuring, not after it)
    import transformers

    from slimact.fit import AUTO_ORDER, fit
    from slimact.policy import resolve
    from slimact.zoo import example_inputs

    transformers.logging.set_verbosity_error()
    model = _model(args)
    # (plain once, also where it is the policy asked for)
    policies = tuple(dict.fromkeys(("plain", *AUTO_ORDER) if args.policy == "auto" else ("plain", args.policy)))
    report = fit(model, lambda b: example_inputs(model, b, args.seq), args.budget, policies=policies,
                 optimizer=args.optimizer, batch=args.batch)
    print(f"{args.model}{' (tiny)' if args.tiny else ''}, {args.seq} tokens per sample, optimizer {args.optimizer}")
    print(report.table())
    rows = {row.policy: row for row in report.rows}
    if args.policy == "plain":  # (plain PyTorch measured alone: nothing to write)
        return 0 if args.batch is None or rows["plain"].max_batch >= args.batch else 1
    if report.static >= report.budget:
        print(f"the budget ({args.budget / 2**20:.1f} MiB) holds not even the weights and the optimizer's state "
              f"({report.static / 2**20:.1f} MiB): no batch fits")
    # With --batch, the policy that reaches it (none: nothing written, status 1); else the one asked for, if it fits
    chosen = report.chosen if args.batch is not None else (args.policy if args.policy != "auto" else None)
    if chosen and chosen != "plain" and rows[chosen].max_batch >= 1:
        path = resolve(chosen).to_file(args.out)
        print(f"wrote {path}: slimact.convert(model, {str(path)!r})")
    elif args.batch is not None:
        print(f"no policy reaches batch {args.batch}: nothing written")
    return 0 if args.batch is None or report.chosen else 1


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _bench(args: argparse.Namespace) -> int:
    import os

    from slimact.bench import kernels, memory, ops, speed, throughput, write_results, zoo

    if _dry(args, "bench"):
        return 0
    if args.layers is None and not args.memory:  # --memory: the models' own depth unless asked
        args.layers = 4
    rows = []
    if args.kernels:
        # Needs no transformers; on CPU, Triton's interpreter (chosen before triton is imported).
        if not args.device.startswith("cuda"):
            os.environ.setdefault("TRITON_INTERPRET", "1")
        for row in kernels(device=args.device, tiny=args.tiny):
            case = f"{row['kernel']:>19} {row['shape']:>14} {row['dtype']:>8} {row['layout']:>14}"
            if row["kernel"] == "group_stats":
                print(f"{case}: min/max differ {row['range_mismatches']}, sum sqrt|x| rel. diff "
                      f"{row['magnitude_max_rel_diff']:.2e}", flush=True)
            else:
                print(f"{case} {row['bits']}-bit {row['rounding']}: codes differ {row['code_mismatches']} "
                      f"(max {row['max_code_diff']}), restored differ {row['restored_mismatches']}", flush=True)
            rows.append(row)
        print(f"wrote {write_results(rows, args.name or 'kernels', args.out)}")
        bad = [r for r in rows if r.get("code_mismatches") or r.get("restored_mismatches")
               or r.get("dequantize_mismatches") or r.get("range_mismatches")]
        return 1 if bad else 0

    import transformers

    from slimact.zoo import MODELS

    transformers.logging.set_verbosity_error()
    if args.speed and args.ops_table:
        from slimact.bench import block_ops

        for p in args.dropout or [None]:
            ops_setups = ["tempo", "int8"] if args.policies == ["int8", "tempo"] else args.policies
            for row in block_ops(ops_setups, batch=args.batch or 4, seq=args.seq or 256, rounds=args.rounds,
                                 device=args.device, dropout=p, tiny=args.tiny):
                cells = "  ".join(f"{k.removesuffix('_ms')} {row[k]:.2f} ms" for k in row if k.endswith("_ms"))
                print(f"{row['op'][:40]:>40}: {cells}", flush=True)
                rows.append(row)
    elif args.speed:
        setups = args.policies if args.policies != ["int8", "tempo"] else ["tempo", "int8", "checkpoint",
                                                                          "checkpoint+int8"]
        for p in args.dropout or [None]:
            for row in speed(args.models or ["gpt2", "llama"], setups, layers=args.layers, batch=args.batch or 4,
                             seq=args.seq or 256, rounds=args.rounds, device=args.device, dtype=args.dtypes[0],
                             dropout=p, vocab=args.vocab):
                print(f"{row['model']:>8} {row['setup']:>16} dropout {row['dropout']}: time "
                      f"{row['time_ratio_median']:.3f}x [{row['time_ratio_min']:.3f}, {row['time_ratio_max']:.3f}]  "
                      f"memory {row['memory_ratio']:.3f}x  inference {row['eval_ratio_median']:.3f}x  "
                      f"first step {row['first_step_s']:.2f} s", flush=True)
                rows.append(row)
    elif args.throughput:
        if args.budget is None:
            raise SystemExit("slimact bench --throughput needs --budget (e.g. 24GiB)")
        for row in throughput(args.models or ["gpt2"], args.budget, args.policies, layers=args.layers,
                              seq=args.seq or 256, rounds=args.rounds, max_batch=args.max_batch,
                              device=args.device, dtype=args.dtypes[0]):
            ratio = row.get("samples_per_s_ratio_median")
            print(f"{row['model']:>8} {row['setup']:>8}: batch {row['batch']:>4} (fit {row['fit_batch']}), "
                  f"{row['fit_measured_mib'] or 0:.0f} MiB of {row['budget_mib']:.0f}, "
                  f"samples/s {'-' if ratio is None else f'{ratio:.3f}x'}", flush=True)
            rows.append(row)
    elif args.ops:
        for row in ops(rounds=args.rounds, device=args.device, mib=args.mib[0], sizes=args.mib[1:]):
            print(f"{row['op']:>24}: {row['time_ratio_median']:.3f}x of {row['vs']}", flush=True)
            rows.append(row)
    elif args.zoo and args.all:
        return _sweep(args)
    elif args.zoo:
        for row in zoo(args.models or list(MODELS), batch=args.batch or 2, seq=args.seq or 128, device=args.device):
            print(f"{row['model']:>14}: coverage {row['coverage']:.1%}, int8 {row['int8_ratio']:.3f}x, "
                  f"tempo {row['tempo_ratio']:.3f}x  ({row['converted']})", flush=True)
            rows.append(row)
    else:
        extra = [tuple(e.split(":")) for e in args.extra]
        models = args.models or ["bert-base", "gpt2", "llama", "vit-b16"]
        # (a tiny model has 128 positions: the default 512 aborted the run)
        seq = args.seq or (128 if args.tiny else 512)
        for row in memory(models, args.dtypes, args.policies, batch=args.batch or 4, seq=seq,
                          device=args.device, extra=extra, tiny=args.tiny, layers=args.layers):
            print(f"{row['model']:>10} {row['dtype']:>5} {row['policy']:>6}: kept {row['plain_kept_mib']:>10.2f} MiB"
                  f" -> {row['kept_mib']:>9.2f} MiB {row['kept_ratio']:.3f}x; peak {row['plain_peak_mib']:>10.2f} MiB"
                  f" -> {row['peak_mib']:>9.2f} MiB {row['peak_ratio']:.3f}x, less parameter gradients "
                  f"{row['peak_less_grads_ratio']:.3f}x", flush=True)
            rows.append(row)
    default = ("speed_ops" if args.speed and args.ops_table else "speed" if args.speed
               else "throughput" if args.throughput else "ops" if args.ops else "zoo" if args.zoo else "memory")
    print(f"wrote {write_results(rows, args.name or default, args.out)}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    """``slimact bench --zoo --all``: every architecture of transformers' auto mappings, checked one by one."""
    import os

    from slimact.bench import sweep_path, write_sweep_docs, zoo_all

    path = os.path.join(args.out, f"{args.name}.csv") if args.name else sweep_path(args.policy, args.out)
    for row in zoo_all(path, policy=args.policy, timeout=args.timeout, resume=args.resume, only=args.models):
        detail = f"  {row['detail']}" if row["detail"] else ""
        print(f"{row['architecture']:>48} {row['outcome']:>12}{detail}", flush=True)
    print(f"wrote {path} and {write_sweep_docs(path, args.docs)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from slimact.zoo import MODELS

    model_help = f"a zoo model built from a configuration in code ({', '.join(MODELS)}), or a local model directory"
    parser = argparse.ArgumentParser(prog="slimact", description="Activation-memory compression for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("profile", help="bytes kept for backward and the step's peak, plain vs converted")
    p.add_argument("--model", default="gpt2", help=model_help)
    p.add_argument("--batch", type=_positive, default=4)
    p.add_argument("--seq", type=_positive, default=None,
                   help="tokens per sample (default 512, or the model's positions where fewer: --tiny's 128)")
    p.add_argument("--policy", default="int8", help="preset name or policy file")
    p.add_argument("--layers", type=_positive, default=None, help="override the number of layers")
    p.add_argument("--attn", default="sdpa", help="Hugging Face attention implementation (sdpa, eager)")
    p.add_argument("--tiny", action="store_true", help="the zoo's test size (width 64, 2 layers) instead of GPT-2's")
    p.add_argument("--dtype", default="fp32", choices=list(_DTYPES), help="bf16 and fp16 run under autocast")
    p.add_argument("--device", default="cpu")
    p.add_argument("--by-module", action="store_true", help="also compare module by module")
    p.set_defaults(func=_profile)

    c = sub.add_parser("check", help="one training step plain and converted: forward and every gradient "
                                     "against the policy's floors (exit 1 when one misses)")
    c.add_argument("--model", default="gpt2", help=model_help)
    c.add_argument("--policy", default="int8", help="preset name or policy file")
    c.add_argument("--layers", type=_positive, default=None, help="override the number of layers")
    c.add_argument("--tiny", action="store_true", help="the zoo's test size (width 64, 2 layers) instead of GPT-2's")
    c.add_argument("--batch", type=_positive, default=2)
    c.add_argument("--seq", type=_positive, default=64)
    c.add_argument("--attn", default="sdpa", help="Hugging Face attention implementation (sdpa, eager)")
    c.add_argument("--device", default="cpu")
    c.add_argument("--micro-batch", type=_positive, default=None,
                   help="rows per call of a gradient accumulation loop (default: the whole batch in one call)")
    c.set_defaults(func=_check)

    d = sub.add_parser("demo", help="train small models plainly and converted on real data; compare loss and memory")
    d.add_argument("--quick", action="store_true",
                   help="a one-minute version (40 steps per text run at half its batch, 200 per digits run)")
    d.add_argument("--steps", type=_positive, default=300,
                   help="training steps per text run (the digits task runs 400; --quick overrides both)")
    d.add_argument("--out", default="slimact-out", help="folder for demo.png, demo.md, demo.csv")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default="cpu")
    d.set_defaults(func=_demo)

    f = sub.add_parser("fit", help="the largest batch that fits a memory budget, plain and under each policy")
    f.add_argument("--model", default="gpt2", help=model_help)
    f.add_argument("--attn", default="sdpa", help="Hugging Face attention implementation (sdpa, eager)")
    f.add_argument("--budget", required=True, type=_budget, help="memory budget, e.g. 8GiB")
    f.add_argument("--seq", type=_positive, default=None,
                   help="tokens per sample (default 512, or the model's positions where fewer: --tiny's 128)")
    f.add_argument("--policy", default="auto", help="auto (least lossy that reaches --batch), or a policy name")
    f.add_argument("--batch", type=_positive, default=None, help="the batch size wanted (for --policy auto)")
    f.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "none"])
    f.add_argument("--layers", type=_positive, default=None)
    f.add_argument("--tiny", action="store_true", help="the zoo's test size (width 64, 2 layers) instead of GPT-2's")
    f.add_argument("--device", default="cpu")
    f.add_argument("--out", default="slimact-policy.toml", help="where the chosen policy is written")
    f.set_defaults(func=_fit)

    b = sub.add_parser("bench", help="measure and write result files (benchmarks/results/)")
    what = b.add_mutually_exclusive_group(required=True)
    what.add_argument("--memory", action="store_true",
                      help="bytes kept for backward and the step's peak, plain vs each policy, per model and dtype "
                           "(the README's headline table)")
    what.add_argument("--zoo", action="store_true",
                      help="per model family: what is converted, coverage, bytes under int8 and tempo (2 layers)")
    what.add_argument("--speed", action="store_true",
                      help="training-step time vs plain, interleaved (setups: presets, checkpoint, checkpoint+int8)")
    what.add_argument("--throughput", action="store_true",
                      help="samples per second at one memory budget (--budget): each setup at the batch that fits")
    what.add_argument("--ops", action="store_true",
                      help="per-op micro-benchmarks: pack/unpack vs copy_ (ratios, GB/s per layout), each Function")
    what.add_argument("--kernels", action="store_true",
                      help="the Triton kernels against the reference: mismatching codes and restored values per "
                           "case (on CPU under TRITON_INTERPRET=1; exit 1 on any mismatch)")
    b.add_argument("--tiny", action="store_true",
                   help="--kernels: small shapes (for Triton's CPU interpreter); --memory: the zoo's test sizes; "
                        "--ops-table: a tiny block")
    b.add_argument("--dropout", nargs="+", type=float, default=None,
                   help="--speed: set every dropout probability of the model to each value in turn (default: as "
                        "built)")
    b.add_argument("--all", action="store_true",
                   help="with --zoo: every architecture of transformers' auto mappings at a tiny size, each checked "
                        "(slimact.check) in its own process; writes zoo_all.csv and a section of --docs (--models: "
                        "only those, their rows replaced)")
    b.add_argument("--policy", default="int8",
                   help="--zoo --all: the policy checked (preset name or policy file; default int8, written to "
                        "zoo_all.csv; another to zoo_all_<policy>.csv and its own section of --docs)")
    b.add_argument("--timeout", type=float, default=120.0, help="--zoo --all: seconds per architecture")
    b.add_argument("--resume", action="store_true", help="--zoo --all: keep the rows already in its CSV")
    b.add_argument("--docs", default="docs/models.md", help="--zoo --all: the document its table goes into")
    b.add_argument("--layers", type=_positive, default=None,
                   help="--speed, --throughput, --memory: layers of each model (default: the model's own, 12 for "
                        "gpt2 and llama; the Python API's bench.speed and bench.throughput default to 4)")
    b.add_argument("--vocab", type=_positive, default=None,
                   help="--speed: the models' vocabulary size (default: their real one; a small one times the "
                        "blocks alone)")
    b.add_argument("--ops-table", action="store_true",
                   help="with --speed: one GPT-2 block's forward and backward op by op (torch.profiler), plain and "
                        "under each of --policies (default int8 tempo); writes speed_ops")
    b.add_argument("--budget", default=None, type=_budget, help="--throughput: the memory budget, e.g. 24GiB")
    b.add_argument("--max-batch", type=_positive, default=None, help="--throughput: the largest batch to time")
    b.add_argument("--rounds", type=_positive, default=7,
                   help="--speed/--throughput/--ops: interleaved rounds (median reported)")
    b.add_argument("--models", nargs="+", default=None,
                   help="default: bert-base gpt2 llama vit-b16 (--memory), gpt2 llama (--speed), gpt2 "
                        "(--throughput), all (--zoo)")
    b.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"],
                   help="--memory: each; --speed: the first (autocast)")
    b.add_argument("--policies", nargs="+", default=["int8", "tempo"],
                   help="--memory, --throughput: policies; --speed: setups (default tempo int8 checkpoint "
                        "checkpoint+int8)")
    b.add_argument("--extra", nargs="*", default=["vit-b16:bf16:mesa"], help="model:dtype:policy triples")
    b.add_argument("--batch", type=_positive, default=None,
                   help="default 4 (--memory, --speed, --ops-table), 2 (--zoo)")
    b.add_argument("--seq", type=_positive, default=None,
                   help="default 512 (--memory), 256 (--speed, --ops-table, --throughput), 128 (--zoo)")
    b.add_argument("--mib", nargs="+", type=float, default=[64.0],
                   help="--ops: tensor sizes in MiB (fp32; whole 4 KiB rows): the first for the op table, each for "
                        "the per-layout pack/unpack rows (default 64)")
    b.add_argument("--device", default="cpu")
    b.add_argument("--name", default=None,
                   help="result file stem (default: memory, zoo, ...; --zoo --all: zoo_all or zoo_all_<policy>)")
    b.add_argument("--out", default="benchmarks/results")
    b.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from slimact.policy import PolicyError
    from slimact.profile import quiet_profiler

    quiet_profiler()

    try:
        return args.func(args)
    except (_UsageError, PolicyError) as e:  # (a typo, not a failed check: argparse's status)
        parser.exit(2, f"slimact {args.command}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
