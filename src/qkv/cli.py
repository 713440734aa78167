"""The `qkv` command. `qkv explain` walks through the formula on real numbers."""

from __future__ import annotations

import argparse
import sys

from .inspect import render, walkthrough


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="qkv", description="Self-attention, from the formula up.")
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="the textbook walk-through on real numbers")
    ex.add_argument("--n", type=_positive, default=4, help="tokens N (default 4)")
    ex.add_argument("--d", type=_positive, default=8, help="model width d (default 8)")
    ex.add_argument("--dk", type=_positive, default=4, help="head width d_k (default 4)")
    ex.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ex.add_argument("--causal", action="store_true", help="hide future tokens")
    ex.add_argument("--lang", choices=("en", "zh"), default="en", help="en or zh (Chinese)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit code (argparse exits with 2 on bad arguments)."""
    args = _parser().parse_args(argv)
    if args.command == "explain":
        w = walkthrough(n=args.n, d=args.d, d_k=args.dk, seed=args.seed, causal=args.causal)
        print(render(w, args.lang))
    return 0


if __name__ == "__main__":
    sys.exit(main())
