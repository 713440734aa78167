"""What the compiled CPU kernel reads of a problem's block layout.

The tiles themselves come from `qkv.layout` — the one place that works out which tiles are
EMPTY, PARTIAL or FULL — as `layout_for(pairs, block_q, 64)` (or the `BlockLayout` the caller
holds, when it has these tile sizes), and how they are found — from the rows' key intervals,
tile by tile, or cut at packed segments — is `qkv.layout.tile_plan`'s decision (and
`qkv.layout.chosen_tiles`'s for blocks chosen per head). A tile is 64 keys wide, so a tile row's
allowed keys fit in one uint64. This module only encodes those tiles for the kernel:

- `row_ptr (nqb + 1)`, `col_idx (nnz)`, `code (nnz)`: the kept tiles of each query-tile row,
  left to right (the layout's compressed rows); a tile's code is `TILE_FULL` (−1) or its index
  p into `bits`;
- `col_ptr (nkb + 1)`, `row_idx (nnz)`, `code_t (nnz)`: the same tiles by key-tile column, top
  to bottom, with the same codes (the layout's compressed columns: the backward's walk);
- `bits (P, Bm, Hm, block_q)` int64 read as uint64: bit c of `bits[p, b, h, r]` says whether row
  r of PARTIAL tile p may attend to key c of the tile, for batch element b and head h
  (`Bm`, `Hm` are 1 when the mask does not depend on them). Bits past Nq or Nk are 0;
- `q_starts (nqb + 1)`, `k_starts (nkb + 1)`: where each tile begins, or None for the uniform
  grid (query tile i at row i·block_q, key tile j at key 64·j).

Packed sequences (a mask with `Mask.segments`: `document`, `varlen`) may get tiles cut at the
segment boundaries instead (`encode_segments`): each segment's rows in pieces of at most block_q,
its keys in pieces of at most 64, and only a segment's own tiles kept. Short segments that do not
start on a multiple of 64 (the windows of a vision encoder) then cost one tile each instead of
pieces of two or three; the cut is taken when it keeps no more tiles than the uniform grid.

Where each query row's allowed keys are a union of intervals (no mask; a rule with exact key
ranges, `Mask.exact_ranges`: windows, causal, global tokens, documents, prefix LM and their
unions and intersections; a key-padding bool tensor; the causal rule among them), the kernel's
`tile_layout` builds the arrays from those intervals, which `qkv.layout.row_intervals` works out,
in one pass over the tiles (`encode_intervals`): at N = 2048 a tenth of a millisecond to half a
millisecond, at 65,536 a few. The C++ never decides which pairs a rule allows. Other masks are
examined with `qkv.layout.allowed` on the PARTIAL tiles only, a chunk of tiles at a time, so
memory stays O(kept tiles).

`kernel_layout` keeps the result in qkv's cache (`qkv.cache.CACHE`): per Mask (held weakly) for
structured masks, by shape for plain and causal problems, never for bool mask tensors (their
content may change between calls). A problem of one query tile (a decoding step) keeps one entry
for the latest key length (`Cache.latest`): the layers of a step share it, and a loop over
growing lengths does not pin an entry per length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache import CACHE
from ...layout import (
    BlockLayout,
    SegmentTiles,
    TilePlan,
    allowed,
    chosen_tiles,
    layout_for,
    tile_plan,
)
from ...pairs import Pairs
from .build import loaded

BLOCK_K = 64  # keys per tile: one uint64 of mask bits per tile row
TILE_FULL = -1  # the code of a FULL tile
BITS_CHUNK = 1 << 18  # mask pairs evaluated at once (PARTIAL tiles × Bm × Hm × block_q × 64)


@dataclass(frozen=True)
class CpuLayout:
    """Kept tiles of one problem, in the form the compiled kernel reads (module docstring)."""

    block_q: int  # query rows per tile
    q_len: int  # Nq
    kv_len: int  # Nk
    row_ptr: torch.Tensor  # int64 (nqb + 1)
    col_idx: torch.Tensor  # int32 (nnz): key tile of each kept tile, by query-tile row
    code: torch.Tensor  # int32 (nnz): TILE_FULL or index into bits
    col_ptr: torch.Tensor  # int64 (nkb + 1)
    row_idx: torch.Tensor  # int32 (nnz): query tile of each kept tile, by key-tile column
    code_t: torch.Tensor  # int32 (nnz)
    bits: torch.Tensor  # int64 (P, Bm, Hm, block_q): allowed keys of PARTIAL tiles' rows
    q_starts: torch.Tensor | None = None  # int64 (nqb + 1): first row of each query tile
    k_starts: torch.Tensor | None = None  # int64 (nkb + 1): first key of each key tile

    @property
    def kept_tiles(self) -> int:
        return int(self.col_idx.numel())

    @property
    def partial_tiles(self) -> int:
        return int(self.bits.shape[0])


def mask_dims(pairs: Pairs) -> tuple[int, int]:
    """(Bm, Hm): how many batch elements / heads the allowed pairs differ over (1 or B, 1 or H)."""
    rule, mask = pairs.rule, pairs.mask
    bm = max(rule.batch or 1 if rule is not None else 1, mask.shape[0] if mask is not None else 1)
    hm = max(rule.heads or 1 if rule is not None else 1, mask.shape[1] if mask is not None else 1)
    return bm, hm


_BYTE_BITS = 1 << torch.arange(8, dtype=torch.uint8)  # weights of the 8 bits of a byte


def pack_bits(ok: torch.Tensor) -> torch.Tensor:
    """`(..., 64)` bool → `(...)` int64 with bit c set where key c is allowed: 8 keys to a byte,
    then the 8 bytes read as one little-endian int64 (the byte order of x86 and ARM)."""
    eights = ok.reshape(*ok.shape[:-1], 8, 8).to(torch.uint8) * _BYTE_BITS
    return eights.sum(-1, dtype=torch.uint8).contiguous().view(torch.int64).squeeze(-1)


def partial_bits(
    pairs: Pairs,
    rows: torch.Tensor,
    cols: torch.Tensor,
    block_q: int,
    q_starts: torch.Tensor | None = None,
    k_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """bits `(P, Bm, Hm, block_q)` int64 of the PARTIAL tiles at (query tile, key tile) =
    (rows[p], cols[p]), evaluated by `qkv.layout.allowed` a chunk of tiles at a time; tile
    origins from `q_starts`/`k_starts` when given, else the uniform grid."""
    nq, nk = pairs.q_len, pairs.kv_len
    if q_starts is None:
        q_starts = torch.arange(-(-nq // block_q) + 1) * block_q
        k_starts = torch.arange(-(-nk // BLOCK_K) + 1) * BLOCK_K
    assert k_starts is not None
    q_ends = q_starts[1:].clamp(max=nq)
    k_ends = k_starts[1:].clamp(max=nk)
    bm, hm = mask_dims(pairs)
    out = torch.empty(rows.numel(), bm, hm, block_q, dtype=torch.int64)
    per = max(1, BITS_CHUNK // (block_q * BLOCK_K * bm * hm))
    r_off = torch.arange(block_q).view(1, block_q, 1)
    c_off = torch.arange(BLOCK_K).view(1, 1, BLOCK_K)
    b = torch.arange(bm).view(-1, 1, 1, 1, 1)
    h = torch.arange(hm).view(1, -1, 1, 1, 1)
    mask = None if pairs.mask is None else pairs.mask.cpu()
    for a in range(0, rows.numel(), per):
        ti, tj = rows[a : a + per].view(-1, 1, 1), cols[a : a + per].view(-1, 1, 1)
        r = q_starts[ti] + r_off  # (p, bq, 1)
        c = k_starts[tj] + c_off  # (p, 1, 64)
        ok = allowed(b, h, r.clamp(max=nq - 1), c.clamp(max=nk - 1), q_len=nq, kv_len=nk,
                     causal=pairs.causal, rule=pairs.rule, mask=mask)  # fmt: skip
        inside = (r < q_ends[ti]) & (c < k_ends[tj])
        ok = inside if ok is None else ok & inside
        ok = torch.broadcast_to(ok, (bm, hm, r.shape[0], block_q, BLOCK_K))
        out[a : a + per] = pack_bits(ok).permute(2, 0, 1, 3)
    return out


def encode(pairs: Pairs, lay: BlockLayout) -> CpuLayout:
    """`lay` (a `block_q × 64` BlockLayout of `pairs`) as the kernel's arrays, with the bits of
    its PARTIAL tiles."""
    if lay.block_k != BLOCK_K:
        raise ValueError(f"the compiled kernel reads 64-key tiles, got block_k={lay.block_k}")
    partial = (~lay.full).nonzero().view(-1)  # forward indices, in forward order
    code = torch.full((lay.nnz,), TILE_FULL, dtype=torch.int32)
    code[partial] = torch.arange(partial.numel(), dtype=torch.int32)
    rows = lay.tile_rows()
    return CpuLayout(
        block_q=lay.block_q,
        q_len=lay.q_len,
        kv_len=lay.kv_len,
        row_ptr=lay.row_ptr,
        col_idx=lay.col.to(torch.int32),
        code=code,
        col_ptr=lay.col_ptr,
        row_idx=rows[lay.by_col].to(torch.int32),
        code_t=code[lay.by_col],
        bits=partial_bits(pairs, rows[partial], lay.col[partial], lay.block_q),
    )


def encode_segments(pairs: Pairs, cut: SegmentTiles, block_q: int) -> CpuLayout:
    """The tiles `cut` at the segment boundaries of `pairs`'s packed-sequence rule (module
    docstring; `qkv.layout.TilePlan.cut`) as the kernel's arrays, with the bits of their
    PARTIAL tiles."""
    partial = (~cut.full).nonzero().view(-1)
    code = torch.full((cut.rows.numel(),), TILE_FULL, dtype=torch.int32)
    code[partial] = torch.arange(partial.numel(), dtype=torch.int32)
    nqb, nkb = cut.q_starts.numel() - 1, cut.k_starts.numel() - 1
    by_col = torch.argsort(cut.cols, stable=True)
    zero = torch.zeros(1, dtype=torch.long)
    return CpuLayout(
        block_q=block_q,
        q_len=pairs.q_len,
        kv_len=pairs.kv_len,
        row_ptr=torch.cat([zero, torch.bincount(cut.rows, minlength=nqb).cumsum(0)]),
        col_idx=cut.cols.to(torch.int32),
        code=code,
        col_ptr=torch.cat([zero, torch.bincount(cut.cols, minlength=nkb).cumsum(0)]),
        row_idx=cut.rows[by_col].to(torch.int32),
        code_t=code[by_col],
        bits=partial_bits(
            pairs, cut.rows[partial], cut.cols[partial], block_q, cut.q_starts, cut.k_starts
        ),
        q_starts=cut.q_starts,
        k_starts=cut.k_starts,
    )


def encode_intervals(plan: TilePlan) -> CpuLayout | None:
    """The arrays `encode(layout_for(...))` gives (the same allowed pairs; a tile the rule's
    bounds leave PARTIAL may be FULL here) of a problem whose allowed keys are intervals per
    query row (`plan.intervals`: the rows' intervals and key mask from `plan.row_keys`), built
    by the kernel's `tile_layout` in one pass over the tiles: microseconds for a decoding step,
    a few milliseconds at 64k tokens, where the tile-by-tile examination with torch operations
    costs tens. None where the kernel is not loaded."""
    ops = loaded()
    if ops is None:
        return None
    pairs = plan.pairs
    lo, hi, keys = plan.row_keys()
    if keys is not None:
        keys = keys.expand(*mask_dims(pairs), pairs.kv_len)
    arrays = ops.tile_layout(lo, hi, keys, pairs.q_len, pairs.kv_len, plan.block_q)
    return CpuLayout(plan.block_q, pairs.q_len, pairs.kv_len, *arrays)


def _chosen_arrays(pairs: Pairs, choice: torch.Tensor, block_q: int) -> list[torch.Tensor] | None:
    """Every (b, kv head)'s arrays of a choice (`Pairs.kv_choice`), read straight from its
    block lists by the kernel's `chosen_layout` (csrc/chosen_blocks.cpp) where
    `qkv.layout.chosen_tiles` says the blocks are whole tiles: each chosen block's tiles FULL
    up to the rows' last keys, PARTIAL across them. None otherwise."""
    tiles = chosen_tiles(pairs, block_q, BLOCK_K)
    if tiles is None:
        return None
    ops = loaded()
    assert ops is not None, "the cpu kernel's ops run with the kernel loaded"
    return ops.chosen_layout(choice, tiles.last, tiles.block, pairs.q_len, pairs.kv_len, block_q)


def chosen_forward(pairs: Pairs, choice: torch.Tensor, block_q: int) -> CpuLayout | None:
    """The forward arrays of every (b, kv head) of a choice at once (`_chosen_arrays`), their
    row pointers back to back (the kernel reads one CSR per (b, kv head)). None where the
    blocks are not whole tiles (`joined` then joins each group's `kernel_layout`)."""
    arrays = _chosen_arrays(pairs, choice, block_q)
    if arrays is None:
        return None
    row_ptr, col_idx, code, *_, bits, _ = arrays
    return CpuLayout(
        block_q=block_q, q_len=pairs.q_len, kv_len=pairs.kv_len, row_ptr=row_ptr,
        col_idx=col_idx, code=code, col_ptr=_EMPTY, row_idx=_EMPTY_I, code_t=_EMPTY_I, bits=bits,
    )  # fmt: skip


_EMPTY, _EMPTY_I = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.int32)


