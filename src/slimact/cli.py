"""The ``slimact`` command line. Thin: every command is a few calls into the library."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _profile(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from slimact import convert, profile, revert
    from slimact.zoo import build, example_inputs

    transformers.logging.set_verbosity_error()  # config notices about random test models are noise here

    model = build(args.model, layers=args.layers, attn=args.attn).to(args.device)
    inputs = example_inputs(model, args.batch, args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"{args.model}: {n_params / 1e6:.1f}M parameters, batch {args.batch} x {args.seq} tokens, "
        f"{args.device}, torch {torch.__version__}, attention {args.attn}"
    )
    plain = profile(model, inputs)
    convert(model, args.policy)
    converted = profile(model, inputs)
    revert(model)
    print(f"\nbytes kept for backward, plain PyTorch vs slimact policy {args.policy!r}:")
    print(plain.compare(converted, by="kind"))
    if args.by_module:
        print()
        print(plain.compare(converted, by="module"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slimact", description="Activation-memory compression for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("profile", help="bytes kept for backward by a model, plain vs converted")
    p.add_argument("--model", default="gpt2", help="zoo model built from a configuration in code (gpt2, bert-base)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--policy", default="int8", help="preset name or policy file")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--attn", default="sdpa", help="Hugging Face attention implementation (sdpa, eager)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--by-module", action="store_true", help="also compare module by module")
    p.set_defaults(func=_profile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
