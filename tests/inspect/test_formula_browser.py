"""The page you can touch (`qkv explain --html`) in a real headless Chromium: its numbers are
`qkv.reference.steps` on the walk-through's X and W, hover shows a value, clicking S[i, j] shows
q_i · k_j term by term, the scale slider, d_k, causal, re-roll and language change what they
should, the slider's ends are labelled, every matrix at d_k = 64 can be read on a 1280×800
laptop screen (wide ones scroll inside their own box) and it asks nothing of the network.

Skipped without Playwright or Chromium, unless QKV_REQUIRE_BROWSER=1 (CI)."""

from __future__ import annotations

import math

import pytest
import torch

from qkv import reference
from qkv.inspect.explain import walkthrough
from qkv.inspect.formula import ROLLS, formula_data, write_formula_page

from .test_viewer_browser import _browser, unreachable


def _close(got, want: torch.Tensor, what: str) -> None:
    """float64 in JavaScript against torch's float64: the same numbers up to the order of a
    few additions (a few units in the last place of the largest entry)."""
    got = torch.tensor(got, dtype=torch.float64)
    assert got.shape == want.shape, what
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)), what
    big = want[finite].abs().max().item() if finite.any() else 1.0
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= 64 * torch.finfo(torch.float64).eps * max(big, 1.0), (what, err)


def _agrees(m: dict, seed: int, dk: int, causal: bool, scale: float | None = None) -> None:
    w = walkthrough(n=4, d=8, d_k=dk, seed=seed, causal=causal)
    assert (m["seed"], m["dk"], m["causal"]) == (seed, dk, causal)
    for key, want in (("X", w.X), ("Wq", w.W_q), ("Q", w.Q), ("K", w.K), ("V", w.V), ("S", w.S)):
        _close(m[key], want, key)
    st = reference.steps(w.Q, w.K, w.V, causal=causal, scale=scale)
    _close(m["Ss"], st.S_scaled, "S·scale")
    _close(m["A"], st.A, "A")
    _close(m["Out"], st.out, "Out")


@pytest.mark.slow
def test_the_page_is_the_formula_and_every_control_works(tmp_path):
    sync_playwright, chromium = _browser()
    path = write_formula_page(tmp_path / "explain.html")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        requests, errors = [], []
        page.on("request", lambda r: requests.append(r.url))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(path.as_uri())
        page.wait_for_function("window.qkvFormulaReady === true", timeout=10_000)
        m = lambda: page.evaluate("window.qkvFormula.matrices()")  # noqa: E731

        _agrees(m(), seed=0, dk=4, causal=False)  # what `qkv explain` prints
        assert page.evaluate("document.documentElement.scrollWidth") <= 1280  # no sideways scroll

        page.hover('table[data-m="A"] td[data-i="1"][data-j="2"]')
        want = walkthrough().A[1, 2].item()
        shown = page.inner_text("#hover")
        assert shown.startswith("A[1, 2] = ")
        assert float(shown.rsplit("= ", 1)[1]) == pytest.approx(want, rel=1e-12)

        page.click('table[data-m="S"] td[data-i="1"][data-j="2"]')
        lines = page.inner_text("#terms").splitlines()
        w = walkthrough()
        assert lines[0] == "S[1, 2] = q_1 · k_2 = Σ_m Q[1, m] · K[2, m]"
        assert lines[1].count("·") == 4  # one product per dimension of d_k = 4
        assert float(page.get_attribute("#terms", "data-sum")) == pytest.approx(
            w.S[1, 2].item(), rel=1e-12
        )
        assert lines[-1].startswith("× scale 0.5000 = ")

        page.select_option("#dk", "64")
        _agrees(m(), seed=0, dk=64, causal=False)
        terms = page.inner_text("#terms").splitlines()
        assert "… 58 more terms …" in terms[1] and terms[1].count("·") == 6  # 64 terms, elided
        assert page.evaluate("document.documentElement.scrollWidth") <= 1280
        scaled_max = max(max(r) for r in m()["A"])
        page.fill("#scale", "0")  # no scaling: the softmax saturates
        page.dispatch_event("#scale", "input")
        _agrees(m(), seed=0, dk=64, causal=False, scale=1.0)
        assert max(max(r) for r in m()["A"]) > scaled_max
        assert m()["scale"] == 1.0

        page.fill("#scale", "100")
        page.dispatch_event("#scale", "input")
        page.check("#causal")
        _agrees(m(), seed=0, dk=64, causal=True)
        page.click("#reroll")
        _agrees(m(), seed=1, dk=64, causal=True)
        assert page.inner_text("#seed") == "seed 1"

        page.select_option("#lang", "zh")
        assert page.inner_text("#title").startswith("逐步演算缩放点积注意力")
        assert page.inner_text("#l-causal") == "因果掩码"
        assert page.evaluate("document.documentElement.lang") == "zh"
        page.screenshot(path=str(tmp_path / "zh.png"))
        browser.close()
    assert errors == []
    assert all(u.startswith("file:") for u in requests), requests


