"""The viewer in a real headless Chromium (Debian's `chromium`, driven by Playwright): no
network, a 128-token input from the real model, and a click shows the right weights (of a head,
and of the attention rollout); the heatmap reads out the hovered cell's weight, the all-heads
view draws each head in its colour with chips that hide them, both speak Chinese, and every
view fits 1280×800 and 1920×1080 without sideways scrolling.

Skipped when Playwright or Chromium is missing, unless QKV_REQUIRE_BROWSER=1 (CI sets it, so
there a missing browser is a failure, not a skip)."""

from __future__ import annotations

import os
import re
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


# What a reader cannot reach at this screen size: an element whose own content is wider than
# its box while the box does not scroll (cut or spilling), or an element that sticks out of a
# box that clips it or out of the window, unless a box around it scrolls sideways (then that
# box must lie within the window). Returns a description of each such element.
UNREACHABLE_JS = """(selector) => {
  const vw = document.documentElement.clientWidth;
  const style = el => getComputedStyle(el).overflowX;
  const scrolls = el => ["auto", "scroll"].includes(style(el));
  const name = el => el.tagName.toLowerCase() + (el.id ? "#" + el.id : "")
    + (el.dataset.m ? "[" + el.dataset.m + "]" : "")
    + " " + (el.textContent || "").trim().slice(0, 40);
  const bad = [];
  for (const el of document.querySelectorAll(selector)) {
    if (!el.getClientRects().length) continue;  // not shown
    if (el.scrollWidth > el.clientWidth + 1 && !scrolls(el)
        && !["svg", "canvas", "img"].includes(el.tagName.toLowerCase())) {
      bad.push("content wider than its box: " + name(el)); continue;
    }
    const r = el.getBoundingClientRect();
    let box = null;
    for (let p = el.parentElement; p && p !== document.body; p = p.parentElement) {
      if (scrolls(p)) { box = p; break; }
      const pr = p.getBoundingClientRect();
      const out = r.right > pr.right + 1 || r.left < pr.left - 1;
      if (["hidden", "clip"].includes(style(p)) && out) {
        bad.push("cut by its box: " + name(el)); box = undefined; break;
      }
    }
    if (box === undefined) continue;
    const b = (box || el).getBoundingClientRect();
    if (b.left < -1 || b.right > vw + 1) bad.push("out of the window: " + name(box || el));
  }
  return bad;
}"""


def unreachable(page, selector: str = "pre, table, canvas, svg, img") -> list[str]:
    """The elements of `selector` on `page` whose content a reader cannot reach (see
    `UNREACHABLE_JS`); empty when everything can be read or scrolled to."""
    return page.evaluate(UNREACHABLE_JS, selector)


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


@pytest.mark.slow
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
        assert page.inner_text("#selected").startswith("“it”（编号 6 的词）看向：层 0，头 0")
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


# The heatmap, all heads at once, and both screen sizes: synthetic maps of the model's shape
# (6 layers, 12 heads), sharp enough that each head has a few strong links.


def _map(words, seed=0):
    import torch

    from qkv.inspect.attend import AttentionMap

    g = torch.Generator().manual_seed(seed)
    shape = (6, 12, len(words), len(words))
    w = (3 * torch.randn(shape, generator=g, dtype=torch.float64)).softmax(-1)
    return AttentionMap.from_weights(w, words, text=" ".join(words))


WORDS = ["[CLS]", "the", "cat", "sat", "on", "mat", "because", "it", "was", "tired", "[SEP]"]


def _open(p, chromium, path, width=1280, height=800):
    """A browser, the viewer open in it at width×height, and the list its errors go to."""
    browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
    page = browser.new_page(viewport={"width": width, "height": height})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_function("window.qkvViewerReady === true", timeout=10_000)
    return browser, page, errors


def _three_decimals(want: float) -> set[str]:
    """What the page may show for the weight `want`: its 16-bit copy (within 0.5/65535 < 1e-5
    of `want`) to three decimals. One answer, or both neighbours where `want` lies within 1e-5
    of a rounding boundary."""
    return {f"{max(0.0, want - 1e-5):.3f}", f"{want + 1e-5:.3f}"}


def _hover_cell(page, i, j) -> str:
    """Point at the heatmap's cell (row i = looking word, column j) and read the readout."""
    heat = page.query_selector("#heatmap")
    heat.scroll_into_view_if_needed()
    box = heat.bounding_box()
    m, cell = (float(heat.get_attribute(a)) for a in ("data-margin", "data-cell"))
    page.mouse.move(box["x"] + m + (j + 0.5) * cell, box["y"] + m + (i + 0.5) * cell)
    return page.inner_text("#readout")


