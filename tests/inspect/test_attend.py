"""AttentionMap: subword merging, the questions it answers, and the real model's numbers."""

from __future__ import annotations

import pytest
import torch

from qkv.inspect.attend import EXAMPLE, AttendError, AttentionMap, default_word, summary
from qkv.inspect.specific import specific_head

from ..helpers import assert_error_ratio


def _random_weights(L=2, H=3, N=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, N, N, generator=g, dtype=torch.float64).softmax(-1)


def test_subwords_merge_sum_to_and_mean_from():
    w = _random_weights()
    tokens = ["[CLS]", "play", "##ing", "cat", "[SEP]"]
    amap = AttentionMap.from_weights(w, tokens, [None, 0, 0, 1, None])
    assert amap.words == ["[CLS]", "playing", "cat", "[SEP]"]
    merged = amap.weights
    # to "playing": the sum of its two pieces' columns; from "playing": the mean of its rows
    torch.testing.assert_close(merged[:, :, 0, 1], w[:, :, 0, 1] + w[:, :, 0, 2])
    torch.testing.assert_close(merged[:, :, 1, 2], (w[:, :, 1, 3] + w[:, :, 2, 3]) / 2)
    torch.testing.assert_close(merged[:, :, 2, 2], w[:, :, 3, 3])
    torch.testing.assert_close(merged.sum(-1), torch.ones(2, 3, 4, dtype=torch.float64))


def test_from_weights_accepts_what_qkv_returns():
    full = _random_weights()  # (L, H, N, N)
    for w, shape in ((full[0, 0], (1, 1, 5, 5)), (full[0], (1, 3, 5, 5)), (full, (2, 3, 5, 5))):
        assert AttentionMap.from_weights(w, list("abcde")).weights.shape == shape
    per_layer = [t.unsqueeze(0) for t in full]  # what output_attentions returns
    assert torch.equal(AttentionMap.from_weights(per_layer, list("abcde")).weights, full)


def test_questions_match_brute_force():
    amap = AttentionMap.from_weights(_random_weights(L=3, H=4, N=6, seed=3), list("uvwxyz"))
    i = amap.index("W")  # case-insensitive
    for key, hw in amap.strongest_heads(i).items():
        j = int(key.split(":")[0])
        assert hw.weight == amap.weights[:, :, i, j].max().item()
        assert amap.weights[hw.layer, hw.head, i, j].item() == hw.weight
    top = amap.top_heads(i, "y", k=3)
    expected = amap.weights[:, :, i, 4].flatten().sort(descending=True).values[:3]
    assert [t.weight for t in top] == expected.tolist()
    focused = amap.focused_heads(i, k=2)
    others = amap.weights[:, :, i, [0, 1, 3, 4, 5]].amax(-1).flatten().sort(descending=True)
    assert [hw.weight for hw, _ in focused] == others.values[:2].tolist()


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda m: m.index("dog"), "the word 'dog' is not in the text"),
        (lambda m: m.row("a", 2, 0), "layer 2 is out of range; the model has layers 0..1"),
        (lambda m: m.row("a", 0, 3), "head 3 is out of range; each layer has heads 0..2"),
        (lambda m: m.row("a", -1, 0), "layer -1 is out of range"),
    ],
)
def test_bad_questions_are_clear_errors(call, message):
    amap = AttentionMap.from_weights(_random_weights(N=3), ["a", "b", "c"])
    with pytest.raises(AttendError, match=message):
        call(amap)


def test_bad_weights_are_clear_errors():
    with pytest.raises(AttendError, match="3 tokens for attention over 5 positions"):
        AttentionMap.from_weights(_random_weights(), ["a", "b", "c"])
    with pytest.raises(AttendError, match=r"weights must be \(L, H, N, N\)"):
        AttentionMap.from_weights(torch.rand(2, 3, 4, 5), list("abcd"))


def test_minilm_weights_equal_the_models_own(minilm, cat_map):
    """The map qkv reports equals the eager model's attention weights (error-ratio rule, with
    the model run in float64 as the golden)."""
    import copy

    model, tok, _ = minilm
    batch = tok(EXAMPLE, return_tensors="pt")
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        ref = torch.stack([a[0] for a in eager(**batch, output_attentions=True).attentions])
        gold = torch.stack(
            [a[0] for a in eager.double()(**batch, output_attentions=True).attentions]
        )
    # every word of the example is a single token, so the map is the model's own weights
    assert cat_map.words == tok.convert_ids_to_tokens(batch["input_ids"][0])
    assert_error_ratio(cat_map.weights.float(), ref, gold, what="attention map")
    assert cat_map.layers == 6 and cat_map.heads == 12
    assert default_word(cat_map) == "it"


def test_summary_reports_the_models_weights(cat_map):
    text = summary(cat_map, "it")
    best = specific_head(cat_map, "it", "cat")
    assert best.weight == cat_map.weights[best.layer, best.head, 8, 2].item()
    assert f"cat      layer {best.layer} head {best.head:<2}  {best.weight:.3f}" in text
    assert f"others {best.others:.3f}" in text
    full = summary(cat_map, "it", layer=best.layer, head=best.head)
    assert f"cat        {best.weight:.3f}" in full


def test_the_answer_in_chinese_says_the_same_numbers(cat_map):
    from qkv.inspect.text import columns

    en, zh = summary(cat_map, "it"), summary(cat_map, "it", lang="zh")
    best = specific_head(cat_map, "it", "cat")
    assert "“it”（编号 8 的词）看向哪里？（层、头和词都从 0 开始编号）" in zh
    assert f"cat      层 {best.layer} 头 {best.head:<2}  {best.weight:.3f}" in zh
    assert "第 0 层" not in zh and "第 8 个词" not in zh  # 0-based numbers are not ordinals
    assert "经过全部 6 层之后，“it”的信息来自哪里" in zh
    numbers = [line.split()[-1] for line in en.splitlines() if line.startswith("    [")]
    assert numbers == [line.split()[-1] for line in zh.splitlines() if line.startswith("    [")]
    full = summary(cat_map, "it", layer=best.layer, lang="zh").splitlines()
    assert full[2].startswith("  词") and len({columns(r) for r in full[2:]}) == 1  # aligned
    with pytest.raises(ValueError, match="lang must be en or zh"):
        summary(cat_map, "it", lang="fr")


def test_empty_text_is_refused_before_loading_a_model():
    from qkv.inspect.attend import model_attention

    with pytest.raises(AttendError, match="the text is empty"):
        model_attention("   ")
