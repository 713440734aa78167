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