@pytest.mark.slow
def test_the_heatmap_shows_the_weight_of_the_hovered_cell(tmp_path):
    sync_playwright, chromium = _browser()
    amap = _map(WORDS)
    path = write_viewer(amap, tmp_path / "v.html")
    long_words = [f"w{k}" for k in range(128)]
    long_map = _map(long_words, seed=1)
    long_path = write_viewer(long_map, tmp_path / "long.html")
    with sync_playwright() as p:
        browser, page, errors = _open(p, chromium, path)
        assert page.is_visible("#lines") and not page.is_visible("#heatmap")
        page.click("#modes button[data-mode=heatmap]")
        assert page.is_visible("#heatmap") and not page.is_visible("#lines")
        assert page.get_attribute("#modes button[data-mode=heatmap]", "aria-pressed") == "true"
        page.select_option("#layer", "3")
        page.select_option("#head", "7")
        for i, j in [(7, 2), (2, 7), (0, 10), (10, 0), (5, 5)]:  # both triangles, corners
            want = amap.weights[3, 7, i, j].item()
            shown = _hover_cell(page, i, j)
            assert shown in {f"{WORDS[i]} → {WORDS[j]}: {v}" for v in _three_decimals(want)}
        page.select_option("#head", "-1")  # the mean over the layer's heads
        want = amap.weights[3, :, 7, 2].mean().item()
        assert _hover_cell(page, 7, 2) in {f"it → cat: {v}" for v in _three_decimals(want)}
        page.select_option("#head", "-2")  # the rollout through layers 0..3
        want = amap.rollout()[3, 7, 2].item()
        assert _hover_cell(page, 7, 2) in {f"it → cat: {v}" for v in _three_decimals(want)}
        page.select_option("#head", "7")
        _hover_cell(page, 7, 2)
        page.mouse.down()
        page.mouse.up()  # a click keeps the row's word: the side lists its weights
        assert page.inner_text("#selected").startswith('"it" (word 7) looks at, layer 3, head 7')
        _agree(_shown(page), _expected(amap, 3, 7, 7))
        assert page.is_visible("#heat-row")
        page.mouse.move(0, 0)
        assert "hover a cell" in page.inner_text("#readout")
        browser.close()
        assert errors == []

        browser, page, errors = _open(p, chromium, long_path)  # 128 words: 16k cells on one canvas
        page.click("#modes button[data-mode=heatmap]")
        page.select_option("#layer", "5")
        page.select_option("#head", "11")
        draw_ms = page.evaluate("window.qkvLastDrawMs")
        assert int(page.get_attribute("#heatmap", "data-step")) > 1  # every word can't be named
        for i, j in [(100, 3), (3, 100), (127, 127), (64, 65)]:
            want = long_map.weights[5, 11, i, j].item()
            shown = _hover_cell(page, i, j)
            assert shown in {f"w{i} → w{j}: {v}" for v in _three_decimals(want)}
        browser.close()
        assert errors == []
    print(f"\n[viewer] 128-word heatmap drawn in {draw_ms:.1f} ms")


def _links(page):
    return page.eval_on_selector_all(
        "#lines line",
        """ls => ls.map(l => ({head: +l.dataset.head, i: +l.dataset.i, j: +l.dataset.j,
                              w: +l.dataset.w, colour: getComputedStyle(l).stroke}))""",
    )


def _readout_at(page, link) -> str:
    """Point at the middle of the drawn link (its head, looking word i, attended word j)."""
    line = page.query_selector(
        f"#lines line[data-head='{link['head']}'][data-i='{link['i']}'][data-j='{link['j']}']"
    )
    box = line.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    return page.inner_text("#readout")


