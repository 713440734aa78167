"""Bad arguments raise TypeError / ValueError naming the argument and what was expected."""

from __future__ import annotations

import pytest
import torch

from qkv.vision import (
    attention_cost,
    mrope_cos_sin,
    mrope_position_ids,
    packed_attention,
    smart_resize,
    token_count,
    vision_cos_sin,
    vision_position_ids,
    window_partition,
)

QKV = tuple(torch.randn(10, 2, 4) for _ in range(3))


@pytest.mark.parametrize(
    "call,error,message",
    [
        (
            lambda: token_count("qwen2-vl", 0, 10),
            ValueError,
            "width must be a positive number of pixels, got width=0",
        ),
        (
            lambda: token_count("llava-next", 10, -3),
            ValueError,
            "height must be a positive number of pixels, got height=-3",
        ),
        (
            lambda: token_count("qwen2-vl", 10.5, 10),
            TypeError,
            "width must be an int number of pixels, got float",
        ),
        (lambda: token_count("qwen2-vl", True, 10), TypeError, "width must be an int"),
        (
            lambda: token_count("qwen2-vl", 10, 2001),
            ValueError,
            "absolute aspect ratio must be at most 200, got 200.1 for 10×2001",
        ),
        (lambda: smart_resize(0, 5), ValueError, "height must be a positive number of pixels"),
        (
            lambda: token_count("gpt-4v", 10, 10),
            ValueError,
            "model must be one of qwen2-vl, llava-next, got 'gpt-4v'",
        ),
        (
            lambda: token_count("qwen2-vl", 10, 10, crop_size=336),
            TypeError,
            "unknown option(s) for qwen2-vl: crop_size",
        ),
        (
            lambda: token_count("qwen2-vl", 10, 10, min_pixels=5000, max_pixels=4000),
            ValueError,
            "min_pixels=5000 must be ≤ max_pixels=4000",
        ),
        (
            lambda: token_count("qwen2-vl", 10, 10, max_pixels=0),
            ValueError,
            "max_pixels must be a positive number",
        ),
        (
            lambda: token_count("llava-next", 10, 10, grid_pinpoints=[(336, 500)]),
            ValueError,
            "pinpoint 336×500 (height×width) does not divide into 336-pixel crops",
        ),
        (
            lambda: token_count("llava-next", 10, 10, crop_size=300),
            ValueError,
            "crop_size=300 does not divide into patches of 14 pixels",
        ),
        (
            lambda: token_count("llava-next", 10, 10, vision_feature_select_strategy="cls"),
            ValueError,
            "vision_feature_select_strategy must be one of",
        ),
        (lambda: attention_cost([4, -1], 2, 8), ValueError, "segment lengths must be ≥ 0"),
        (lambda: attention_cost([4], 0, 8), ValueError, "heads must be a positive number"),
        # grids that do not divide by the merge size
        (
            lambda: window_partition([(1, 5, 8)]),
            ValueError,
            "grid (t, h, w)=(1, 5, 8) does not divide by merge size 2",
        ),
        (
            lambda: vision_position_ids([(1, 4, 3)], 2),
            ValueError,
            "grid (t, h, w)=(1, 4, 3) does not divide by merge size 2",
        ),
        (
            lambda: mrope_position_ids(torch.ones(1, 3, dtype=torch.long), [(1, 3, 4)]),
            ValueError,
            "grid (t, h, w)=(1, 3, 4) does not divide by spatial_merge_size=2",
        ),
        (
            lambda: window_partition([(1, 0, 8)]),
            ValueError,
            "grid_thw sizes must be positive, got (t, h, w)=(1, 0, 8)",
        ),
        (lambda: window_partition([]), ValueError, "grid_thw must describe at least one image"),
        (
            lambda: window_partition([(1, 4, 4)], window_size=20),
            ValueError,
            "window_size=20 is smaller than one merged unit (2×14 = 28 pixels)",
        ),
        (lambda: window_partition([(1, 4)]), ValueError, "grid_thw rows must be (t, h, w)"),
        # M-RoPE: tokens and grids that do not agree
        (
            lambda: mrope_position_ids(torch.ones(1, 5, dtype=torch.long), [(1, 2, 2)]),
            ValueError,
            "more image tokens than image_grid_thw describes",
        ),
        (
            lambda: mrope_position_ids(torch.ones(1, 3, dtype=torch.long), [(1, 2, 4)] * 2),
            ValueError,
            "run of 3 vision tokens at position 0 of sequence 0 does not match its grids (4",
        ),
        (
            lambda: mrope_position_ids(torch.zeros(1, 3, dtype=torch.long), [(1, 2, 2)]),
            ValueError,
            "image_grid_thw describes more grids than the sequences hold",
        ),
        (
            lambda: mrope_position_ids(torch.full((1, 3), 5)),
            ValueError,
            "token_types must hold 0 (text), 1 (image) or 2 (video), got 5",
        ),
        (
            lambda: mrope_position_ids(torch.zeros(3, dtype=torch.long)),
            ValueError,
            "token_types must be a (B, L) tensor",
        ),
        (
            lambda: mrope_position_ids(
                torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 4)
            ),
            ValueError,
            "attention_mask (1, 4) must have token_types' shape (1, 3)",
        ),
        (
            lambda: mrope_position_ids(
                torch.full((1, 1), 2), video_grid_thw=[(1, 2, 2)], video_intervals=[1, 2]
            ),
            ValueError,
            "video_intervals has 2 entries for 1 videos",
        ),
        (
            lambda: mrope_cos_sin(
                torch.zeros(3, 1, 4, dtype=torch.long), 64, sections=[16, 24, 24]
            ),
            ValueError,
            "summing to head_dim/2=32, got [16, 24, 24]",
        ),
        (
            lambda: mrope_cos_sin(torch.zeros(2, 1, 4, dtype=torch.long), 8, sections=[2, 1, 1]),
            ValueError,
            "position_ids must be (3, B, L) or (B, L), got (2, 1, 4)",
        ),
        (
            lambda: mrope_cos_sin(torch.zeros(3, 1, 4, dtype=torch.long), 7, sections=[1, 1, 1]),
            ValueError,
            "the rotary dim must be a positive even int, got 7",
        ),
        (
            lambda: vision_cos_sin(torch.zeros(4, 2), 6),
            ValueError,
            "2-D RoPE needs head_dim divisible by 4, got 6",
        ),
        # packed attention
        (
            lambda: packed_attention(*QKV, torch.tensor([1, 10])),
            ValueError,
            "cu_seqlens must start at 0 and never decrease, got [1, 10]",
        ),
        (
            lambda: packed_attention(*QKV, torch.tensor([0, 6, 4, 10])),
            ValueError,
            "cu_seqlens must start at 0 and never decrease",
        ),
        (
            lambda: packed_attention(*QKV, torch.tensor([0, 4, 9])),
            ValueError,
            "cu_seqlens ends at 9, but the packed tensors hold 10 rows",
        ),
        (
            lambda: packed_attention(*QKV, torch.tensor([0.0, 10.0])),
            TypeError,
            "cu_seqlens must be an int32/int64 tensor",
        ),
        (
            lambda: packed_attention(*QKV, [0, 10]),
            TypeError,
            "cu_seqlens must be an int32/int64 tensor",
        ),
        (
            lambda: packed_attention(*QKV, torch.tensor([0, 10]), layout="dense"),
            ValueError,
            "layout must be one of ('auto', 'padded', 'varlen'), got 'dense'",
        ),
        (
            lambda: packed_attention(QKV[0][None], *QKV[1:], torch.tensor([0, 10])),
            ValueError,
            "q must have shape (total_tokens, heads, dim), got (1, 10, 2, 4)",
        ),
        (
            lambda: packed_attention(QKV[0][:9], *QKV[1:], torch.tensor([0, 9])),
            ValueError,
            "q, k and v must hold the same tokens, got 9, 10 and 10 rows",
        ),
    ],
)
def test_bad_arguments(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert message in str(info.value)
