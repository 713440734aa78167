"""Multimodal rotary positions: Qwen2-VL's M-RoPE and the 2-D RoPE of a ViT patch grid.

**M-RoPE** (Qwen2-VL). Every token gets three position ids, (temporal, height, width), shape
`(3, B, L)`. A text token uses the same id on all three axes (plain RoPE); the tokens of an image
or video with an LLM grid of t × h × w (patches after the 2×2 merge) get::

    temporal = start + t_index · interval      (interval 1; for Qwen2.5-VL videos
    height   = start + row                      tokens_per_second · seconds per grid step)
    width    = start + col

and the next token starts at `start + max(h, w)` (transformers ≥ 5's `get_rope_index`; older
releases continued after the largest id, which differs only for videos whose temporal ids pass
max(h, w)). The rotary frequencies of a head are split into `sections` (e.g. [16, 24, 24] of the
64 frequencies of a 128-dim head): the first section turns with the temporal id, the next with
the height id, the last with the width id. The *interleaved* layout (Qwen3-VL) deals frequency i
to height when i % 3 == 1, to width when i % 3 == 2 (within each section's share), else to time.

**2-D RoPE** for a ViT patch grid (Qwen2-VL's vision encoder): a head of D dims rotates D/4
frequencies by the patch's row and the same D/4 by its column; `vision_position_ids` lists the
(row, col) of each patch in the encoder's order (2×2 merge blocks kept together).

All rotations use the Llama `rotate_half` pairing (feature i with i + D/2) and compute in fp32.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2  # token types, as transformers' `mm_token_type_ids`
QWEN2_VL_SECTIONS = (16, 24, 24)  # of a 128-dim head's 64 frequencies


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`(x1, x2) → (−x2, x1)` over the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int = 1
) -> torch.Tensor:
    """Rotate `x` by angles given as `cos`, `sin` (the shape of x without the head dim `dim`):
    `x · cos + rotate_half(x) · sin`, computed in fp32, returned in x's dtype.

    For `x (B, H, L, D)` and `cos (B, L, D)` use dim=1; for the packed `(N, H, D)` layout of a
    vision encoder and `cos (N, D)`, dim=-2."""
    c, s = cos.unsqueeze(dim).float(), sin.unsqueeze(dim).float()
    xf = x.float()
    return (xf * c + rotate_half(xf) * s).to(x.dtype)


def inverse_frequencies(dim: int, base: float = 10000.0) -> torch.Tensor:
    """`1 / base^(2i/dim)` for i < dim/2, float32 (as transformers computes them)."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 2:
        raise ValueError(f"the rotary dim must be a positive even int, got {dim!r}")
    if not base > 1:
        raise ValueError(f"base must be > 1, got {base!r}")
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


# ----------------------------------------------------------------------------- M-RoPE ids


def grid_rows(name: str, grid: object) -> list[tuple[int, int, int]]:
    if grid is None:
        return []
    rows = grid.tolist() if isinstance(grid, torch.Tensor) else grid
    if not isinstance(rows, Sequence):
        raise TypeError(f"{name} must be a (n, 3) tensor or list of (t, h, w), got {grid!r}")
    out = []
    for r in rows:
        if not isinstance(r, Sequence) or len(r) != 3:
            raise ValueError(f"{name} rows must be (t, h, w), got {r!r}")
        t, h, w = (int(x) for x in r)
        if min(t, h, w) <= 0:
            raise ValueError(f"{name} sizes must be positive, got (t, h, w)={tuple(r)}")
        out.append((t, h, w))
    return out


