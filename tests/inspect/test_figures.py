"""The PNGs: written, one panel per head, labelled."""

from __future__ import annotations

import pytest
import torch

from qkv.inspect.attend import AttentionMap

pytest.importorskip("matplotlib")
from qkv.inspect import figures

PNG = b"\x89PNG\r\n\x1a\n"


def _map():
    w = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0)).softmax(-1)
    return AttentionMap.from_weights(w, ["the", "cat", "sat", "down"], text="the cat sat down")


def test_attention_grid_has_a_panel_per_head(tmp_path):
    fig = figures.attention_grid(_map(), tmp_path / "grid.png")
    assert (tmp_path / "grid.png").read_bytes().startswith(PNG)
    panels = [ax for ax in fig.axes if ax.get_title().startswith("L")]
    assert len(panels) == 6 and panels[-1].get_title() == "L1 H2"
    assert [t.get_text() for t in panels[0].get_yticklabels()] == ["the", "cat", "sat", "down"]
    assert any(ax.get_ylabel() == "attention weight" for ax in fig.axes)  # the colour bar


def test_token_heads_rows_are_that_words_weights(tmp_path):
    amap = _map()
    fig = figures.token_heads(amap, "cat", tmp_path / "cat.png")
    assert (tmp_path / "cat.png").read_bytes().startswith(PNG)
    shown = torch.as_tensor(fig.axes[0].images[0].get_array())
    assert torch.equal(shown, amap.weights[:, :, 1, :].reshape(6, 4))


def test_cost_plot_labels_the_fitted_slopes(tmp_path):
    recs = [
        {"method": "dense", "pass": p, "n": n, "time_s": 1e-9 * n * n, "peak_mib": 1e-6 * n * n}
        for p in ("forward", "forward+backward")
        for n in (256, 512, 1024)
    ]
    fig = figures.cost_plot(recs, tmp_path / "cost.png")
    assert (tmp_path / "cost.png").read_bytes().startswith(PNG)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["dense (slope 2.00)"]


def _chinese_map():
    w = torch.randn(1, 2, 4, 4, generator=torch.Generator().manual_seed(0)).softmax(-1)
    return AttentionMap.from_weights(w, ["猫", "坐", "它", "累"], text="猫坐它累")


def test_chinese_labels_are_drawn_with_an_installed_cjk_font(tmp_path):
    from matplotlib import font_manager, ft2font

    font = figures.cjk_font()
    if font is None:
        pytest.skip("no CJK font on this machine (apt-get install fonts-noto-cjk)")
    fig = figures.token_heads(_chinese_map(), "它", tmp_path / "zh.png")
    labels = fig.axes[0].get_xticklabels()
    assert [t.get_text() for t in labels] == ["猫", "坐", "它", "累"]
    assert all(font in t.get_fontfamily() for t in labels)
    face = font_manager.FontProperties(family=font)
    path = font_manager.findfont(face, fallback_to_default=False)
    glyphs = ft2font.FT2Font(path).get_charmap()
    assert all(ord(c) in glyphs for c in "猫坐它累")


def test_a_cjk_font_installed_after_matplotlib_listed_its_fonts_is_found(monkeypatch):
    from matplotlib import font_manager

    class Face:
        def __init__(self, name):
            self.name = name

    manager = font_manager.fontManager
    listed = [Face("DejaVu Sans")]
    monkeypatch.setattr(manager, "ttflist", listed)
    added = []

    def addfont(path):
        added.append(path)
        listed.append(Face("Noto Sans CJK JP"))  # a .ttc is listed under its first face

    monkeypatch.setattr(manager, "addfont", addfont)
    monkeypatch.setattr(
        font_manager,
        "findSystemFonts",
        lambda: ["/usr/share/fonts/DejaVuSans.ttf", "/usr/share/fonts/NotoSansCJK-Regular.ttc"],
    )
    figures.cjk_font.cache_clear()
    try:
        assert figures.cjk_font() == "Noto Sans CJK JP"
        assert added == ["/usr/share/fonts/NotoSansCJK-Regular.ttc"]
        assert figures.cjk_note(["它"]) is None
        listed[:] = [Face("DejaVu Sans")]
        figures.cjk_font.cache_clear()
        monkeypatch.setattr(font_manager, "findSystemFonts", lambda: [])
        assert figures.cjk_note(["it"]) is None
        note = figures.cjk_note(["它"])
        assert note is not None and "fonts-noto-cjk" in note
    finally:
        figures.cjk_font.cache_clear()
        figures._families.cache_clear()
