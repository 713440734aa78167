"""The compiled kernel's C++ keeps the shape issue 39 gave it: little repeated code, no long
function, and every file in the build's hash; and its includes run one way (issue 53). Reads
the sources only (builds nothing)."""

from __future__ import annotations

import re

from qkv.kernels.cpu import build

from .csrc_shape import CSRC, _strip_comments, duplicates, functions

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


def _includes(name: str) -> list[str]:
    """The files of csrc that `name` includes by name (`#include "…"`)."""
    return re.findall(r'^\s*#include "([^"]+)"', (CSRC / name).read_text(), re.M)


def test_no_file_includes_one_that_includes_it_back():
    # a file's includes (and theirs, on down) never reach the file again: the arrows run one way
    cycles = []
    for start in (p.name for p in CSRC.iterdir() if p.suffix in (".h", ".cpp")):
        seen, todo = set(), list(_includes(start))
        while todo:
            name = todo.pop()
            if name not in seen and (CSRC / name).exists():
                seen.add(name)
                todo += _includes(name)
        if start in seen:
            cycles.append(start)
    assert not cycles, f"included again by what they include: {cycles}"


def test_kernel_h_only_includes_the_kernel_s_parts():
    # what the parts share lives in a header of its own, included before them (worker.h,
    # unit_choice.h), never in kernel.h above the parts that use it
    code = [line.strip() for line in _strip_comments((CSRC / "kernel.h").read_text())]
    assert [line for line in code if line and not line.startswith("#include")] == []
