"""Every relative link in README.md and docs/*.md leads somewhere: the file exists, and an
anchor names a heading of that file by GitHub's slug rules (duplicates get -1, -2, ...)."""

from __future__ import annotations

import re
import sys
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose(path: Path) -> list[str]:
    """The file's lines with fenced code blanked (links in code are not links)."""
    out, inside = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            inside = not inside
            out.append("")
        else:
            out.append("" if inside else re.sub(r"`[^`]*`", "", line))
    return out


def slug(heading: str) -> str:
    t = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    t = re.sub(r"<[^>]+>", "", t).replace("`", "").replace("*", "").strip().lower()
    t = "".join(c for c in t if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return t.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m and not FENCE.match(line):
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(files: list[Path]) -> list[str]:
    bad = []
    for f in files:
        for no, line in enumerate(prose(f), 1):
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto:
                    continue
                part, _, anchor = target.partition("#")
                dest = (f.parent / part).resolve() if part else f
                where = f"{f.relative_to(ROOT)}:{no}"
                if not dest.exists():
                    bad.append(f"{where}: no file {target}")
                elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                    bad.append(f"{where}: no heading for #{anchor} in {part or f.name}")
    return bad


def test_every_link_in_the_docs_leads_somewhere():
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert broken_links(files) == []


def test_a_broken_link_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# The `b` page\n## Two words\n## Two words\n")
    page.write_text(
        "[ok](b.md#the-b-page) [ok](b.md#two-words-1) [bad](b.md#three) [gone](c.md)\n"
        "```\n[in code](nowhere.md)\n```\n"
    )
    assert broken_links([page]) == ["a.md:1: no heading for #three in b.md", "a.md:1: no file c.md"]
