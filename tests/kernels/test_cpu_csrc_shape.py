"""The compiled kernel's C++ keeps the shape issue 39 gave it: little repeated code, no long
function, and every file in the build's hash. Reads the sources only (builds nothing)."""

from __future__ import annotations

from qkv.kernels.cpu import build

from .csrc_shape import CSRC, duplicates, functions

MAX_PAIRS = 3
MAX_LINES = 120


def test_repeated_code_stands_in_at_most_three_pairs_of_places():
    pairs = duplicates()
    rows = [f"{a} ~ {b}: {runs[0]}" for (a, b), runs in pairs.items()]
    assert len(pairs) <= MAX_PAIRS, "\n".join(rows)


def test_no_function_is_longer_than_120_lines():
    long = [
        f"{f}:{first} {name}: {last - first + 1} lines"
        for f, name, first, last in functions()
        if last - first + 1 > MAX_LINES
    ]
    assert not long, "\n".join(long)


def test_the_build_hashes_every_source_file():
    # a header left out of HEADERS would not rebuild the kernel when it changes
    files = {p.name for p in CSRC.iterdir() if p.suffix in (".h", ".cpp")}
    assert files == set(build.SOURCES) | set(build.HEADERS)
