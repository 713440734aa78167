"""Qwen2.5-VL window partition: equal to transformers', a permutation, windows contiguous."""

from __future__ import annotations

import itertools

import pytest
import torch

from qkv.vision import vision_position_ids, window_partition

vu = pytest.importorskip("transformers.vision_utils")

GRIDS = [
    [[1, 96, 96]],  # 1344×1344 at 14-pixel patches: 144 full windows
    [[1, 96, 96], [1, 54, 96], [1, 34, 46], [1, 32, 32]],  # the benchmark's four images
    [[2, 10, 14], [1, 2, 2], [3, 6, 20]],  # videos, tiny images, windows cut at the edges
    [[1, 8, 8]],  # exactly one window
    [[1, 2, 200]],  # a strip one merged unit high
]


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{len(g)} grids")
@pytest.mark.parametrize("window,patch,merge", [(112, 14, 2), (56, 14, 2), (64, 16, 2)])
def test_equals_transformers(grid, window, patch, merge):
    g = torch.tensor(grid)
    if any(h % merge or w % merge for _, h, w in grid):
        pytest.skip("grid does not divide by the merge size")
    index, cu_windows = vu.get_vision_window_index(g, merge, window, patch)
    part = window_partition(g, window_size=window, patch_size=patch, spatial_merge_size=merge)
    assert torch.equal(part.index, index)
    assert torch.equal(part.cu_window_seqlens, cu_windows)
    assert torch.equal(part.cu_seqlens, vu.get_vision_cu_seqlens(g))
    assert part.unit == merge * merge


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{len(g)} grids")
def test_index_round_trips(grid):
    part = window_partition(grid)
    n = sum(t * h * w for t, h, w in grid)
    assert torch.equal(part.index.sort().values, torch.arange(n // 4))  # a permutation
    assert torch.equal(part.index[part.inverse], torch.arange(n // 4))
    assert torch.equal(part.patch_index[part.patch_inverse], torch.arange(n))
    x = torch.randn(n, 5)
    assert torch.equal(part.from_windows(part.to_windows(x)), x)


@pytest.mark.parametrize("grid", GRIDS[1:3], ids=["images", "videos"])
def test_every_window_is_one_8x8_block_of_one_frame(grid):
    part = window_partition(grid)
    pos = vision_position_ids(grid, 2)  # (row, col) of each patch in the encoder's order
    frame = torch.cat(
        [torch.arange(i, i + t).repeat_interleave(h * w) for i, (t, h, w) in _frame_starts(grid)]
    )
    block = pos // 8  # 112-pixel windows are 8×8 patches
    key = frame * 10**6 + block[:, 0] * 1000 + block[:, 1]
    key = part.to_windows(key)
    cu = part.cu_window_seqlens.tolist()
    seen = set()
    for a, b in itertools.pairwise(cu):
        window = key[a:b].unique()
        assert window.numel() == 1, "a window mixes patches of different blocks or frames"
        assert int(window) not in seen
        seen.add(int(window))
    # the frames' cu_seqlens hold in window order too: frames stay contiguous
    frame_w = part.to_windows(frame)
    for a, b in zip(part.cu_seqlens.tolist(), part.cu_seqlens.tolist()[1:], strict=False):
        assert frame_w[a:b].unique().numel() == 1


def _frame_starts(grid):
    start = 0
    for t, h, w in grid:
        yield start, (t, h, w)
        start += t
