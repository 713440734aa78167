"""The demo's chapter sections: their numbers come from qkv itself, not from the text."""

from __future__ import annotations

import torch

from qkv.inspect import chapter
from qkv.inspect.explain import cost
from qkv.vision.tokens import image_tokens


def _rec(method, n, time_s, peak):
    return {"method": method, "pass": "forward", "n": n, "time_s": time_s, "peak_mib": peak,
            "note": None}  # fmt: skip


def test_long_context_shows_the_kept_tiles_and_what_the_cost_curve_measured():
    records = [
        _rec("naive", 1024, 0.02, 100.0),
        _rec("tiled", 1024, 0.03, 10.0),
        _rec("sdpa", 1024, 0.01, 50.0),
        _rec("window", 1024, 0.002, 8.0),
        _rec("naive", 4096, None, None),  # skipped: not the largest measured
    ]
    text = chapter.long_context(records)
    flops, nbytes = cost(chapter.LONG_N, 64)
    assert flops == 4 * chapter.LONG_N**2 * 64 and nbytes == 4 * chapter.LONG_N**2
    assert "281 TFLOP" in text and "4.4 TB" in text
    for name, rule in chapter.PATTERNS:
        lay = rule.blocks(chapter.TILE_N, chapter.TILE_N, chapter.TILE, chapter.TILE)
        assert f"{name}: {lay.kept_fraction:.0%} of tiles kept" in text
        assert all(row in text for row in lay.show().splitlines())
    assert "forward at N = 1024" in text
    assert "naive formula peaked at 100 MiB, the tiled kernel at 10 MiB (10.0× less" in text
    assert "(torch SDPA) 10.0 ms, the sliding window 2.0 ms (5.0× faster" in text
    assert "nothing to compare" in chapter.long_context(None)


def test_each_ratio_sentence_says_faster_or_slower_as_measured():
    """'faster' only when it was: a window slower than dense attention is said to be slower
    (the demo once printed '0.6× faster'), and a tiled kernel that held no less is not 'less'."""

    def measured(window_s, tiled_mib, lang="en"):
        recs = [_rec("naive", 2048, 0.02, 100.0), _rec("tiled", 2048, 0.03, tiled_mib),
                _rec("sdpa", 2048, 0.010, 50.0), _rec("window", 2048, window_s, 8.0)]  # fmt: skip
        return chapter.long_context(recs, lang)

    slow = measured(0.016, 100.0)
    assert "1.6× slower at this N" in slow and "faster" not in slow
    assert "× less" not in slow and "no less at this N" in slow
    fast = measured(0.004, 10.0)
    assert "2.5× faster" in fast and "slower" not in fast and "10.0× less" in fast
    assert "the same time, within 5%" in measured(0.0102, 10.0)
    zh = measured(0.016, 100.0, "zh")
    assert "慢 1.6 倍" in zh and "快 " not in zh and "并不更少" in zh


def test_the_block_names_layernorm():
    assert "LN is LayerNorm" in chapter.transformer_block()
    assert "LayerNorm" in chapter.transformer_block(lang="zh")


def test_visual_tokens_are_the_models_counts():
    text = chapter.visual_tokens()
    for side in chapter.IMAGE_SIDES:
        q = image_tokens("qwen2-vl", side, side).tokens
        ll = image_tokens("llava-next", side, side).tokens
        assert f"{f'{side}×{side}':>11} {q:>10,} {ll:>11,}   {q * q:,} scores" in text


def test_the_block_is_qkv_nn_transformer_block_shape_by_shape():
    text = chapter.transformer_block()
    assert "Q split into 2 heads      (1, 2, 4, 4)" in text
    assert "FFN: Linear 8 → 32, GELU  (1, 4, 32)" in text
    assert "max difference 0.0e+00" in text
    torch.manual_seed(1)  # the seed is the function's own
    assert chapter.transformer_block() == text
