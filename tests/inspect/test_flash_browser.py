"""The FlashAttention page (`qkv explain --flash --html`, the demo's `flash.html`) in a real
headless Chromium at 1280×800: stepping through it shows `flash_steps`' numbers (the tile of S,
m, α, l, O at every step, read from the DOM's data attributes), the textbook row equals the
online one at the end, the mask switch greys exactly the tiles the kernel skips and counts the
products saved, the decoding view's merge equals the unsplit result, the page speaks Chinese,
asks nothing of the network, and has nothing wider than the screen outside a scroll box.

Each check is a function of a loaded page, and `test_each_check_fails_on_a_broken_page` runs it
on a page broken on purpose (the rescale skipped, partial tiles greyed, the merge unweighted,
no Chinese, an image from the web, no scroll boxes): a check that passed there would prove
nothing. Skipped without Playwright or Chromium, unless QKV_REQUIRE_BROWSER=1."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import pytest
import torch

from qkv import reference
from qkv.inspect.explain import walkthrough
from qkv.inspect.flash import FlashSteps, flash_steps
from qkv.inspect.flash_page import flash_html, view_masks

from .test_viewer_browser import _browser

WIDTH, HEIGHT = 1280, 800


@dataclass
class Session:
    """A loaded page and what it tried to fetch from outside (blocked)."""

    page: object
    blocked: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def html() -> str:
    return flash_html()  # N = 8, tiles of 2, seed 0, English


@pytest.fixture(scope="module")
def chromium():
    sync_playwright, path = _browser()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield browser
        browser.close()


def _open(browser, path) -> Session:
    page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
    s = Session(page)

    def route(r):
        if r.request.url.startswith(("file:", "data:", "about:")):
            r.continue_()
        else:  # nothing may leave the page
            s.blocked.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.on("pageerror", lambda e: s.errors.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_function("window.qkvFlashReady === true", timeout=10_000)
    return s


def _f(text: str) -> float | None:
    """A data-v attribute: '' is none, JavaScript's -Infinity is −inf."""
    if text == "":
        return None
    return -math.inf if text == "-Infinity" else float(text)


def _close(got, want, what: str) -> None:
    """JavaScript's float64 against torch's: the error rule's float64 clause (1e-10 of the
    magnitude; −inf exactly where the truth has it)."""
    got = torch.tensor([-math.inf if x is None else x for x in got], dtype=torch.float64)
    want = torch.as_tensor(want, dtype=torch.float64).flatten()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    inf = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), inf), (what, got, want)
    if (~inf).any():
        err = (got[~inf] - want[~inf]).abs().max().item()
        assert err <= 1e-10 * max(1.0, want[~inf].abs().max().item()), (what, err)


def _walk(n: int, tile: int, view: str) -> FlashSteps:
    causal, mask, _ = view_masks(n)[view]
    w = walkthrough(n=n)
    return flash_steps(w.Q, w.K, w.V, tile_q=tile, tile_k=tile, causal=causal, mask=mask)


def _cells(page, selector: str) -> list[dict]:
    return page.evaluate(
        "sel => [...document.querySelectorAll(sel)].map(td => ({...td.dataset}))", selector
    )


def _values(page, selector: str, f: str, **attrs) -> list[float | None]:
    rows = [c for c in _cells(page, selector) if c.get("f") == f]
    rows = [c for c in rows if all(c.get(k) == str(v) for k, v in attrs.items())]
    return [_f(c["v"]) for c in rows]


def _pos(page) -> int:
    return int(page.get_attribute("#counter", "data-pos"))


def _configure(page, n: int = 8, tile: int = 2, view: str = "dense", lang: str = "en") -> None:
    page.select_option("#lang", lang)
    page.select_option("#n", str(n))
    page.select_option("#tile", str(tile))
    page.click(f"#view-{view}")


# ------------------------------------------------------------------------------------ checks


