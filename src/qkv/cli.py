"""The `qkv` command.

- `qkv explain`: the textbook walk-through on real numbers;
- `qkv attend TEXT --token WORD`: where a word looks in the real all-MiniLM-L6-v2;
- `qkv bench`: the cost curve, time and memory against N;
- `qkv demo`: all three, written to a folder with a report;
- `qkv build`: compile the CPU attention kernel now (otherwise it is compiled at first use).

Bad input ends with a one-line message on stderr and a non-zero exit code, never a traceback:
2 for a bad argument or a request the input cannot answer, 1 for a missing optional package.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .inspect import render, walkthrough

USAGE_ERROR, MISSING_PACKAGE = 2, 1


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(_positive(x) for x in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected sizes separated by commas such as 512,1024, got {text!r}"
        ) from None


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

    at = sub.add_parser("attend", help="where a word looks in the real all-MiniLM-L6-v2")
    at.add_argument("text", nargs="?", default=None, help="the text (default: the cat example)")
    at.add_argument("--token", help='the word to ask about (default "it", else the first word)')
    at.add_argument("--layer", type=int, help="show this layer's heads in full")
    at.add_argument("--head", type=int, help="with --layer: show only this head")
    at.add_argument(
        "--json", metavar="FILE", help="write every layer's and head's weights ('-': stdout)"
    )
    at.add_argument("--out", default="qkv-attend", help="folder for the PNGs and the viewer")
    at.add_argument("--no-files", action="store_true", help="print only; write no PNG or HTML")

    be = sub.add_parser("bench", help="time and memory of attention against N")
    be.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    be.add_argument("--sizes", type=_sizes, help="sequence lengths, e.g. 1024,2048,4096")
    be.add_argument("--window", type=_positive, help="the sliding window's reach each side")
    be.add_argument("--methods", default=",".join(_bench().METHODS), help="which methods")
    be.add_argument("--passes", choices=("forward", "backward", "both"), default="both")
    be.add_argument("--json", metavar="FILE", help="write the measurements as JSON")
    be.add_argument("--png", metavar="FILE", help="write the log-log plot")
    be.add_argument("--no-progress", action="store_true", help="no progress bar")

    de = sub.add_parser("demo", help="explain, attend and bench, written to a folder")
    de.add_argument("--out", default="qkv-demo", help="the folder (default qkv-demo)")
    de.add_argument("--no-progress", action="store_true", help="no progress bar")

    bu = sub.add_parser("build", help="compile the CPU attention kernel now (else at first use)")
    bu.add_argument("--force", action="store_true", help="rebuild, also after a failed build")
    bu.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    return ap


def _bench():
    from .inspect import bench

    return bench


class _Refused(Exception):
    """An input the command cannot answer; its message is shown without a traceback."""


def _attend(args) -> None:
    from .inspect.attend import EXAMPLE, AttendError, default_word, model_attention, summary

    text = EXAMPLE if args.text is None else args.text
    if args.head is not None and args.layer is None:
        raise _Refused("--head needs --layer")
    try:
        amap = model_attention(text)
        word = args.token or default_word(amap)
        print(summary(amap, word, args.layer, args.head))
    except AttendError as e:
        raise _Refused(str(e)) from None
    if args.json == "-":
        print(json.dumps(amap.to_dict()))
    elif args.json:
        Path(args.json).write_text(json.dumps(amap.to_dict()), encoding="utf-8")
        print(f"weights: {args.json}")
    if not args.no_files:
        from .inspect.figures import attention_grid, token_heads
        from .inspect.viewer import write_viewer

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() else "_" for c in word.lower())
        attention_grid(amap, out / "attention-grid.png")
        token_heads(amap, word, out / f"attention-{safe}.png")
        write_viewer(amap, out / "viewer.html")
        print(f"pictures: {out / 'attention-grid.png'}, {out / f'attention-{safe}.png'}")
        print(f"viewer:   {out / 'viewer.html'} (open it in a browser)")


def _run_bench(args) -> None:
    from dataclasses import replace

    bench = _bench()
    sizes = bench.QUICK if args.quick else bench.FULL
    if args.sizes:
        sizes = replace(sizes, ns=args.sizes)
    if args.window:
        sizes = replace(sizes, window=args.window)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in bench.METHODS]
    if unknown or not methods:
        raise _Refused(f"unknown method {unknown}; choose from {', '.join(bench.METHODS)}")
    passes = {"forward": ["forward"], "backward": ["forward+backward"]}.get(
        args.passes, bench.PASSES
    )
    records = bench.measure(sizes, methods, passes, progress=not args.no_progress)
    print(bench.table(records))
    if args.json:
        Path(args.json).write_text(json.dumps(bench.report(records, sizes), indent=1))
        print(f"measurements: {args.json}")
    if args.png:
        from .inspect.figures import cost_plot

        cost_plot(records, args.png)
        print(f"plot: {args.png}")


def _build(args) -> int:
    from .kernels.cpu import build, isa

    try:
        ops = build.load(force=args.force, verbose=args.verbose)
    except build.KernelUnavailable as e:
        cause = e.__cause__
        if cause is not None and args.verbose:
            print(str(cause).strip()[-4000:], file=sys.stderr)
        print(f"qkv build: error: the CPU kernel could not be built: {e}", file=sys.stderr)
        return MISSING_PACKAGE
    have = ", ".join(f"{name} {'yes' if ops.isa_supported(name) else 'no'}" for name in isa.ISAS)
    chosen, why = isa.choose(ops)
    print(f"CPU attention kernel: {build.build_dir() / (build.NAME + '.so')}")
    print(f"instruction sets on this CPU: {have}")
    print(f"runs: {chosen} ({isa.ENV} forces one)" if why is None else f"cannot run: {why}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit code (argparse exits with 2 on bad arguments)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "explain":
            w = walkthrough(n=args.n, d=args.d, d_k=args.dk, seed=args.seed, causal=args.causal)
            print(render(w, args.lang))
        elif args.command == "attend":
            _attend(args)
        elif args.command == "bench":
            _run_bench(args)
        elif args.command == "demo":
            from .inspect import demo

            demo.run(args.out, progress=not args.no_progress)
        elif args.command == "build":
            return _build(args)
    except _Refused as e:
        print(f"qkv {args.command}: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    except ImportError as e:
        print(f"qkv {args.command}: error: {e}", file=sys.stderr)
        return MISSING_PACKAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
