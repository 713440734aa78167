"""Where a command's results go, checked before the work is done.

A benchmark or a model run can take minutes; a bad `--json`, `--png` or `--out` must be refused
before it starts, in one line, not with a traceback after it ends. Each check tries what the
write will do (create the file in its folder, then remove it again) rather than guess from
permission bits, so read-only file systems and /proc are caught as well as missing folders.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

STDOUT = "-"  # `--json -`: the document goes to stdout, alone


class OutputError(ValueError):
    """A place a result cannot be written to; the message names the option and the reason."""


def check_file(
    path: str | Path,
    option: str,
    *,
    allow_stdout: bool = False,
    formats: Iterable[str] | None = None,
) -> None:
    """Raise `OutputError` unless a file can be written at `path`.

    `allow_stdout`: `-` means stdout (always fine). `formats`: the allowed file extensions
    (lower case, no dot); a name without an extension is allowed (the writer picks its default).
    """
    if allow_stdout and str(path) == STDOUT:
        return
    p = Path(path)
    shown = f"{option} {str(path)!r}"
    if formats is not None and p.suffix:
        ext = p.suffix[1:].lower()
        allowed = sorted(set(formats))
        if ext not in allowed:
            raise OutputError(
                f"{shown}: unknown image format {ext!r}; use one of {', '.join(allowed)}"
            )
    if p.is_dir():
        raise OutputError(f"{shown} is a folder; give a file name")
    parent = p.parent
    if not parent.exists():
        raise OutputError(f"{shown}: the folder {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise OutputError(f"{shown}: {str(parent)!r} is a file, not a folder")
    existed = p.exists()
    try:
        with open(p, "ab"):
            pass
    except OSError as e:
        raise OutputError(f"{shown}: cannot write there ({e.strerror})") from None
    if not existed:
        with contextlib.suppress(OSError):
            p.unlink()


def check_folder(path: str | Path, option: str) -> Path:
    """Raise `OutputError` unless `path` is, or can be created as, a folder we can write in.

    Nothing is created: the nearest existing ancestor must be a folder that accepts a file."""
    p = Path(path)
    shown = f"{option} {str(path)!r}"
    if p.exists() and not p.is_dir():
        raise OutputError(f"{shown} is an existing file; give a folder")
    ancestor = p
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"{shown}: {str(ancestor)!r} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as e:
        raise OutputError(f"{shown}: cannot write in {str(ancestor)!r} ({e.strerror})") from None
    return p


def image_formats() -> set[str]:
    """The file extensions matplotlib can save a figure as (png, svg, pdf, ...)."""
    from .figures import new_figure

    return set(new_figure(1, 1).canvas.get_supported_filetypes())


def write_json(doc: object, target: str | Path, *, indent: int | None = None) -> None:
    """Write `doc` as JSON to the file `target`, or to stdout (alone, one document) for `-`."""
    text = json.dumps(doc, indent=indent)
    if str(target) == STDOUT:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return
    Path(target).write_text(text + "\n", encoding="utf-8")


def say_to(json_target: str | Path | None):
    """Where human-readable text goes: stdout, or stderr when stdout carries the JSON."""
    if json_target is not None and str(json_target) == STDOUT:
        return lambda *a: print(*a, file=sys.stderr)
    return print