def test_all_heads_at_once_each_in_its_colour_with_chips_that_hide_them(tmp_path):
    sync_playwright, chromium = _browser()
    amap = _map(WORDS, seed=2)
    path = write_viewer(amap, tmp_path / "v.html")
    layer, word = 4, 7  # "it"
    w = amap.weights[layer, :, word]  # (heads, words)
    with sync_playwright() as p:
        browser, page, errors = _open(p, chromium, path)
        page.select_option("#layer", str(layer))
        page.click("#modes button[data-mode=heads]")
        assert not page.is_visible("#head") and page.is_visible("#chips")
        page.click(f'#lines text[data-side=from][data-i="{word}"]')  # keep "it"
        page.mouse.move(0, 0)
        links = _links(page)
        drawn = {(k["head"], k["j"]) for k in links}
        assert len(drawn) == len(links) and {k["i"] for k in links} == {word}
        # every link of weight ≥ 0.01, one set per head (a weight within the 16-bit error of
        # 0.01 may go either way)
        assert {(h, j) for h in range(12) for j in range(11) if w[h, j] >= 0.01 + 1e-5} <= drawn
        assert drawn <= {(h, j) for h in range(12) for j in range(11) if w[h, j] >= 0.01 - 1e-5}
        assert {k["head"] for k in links} == set(range(12))
        for k in links:
            assert abs(k["w"] - w[k["head"], k["j"]].item()) <= 1e-5, k
        colours = {h: {k["colour"] for k in links if k["head"] == h} for h in range(12)}
        assert (
            all(len(c) == 1 for c in colours.values()) and len(set.union(*colours.values())) == 12
        )
        chip = page.eval_on_selector_all(
            "#chips .chip", "cs => cs.map(c => getComputedStyle(c).backgroundColor)"
        )
        assert chip == [colours[h].pop() for h in range(12)]  # a head's chip is its colour

        # hovering a link names its head and weight (the topmost link under the pointer)
        pattern = re.compile(r"^head (\d+): it → (\S+): (\d\.\d{3})$")
        for k in sorted(links, key=lambda k: -k["w"])[:8]:
            m = pattern.match(_readout_at(page, k))
            assert m, page.inner_text("#readout")
            h, j = int(m[1]), WORDS.index(m[2])
            assert m[3] in _three_decimals(w[h, j].item()), (m.group(0), w[h, j].item())

        page.click("#chips button#chips-none")
        assert _links(page) == []
        assert page.get_attribute("#chips .chip[data-head='5']", "aria-pressed") == "false"
        page.click("#chips .chip[data-head='5']")  # head 5 alone: each of its links hovered
        alone = _links(page)
        assert {k["head"] for k in alone} == {5} and alone
        for k in alone:
            want = w[5, k["j"]].item()
            assert _readout_at(page, k) in {
                f"head 5: it → {WORDS[k['j']]}: {v}" for v in _three_decimals(want)
            }
        page.hover("#chips .chip[data-head='5']")  # a chip tells its head's strongest link
        j = int(w[5].argmax())
        want = {
            f"head 5: it → {WORDS[j]}: {v} (its strongest link)"
            for v in _three_decimals(w[5, j].item())
        }
        assert page.inner_text("#readout") in want

        page.click("#chips button#chips-all")
        assert {k["head"] for k in _links(page)} == set(range(12))
        page.click("#chips .chip[data-head='3']")  # head 3 off: its links go, the rest stay
        assert page.get_attribute("#chips .chip[data-head='3']", "aria-pressed") == "false"
        heads = [k["head"] for k in _links(page)]
        assert 3 not in heads and set(heads) == set(range(12)) - {3}
        assert len(heads) == len(links) - sum(1 for k in links if k["head"] == 3)
        page.click("#chips .chip[data-head='3']")
        assert len(_links(page)) == len(links)
        assert page.inner_text("#selected").startswith('"it" (word 7) looks at, layer 4, all heads')
        browser.close()
        assert errors == []


def test_the_new_modes_speak_chinese(tmp_path):
    sync_playwright, chromium = _browser()
    words = ["[CLS]", "猫", "在", "垫子", "上", "[SEP]"]
    amap = _map(words, seed=3)
    path = write_viewer(amap, tmp_path / "v.html")
    with sync_playwright() as p:
        browser, page, errors = _open(p, chromium, path)
        assert page.evaluate("Object.keys(T.en).join()") == page.evaluate(
            "Object.keys(T.zh).join()"
        )
        page.select_option("#lang", "zh")
        modes = page.eval_on_selector_all("#modes button", "bs => bs.map(b => b.textContent)")
        assert modes == ["连线", "热力图", "多头叠加"] and page.inner_text("#l-view") == "视图"
        assert page.inner_text("#readout") == "把鼠标移到连线上查看权重"
        page.click("#modes button[data-mode=heatmap]")
        assert page.inner_text("#readout").startswith("把鼠标移到格子上查看权重")
        assert page.inner_text("#hint").startswith("行：发出注意的词")
        want = amap.weights[0, 0, 1, 3].item()
        assert _hover_cell(page, 1, 3) in {f"猫 → 垫子：{v}" for v in _three_decimals(want)}
        page.click("#modes button[data-mode=heads]")
        assert page.inner_text("#l-chips") == "头"
        assert (page.inner_text("#chips-all"), page.inner_text("#chips-none")) == ("全部", "全不选")
        assert page.inner_text("#readout").startswith("点击头的色块隐藏或显示它")
        page.hover("#chips .chip[data-head='2']")
        assert page.inner_text("#readout") == "头 2：点击一个词查看它的连线"
        page.click('#lines text[data-side=from][data-i="1"]')
        k = _links(page)[0]  # the strongest link: another head's may lie over its middle
        m = re.match(r"^头 (\d+)：猫 → (\S+)：(\d\.\d{3})$", _readout_at(page, k))
        assert m, page.inner_text("#readout")
        assert m[3] in _three_decimals(amap.weights[0, int(m[1]), 1, words.index(m[2])].item())
        browser.close()
        assert errors == []


