"""Which head links "it" to "cat": chosen by specificity, not by a head where every word looks
at "cat"; the same head asked about "… because it was dirty"; the rollout's sink tokens."""

from __future__ import annotations

import pytest
import torch

from qkv.inspect.attend import AttentionMap, summary
from qkv.inspect.specific import question_lines, sinks, specific_head, specific_heads, strongest

WORDS = ["[CLS]", "the", "cat", "sat", "because", "it", "[SEP]"]


def _crowd_map() -> AttentionMap:
    """Head 0: every word gives "cat" 0.9 ("it" too); head 1: only "it" gives "cat" 0.5."""
    n = len(WORDS)
    w = torch.full((1, 2, n, n), 0.1 / (n - 1), dtype=torch.float64)
    w[0, 0, :, 2] = 0.9
    w[0, 1, :, :] = 0.5 / (n - 1)
    w[0, 1, 5, :] = 0.5 / (n - 1)
    w[0, 1, 5, 2] = 0.5
    return AttentionMap.from_weights(w / w.sum(-1, keepdim=True), WORDS)


def test_the_specific_head_is_not_the_crowd_head():
    amap = _crowd_map()
    crowd, best = strongest(amap, "it", "cat"), specific_head(amap, "it", "cat")
    assert (crowd.layer, crowd.head) == (0, 0) and (best.layer, best.head) == (0, 1)
    others = [1, 3, 4]  # the, sat, because: neither "it" nor "cat" nor a special token
    col = amap.weights[0, 1, :, 2]
    assert best.others == pytest.approx(col[others].mean().item(), abs=1e-15)
    assert best.specificity == pytest.approx(best.weight - best.others, abs=1e-15)
    text = "\n".join(question_lines(amap, "it", "cat"))
    assert "layer 0 head 1" in text and 'every word looks at "cat"' in text


def test_specific_heads_rank_every_head_by_brute_force():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 4, 7, 7, generator=g, dtype=torch.float64).softmax(-1)
    amap = AttentionMap.from_weights(w, WORDS)
    spec = torch.empty(3, 4, dtype=torch.float64)
    for layer in range(3):
        for head in range(4):
            col = w[layer, head, :, 2]
            spec[layer, head] = col[5] - col[[1, 3, 4]].mean()
    found = specific_heads(amap, "it", "cat", k=12)
    assert [s.specificity for s in found] == spec.flatten().sort(descending=True).values.tolist()


def test_sinks_add_up_to_the_rollout():
    amap = _crowd_map()
    s = sinks(amap, "it", "cat")
    final = amap.rollout()[-1, 5]
    assert s.special == pytest.approx(final[[0, 6]].sum().item(), abs=1e-15)
    assert s.target == final[2].item() and 1 <= s.rank <= s.words == 5


def test_minilm_it_looks_at_cat_in_a_head_specific_to_it(cat_map):
    """On the real model the answer is a head where "it" gives "cat" more than the other words
    do, and the head where "it" gives "cat" the most is one every word looks at "cat" in."""
    best, top = specific_head(cat_map, "it", "cat"), strongest(cat_map, "it", "cat")
    assert best.weight > 2 * best.others
    assert (top.layer, top.head) != (best.layer, best.head) and top.others > 0.5 * top.weight
    lines = question_lines(cat_map, "it", "cat", lang="en")
    assert f"layer {best.layer} head {best.head}" in lines[1]
    assert "every word looks at" in lines[2]


def test_minilm_the_same_head_follows_dirty_to_mat(minilm, cat_map):
    from qkv.inspect.attend import model_attention

    dirty = model_attention("The cat sat on the mat because it was dirty")
    best = specific_head(cat_map, "it", "cat")
    row_tired = cat_map.weights[best.layer, best.head, 8]
    row_dirty = dirty.weights[best.layer, best.head, 8]
    assert row_tired[2] > row_tired[6] and row_dirty[6] > row_dirty[2]  # cat, then mat
    for lang, word in (("en", "follows the meaning"), ("zh", "跟着句意走")):
        text = "\n".join(
            question_lines(cat_map, "it", "cat", contrast=dirty, contrast_target="mat", lang=lang)
        )
        assert word in text and f"{row_dirty[6].item():.3f}" in text


def test_the_summary_explains_the_sink_tokens(cat_map):
    s = sinks(cat_map, "it", "cat")
    assert s.special > 0.5  # most of the rollout ends on [CLS] and [SEP]
    assert f'{s.special:.0%} of "it"\'s attention rollout sits on the special tokens' in summary(
        cat_map, "it"
    )
    assert "注意力汇聚点" in summary(cat_map, "it", lang="zh")