def chosen_layouts(pairs: Pairs, choice: torch.Tensor, block_q: int) -> list[CpuLayout] | None:
    """The arrays of each (b, kv head) of a choice (`Pairs.kv_groups` order), forward and
    backward, cut from the joined arrays of all (`_chosen_arrays`); None where the blocks are
    not whole tiles (each group's `kernel_layout` then)."""
    arrays = _chosen_arrays(pairs, choice, block_q)
    if arrays is None:
        return None
    row_ptr, col_idx, code, col_ptr, row_idx, code_t, bits, parts = arrays
    groups = parts.numel() - 1
    row_ptr, col_ptr = row_ptr.view(groups, -1), col_ptr.view(groups, -1)

    def local(c: torch.Tensor, p0: int) -> torch.Tensor:  # a group's PARTIAL codes from 0
        return torch.where(c >= 0, c - p0, c)

    out = []
    for g, (p0, p1) in enumerate(zip(parts[:-1].tolist(), parts[1:].tolist(), strict=True)):
        t0, t1 = int(row_ptr[g, 0]), int(row_ptr[g, -1])
        one = CpuLayout(
            block_q=block_q, q_len=pairs.q_len, kv_len=pairs.kv_len,
            row_ptr=row_ptr[g] - t0, col_idx=col_idx[t0:t1], code=local(code[t0:t1], p0),
            col_ptr=col_ptr[g] - t0, row_idx=row_idx[t0:t1], code_t=local(code_t[t0:t1], p0),
            bits=bits[p0:p1],
        )  # fmt: skip
        out.append(one)
    return out


