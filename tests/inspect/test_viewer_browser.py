"""The viewer in a real headless Chromium (Debian's `chromium`, driven by Playwright): no
network, a 128-token input from the real model, and a click shows the right weights (of a head,
and of the attention rollout).

Skipped when Playwright or Chromium is missing, unless QKV_REQUIRE_BROWSER=1 (CI sets it, so
there a missing browser is a failure, not a skip)."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from qkv.inspect.attend import EXAMPLE, model_attention
from qkv.inspect.viewer import write_viewer


def _browser():
    required = os.environ.get("QKV_REQUIRE_BROWSER") == "1"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if required:
            raise
        pytest.skip("playwright is not installed (pip install playwright)")
    chromium = shutil.which("chromium")
    if chromium is None:
        if required:
            pytest.fail("QKV_REQUIRE_BROWSER=1 but there is no chromium on PATH")
        pytest.skip("no chromium on PATH (apt-get install -y chromium)")
    return sync_playwright, chromium


def _shown(page) -> list[tuple[str, float]]:
    rows = page.query_selector_all("#weights tr")
    return [
        (r.query_selector("td").inner_text(), float(r.query_selector(".w").inner_text()))
        for r in rows
    ]


def _expected(amap, layer, head, i) -> list[tuple[str, float]]:
    row = amap.weights[layer, head, i]
    order = row.argsort(descending=True, stable=True)[:10]
    return [(amap.words[j], row[j].item()) for j in order.tolist()]


def _agree(shown, expected):
    """Three decimals are shown: each must be the true weight rounded (the embedded 16-bit
    value may sit within 8e-6 of a rounding boundary, hence the half-step allowance)."""
    assert len(shown) == len(expected)
    shown_weights = sorted((w for _, w in shown), reverse=True)
    for got, (_, want) in zip(shown_weights, expected, strict=True):
        assert abs(got - want) <= 0.0005 + 1e-5, (shown, expected)
    strong = {word for word, w in expected if w > 0.01}
    assert strong <= {word for word, _ in shown}


def test_click_shows_the_words_weights_in_chromium(minilm, tmp_path):
    sync_playwright, chromium = _browser()
    words = (EXAMPLE.lower().split() * 13)[:126]  # single-token words: 126 + [CLS] + [SEP]
    amap = model_attention(" ".join(words), *minilm)
    assert len(amap.words) == 128
    path = write_viewer(amap, tmp_path / "viewer.html")

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page()
        requests, errors = [], []
        page.on("request", lambda r: requests.append(r.url))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(path.as_uri())
        page.wait_for_function("window.qkvViewerReady === true", timeout=10_000)
        assert page.input_value("#topk") == "5"  # long input: top-5 links per word

        page.select_option("#layer", "5")
        page.select_option("#head", "11")
        word = 8  # "it" in the first sentence
        t0 = time.perf_counter()
        page.click(f'#lines text[data-side=from][data-i="{word}"]')
        page.wait_for_function("document.querySelectorAll('#weights tr').length > 0")
        click_s = time.perf_counter() - t0
        assert page.inner_text("#selected").startswith('"it" (word 8) looks at, layer 5, head 11')
        _agree(_shown(page), _expected(amap, 5, 11, word))
        links = page.eval_on_selector_all("#lines line", "ls => ls.length")
        assert 1 <= links <= 5

        before = _shown(page)
        page.select_option("#head", "2")  # the pinned word now shows another head
        after = _shown(page)
        assert after != before
        _agree(after, _expected(amap, 5, 2, word))
        draw_ms = page.evaluate("window.qkvLastDrawMs")

        page.select_option("#head", "-2")  # the rollout through layers 0..5
        assert page.inner_text("#selected").startswith(
            '"it" (word 8) draws from, rollout through layers 0..5'
        )
        rolled = amap.rollout()[5, word]
        order = rolled.argsort(descending=True, stable=True)[:10].tolist()
        _agree(_shown(page), [(amap.words[j], rolled[j].item()) for j in order])
        page.click("#overview canvas[data-layer='2'][data-head='-2']")
        assert page.input_value("#layer") == "2" and page.input_value("#head") == "-2"
        rolled = amap.rollout()[2, word]
        order = rolled.argsort(descending=True, stable=True)[:10].tolist()
        _agree(_shown(page), [(amap.words[j], rolled[j].item()) for j in order])
        browser.close()

    assert errors == []
    assert all(u.startswith("file:") for u in requests), requests  # nothing from the network
    print(
        f"\n[viewer] 128 tokens: click → weights shown in {click_s * 1e3:.0f} ms "
        f"(page redraw {draw_ms:.1f} ms)"
    )


def test_a_text_that_looks_like_markup_cannot_blank_the_page(tmp_path):
    """`<!--<script>` in the text puts the HTML parser in its double-escaped script state, where
    the real `</script>` no longer ends the script: the page used to stay blank."""
    import torch

    from qkv.inspect.attend import AttentionMap

    sync_playwright, chromium = _browser()
    words = ["<!--<script>", "it", "</script><b>x</b>", "&lt;"]
    text = "<!--<script> it </script><b>x</b> &lt;"
    w = torch.full((1, 2, 4, 4), 0.25, dtype=torch.float64)
    path = write_viewer(AttentionMap.from_weights(w, words, text=text), tmp_path / "v.html")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(path.as_uri())
        page.wait_for_function("window.qkvViewerReady === true", timeout=10_000)
        assert page.inner_text("#sentence") == text  # shown as typed, not parsed
        shown = page.eval_on_selector_all(
            "#lines text[data-side=from]", "ts => ts.map(t => t.textContent)"
        )
        assert shown == words
        assert page.query_selector("#sentence b") is None
        browser.close()
    assert errors == []


def test_a_laptop_screen_shows_every_head_numbered_with_a_legend_and_the_unk_note(tmp_path):
    """At 1280×800 the overview's last column (the rollout) is on screen, columns carry head
    numbers, a legend says what the colour means, and words the model could not read are
    named on the page."""
    import torch

    from qkv.inspect.attend import AttentionMap

    sync_playwright, chromium = _browser()
    words = ["[CLS]", "猫", "[UNK]", "在", "[UNK]", "上", "it", "was", "[UNK]", "tired", "[SEP]"]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 12, 11, 11, generator=g, dtype=torch.float64).softmax(-1)
    path = write_viewer(AttentionMap.from_weights(w, words, text="猫在上 it was tired"),
                        tmp_path / "v.html")  # fmt: skip
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(path.as_uri())
        page.wait_for_function("window.qkvViewerReady === true", timeout=10_000)
        last = page.query_selector("#overview canvas[data-layer='0'][data-head='-2']")
        box = last.bounding_box()
        assert box["x"] + box["width"] <= 1280 and box["width"] >= 20, box
        assert page.evaluate("document.documentElement.scrollWidth") <= 1280
        heads = page.eval_on_selector_all("#overview .head-lab", "ls => ls.map(l => l.textContent)")
        assert heads == ["", *(f"H{h}" for h in range(12)), "roll"]
        assert page.is_visible("#legend") and "weight 0" in page.inner_text("#legend")
        note = page.inner_text("#note")
        assert "3 of the 9 words became [UNK]" in note, note
        page.select_option("#lang", "zh")  # every word of the page in Chinese
        assert page.inner_text("#title") == "每个词看向哪里？"
        assert "9 个词里有 3 个变成了 [UNK]" in page.inner_text("#note")
        page.click('#lines text[data-side=from][data-i="6"]')
        assert page.inner_text("#selected").startswith("“it”（第 6 个词）看向：第 0 层，第 0 个头")
        assert page.inner_text("#legend").startswith("权重 0")
        page.screenshot(path=str(tmp_path / "laptop-zh.png"))
        browser.close()
    zh = write_viewer(AttentionMap.from_weights(w, words), tmp_path / "zh.html", lang="zh")
    with sync_playwright() as p:  # a page written in Chinese opens in Chinese
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(zh.as_uri())
        page.wait_for_function("window.qkvViewerReady === true", timeout=10_000)
        assert page.input_value("#lang") == "zh" and page.inner_text("#l-layer") == "层"
        browser.close()