def check_stepping(s: Session) -> None:
    """Every step shows flash_steps' tile of S, m before and after, α, l and O."""
    page = s.page
    for view in ("longformer", "causal"):
        _configure(page, view=view)
        fs = _walk(8, 2, view)
        assert _pos(page) == 0
        for k, step in enumerate(fs.steps, start=1):
            page.click("#next")
            assert _pos(page) == k
            (r0, r1), (c0, c1) = step.rows, step.cols
            lit = _cells(page, "#grid td.lit")
            if step.scores is None:
                assert lit == []
            else:
                assert sorted((int(c["i"]), int(c["j"])) for c in lit) == [
                    (i, j) for i in range(r0, r1) for j in range(c0, c1)
                ]
                got = {(int(c["i"]), int(c["j"])): _f(c["v"]) for c in lit}
                _close([got[i, j] for i in range(r0, r1) for j in range(c0, c1)], step.scores,
                       f"{view} step {k}: S tile")  # fmt: skip
            _close(_values(page, "#state td", "m"), step.m, f"{view} step {k}: m")
            _close(_values(page, "#state td", "l"), step.l, f"{view} step {k}: l")
            _close(_values(page, "#state td", "o"), step.o, f"{view} step {k}: O")
            alpha = _values(page, "#state td", "alpha")
            if step.alpha is None:
                assert alpha == [None] * (r1 - r0), (view, k, alpha)
            else:
                _close(alpha, step.alpha, f"{view} step {k}: alpha")
            # the caption speaks of a rescale exactly where a row had something to shrink
            rescaled = step.alpha is not None and any(0 < float(a) < 1 for a in step.alpha)
            assert ("max grew" in page.inner_text("#caption")) == rescaled, (view, k, step.alpha)
        # At the end every row's online m, l and O are the textbook's.
        causal, mask, _ = view_masks(8)[view]
        w = walkthrough(n=8)
        st = reference.steps(w.Q, w.K, w.V, causal=causal, mask=mask)
        for i in (0, 5, 7):
            page.select_option("#row", str(i))
            _close(_values(page, "#rowsum td", "on-o"), st.out[i], f"{view} row {i}: O")
            _close(_values(page, "#rowsum td", "tb-o"), st.out[i], f"{view} row {i}: textbook O")
            fin = [x for x in fs.steps if x.rows[0] <= i < x.rows[1]][-1]  # its final state
            _close(_values(page, "#rowsum td", "on-m"), fin.m[i - fin.rows[0]], f"row {i}: m")
            _close(_values(page, "#rowsum td", "on-l"), fin.l[i - fin.rows[0]], f"row {i}: l")
            assert page.get_attribute("#row-verdict", "class") == "ok"
        page.select_option("#row", "-1")
    # back, keys, play
    page.click("#back")
    assert _pos(page) == len(fs.steps) - 1
    page.keyboard.press("Home")
    assert _pos(page) == 0
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    assert _pos(page) == 2
    page.keyboard.press("ArrowLeft")
    assert _pos(page) == 1
    page.keyboard.press("End")
    assert _pos(page) == len(fs.steps)
    page.keyboard.press("Home")
    page.click("#play")
    page.wait_for_function("Number(document.querySelector('#counter').dataset.pos) >= 1")
    page.click("#play")  # pause


def check_skipped(s: Session) -> None:
    """Each mask greys exactly the tiles flash_steps skips, and counts the products saved."""
    page = s.page
    for n, tile in ((8, 2), (16, 4)):
        for view in ("dense", "causal", "window", "longformer", "documents"):
            _configure(page, n=n, tile=tile, view=view)
            fs = _walk(n, tile, view)
            want = {(s.q_tile, s.k_tile) for s in fs.steps if s.status == "skipped"}
            cells = _cells(page, "#grid td")
            classes = page.evaluate(
                "[...document.querySelectorAll('#grid td')].map(td => td.className)"
            )
            assert len(cells) == n * n
            greyed = {(int(c["qt"]), int(c["kt"])) for c, k in zip(cells, classes, strict=True)
                      if "skip" in k.split()}  # fmt: skip
            assert greyed == want, (n, tile, view)
            for c, k in zip(cells, classes, strict=True):  # every cell of a skipped tile
                assert ("skip" in k.split()) == ((int(c["qt"]), int(c["kt"])) in want)
            assert int(page.get_attribute("#products", "data-saved")) == fs.products_saved
            assert int(page.get_attribute("#products", "data-done")) == fs.products
            if want:  # greyed is grey, and not what a kept tile looks like
                grey = page.evaluate(
                    "getComputedStyle(document.querySelector('#grid td.skip')).backgroundColor"
                )
                kept = page.evaluate(
                    "getComputedStyle(document.querySelector('#grid td:not(.skip)'))"
                    ".backgroundColor"
                )
                assert grey == "rgb(189, 189, 189)" and kept != grey