def joined(layouts: list[CpuLayout]) -> CpuLayout:
    """The forward arrays of several one-(b, kv head) layouts of a problem (`Pairs.kv_groups`
    order) as one: their row pointers back to back, offset into the joined tile and bits
    arrays, which the kernel's forward reads per (b, kv head) in one call."""
    first = layouts[0]
    kept = torch.tensor([0] + [lay.kept_tiles for lay in layouts[:-1]]).cumsum(0)
    parts = torch.tensor([0] + [lay.partial_tiles for lay in layouts[:-1]]).cumsum(0)
    codes = [
        torch.where(lay.code >= 0, lay.code + int(p), lay.code)
        for lay, p in zip(layouts, parts.tolist(), strict=True)
    ]
    return CpuLayout(
        block_q=first.block_q,
        q_len=first.q_len,
        kv_len=first.kv_len,
        row_ptr=torch.cat([lay.row_ptr + o for lay, o in zip(layouts, kept, strict=True)]),
        col_idx=torch.cat([lay.col_idx for lay in layouts]),
        code=torch.cat(codes),
        col_ptr=first.col_ptr,  # the backward reads each group's own
        row_idx=first.row_idx,
        code_t=first.code_t,
        bits=torch.cat([lay.bits for lay in layouts]),
    )


