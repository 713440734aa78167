"""`qkv lab NAME`: run one of the chapter's labs, print its answer, write its figure and JSON.

    qkv lab rnn                      # the quick run (the default; its time: docs/labs.md)
    qkv lab scale --full --lang zh   # the longer run, its answer in Chinese
    qkv lab routing --json -         # stdout: the JSON document alone (the answer on stderr)
    qkv lab sparse --out figures     # the figure as figures/sparse.png

Outputs (`--json`, `--out`) are checked before the lab runs.
"""

from __future__ import annotations

import argparse
import importlib
import warnings
from pathlib import Path

from ..inspect.outputs import STDOUT, check_file, check_folder, say_to, write_json
from ..inspect.seeds import LAB_SEED_MAX, seed_arg
from . import LABS
from .common import LANGS, pick

# said instead of argparse's "the following arguments are required: name" (`qkv.cli` reads a
# parser's `required_message`)
NO_NAME = (
    f"qkv lab needs a lab's name: {', '.join(LABS[:-1])} or {LABS[-1]} (e.g. qkv lab {LABS[0]})"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.required_message = NO_NAME  # type: ignore[attr-defined]  # qkv.cli's parser (a layer up)
    p.add_argument("name", choices=LABS, help="which lab: " + ", ".join(LABS))
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the short run (default)")
    size.add_argument("--full", action="store_true", help="the longer run, smoother curves")
    p.add_argument("--lang", choices=LANGS, default="en", help="en or zh (Chinese)")
    p.add_argument("--json", metavar="FILE", help="write the measurements as JSON ('-': stdout)")
    p.add_argument("--out", default="qkv-lab", help="folder for the figure NAME.png")
    p.add_argument("--no-files", action="store_true", help="print only; write no figure")
    p.add_argument(
        "--seed", type=seed_arg(LAB_SEED_MAX), default=0, help="random seed, 0..2**32-1 (default 0)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


SAID = {
    "en": {"json": "measurements: {path}", "figure": "figure: {path}", "note": "note: {note}"},
    "zh": {"json": "测量结果：{path}", "figure": "图：{path}", "note": "注意：{note}"},
}


def run(args: argparse.Namespace) -> None:
    if args.json:
        check_file(args.json, "--json", allow_stdout=True)
    out = None if args.no_files else check_folder(args.out, "--out")
    if out is not None:
        from ..inspect.figures import new_figure

        new_figure(1, 1)  # matplotlib missing: say so now (exit 1), not after the run
    lab = importlib.import_module(f"qkv.labs.{args.name}")
    preset = lab.FULL if args.full else lab.QUICK
    say = say_to(args.json)
    t = pick(SAID, args.lang)
    doc = lab.run(preset, seed=args.seed, progress=not args.no_progress)
    say(lab.summary(doc, args.lang))
    if args.json:
        write_json(doc, args.json, indent=1)
        if args.json != STDOUT:
            say(t("json", path=args.json))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        path = Path(out) / f"{args.name}.png"
        note = _draw(lab, doc, path, args.lang)
        say(t("figure", path=path))
        if note:
            say(t("note", note=note))


def _draw(lab, doc: dict, path: Path, lang: str) -> str | None:
    """Write the lab's figure in `lang`; return what to say when Chinese had to be drawn in
    English (no CJK font), said as a note rather than as a Python warning."""
    from ..inspect.figures import FontWarning, font_note

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FontWarning)
        lab.figure(doc, path, lang=lang)
    return font_note(lang)