@pytest.mark.slow
def test_both_screens_show_every_mode_without_sideways_scrolling(tmp_path):
    """At 1280×800 and 1920×1080, in each mode, nothing sticks out to the right: not the
    controls, not the heatmap, not the overview's rollout column; the wide screen's width is
    used (the overview reaches its right edge)."""
    sync_playwright, chromium = _browser()
    words = [*WORDS[:-1], "extraordinarily-long-hyphenated-word", "[SEP]"]
    path = write_viewer(_map(words), tmp_path / "v.html")
    with sync_playwright() as p:
        for width, height in [(1280, 800), (1920, 1080)]:
            browser, page, errors = _open(p, chromium, path, width, height)
            page.click('#lines text[data-side=from][data-i="7"]')
            for mode in ["links", "heatmap", "heads"]:
                page.click(f"#modes button[data-mode={mode}]")
                page.mouse.move(0, 0)
                assert page.evaluate("document.documentElement.scrollWidth") <= width, mode
                shown = [
                    "#controls",
                    "#view",
                    "#side",
                    "#overview canvas[data-layer='5'][data-head='-2']",
                ]
                shown += ["#heatmap"] if mode == "heatmap" else ["#lines"]
                shown += ["#chips"] if mode == "heads" else []
                for selector in shown:
                    box = page.query_selector(selector).bounding_box()
                    assert box["x"] >= 0 and box["x"] + box["width"] <= width, (mode, selector, box)
                last = page.query_selector("#overview canvas[data-layer='0'][data-head='-2']")
                box = last.bounding_box()
                assert box["width"] >= 20 and box["x"] + box["width"] >= width - 40, (mode, box)
                page.screenshot(path=str(tmp_path / f"{mode}-{width}x{height}.png"))
            browser.close()
            assert errors == []


# The page opens on a question: a word selected at a chosen layer and head.


def _opened(page) -> dict:
    """What the page shows right after opening: layer, head, the selected word's line, the
    looking words drawn and the word in bold."""
    return {
        "layer": page.input_value("#layer"),
        "head": page.input_value("#head"),
        "selected": page.inner_text("#selected"),
        "from": sorted({k["i"] for k in _links(page)}),
        "bold": page.eval_on_selector_all("#lines text.sel", "ts => ts.map(t => t.dataset.i)"),
    }


def _opens_on(page, amap, word: int, layer: int, head: int) -> None:
    """The page shows `word` selected at `layer` and `head`, with that head's weights."""
    shown = _opened(page)
    name = amap.words[word]
    assert (shown["layer"], shown["head"]) == (str(layer), str(head)), shown
    assert shown["selected"].startswith(
        f'"{name}" (word {word}) looks at, layer {layer}, head {head}'
    ), shown
    assert shown["from"] == [word] and shown["bold"] == [str(word)], shown
    _agree(_shown(page), _expected(amap, layer, head, word))


