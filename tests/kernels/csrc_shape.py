"""The shape of the compiled kernel's C++ sources: repeated code and function lengths.

    python -m tests.kernels.csrc_shape [-v] [FOLDER]

FOLDER defaults to src/qkv/kernels/cpu/csrc; -v lists every repeated run, not only the longest.

- `duplicates`: runs of RUN (6) or more lines of the same shape, in two places of one file or of
  two files. A line's shape is its code with comments dropped, white space folded and every
  name, number and string replaced by a placeholder (keywords and punctuation kept); blank
  lines, lone punctuation, lines of string text alone, preprocessor includes and pragmas are
  passed over. A run that stands in more than COMMON (8) places, or whose lines take at most 2
  shapes (a list: struct fields, assignments, `case` labels), is boilerplate, not a copy, and is
  not counted. A pair of places is a pair of files (or a file with itself): its row gives the
  longest run and how many more the two share.
- `functions`: every function body (free or member; macros are passed over) with its length in
  lines, from the line its declaration starts on to its closing brace.

test_cpu_csrc_shape.py holds the kernel to its limits (issue 39): at most 3 pairs of places,
no function over 120 lines.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "src" / "qkv" / "kernels" / "cpu" / "csrc"
RUN = 6
COMMON = 8
KEYWORDS = frozenset(
    [
        "if",
        "else",
        "for",
        "while",
        "do",
        "switch",
        "case",
        "default",
        "break",
        "continue",
        "return",
        "goto",
        "static",
        "inline",
        "const",
        "constexpr",
        "struct",
        "class",
        "enum",
        "union",
        "namespace",
        "template",
        "typename",
        "using",
        "sizeof",
        "alignas",
        "true",
        "false",
        "nullptr",
        "auto",
        "void",
        "bool",
        "char",
        "int",
        "long",
        "unsigned",
        "signed",
        "short",
        "float",
        "double",
        "new",
        "delete",
        "this",
        "operator",
        "public",
        "private",
        "protected",
    ]
)
_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|[A-Za-z_]\w*|\d[\w.]*|\S')


def _strip_comments(text: str) -> list[str]:
    """The file's lines with comments blanked (line structure kept)."""
    out, in_block = [], False
    for line in text.splitlines():
        res, i = [], 0
        while i < len(line):
            if in_block:
                end = line.find("*/", i)
                if end < 0:
                    i = len(line)
                else:
                    in_block, i = False, end + 2
            elif line.startswith("//", i):
                break
            elif line.startswith("/*", i):
                in_block, i = True, i + 2
            elif line[i] in "\"'":
                m = _TOKEN.match(line, i)
                tok = m.group(0) if m else line[i]
                res.append(tok)
                i += len(tok)
            else:
                res.append(line[i])
                i += 1
        out.append("".join(res))
    return out


def _shape(line: str) -> str | None:
    """A line's shape, or None for a line that is passed over."""
    s = line.strip()
    if not s or s.startswith("#include") or s.startswith("#pragma"):
        return None
    toks = _TOKEN.findall(s)
    if all(not (t[0].isalnum() or t[0] == "_") for t in toks):
        return None  # lone punctuation (braces, `};`) or the text of a string continued
    shape = []
    for t in toks:
        if t[0] in "\"'":
            shape.append("S")
        elif t[0].isdigit():
            shape.append("N")
        elif t[0].isalpha() or t[0] == "_":
            shape.append(t if t in KEYWORDS else "I")
        else:
            shape.append(t)
    return " ".join(shape)


def _sources(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.suffix in (".h", ".cpp", ".cc", ".hpp"))