def test_the_page_embeds_each_rolls_walkthrough():
    data = formula_data(seed=2**64 - 1)  # the last seed wraps to 0 on re-roll
    assert [r["seed"] for r in data["rolls"]] == [2**64 - 1, *range(ROLLS - 1)]
    w = walkthrough(n=4, d=8, d_k=16, seed=0)
    assert data["rolls"][1]["X"] == w.X.tolist() and data["rolls"][1]["W"]["16"]["Wv"] == (
        w.W_v.tolist()
    )
    assert math.isclose(sum(map(len, data["rolls"][0]["X"])), 32)


def _open(p, chromium, path, width=1280, height=800):
    browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
    page = browser.new_page(viewport={"width": width, "height": height})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_function("window.qkvFormulaReady === true", timeout=10_000)
    return browser, page, errors


def _ends(page) -> tuple[str, str]:
    """The slider's two end labels, checked to sit left and right of it on its line."""
    lo, bar, hi = (
        page.query_selector(s).bounding_box() for s in ("#scale-lo", "#scale", "#scale-hi")
    )
    assert lo["x"] + lo["width"] <= bar["x"] and bar["x"] + bar["width"] <= hi["x"], (lo, bar, hi)
    for box in (lo, hi):
        assert box["y"] < bar["y"] + bar["height"] and bar["y"] < box["y"] + box["height"]
    return page.inner_text("#scale-lo"), page.inner_text("#scale-hi")


def test_the_sliders_ends_say_what_they_mean_in_both_languages(tmp_path):
    sync_playwright, chromium = _browser()
    path = write_formula_page(tmp_path / "explain.html")
    with sync_playwright() as p:
        browser, page, errors = _open(p, chromium, path)
        assert _ends(page) == ("1 (no scaling)", "1/√d_k")
        page.select_option("#lang", "zh")
        assert _ends(page) == ("1（不缩放）", "1/√d_k")
        assert page.title() == "qkv：逐步演算缩放点积注意力"
        browser.close()
    assert errors == []


def test_every_matrix_at_d_k_64_can_be_reached_on_a_laptop(tmp_path):
    """At 1280×800 and d_k = 64 the (8, 64) and (4, 64) matrices are wider than the window: each
    scrolls sideways inside its own box, which says so in its caption, in both languages, and
    the page itself never scrolls sideways. With that box's scrolling taken away, the check
    fails."""
    sync_playwright, chromium = _browser()
    path = write_formula_page(tmp_path / "explain.html", d_k=64)
    text = path.read_text(encoding="utf-8")
    rule = ".mat { max-width: 100%; overflow-x: auto;"
    assert rule in text
    broken = tmp_path / "broken.html"
    broken.write_text(text.replace(rule, ".mat { max-width: 100%;"), encoding="utf-8")
    with sync_playwright() as p:
        browser, page, errors = _open(p, chromium, path)
        for lang, more in (
            ("en", "scroll sideways for all 64 columns"),
            ("zh", "左右滚动可看到全部 64 列"),
        ):
            page.select_option("#lang", lang)
            assert unreachable(page) == [], lang
            assert page.evaluate("document.documentElement.scrollWidth") <= 1280
            wide = page.eval_on_selector_all("figure.wide table", "ts => ts.map(t => t.dataset.m)")
            assert wide == ["Wq", "Wk", "Wv", "Q", "K", "V", "Out"], wide
            box = page.query_selector("figure.wide .mat")
            assert box.evaluate("b => b.scrollWidth > b.clientWidth")
            box.evaluate("b => { b.scrollLeft = b.scrollWidth; }")  # scrolled to its end,
            last = page.query_selector('table[data-m="Wq"] tr td:last-child').bounding_box()
            assert last["x"] >= 0 and last["x"] + last["width"] <= 1280  # the last column shows
            assert more in page.inner_text('figure:has(table[data-m="Wq"]) figcaption')
            assert more not in page.inner_text('figure:has(table[data-m="S"]) figcaption')
        page.select_option("#dk", "4")  # nothing is wide at d_k = 4
        assert page.query_selector_all("figure.wide") == []
        browser.close()
        assert errors == []

        browser, page, errors = _open(p, chromium, broken)
        assert any("table[Wq]" in bad for bad in unreachable(page)), unreachable(page)
        browser.close()