def check_merge(s: Session) -> None:
    """The decoding view: the splits' partials are flash_steps', their merge is flash_steps'
    merge and equals the one-pass output."""
    page = s.page
    _configure(page, n=8, tile=2)
    w = walkthrough(n=8)
    for _ in range(8):
        page.click("#d-next")
    assert page.get_attribute("#d-counter", "data-t") == "8"
    for splits in (2, 3, 4):
        page.select_option("#splits", str(splits))
        fs = flash_steps(w.Q[7:8], w.K, w.V, tile_q=1, tile_k=2, splits=splits)
        one = flash_steps(w.Q[7:8], w.K, w.V, tile_q=1, tile_k=2)
        for p in fs.splits[0]:
            _close(_values(page, "#parts td", "m", split=p.split), p.m, f"split {p.split} m")
            _close(_values(page, "#parts td", "l", split=p.split), p.l, f"split {p.split} l")
        merged = _values(page, "#merge td", "merged-o")
        _close(merged, fs.merged[0].o[0], f"{splits} splits: merged O")
        _close(merged, one.out[0], f"{splits} splits: merged = unsplit")
        _close(_values(page, "#merge td", "unsplit-o"), one.out[0], "unsplit O")
        assert page.get_attribute("#d-verdict", "class") == "ok"
    page.click("#d-back")
    assert page.get_attribute("#d-counter", "data-t") == "7"


LATIN_OK = {  # names, code and symbols a Chinese page keeps as written
    "FlashAttention", "softmax", "rowmax", "rowsum", "exp", "max", "max_j", "acc", "English",
    "Longformer", "Home", "End", "qkv", "explain", "flash_steps", "sliding_window",
    "global_tokens", "document", "split", "KV", "Flash", "Decoding", "S_tile", "V_tile",
    "m_old", "m_new", "m_s", "l_s", "acc_s", "float", "KB", "TB", "d_k", "GPU",
}  # fmt: skip


def check_zh(s: Session) -> None:
    """Switched to Chinese, every sentence on the page is Chinese."""
    page = s.page
    _configure(page, view="causal", lang="zh")
    page.click("#next")
    page.click("#next")
    assert page.evaluate("document.documentElement.lang") == "zh"
    assert page.inner_text("#title").startswith("FlashAttention 分块演示")
    assert page.inner_text("#next") == "下一步 ▶"
    assert page.inner_text("#view-documents") == "多文档"
    sentences = (
        "#intro",
        "#mask-note",
        "#caption",
        "#h-grid",
        "#legend",
        "#held",
        "#h-state",
        "#h-out",
        "#h-row",
        "#row-verdict",
        "#h-cost",
        "#products",
        "#memory",
        "#kernel-check",
        "#h-decode",
        "#decode-intro",
        "#d-counter",
        "#d-verdict",
    )
    for sel in sentences:
        assert re.search(r"[\u4e00-\u9fff]", page.inner_text(sel)), sel
    words = set(re.findall(r"[A-Za-z][A-Za-z_]+", page.inner_text("body")))
    assert words <= LATIN_OK, sorted(words - LATIN_OK)
    page.select_option("#lang", "en")
    assert page.inner_text("#next") == "next ▶"