def duplicates(root: Path = CSRC, run: int = RUN, common: int = COMMON):
    """`{(file_a, file_b): [(lines_a, lines_b, length), …]}` (longest first): runs of `run`+
    lines of the same shape; lines as (first, last), 1-based."""
    files = {}  # name -> [(line number, shape)]
    for path in _sources(root):
        lines = _strip_comments(path.read_text())
        files[path.name] = [(n + 1, s) for n, line in enumerate(lines) if (s := _shape(line))]
    where = defaultdict(list)  # window of `run` shapes -> [(file, index)]
    for name, seq in files.items():
        for i in range(len(seq) - run + 1):
            where[tuple(s for _, s in seq[i : i + run])].append((name, i))
    starts = set()  # (file_a, i, file_b, j): a window that matches
    for places in where.values():
        if len(places) < 2 or len(places) > common:
            continue
        for x in range(len(places)):
            for y in range(x + 1, len(places)):
                (fa, i), (fb, j) = sorted((places[x], places[y]))
                if fa == fb and j - i < run:
                    continue  # a window matching itself shifted: one place, not two
                starts.add((fa, i, fb, j))
    pairs = defaultdict(list)
    for fa, i, fb, j in starts:
        if (fa, i - 1, fb, j - 1) in starts:
            continue  # not the first window of its run
        n = 1
        while (fa, i + n, fb, j + n) in starts:
            n += 1
        length = n + run - 1
        sa, sb = files[fa], files[fb]
        if len({s for _, s in sa[i : i + length]}) <= 2:
            continue  # a list of one or two shapes: boilerplate
        pairs[(fa, fb)].append(
            ((sa[i][0], sa[i + length - 1][0]), (sb[j][0], sb[j + length - 1][0]), length)
        )
    for runs in pairs.values():
        runs.sort(key=lambda r: -r[2])
    return dict(sorted(pairs.items(), key=lambda kv: -kv[1][0][2]))


_SCOPE = re.compile(r"\b(namespace|struct|class|enum|union)\b|extern\s*\"C\"")


def functions(root: Path = CSRC):
    """`[(file, name, first line, last line)]` of every function body in the sources."""
    found = []
    for path in _sources(root):
        lines = _strip_comments(path.read_text())
        stack = []  # per open brace: "scope", "function", or "block"
        head, head_line, in_macro = "", None, False
        fn_start = fn_name = None
        for n, line in enumerate(lines, 1):
            if in_macro or line.lstrip().startswith("#"):
                in_macro = line.rstrip().endswith("\\")
                continue
            for ch in line:
                if ch == "{":
                    if "function" in stack or "block" in stack:
                        stack.append("block")
                    elif _SCOPE.search(head) and "(" not in head.split("=")[0]:
                        stack.append("scope")
                    elif ")" in head:
                        stack.append("function")
                        m = re.findall(r"([~\w:]+)\s*\(", head)
                        fn_name, fn_start = (m[0] if m else "?"), head_line
                    else:
                        stack.append("block")  # an initializer list, a lambda at scope
                    head, head_line = "", None
                elif ch == "}":
                    kind = stack.pop() if stack else "scope"
                    if kind == "function":
                        found.append((path.name, fn_name, fn_start, n))
                    head, head_line = "", None
                elif ch == ";" and not ("function" in stack or "block" in stack):
                    head, head_line = "", None
                else:
                    if head_line is None and not ch.isspace():
                        head_line = n
                    head += ch
            head += " "
    return found


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    argv = [a for a in argv if a != "-v"]
    root = Path(argv[0]) if argv else CSRC
    pairs = duplicates(root)
    print(f"{len(pairs)} pairs of places share runs of {RUN}+ lines of the same shape")
    for k, ((fa, fb), runs) in enumerate(pairs.items(), 1):
        (a0, a1), (b0, b1), length = runs[0]
        more = f" (+{len(runs) - 1} more runs)" if len(runs) > 1 else ""
        print(f"D{k} {fa}:{a0}-{a1} ~ {fb}:{b0}-{b1} [{length} lines]{more}")
        for (a0, a1), (b0, b1), length in runs[1:] if verbose else ():
            print(f"     {fa}:{a0}-{a1} ~ {fb}:{b0}-{b1} [{length} lines]")
    fns = sorted(functions(root), key=lambda f: f[2] - f[3])
    print(f"{len(fns)} functions; the longest:")
    for name, fn, first, last in fns[:8]:
        print(f"  {last - first + 1:4d} lines  {name}:{first}  {fn}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
