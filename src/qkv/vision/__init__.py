"""Visual tokens: what an image costs and where its tokens sit.

    qkv.vision.token_count("qwen2-vl", 1344, 1344)               # 1225 (default max_pixels)
    ids, deltas = qkv.vision.mrope_position_ids(token_types, image_grid_thw)   # (3, B, L)
    part = qkv.vision.window_partition(grid_thw)                  # Qwen2.5-VL windows
    out = qkv.vision.packed_attention(q, k, v, part.cu_window_seqlens)   # one qkv call

Modules: `tokens` (counts and attention cost), `mrope` (M-RoPE ids and rotation, 2-D RoPE),
`windows` (Qwen2.5-VL window partition), `packed` (packed attention in one call).
"""

from .mrope import (
    apply_rotary,
    mrope_cos_sin,
    mrope_position_ids,
    vision_cos_sin,
    vision_position_ids,
)
from .packed import packed_attention
from .tokens import (
    MODELS,
    AttentionCost,
    ImageTokens,
    attention_cost,
    image_tokens,
    smart_resize,
    token_count,
    window_lengths,
)
from .windows import WindowPartition, window_partition

__all__ = [
    "MODELS",
    "AttentionCost",
    "ImageTokens",
    "WindowPartition",
    "apply_rotary",
    "attention_cost",
    "image_tokens",
    "mrope_cos_sin",
    "mrope_position_ids",
    "packed_attention",
    "smart_resize",
    "token_count",
    "vision_cos_sin",
    "vision_position_ids",
    "window_lengths",
    "window_partition",
]