def vision_block_ids(
    start: int, grid_thw: tuple[int, int, int], spatial_merge_size: int = 2, interval: float = 1.0
) -> torch.Tensor:
    """The `(3, t·h·w)` M-RoPE ids of one image or video whose encoder grid is `grid_thw`
    (patches), starting at `start`: the LLM grid is (t, h/m, w/m) for merge size m."""
    t, h, w = grid_thw
    m = spatial_merge_size
    if h % m or w % m:
        raise ValueError(f"grid (t, h, w)={grid_thw} does not divide by spatial_merge_size={m}")
    lt, lh, lw = t, h // m, w // m
    # (arange · interval) truncated, in float32 as transformers computes it
    temporal = (torch.arange(lt) * torch.tensor(interval, dtype=torch.float32)).long()
    tt, hh, ww = torch.meshgrid(temporal, torch.arange(lh), torch.arange(lw), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_position_ids(
    token_types: torch.Tensor,
    image_grid_thw: torch.Tensor | Sequence | None = None,
    video_grid_thw: torch.Tensor | Sequence | None = None,
    *,
    spatial_merge_size: int = 2,
    attention_mask: torch.Tensor | None = None,
    video_intervals: Sequence[float] | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE position ids for a batch of mixed text / image / video sequences.

    Args:
        token_types: int `(B, L)`: 0 text, 1 image, 2 video per token (transformers'
            `mm_token_type_ids`). A run of image (video) tokens takes the next grids from
            `image_grid_thw` (`video_grid_thw`), in order across the batch, until it is covered.
        image_grid_thw, video_grid_thw: `(n, 3)` encoder grids (t, h, w) in patches.
        spatial_merge_size: patches merged per side into one LLM token (2).
        attention_mask: optional `(B, L)`, 1 = real token; padding gets id 0 and is skipped.
        video_intervals: temporal id step per video (Qwen2.5-VL: `tokens_per_second ·
            second_per_grid_t`); default 1 (Qwen2-VL).

    Returns:
        `position_ids (3, B, L)` int64 and `deltas (B, 1)`: `max id + 1 − real length`, what
        decoding adds to a plain position to continue the sequence.
    """
    if not isinstance(token_types, torch.Tensor) or token_types.dim() != 2:
        raise ValueError(f"token_types must be a (B, L) tensor, got {token_types!r}")
    if isinstance(spatial_merge_size, bool) or not isinstance(spatial_merge_size, int):
        raise TypeError(f"spatial_merge_size must be an int, got {spatial_merge_size!r}")
    if spatial_merge_size < 1:
        raise ValueError(f"spatial_merge_size must be ≥ 1, got {spatial_merge_size}")
    if attention_mask is not None and attention_mask.shape != token_types.shape:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} must have token_types' shape "
            f"{tuple(token_types.shape)}"
        )
    grids = {IMAGE: iter(grid_rows("image_grid_thw", image_grid_thw)),
             VIDEO: iter(grid_rows("video_grid_thw", video_grid_thw))}  # fmt: skip
    n_videos = len(grid_rows("video_grid_thw", video_grid_thw))
    if video_intervals is None:
        intervals = iter([1.0] * n_videos)
    else:
        vals = (
            video_intervals.tolist()
            if isinstance(video_intervals, torch.Tensor)
            else video_intervals
        )
        if len(vals) != n_videos:
            raise ValueError(f"video_intervals has {len(vals)} entries for {n_videos} videos")
        intervals = iter(float(x) for x in vals)
    B, L = token_types.shape
    m = spatial_merge_size
    ids = torch.zeros(3, B, L, dtype=torch.long)
    deltas = []
    for b in range(B):
        keep = (
            torch.ones(L, dtype=torch.bool) if attention_mask is None else attention_mask[b].bool()
        )
        types = token_types[b][keep.to(token_types.device)].tolist()
        pos, parts = 0, []
        i = 0
        for kind, run in itertools.groupby(types):
            n = len(list(run))
            if kind == TEXT:
                parts.append(torch.arange(n).view(1, -1).expand(3, -1) + pos)
                pos += n
            elif kind in (IMAGE, VIDEO):
                covered = 0
                while covered < n:
                    grid = next(grids[kind], None)
                    if grid is None:
                        what = "image" if kind == IMAGE else "video"
                        raise ValueError(f"more {what} tokens than {what}_grid_thw describes")
                    interval = next(intervals) if kind == VIDEO else 1.0
                    block = vision_block_ids(pos, grid, m, interval)
                    parts.append(block)
                    covered += block.shape[1]
                    pos += max(grid[1], grid[2]) // m
                if covered != n:
                    raise ValueError(
                        f"a run of {n} vision tokens at position {i} of sequence {b} does not "
                        f"match its grids ({covered} tokens)"
                    )
            else:
                raise ValueError(
                    f"token_types must hold 0 (text), 1 (image) or 2 (video), got {kind}"
                )
            i += n
        row = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
        ids[:, b, keep.cpu()] = row
        deltas.append((int(row.max()) + 1 if row.numel() else 0) - row.shape[1])
    for kind, name in ((IMAGE, "image_grid_thw"), (VIDEO, "video_grid_thw")):
        if next(grids[kind], None) is not None:
            raise ValueError(f"{name} describes more grids than the sequences hold")
    return ids.to(token_types.device), torch.tensor(deltas, device=token_types.device).view(B, 1)


# ----------------------------------------------------------------------------- M-RoPE rotation


def mrope_cos_sin(
    position_ids: torch.Tensor,
    head_dim: int,
    *,
    base: float = 10000.0,
    sections: Sequence[int] = QWEN2_VL_SECTIONS,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `(B, L, head_dim)` (float32) of M-RoPE for `position_ids (3, B, L)` (or
    `(B, L)` for text only, the same id on every axis).

    `sections` splits the head_dim/2 frequencies between (temporal, height, width) and must sum
    to head_dim/2. Contiguous layout (Qwen2-VL, Qwen2.5-VL): the first `sections[0]` frequencies
    follow the temporal id, the next `sections[1]` the height, the last `sections[2]` the width.
    Interleaved (Qwen3-VL): frequency i follows the height when i % 3 == 1 and i < 3·sections[1],
    the width when i % 3 == 2 and i < 3·sections[2], otherwise the temporal id."""
    inv = inverse_frequencies(head_dim, base)
    secs = [int(s) for s in sections]
    if len(secs) != 3 or any(s < 0 for s in secs) or sum(secs) != head_dim // 2:
        raise ValueError(
            f"sections must be three non-negative ints summing to head_dim/2={head_dim // 2}, "
            f"got {list(sections)}"
        )
    if position_ids.dim() == 2:
        position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
    if position_ids.dim() != 3 or position_ids.shape[0] != 3:
        raise ValueError(
            f"position_ids must be (3, B, L) or (B, L), got {tuple(position_ids.shape)}"
        )
    freqs = position_ids[..., None].float() * inv.to(position_ids.device)  # (3, B, L, D/2)
    axis = frequency_axes(head_dim, secs, interleaved).to(position_ids.device)
    # pick, for frequency i, the row of its axis: (B, L, D/2)
    chosen = freqs.gather(0, axis.view(1, 1, 1, -1).expand(1, *freqs.shape[1:]))[0]
    emb = torch.cat((chosen, chosen), dim=-1)
    return emb.cos(), emb.sin()


def frequency_axes(head_dim: int, sections: Sequence[int], interleaved: bool) -> torch.Tensor:
    """Which axis (0 temporal, 1 height, 2 width) each of the head_dim/2 frequencies follows."""
    half = head_dim // 2
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(list(sections)))
    axes = torch.zeros(half, dtype=torch.long)
    for axis in (1, 2):
        axes[axis : sections[axis] * 3 : 3] = axis
    return axes


# ----------------------------------------------------------------------------- 2-D RoPE (ViT)


def vision_position_ids(
    grid_thw: torch.Tensor | Sequence, spatial_merge_size: int = 1
) -> torch.Tensor:
    """`(N, 2)` (row, col) of every patch of the images/videos of `grid_thw (n, 3)` (t, h, w), in
    the encoder's order: frame by frame, and within a frame the m×m merge blocks one after
    another (m = `spatial_merge_size`; m = 1 is the plain row-major order of a ViT)."""
    m = spatial_merge_size
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"spatial_merge_size must be an int ≥ 1, got {m!r}")
    out = []
    for t, h, w in grid_rows("grid_thw", grid_thw):
        if h % m or w % m:
            raise ValueError(f"grid (t, h, w)=({t}, {h}, {w}) does not divide by merge size {m}")
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // m, m, w // m, m)  # (block row, row in block, block col, col in block)
        hh = hh.reshape(shape).transpose(1, 2).flatten()
        ww = ww.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack([hh, ww], dim=-1).repeat(t, 1))
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.long)


def vision_cos_sin(
    positions: torch.Tensor, head_dim: int, base: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `(N, head_dim)` of 2-D RoPE for patch `positions (N, 2)` (row, col): head_dim/4
    frequencies turn with the row, the same head_dim/4 with the column (Qwen2-VL's encoder)."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs head_dim divisible by 4, got {head_dim}")
    if positions.dim() != 2 or positions.shape[1] != 2:
        raise ValueError(f"positions must be (N, 2) (row, col), got {tuple(positions.shape)}")
    inv = inverse_frequencies(head_dim // 2, base).to(positions.device)
    freqs = positions[..., None].float() * inv  # (N, 2, D/4)
    hw = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)  # (N, D/2)
    emb = torch.cat([hw, hw], dim=-1)
    return emb.cos(), emb.sin()
