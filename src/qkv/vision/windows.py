"""Window partition of a Qwen2.5-VL-style vision encoder.

The encoder sees the patches of every image (video frame) packed into one sequence, in merge-
block order (see `qkv.vision.mrope.vision_position_ids`). Most blocks attend within windows of
`window_size` pixels (112: 8×8 patches = 4×4 merged units of 2×2 patches), a few within whole
frames. To make every window a contiguous run, the sequence is permuted once, at the level of
merged units, by the *window index*; both kinds of block then run on the permuted sequence with
their own `cu_seqlens`, and the inverse permutation restores the order at the end::

    frame of 6×10 merged units, windows of 4×4:    window order of the units:
        a a a a b b b b c c                        a a a a a a a a a a a a a a a a
        a a a a b b b b c c                        b … (16) … c … (8) … d … (8) …
        a a a a b b b b c c                        e … (8) … f (4)
        a a a a b b b b c c
        d d d d e e e e f f    windows at the right and bottom edges are smaller
        d d d d e e e e f f

Frames stay contiguous in window order (windows never cross a frame), so the frames'
`cu_seqlens` hold for the permuted sequence too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .mrope import grid_rows


@dataclass(frozen=True)
class WindowPartition:
    """The windows of packed images/videos, at two granularities: merged units (what transformers'
    `window_index` permutes) and patches (`unit` consecutive patches per merged unit)."""

    index: torch.Tensor  # (U,) int64: window-order position i holds merged unit index[i]
    inverse: torch.Tensor  # (U,) int64: argsort(index), back to the encoder's order
    cu_window_seqlens: torch.Tensor  # (W + 1,) int32, windows in patches (empty windows dropped)
    cu_seqlens: torch.Tensor  # (F + 1,) int32, frames (images) in patches
    unit: int  # patches per merged unit (merge²)

    @property
    def patch_index(self) -> torch.Tensor:
        """`(N,)` int64: the window index expanded to patches."""
        u = self.unit
        return (self.index.view(-1, 1) * u + torch.arange(u)).reshape(-1)

    @property
    def patch_inverse(self) -> torch.Tensor:
        """`(N,)` int64: the inverse of `patch_index`."""
        u = self.unit
        return (self.inverse.view(-1, 1) * u + torch.arange(u)).reshape(-1)

    @property
    def window_lengths(self) -> list[int]:
        """Lengths of the windows in patches."""
        return (self.cu_window_seqlens[1:] - self.cu_window_seqlens[:-1]).tolist()

    def to_windows(self, x: torch.Tensor) -> torch.Tensor:
        """Patches `(N, …)` in the encoder's order → window order."""
        return x.index_select(0, self.patch_index.to(x.device))

    def from_windows(self, x: torch.Tensor) -> torch.Tensor:
        """Patches `(N, …)` in window order → the encoder's order."""
        return x.index_select(0, self.patch_inverse.to(x.device))


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def window_partition(
    grid_thw: torch.Tensor | Sequence,
    *,
    window_size: int = 112,
    patch_size: int = 14,
    spatial_merge_size: int = 2,
) -> WindowPartition:
    """The window partition of images/videos with encoder grids `grid_thw (n, 3)` (t, h, w in
    patches), equal to transformers' `get_vision_window_index` (Qwen2.5-VL).

    A window is `window_size // spatial_merge_size // patch_size` merged units on a side (4 by
    default); windows start at the top-left of each frame, those at the right and bottom edges
    are cut short, and empty ones are dropped."""
    window_size = _positive("window_size", window_size)
    patch_size = _positive("patch_size", patch_size)
    m = _positive("spatial_merge_size", spatial_merge_size)
    side = window_size // m // patch_size
    if side < 1:
        raise ValueError(
            f"window_size={window_size} is smaller than one merged unit "
            f"({m}×{patch_size} = {m * patch_size} pixels)"
        )
    rows = grid_rows("grid_thw", grid_thw)
    if not rows:
        raise ValueError("grid_thw must describe at least one image or video")
    index, window_units, frame_patches = [], [], []
    offset = 0
    for t, h, w in rows:
        if h % m or w % m:
            raise ValueError(f"grid (t, h, w)=({t}, {h}, {w}) does not divide by merge size {m}")
        lh, lw = h // m, w // m
        nh, nw = -(-lh // side), -(-lw // side)  # windows per column / row
        units = torch.arange(t * lh * lw).view(t, lh, lw)
        # pad to whole windows with −1, then read window by window
        padded = torch.full((t, nh * side, nw * side), -1, dtype=torch.long)
        padded[:, :lh, :lw] = units
        by_window = (
            padded.view(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t, -1, side**2)
        )
        real = by_window >= 0
        window_units.append(real.sum(-1).reshape(-1))
        index.append(by_window[real] + offset)
        offset += t * lh * lw
        frame_patches += [h * w] * t
    idx = torch.cat(index)
    counts = torch.cat(window_units)
    counts = counts[counts > 0]
    unit = m * m
    cu_w = torch.nn.functional.pad(counts.cumsum(0) * unit, (1, 0)).to(torch.int32)
    cu_f = torch.nn.functional.pad(torch.tensor(frame_patches).cumsum(0), (1, 0)).to(torch.int32)
    return WindowPartition(
        index=idx, inverse=torch.argsort(idx), cu_window_seqlens=cu_w, cu_seqlens=cu_f, unit=unit
    )
