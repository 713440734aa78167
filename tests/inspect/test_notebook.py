"""In a notebook: the walk-through, an attention map and the flash walk display inline."""

from __future__ import annotations

import html
import re

import torch

from qkv.inspect import AttentionMap, flash_steps, walkthrough

WORDS = ["[CLS]", "the", "cat", "sat", "it", "[SEP]"]


def test_an_attention_map_shows_the_viewer_inline_with_no_network():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 3, 6, 6, generator=g, dtype=torch.float64).softmax(-1)
    shown = AttentionMap.from_weights(w, WORDS, text="the cat sat it")._repr_html_()
    assert shown.startswith("<iframe srcdoc=") and 'sandbox="allow-scripts"' in shown
    page = html.unescape(re.search(r'srcdoc="([^"]*)"', shown).group(1))
    assert page.startswith("<!DOCTYPE html>") and "the cat sat it" in page
    assert not re.search(r"(src|href)=\"https?:", page)  # nothing fetched from the network


def test_the_walkthrough_and_the_flash_walk_show_their_numbers():
    w = walkthrough()
    assert f"{w.Out[0, 0].item():.2f}</td>" in w._repr_html_()
    fs = flash_steps(w.Q, w.K, w.V, tile_q=2, tile_k=2, causal=True)
    page = fs._repr_html_()
    assert "<" in page and "skipped" in page.lower()
