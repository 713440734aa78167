"""Token counts equal what transformers' processors insert, for any image size."""

from __future__ import annotations

import itertools
import types

import numpy as np
import pytest

from qkv.vision import attention_cost, image_tokens, token_count, window_lengths, window_partition

# Awkward sizes on purpose: below/at/above the 28-pixel factor and the 336 crop, halves that
# Python's round sends to the even neighbour (14, 42, 70), and very large images.
SIDES = [1, 2, 13, 14, 27, 28, 29, 42, 55, 56, 70, 99, 223, 224, 225, 336, 337, 500, 671, 672]
SIDES += [673, 1000, 1007, 1344, 1345, 2000, 3840, 5000, 10000]
# Extreme aspect ratios up to transformers' limit of 200 (Qwen2-VL refuses beyond it).
EXTREME = [(1, 200), (200, 1), (3, 600), (600, 3), (10, 2000), (2000, 10), (28, 5600), (5600, 28)]
EXTREME += [(50, 9999), (9999, 50), (112, 20000), (20000, 112)]
PIXEL_LIMITS = [
    {},
    {"min_pixels": 224 * 224},
    {"max_pixels": 256 * 28 * 28},
    {"min_pixels": 512 * 28 * 28, "max_pixels": 1024 * 28 * 28},
    {"max_pixels": 12845056},
    {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 4},
]


def _grid():
    sizes = list(itertools.product(SIDES, SIDES)) + EXTREME
    return [(h, w) for h, w in sizes if max(h, w) / min(h, w) <= 200]


@pytest.mark.parametrize("limits", PIXEL_LIMITS, ids=lambda d: str(d) or "defaults")
def test_qwen2_vl_counts_equal_the_image_processor(qwen_image_processor, limits):
    processor = qwen_image_processor()
    kwargs = dict(limits)
    for h, w in _grid():
        # transformers' count, as vLLM asks for it: patches of the resized image, merged 2×2
        patches = processor.get_number_of_image_patches(h, w, kwargs)
        assert token_count("qwen2-vl", w, h, **limits) == patches // 4, (w, h, limits)


def test_llava_next_counts_equal_the_processor(llava_processor):
    processor = llava_processor()
    sizes = _grid() + [(h, w) for h, w in itertools.product(SIDES, SIDES) if h / w > 200]
    theirs = processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens
    ours = [token_count("llava-next", w, h) for h, w in sizes]
    assert ours == theirs


def test_llava_next_full_strategy_keeps_the_cls_token(llava_processor):
    processor = llava_processor("full")
    sizes = [(336, 336), (500, 700), (20, 4000), (1344, 1344)]
    theirs = processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens
    ours = [
        token_count("llava-next", w, h, vision_feature_select_strategy="full") for h, w in sizes
    ]
    assert ours == theirs
    assert ours[0] == token_count("llava-next", 336, 336) + 1


def _image(w: int, h: int):
    from PIL import Image

    rng = np.random.default_rng(w * 7 + h)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


SAMPLES = [(224, 224), (500, 375), (1344, 1344), (30, 3000), (3000, 30), (17, 61), (2100, 900)]


@pytest.mark.parametrize("limits", PIXEL_LIMITS[:4], ids=lambda d: str(d) or "defaults")
def test_qwen2_vl_counts_equal_the_tokens_the_processor_inserts(qwen_image_processor, limits):
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    processor = qwen_image_processor(**limits)
    for w, h in SAMPLES:
        inputs = processor(images=[_image(w, h)])
        # the processor's own expansion of <|image_pad|> (it needs only these two attributes)
        me = types.SimpleNamespace(image_processor=processor, image_token="<|image_pad|>")
        inserted = Qwen2VLProcessor.replace_image_token(me, inputs, 0)
        n = len(inserted) // len("<|image_pad|>")
        t = image_tokens("qwen2-vl", w, h, **limits)
        assert t.tokens == n, (w, h)
        grid = inputs["image_grid_thw"][0].tolist()
        assert [1, *t.patch_grid] == grid
        assert t.encoder_segments == (grid[1] * grid[2],)


def test_llava_next_counts_equal_the_tokens_the_processor_inserts(llava_processor):
    processor = llava_processor()
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    for w, h in SAMPLES:
        out = processor(text=["hi <image> hi"], images=[_image(w, h)], return_tensors="pt")
        inserted = int((out["input_ids"] == image_id).sum())
        assert token_count("llava-next", w, h) == inserted, (w, h)


def test_224_is_64_tokens_and_the_documented_examples():
    assert token_count("qwen2-vl", 224, 224) == 64
    t = image_tokens("qwen2-vl", 1344, 1344)  # capped by the default max_pixels
    assert (t.resized, t.patch_grid, t.grid, t.tokens) == ((980, 980), (70, 70), (35, 35), 1225)
    t = image_tokens("qwen2-vl", 1344, 1344, max_pixels=12845056)
    assert (t.patch_grid, t.tokens) == ((96, 96), 2304)
    t = image_tokens("llava-next", 1344, 1344)
    assert t.tokens == 2928 and t.parts == {
        "unpadded features": 2304,
        "newlines": 48,
        "base image": 576,
    }
    assert t.encoder_segments == (577,) * 5  # 2×2 tiles and the base image, CLS included


def test_attention_cost_counts_pairs_flops_and_bytes():
    c = attention_cost([3, 4], heads=2, head_dim=8)
    assert (c.tokens, c.pairs) == (7, 25)
    assert c.flops == 4 * 25 * 2 * 8
    assert c.weights_bytes == 25 * 2 * 4
    assert c.tiled_bytes == 7 * 2 * 9 * 4
    dense, windowed = attention_cost([9216], 16, 80), attention_cost([64] * 144, 16, 80)
    assert dense.pairs == 144 * windowed.pairs  # 1344² at 14-px patches: 144 windows of 64


@pytest.mark.parametrize("grid", [(96, 96), (54, 96), (34, 46), (2, 2), (10, 30)])
def test_window_lengths_equal_the_window_partition(grid):
    part = window_partition([(1, *grid)])
    assert window_lengths(grid) == part.window_lengths
