"""Visual tokens: what an image costs, where its tokens sit, and how to attend over many images.

    qkv.vision.token_count("qwen2-vl", 1344, 1344)               # 1225 (default max_pixels)
    ids, deltas = qkv.vision.mrope_position_ids(token_types, image_grid_thw)   # (3, B, L)
    part = qkv.vision.window_partition(grid_thw)                  # Qwen2.5-VL windows
    out = qkv.vision.packed_attention(q, k, v, part.cu_window_seqlens)   # one qkv call
    x, size, m = qkv.vision.merge(x, keys, r=16)                  # ToMe
    a = qkv.vision.received_attention(q, k, causal=True)          # column sums of A, O(N)
    x, kept = qkv.vision.prune(x, a.mean(1), keep=0.5, candidates=is_image)   # FastV

Modules: `tokens` (counts and attention cost), `mrope` (M-RoPE ids and rotation, 2-D RoPE),
`windows` (Qwen2.5-VL window partition), `packed` (packed attention in one call), `tome` (token
merging, proportional attention), `received` (received attention, pruning), `report` (the
`qkv tokens` command's text and plot). docs/vision.md walks through all of it.
"""

from .mrope import (
    apply_rotary,
    mrope_cos_sin,
    mrope_position_ids,
    vision_cos_sin,
    vision_position_ids,
)
from .packed import packed_attention
from .received import prune, received_attention
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
from .tome import (
    Matching,
    bipartite_soft_matching,
    log_size_bias,
    merge,
    proportional_attention,
    size_score_mod,
    unmerge,
)
from .windows import WindowPartition, window_partition

__all__ = [
    "MODELS",
    "AttentionCost",
    "ImageTokens",
    "Matching",
    "WindowPartition",
    "apply_rotary",
    "attention_cost",
    "bipartite_soft_matching",
    "image_tokens",
    "log_size_bias",
    "merge",
    "mrope_cos_sin",
    "mrope_position_ids",
    "packed_attention",
    "proportional_attention",
    "prune",
    "received_attention",
    "size_score_mod",
    "smart_resize",
    "token_count",
    "unmerge",
    "vision_cos_sin",
    "vision_position_ids",
    "window_lengths",
    "window_partition",
]