@pytest.mark.slow
def test_the_viewer_opens_on_the_question_it_was_given(tmp_path):
    """`write_viewer(..., word=, layer=, head=)` opens on that word selected at that layer and
    head (the demo's "it" at the head most specific to "cat"), in either language, and says
    once that every number counts from 0. Without them: layer 0, head 0, no word."""
    sync_playwright, chromium = _browser()
    amap = _map(WORDS, seed=4)
    asked = write_viewer(amap, tmp_path / "asked.html", word="it", layer=3, head=7)
    by_position = write_viewer(amap, tmp_path / "pos.html", word=2, layer=5, head=11)
    zh = write_viewer(amap, tmp_path / "zh.html", lang="zh", word="it", layer=3, head=1)
    plain = write_viewer(amap, tmp_path / "plain.html")
    with sync_playwright() as p:
        browser, page, errors = _open(p, chromium, asked)
        _opens_on(page, amap, 7, 3, 7)
        assert page.inner_text("#numbering") == (
            "Layers, heads and words are numbered from 0, as qkv attend prints them."
        )
        page.click('#lines text[data-side=from][data-i="7"]')  # a click lets go of the word
        page.mouse.move(0, 0)
        assert page.inner_text("#selected") == "no word selected"
        browser.close()
        assert errors == []

        browser, page, errors = _open(p, chromium, by_position)
        _opens_on(page, amap, 2, 5, 11)
        browser.close()

        browser, page, errors = _open(p, chromium, zh)
        assert (page.input_value("#layer"), page.input_value("#head")) == ("3", "1")
        assert page.inner_text("#selected").startswith("“it”（编号 7 的词）看向：层 3，头 1")
        numbering = "层、头和词都从 0 开始编号，与 qkv attend 的输出一致。"
        assert page.inner_text("#numbering") == numbering
        labels = page.eval_on_selector_all(".head-lab", "ls => ls.map(l => l.textContent)")
        assert labels[-1] == "展开"  # the rollout's column
        assert page.title() == "qkv 注意力查看器"
        browser.close()
        assert errors == []

        browser, page, errors = _open(p, chromium, plain)
        shown = _opened(page)
        assert (shown["layer"], shown["head"], shown["selected"]) == ("0", "0", "no word selected")
        browser.close()


def test_the_opening_check_fails_on_a_page_that_ignores_the_question(tmp_path):
    """The opening test's check, on a page broken on purpose (it drops the word and opens on
    layer 0 head 0 as before), fails."""
    sync_playwright, chromium = _browser()
    amap = _map(WORDS, seed=4)
    path = write_viewer(amap, tmp_path / "v.html", word="it", layer=3, head=7)
    page_text = path.read_text(encoding="utf-8")
    broken = page_text.replace(
        "layer: open.layer, head: open.head, pinned: open.word",
        "layer: 0, head: 0, pinned: null",
    ).replace('$("layer").value = String(state.layer);', '$("layer").value = "0";')
    assert broken != page_text
    path.write_text(broken, encoding="utf-8")
    with sync_playwright() as p:
        browser, page, _ = _open(p, chromium, path)
        with pytest.raises(AssertionError):
            _opens_on(page, amap, 7, 3, 7)
        browser.close()


@pytest.mark.slow
def test_nothing_in_the_viewer_is_out_of_reach_on_a_laptop(tmp_path):
    """At 1280×800, every table, canvas and drawing of the viewer can be read or scrolled to,
    in each mode, with a long word and with 700 words (a heatmap, at two pixels a cell, wider
    than the window, which then scrolls inside its own box); with that box's scrolling taken
    away, the check fails."""
    import torch

    from qkv.inspect.attend import AttentionMap

    sync_playwright, chromium = _browser()
    words = [*WORDS[:-1], "extraordinarily-long-hyphenated-word", "[SEP]"]
    short = write_viewer(_map(words), tmp_path / "short.html", word="it", layer=2, head=3)
    many = [f"w{k}" for k in range(700)]
    g = torch.Generator().manual_seed(5)
    w = (3 * torch.randn((1, 1, 700, 700), generator=g, dtype=torch.float64)).softmax(-1)
    wide = write_viewer(AttentionMap.from_weights(w, many), tmp_path / "wide.html")
    text = wide.read_text(encoding="utf-8")
    rule = "#view { flex: 0 1 auto; max-width: 100%; min-width: 0; overflow-x: auto; }"
    assert rule in text
    broken = tmp_path / "broken.html"
    broken.write_text(text.replace(rule, "#view { flex: 0 1 auto; }"), encoding="utf-8")
    with sync_playwright() as p:
        for path in (short, wide):
            browser, page, errors = _open(p, chromium, path)
            for mode in ["links", "heatmap", "heads"]:
                page.click(f"#modes button[data-mode={mode}]")
                assert unreachable(page) == [], (path.name, mode)
                assert page.evaluate("document.documentElement.scrollWidth") <= 1280
            browser.close()
            assert errors == []
        browser, page, errors = _open(p, chromium, broken)
        page.click("#modes button[data-mode=heatmap]")
        assert page.evaluate("heatmap.getBoundingClientRect().width") > 1280
        assert any("canvas#heatmap" in bad for bad in unreachable(page))
        browser.close()