def check_network(s: Session) -> None:
    """Nothing was fetched from outside the file (every other request is routed and failed)."""
    assert s.blocked == [], s.blocked


OVERFLOW = """() => {
  // Elements that stick out of their box (or the screen) with no scroll box to reach them.
  const bad = [], vw = document.documentElement.clientWidth;
  for (const e of document.body.querySelectorAll("*")) {
    const r = e.getBoundingClientRect();
    if (r.width === 0 && r.height === 0) continue;
    let box = e.parentElement, scrolls = false;
    while (box && box !== document.body) {
      const ox = getComputedStyle(box).overflowX;
      if (ox === "auto" || ox === "scroll") { scrolls = true; break; }
      if (box.classList.contains("box")) break;
      box = box.parentElement;
    }
    if (scrolls) continue;
    const limit = box && box !== document.body ? box.getBoundingClientRect().right : vw;
    if (r.right > limit + 1 || r.left < -1) bad.push(`${e.tagName}#${e.id}.${e.className}`);
  }
  return bad;
}"""


def check_fits(s: Session) -> None:
    """At 1280×800 nothing is wider than the screen or its box outside a scroll box, for the
    largest choices, in both languages."""
    page = s.page
    for lang in ("en", "zh"):
        for n, tile, view in ((8, 2, "dense"), (16, 1, "longformer")):
            _configure(page, n=n, tile=tile, view=view, lang=lang)
            page.keyboard.press("End")
            for _ in range(n):
                page.click("#d-next")
            assert page.evaluate("document.documentElement.scrollWidth") <= WIDTH
            assert page.evaluate(OVERFLOW) == [], (lang, n, tile)


CHECKS = {
    "stepping": check_stepping,
    "skipped": check_skipped,
    "merge": check_merge,
    "zh": check_zh,
    "network": check_network,
    "fits": check_fits,
}

# How each check's page is broken: (what the template has, what it gets instead).
BREAKS = {
    "stepping": ("const alpha = Math.exp(prev.m[r] - mUse);", "const alpha = 1;"),  # no rescale
    "skipped": ('if (kind === "e") cls = "skip";', 'if (kind !== "f") cls = "skip";'),
    "merge": ("? 0 : Math.exp(m - mStar)));", "? 0 : 1));"),  # splits summed unweighted
    "zh": ("const state = {", "T.zh = T.en;\nconst state = {"),
    "network": ("</body>", '<img src="https://example.com/qkv.png" alt=""></body>'),
    "fits": (".scroll { overflow-x: auto; }", ".scroll { }"),
}


@pytest.mark.slow
def test_the_page_is_flash_steps_and_every_control_works(chromium, html, tmp_path):
    path = tmp_path / "flash.html"
    path.write_text(html, encoding="utf-8")
    s = _open(chromium, path)
    for check in CHECKS.values():
        check(s)
    s.page.screenshot(path=str(tmp_path / "flash.png"), full_page=True)
    assert s.errors == []
    s.page.close()


@pytest.mark.parametrize("name", list(BREAKS))
def test_each_check_fails_on_a_broken_page(chromium, html, tmp_path, name):
    old, new = BREAKS[name]
    assert html.count(old) == 1, old
    path = tmp_path / "broken.html"
    path.write_text(html.replace(old, new), encoding="utf-8")
    s = _open(chromium, path)
    with pytest.raises(AssertionError):
        CHECKS[name](s)
    s.page.close()


def test_the_page_opens_where_it_is_asked_to(chromium, tmp_path):
    path = tmp_path / "causal.html"
    path.write_text(flash_html(lang="zh", n=4, tile=1, causal=True), encoding="utf-8")
    s = _open(chromium, path)
    page = s.page
    assert page.input_value("#n") == "4" and page.input_value("#tile") == "1"
    assert "on" in page.get_attribute("#view-causal", "class")
    assert page.evaluate("document.documentElement.lang") == "zh"
    assert s.errors == [] and s.blocked == []
    s.page.close()
