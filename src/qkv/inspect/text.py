"""Text for a terminal: how many columns a string takes, and padding by that.

A wide character (Chinese, Japanese, Korean, most emoji: Unicode's East Asian width W or F)
takes two columns and a combining mark none, so `str.ljust` and format widths, which count
characters, misalign every table with Chinese in it. Pad with these instead."""

from __future__ import annotations

import unicodedata


def columns(text: str) -> int:
    """Columns `text` takes in a terminal: wide characters two, combining marks none."""
    return sum(
        0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
        for c in text
    )


def ljust(text: object, width: int) -> str:
    """`text` then spaces up to `width` columns."""
    s = str(text)
    return s + " " * max(width - columns(s), 0)


def rjust(text: object, width: int) -> str:
    """Spaces up to `width` columns, then `text`."""
    s = str(text)
    return " " * max(width - columns(s), 0) + s


def row(cells: tuple | list, widths: tuple[int, ...], indent: str = "  ") -> str:
    """One table line: each cell right-aligned in its width, one space apart."""
    return indent + " ".join(rjust(c, w) for c, w in zip(cells, widths, strict=True))
