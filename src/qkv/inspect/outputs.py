"""Where a command's results go, checked before the work is done.

A benchmark or a model run can take minutes; a bad `--json`, `--png` or `--out` must be refused
before it starts, in one line, not with a traceback after it ends. Each check tries what the
write will do (create the file in its folder, then remove it again) rather than guess from
permission bits, so read-only file systems and /proc are caught as well as missing folders.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import tempfile
import unicodedata
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
    check_name_lengths(path, option)
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
    check_name_lengths(path, option)
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


def terminal_safe(text: str) -> str:
    """`text` safe for a terminal: control characters (escape sequences, bells, carriage
    returns: what could retitle a terminal or hide a line) written as `\\x1b`, `\\x07`, ...;
    newlines and tabs kept."""
    return "".join(
        f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc" and c not in "\n\t" else c
        for c in text
    )


def say_to(json_target: str | Path | None):
    """Where human-readable text goes: stdout, or stderr when stdout carries the JSON; control
    characters of the user's text shown escaped (`terminal_safe`)."""
    stream = sys.stderr if json_target is not None and str(json_target) == STDOUT else None

    def say(*parts: object) -> None:
        print(*(terminal_safe(str(p)) for p in parts), file=stream or sys.stdout)

    return say


NAME_MAX = 255  # bytes in one file or folder name (Linux, macOS; pathconf says where it can)
SLUG_MAX = 40  # characters of a word kept in a file name made from it


def slug(word: str) -> str:
    """A file-name part made from a user's word: letters and digits kept, anything else `_`, at
    most `SLUG_MAX` characters; a longer (or empty) result ends with 8 hex digits of the word's
    hash, so that two long words do not share a file."""
    base = "".join(c if c.isalnum() else "_" for c in word.lower())
    if 0 < len(base) <= SLUG_MAX:
        return base
    digest = hashlib.sha1(word.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{base[: SLUG_MAX - 9]}_{digest}" if base else digest


def check_name_lengths(path: str | Path, option: str) -> None:
    """Raise `OutputError` when a part of `path` is longer than a file name may be."""
    for part in Path(path).parts:
        size = len(part.encode("utf-8", "surrogateescape"))
        if size > NAME_MAX:
            raise OutputError(
                f"{option}: a name of {size} bytes ({part[:24]!r}…); a file or folder name may "
                f"have at most {NAME_MAX}"
            )
