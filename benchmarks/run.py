"""The one entry point: run a suite and write its section of the benchmarks document.

    python -m benchmarks.run --list                           # the suites
    python -m benchmarks.run core --out docs/benchmarks.md    # run, write the section + JSON
    python -m benchmarks.run core --quick                     # small sizes, print the section
    python -m benchmarks.run core --dry-run                   # list the cases, measure nothing
    python -m benchmarks.run core --from-json docs/benchmarks-core.json --out docs/benchmarks.md

Run it from the repository root. Progress goes to stderr. With `--out`, the JSON of the results
(`docs/benchmarks-<suite>.json` beside the document, or `--json`) is rewritten after every case,
so a run cut short keeps what it measured; `--from-json` renders a section from such a file.
Exit status 2: the suite cannot run on this machine (it says why).
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
try:
    import qkv  # noqa: F401
except ImportError:  # a checkout that is not installed
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from . import suites  # noqa: E402
from .probe import child  # noqa: E402
from .report import json_path, render, write_section  # noqa: E402
from .results import Results  # noqa: E402
from .runner import Options, run  # noqa: E402
from .suite import Suite  # noqa: E402


def suite_names() -> list[str]:
    return sorted(
        m.name for m in pkgutil.iter_modules(suites.__path__) if not m.name.startswith("_")
    )


def load_suite(name: str) -> Suite:
    if name not in suite_names():
        raise SystemExit(f"no suite {name!r}; the suites: {', '.join(suite_names())}")
    return importlib.import_module(f"{suites.__name__}.{name}").SUITE


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.split("\n")[0]
    )
    ap.add_argument("suite", nargs="?", help="the suite to run (--list names them)")
    ap.add_argument("--list", action="store_true", help="name the suites and stop")
    ap.add_argument("--quick", action="store_true", help="the suite's small settings (a smoke run)")
    ap.add_argument("--out", type=Path, help="write the suite's section of this Markdown file")
    ap.add_argument("--json", type=Path, help="where the JSON goes (default: beside --out)")
    ap.add_argument("--dry-run", action="store_true", help="list the cases, measure nothing")
    ap.add_argument("--from-json", type=Path, help="render the section from this results file")
    ap.add_argument(
        "--gate",
        choices=("wait", "refuse", "off"),
        help="quiet gate before each timed round (default: wait; off with --quick)",
    )
    ap.add_argument("--budget-s", type=float, help="runtime budget: no case starts after it")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument("--probe", help=argparse.SUPPRESS)  # internal: one memory probe
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe:
        print(json.dumps(child(json.loads(args.probe))))
        return 0
    if args.list or not args.suite:
        for name in suite_names():
            print(f"{name:12s} {load_suite(name).title}")
        return 0
    suite = load_suite(args.suite)
    out_json = args.json or (json_path(args.out, suite.name) if args.out else None)
    if args.from_json:
        results = Results.read(args.from_json)
    else:
        reason = None if args.dry_run else suite.requires()
        if reason:
            print(f"benchmarks: {suite.name} {reason}", file=sys.stderr)
            return 2
        if args.threads:
            torch.set_num_threads(args.threads)

        def checkpoint(results: Results) -> None:
            if out_json is not None:
                out_json.parent.mkdir(parents=True, exist_ok=True)
                out_json.write_text(results.to_json())

        options = Options(
            mode="quick" if args.quick else "full",
            gate=args.gate or ("off" if args.quick or args.dry_run else "wait"),
            dry_run=args.dry_run,
            budget_s=args.budget_s,
            command=shlex.join(["python", "-m", "benchmarks.run", *(argv or sys.argv[1:])]),
            checkpoint=checkpoint,
        )
        results = run(suite, options)
        checkpoint(results)
    body = render(suite, results)
    if args.out is None:
        print(body)
        return 0
    write_section(args.out, suite.name, body)
    if args.from_json and out_json.resolve() != args.from_json.resolve():
        out_json.write_text(results.to_json())  # the figures travel with their section
    print(f"wrote section {suite.name!r} of {args.out} and {out_json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
