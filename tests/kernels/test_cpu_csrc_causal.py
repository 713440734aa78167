"""The compiled kernel's C++ never writes the causal rule (issue 53): which pairs may attend is
decided in Python (`qkv.layout`, `qkv.sparse`, the masks), and the C++ layout builders read the
result as intervals (each query row's reachable keys, the last key each row sees). Reads the
sources only (builds nothing).

What counts as writing the rule, comments left out:

- the word `causal` anywhere in code or in a string (a flag, a parameter, an op's schema);
- the bottom-right diagonal, a key length minus a query length (`nk - nq`, `P.Nk - P.Nq`,
  `kv_len - q_len`), in a statement that compares or clamps (`<`, `<=`, `>`, `>=`, `min`,
  `max`), or held in a variable that such a statement reads. The position the ALiBi distance is
  measured from (`qpos = r + Nk - Nq`, never compared) is not the rule and stays."""

from __future__ import annotations

import re

from .csrc_shape import CSRC, _strip_comments

WORD = re.compile(r"causal", re.I)
_LEN = r"(?:\w+(?:\.|->))?"  # an optional owner: P.Nk, p->nk
DIAGONAL = re.compile(rf"\b{_LEN}(?:nk|n_k|kv_len|k_len)\s*-\s*{_LEN}(?:nq|n_q|q_len)\b", re.I)
ASSIGNED = re.compile(r"^\s*(?:[\w:<>,\s*&]+\s)?(\w+)\s*=(?!=)")  # `[const T] name = …`
TEMPLATE = re.compile(r"<[\w:\s,*]*>")  # std::min<int64_t>, data_ptr<int64_t>
ORDERS = re.compile(r"[<>]=?|\b(?:min|max)\s*\(")


def _statements(text: str) -> list[tuple[int, str]]:
    """(line, text) of each statement of a C++ source, comments dropped: the code between `;`,
    `{` and `}`, so a condition and what it guards stay together."""
    code = "\n".join(_strip_comments(text))
    out, start = [], 0
    for m in re.finditer(r"[;{}]|$", code):
        piece = code[start : m.start()]
        if piece.strip():
            first = start + len(piece) - len(piece.lstrip())
            out.append((code.count("\n", 0, first) + 1, piece))
        start = m.end()
    return out


def _orders(statement: str) -> bool:
    """Whether a statement compares or clamps (template brackets, shifts and arrows aside)."""
    s = statement.replace("->", ".")
    while TEMPLATE.search(s):
        s = TEMPLATE.sub("", s)
    s = re.sub(r"<<=?|>>=?", " ", s)
    return bool(ORDERS.search(s))


def causal_writing(text: str) -> list[tuple[int, str]]:
    """(line, what) wherever C++ source `text` writes the causal rule (module docstring)."""
    found = []
    statements = _statements(text)
    held = set()  # variables that hold the diagonal
    for line, s in statements:
        if WORD.search(s):
            found.append((line, "names causal"))
        m = ASSIGNED.match(s)
        if m and DIAGONAL.search(s[m.end() :]):
            held.add(m.group(1))
    uses = re.compile(rf"\b(?:{'|'.join(map(re.escape, sorted(held)))})\b") if held else None
    for line, s in statements:
        if not _orders(s):
            continue
        if DIAGONAL.search(s) or (uses is not None and uses.search(s)):
            found.append((line, "compares with the diagonal"))
    return sorted(found)


def test_the_csrc_never_writes_the_causal_rule():
    found = [
        f"{path.name}:{line} {what}"
        for path in sorted(CSRC.iterdir())
        if path.suffix in (".h", ".cpp")
        for line, what in causal_writing(path.read_text())
    ]
    assert not found, "\n".join(found)


def test_the_check_sees_the_rule_written_out():
    # the forms the layout builders used before issue 53, and the ways around a first check
    planted = """
  bool causal;
  if (causal) b = std::min(b, r + nk - nq);
  const int64_t shift = nk - nq;  // row r sits at key position r + shift
  if (k_lo > r1 - 1 + shift) continue;
  bits = span_bits(first, std::min<int64_t>(end, r + shift), first);
  const bool whole = k_hi <= r0 + p->kv_len - p->q_len;
  m.def("tile_layout(Tensor? lo, int block_q, bool is_causal) -> Tensor");
"""
    assert causal_writing(planted) == [
        (2, "names causal"),
        (3, "compares with the diagonal"),
        (3, "names causal"),
        (5, "compares with the diagonal"),
        (6, "compares with the diagonal"),
        (7, "compares with the diagonal"),
        (8, "names causal"),
    ]


def test_the_check_passes_what_is_not_the_rule():
    fine = """
  // causal: row r sees keys up to r + nk - nq, so min(b, r + nk - nq) was the clamp
  /* if (causal) b = std::min(b, r + nk - nq); */
  w.qpos[R] = x.r0 + r + P.Nk - P.Nq;  // the ALiBi distance's origin
  const int64_t span = nk - nq;
  out[r] = uint64_t(1) << (span & 63);
  const int64_t a = std::max<int64_t>(lo[k * nq + r], 0), b = std::min(hi[r], nk - 1);
  std::vector<std::pair<int64_t, int64_t>> spans;
"""
    assert causal_writing(fine) == []