def _build(pairs: Pairs, block_q: int) -> CpuLayout:
    """The arrays of the tiles `qkv.layout.tile_plan` says how to find."""
    plan = tile_plan(pairs, block_q, BLOCK_K)
    uniform = encode_intervals(plan) if plan.intervals else None
    if uniform is None:
        uniform = encode(pairs, layout_for(pairs, block_q, BLOCK_K))
    cut = plan.cut(uniform.kept_tiles)
    return uniform if cut is None else encode_segments(pairs, cut, block_q)


def kernel_layout(pairs: Pairs, block_q: int) -> CpuLayout:
    """The kernel's arrays for `pairs` with tiles of at most `block_q × 64` (module docstring),
    from qkv's cache; a bool mask tensor's read anew every call. One query tile (a decoding
    step) keeps a single entry per (Mask, Nq, causal) for the latest key length: every layer of
    a step shares it, and a loop over growing lengths pins no entry per length."""
    if pairs.mask is not None:
        return _build(pairs, block_q)
    shape = (pairs.q_len, block_q, pairs.causal, *mask_dims(pairs))
    if pairs.q_len <= block_q:
        step = ("cpu-layout-step", *shape)
        return CACHE.latest(step, pairs.kv_len, lambda: _build(pairs, block_q), pairs.rule)
    key = ("cpu-layout", pairs.kv_len, *shape)
    return CACHE.get(key, lambda: _build(pairs, block_q), owner=pairs.rule)
