"""The demo's `index.html` as a page a learner reads: a table of contents whose links land on
their sections, the terminal's prose in paragraphs that wrap (the FlashAttention sentence is
read to its end), its tables in boxes that scroll sideways by themselves, pictures no wider than
the page; at 1280×800 and 1920×1080, in English and Chinese. The report is built from cheap
sections (no model is loaded); each browser check is also run on a page broken on purpose, and
must fail there.

Browser tests skip without Playwright or Chromium, unless QKV_REQUIRE_BROWSER=1 (CI)."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from qkv.inspect import bench, chapter, demo

from .test_viewer_browser import _browser, unreachable

FLASH = "never holds the N × N matrix"
SVG = (
    '<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">'
    '<rect width="{w}" height="{h}" fill="#9cf"/></svg>'
)
ZH_FLASH = "从不保存 N × N 矩阵"


def _paragraphs(page_html: str) -> list[str]:
    return [
        html.unescape(re.sub(r"<[^>]+>", "", p))
        for p in re.findall(r"<p[^>]*>(.*?)</p>", page_html)
    ]


def _tables(page_html: str) -> list[str]:
    return [
        html.unescape(t)
        for t in re.findall(r'<pre class="table"[^>]*>(.*?)</pre>', page_html, re.S)
    ]


# ------------------------------------------------------------------- printed text as a page


def test_prose_wraps_as_paragraphs_and_tables_keep_their_columns():
    long = demo.blocks(chapter.long_context([], "en"))
    sentence = [p for p in _paragraphs(long) if FLASH in p]
    assert len(sentence) == 1 and sentence[0].endswith("compiled kernels).")  # whole, in a <p>
    maps = [t for t in _tables(long) if "##++++++++++++++" in t]
    assert len(maps) == 1 and maps[0].count("\n") == 16  # the tile maps: a header, 16 rows
    assert any(p.startswith("3. BigBird") for p in _paragraphs(long))  # an item, not a row
    assert ZH_FLASH in " ".join(_paragraphs(demo.blocks(chapter.long_context([], "zh"))))

    block = demo.blocks(chapter.transformer_block(lang="en"))
    (rows,) = _tables(block)
    assert rows.startswith("  x  ") and "FFN: Linear 8 → 32, GELU  (1, 4, 32)" in rows
    assert _paragraphs(block)[0].startswith("The next chapter stacks attention")

    visual = _paragraphs(demo.blocks(chapter.visual_tokens("en")))
    assert any("grows with its square. Qwen2-VL" in p for p in visual)  # a wrapped sentence
    assert "<code>qkv tokens --image WxH</code>" in demo.blocks(chapter.visual_tokens("en"))


def test_wrapped_lines_join_as_their_language_writes():
    en = "a sentence long enough to have been wrapped by the terminal at this\nword, then more."
    zh = (
        "一个很长的句子在终端里被折成两行，两行之间不该出现空格，因为中文\n词语之间本来就没有空格。"
    )
    assert _paragraphs(demo.blocks(en)) == [en.replace("\n", " ")]
    assert _paragraphs(demo.blocks(zh)) == [zh.replace("\n", "")]
    mixed = "每一项最终都是 exp(s − 最终最大值)，所以最后 O = acc / l 恰好等于\nsoftmax(S) V。"
    assert _paragraphs(demo.blocks(mixed)) == [mixed.replace("\n", " ")]  # 中文 and Latin
    listed = "Two items:\n- the first item of a list that is long enough to be wrapped ok\n- two"
    assert _paragraphs(demo.blocks(listed)) == listed.splitlines()  # items stay apart
    assert _tables(demo.blocks("<b>  x  </b>\n  1  2")) == ["<b>  x  </b>\n  1  2"]  # escaped


def _report(out: Path, lang: str = "en", wide: bool = True) -> demo.Report:
    """A report of cheap real sections (the formula, the chapter's texts) and, with `wide`, a
    table and a picture wider than any screen (in the sections "backends" and "cost")."""
    r = demo.Report(out, bench.QUICK, False, lambda _: None, lang=lang)
    demo._formula(r)
    for section in (demo._long_context, demo._visual_tokens, demo._block):
        section(r)
    if wide:
        rows = ["  " + "  ".join(f"{k * j:>6}" for k in range(40)) for j in range(4)]
        sentence = "A sentence " + "that goes on " * 40 + "and ends."
        r.add(
            "backends", demo.blocks("\n".join(["A table wider than any screen:", *rows, sentence]))
        )
        svg = SVG.format(w=3000, h=80)
        (out / "wide.svg").write_text(svg, encoding="utf-8")
        r.add("cost", '<p><img src="wide.svg" alt="wide"></p>')
    return r


def test_the_page_has_a_table_of_contents_that_names_each_section(tmp_path):
    r = _report(tmp_path)
    page = demo.page(r, 12.0)
    ids = re.findall(r'<section id="([\w-]+)">', page)
    assert ids == ["formula", "long", "visual", "block", "backends", "cost"]
    links = re.findall(r'<li><a href="#([\w-]+)">(\d+)\. ', page)
    assert [i for i, _ in links] == ids and [int(n) for _, n in links] == list(range(1, 7))
    titles = re.findall(r"<h2>\d+\. (.+?)</h2>", page)  # what the demo's CLI tests read
    assert titles[0] == "The formula, step by step" and len(titles) == 6
    assert "<nav" in page and '<meta name="viewport"' in page
    zh = demo.page(_report(tmp_path, "zh", wide=False), 12.0)
    assert "<b>目录</b>" in zh and "<h2>1. 逐步演算公式</h2>" in zh


def test_the_flash_walk_follows_the_cost_and_every_sentence_is_in_both_languages():
    assert demo.SECTIONS.index(demo._flash) == demo.SECTIONS.index(demo._cost) + 1
    assert demo.TEXT["en"].keys() == demo.TEXT["zh"].keys()
    assert demo.CHECK["en"].keys() == demo.CHECK["zh"].keys()


def test_the_flash_section_prints_the_walk_and_writes_its_page(tmp_path):
    from qkv.inspect.flash_text import render_walk

    for lang in ("en", "zh"):
        lines: list[str] = []
        r = demo.Report(tmp_path / lang, bench.QUICK, False, lines.append, lang=lang)
        r.out.mkdir()
        demo._flash(r)
        assert lines[-1] == render_walk(lang=lang)
        assert (r.out / "flash.html").stat().st_size > 0
        (section,) = r.sections
        assert section.anchor == "flash" and 'href="flash.html"' in section.body
        assert section.title == demo.TEXT[lang]["flash"]


def _fake(r: demo.Report) -> None:
    r.heading("formula")
    r.add("formula", "<p>done</p>")


def _stopped(r: demo.Report) -> None:
    _fake(r)
    raise KeyboardInterrupt


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_last_line_is_in_the_reports_language(tmp_path, monkeypatch, lang):
    monkeypatch.setattr(demo, "check_requirements", lambda: None)
    lines: list[str] = []
    index = demo.run(tmp_path / "a", sections=[_fake], echo=lines.append, lang=lang)
    done = {"en": "qkv demo finished in ", "zh": "qkv demo 已完成，用时 "}[lang]
    assert lines[-1].strip().startswith(done) and lines[-1].endswith(str(index.resolve()))
    with pytest.raises(KeyboardInterrupt):
        demo.run(tmp_path / "b", sections=[_stopped], echo=lines.append, lang=lang)
    stopped = {"en": "qkv demo interrupted after ", "zh": "qkv demo 在 "}[lang]
    assert lines[-1].strip().startswith(stopped)
    if lang == "zh":
        assert "秒后被中断；已完成的部分：" in lines[-1]
    assert "<section" in (tmp_path / "b" / "index.html").read_text(encoding="utf-8")


def test_the_backends_check_names_return_lse_in_chinese():
    zh = demo.backends_check(n=32, lang="zh")
    picks = [line for line in zh.splitlines() if "`auto`" in line]
    why = "`auto` 选了哪个后端，为什么（下面的理由来自 qkv.dispatch，只有英文）："
    assert picks == [why, f"return_lse=True 时，{why}"]
    assert "with return_lse" not in zh
    assert "What `auto` picks with return_lse=True and why:" in demo.backends_check(n=32)


# ------------------------------------------------------------------------- in a browser


TOC_JS = """() => {
  const bad = [];
  const links = [...document.querySelectorAll("nav.toc a")];
  const sections = [...document.querySelectorAll("section")];
  if (!links.length || links.length !== sections.length) bad.push("links ≠ sections");
  for (const a of links) {
    const id = (a.getAttribute("href") || "").replace(/^#/, "");
    const target = id && document.getElementById(id);
    if (!target || target.tagName !== "SECTION" || !target.querySelector("h2"))
      bad.push("no section for " + a.getAttribute("href"));
  }
  return bad;
}"""


def _toc_problems(page) -> list[str]:
    """What is wrong with the table of contents: a link without its section (or none at all)."""
    return page.evaluate(TOC_JS)


def _cut_lines(page) -> list[str]:
    """The preformatted boxes of the real sections whose lines do not fit (they would be read
    only by scrolling): none may be, even at 1280 px; only the made-up wide table scrolls."""
    return page.eval_on_selector_all(
        "section:not(#backends) pre",
        "ps => ps.filter(p => p.scrollWidth > p.clientWidth + 1).map(p => p.textContent)",
    )


def _whole(page, phrase: str) -> bool:
    """Whether the paragraph holding `phrase` is shown whole: a <p> that wraps inside the
    window (not a line of a box that scrolls)."""
    return page.evaluate(
        """phrase => {
          const el = [...document.querySelectorAll("p, pre")]
            .find(e => e.textContent.includes(phrase));
          const r = el.getBoundingClientRect();
          return el.tagName === "P" && el.scrollWidth <= el.clientWidth + 1
            && r.left >= 0 && r.right <= document.documentElement.clientWidth;
        }""",
        phrase,
    )


def _open(p, chromium, path: Path, width: int, height: int):
    browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
    page = browser.new_page(viewport={"width": width, "height": height})
    requests, errors = [], []
    page.on("request", lambda q: requests.append(q.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    return browser, page, requests, errors


def _write(out: Path, lang: str) -> Path:
    out.mkdir()
    index = out / "index.html"
    index.write_text(demo.page(_report(out, lang), 12.0), encoding="utf-8")
    return index


@pytest.mark.slow
@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_report_reads_on_a_laptop_and_on_a_wide_screen(tmp_path, lang):
    sync_playwright, chromium = _browser()
    index = _write(tmp_path / "demo", lang)
    with sync_playwright() as p:
        for width, height in [(1280, 800), (1920, 1080)]:
            browser, page, requests, errors = _open(p, chromium, index, width, height)
            assert unreachable(page) == [], (width, unreachable(page))
            assert page.evaluate("document.documentElement.scrollWidth") <= width
            assert _cut_lines(page) == [], width
            assert _whole(page, FLASH if lang == "en" else ZH_FLASH), width
            wide = page.query_selector("#backends pre")  # the made-up table scrolls in its box
            assert wide.evaluate("b => b.scrollWidth > b.clientWidth")
            img = page.query_selector("#cost img").bounding_box()
            assert img["x"] + img["width"] <= width
            assert _toc_problems(page) == []
            nav = page.query_selector("nav.toc").bounding_box()
            main = page.query_selector("section").bounding_box()
            if width == 1920:  # the contents stay beside the text, clear of it
                assert nav["x"] + nav["width"] <= main["x"]
            page.click('nav.toc a[href="#long"]')
            top = page.evaluate("document.getElementById('long').getBoundingClientRect().top")
            assert 0 <= top <= 40, top  # the link lands on its section
            page.screenshot(path=str(tmp_path / f"{lang}-{width}.png"), full_page=True)
            browser.close()
            assert errors == []
            assert all(u.startswith("file:") for u in requests), requests


def test_the_checks_fail_on_pages_broken_on_purpose(tmp_path, monkeypatch):
    """Each check of the report above, on a page broken on purpose: the tables' boxes that no
    longer scroll, a table of contents whose anchors are gone, and the old page (every text in
    one preformatted box: the FlashAttention sentence cut behind a scrollbar at 1920 px)."""
    sync_playwright, chromium = _browser()
    index = _write(tmp_path / "demo", "en")
    text = index.read_text(encoding="utf-8")
    no_scroll = tmp_path / "demo" / "no-scroll.html"
    assert "overflow-x: auto; border-radius: 4px;" in text
    no_scroll.write_text(text.replace("overflow-x: auto; border-radius: 4px;", ""), "utf-8")
    no_ids = tmp_path / "demo" / "no-ids.html"
    no_ids.write_text(re.sub(r'<section id="[\w-]+">', "<section>", text), "utf-8")
    monkeypatch.setattr(demo, "blocks", lambda t: f'<pre class="table">{html.escape(t)}</pre>')
    old = tmp_path / "old"
    old.mkdir()
    (old / "index.html").write_text(demo.page(_report(old, "en"), 12.0), encoding="utf-8")
    with sync_playwright() as p:
        browser, page, _, _ = _open(p, chromium, no_scroll, 1280, 800)
        assert any("pre" in bad for bad in unreachable(page))
        browser.close()
        browser, page, _, _ = _open(p, chromium, no_ids, 1280, 800)
        assert len(_toc_problems(page)) == 6
        browser.close()
        browser, page, _, _ = _open(p, chromium, old / "index.html", 1920, 1080)
        assert not _whole(page, FLASH) and _cut_lines(page)
        browser.close()
