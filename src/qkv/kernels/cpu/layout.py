"""The block layout the compiled CPU kernel reads, built from a plan.

The score matrix is cut into `block_q × 64` tiles (64 keys, so a tile row's allowed keys fit in
one uint64). A tile is EMPTY (never computed), FULL (computed with no mask arithmetic) or PARTIAL
(computed, then masked by its bits); a tile is kept if some (batch, head) keeps it, FULL only if
every one sees it whole. The kernel reads:

- `row_ptr (nqb + 1)`, `col_idx (nnz)`, `code (nnz)`: the kept tiles of each query-tile row,
  left to right (CSR); a tile's code is `FULL` (−1) or its index p into `bits`;
- `col_ptr (nkb + 1)`, `row_idx (nnz)`, `code_t (nnz)`: the same tiles by key-tile column, top
  to bottom, with the same codes (the backward's walk);
- `bits (P, Bm, Hm, block_q)` int64 read as uint64: bit c of `bits[p, b, h, r]` says whether row
  r of PARTIAL tile p may attend to key c of the tile, for batch element b and head h
  (`Bm`, `Hm` are 1 when the mask does not depend on them). Bits past Nk are 0.

`build_layout` is the one place that turns what may attend (the causal flag, a bool mask
tensor, a `qkv.masks.Mask`) into this layout. It works a band of query-tile rows at a time,
classifying tiles with the mask's tile bounds (as `qkv.kernels.schedule.tile_kinds` does, never
an Nq×Nk tensor) and evaluating the rule only on the PARTIAL tiles, so memory stays O(band +
kept tiles): a sliding window at N = 1,048,576 builds in a few seconds and a few MiB.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...masks import EMPTY, FULL, PARTIAL, Mask, causal, classify, tile_grid
from ...plan import AttentionPlan

BLOCK_K = 64  # keys per tile: one uint64 of mask bits per tile row
TILE_FULL = -1  # the code of a FULL tile
_BAND_TILES = 1 << 21  # tiles (× batch/head variants) classified at once
_BAND_ELEMENTS = 1 << 21  # mask elements evaluated at once (PARTIAL tiles, rules without bounds)


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

    @property
    def kept_tiles(self) -> int:
        return int(self.col_idx.numel())

    @property
    def partial_tiles(self) -> int:
        return int(self.bits.shape[0])


def _mask_dims(plan: AttentionPlan) -> tuple[int, int]:
    """(Bm, Hm): whether the allowed pairs depend on the batch element / the head."""
    bm = hm = 1
    rule = plan.mask_rule
    if rule is not None:
        bm = plan.batch if rule.batch is not None else 1
        hm = plan.heads if rule.heads is not None else 1
    if plan.mask is not None:
        bm = plan.batch if plan.mask.shape[0] > 1 else bm
        hm = plan.heads if plan.mask.shape[1] > 1 else hm
    return bm, hm


def _band_kinds(plan: AttentionPlan, r0: int, r1: int, bq: int, dims: tuple[int, int]):
    """Tile kinds `(r1 − r0, nkb)` int8 of query-tile rows r0 … r1−1, collapsed over batch and
    heads (kept if any keeps it, FULL if all see it whole)."""
    nq, nk = plan.q_len, plan.kv_len
    nkb = -(-nk // BLOCK_K)
    q_lo, q_hi, k_lo, k_hi = tile_grid(nq, nk, bq, BLOCK_K)
    q_lo, q_hi = q_lo[:, :, r0:r1], q_hi[:, :, r0:r1]
    kind = torch.full((r1 - r0, nkb), FULL, dtype=torch.int8)
    bounds = []
    if plan.causal:
        bounds.append((causal(), None, None))
    rule = plan.mask_rule
    if rule is not None:
        bi = torch.arange(dims[0]).view(-1, 1, 1, 1)
        hi = torch.arange(dims[1]).view(1, -1, 1, 1)
        bounds.append((rule, bi, hi))
    for m, bi, hi in bounds:
        if m._bounds is not None:
            maybe_any, surely_all = m._bounds(bi, hi, q_lo, q_hi, k_lo, k_hi, nk)
            shape = torch.broadcast_shapes(maybe_any.shape, surely_all.shape, (1, 1, r1 - r0, nkb))
            maybe_any = maybe_any.expand(shape).any(0).any(0)
            surely_all = surely_all.expand(shape).all(0).all(0)
        else:  # a rule without tile bounds: evaluate it on the band's rows
            maybe_any, surely_all = _scan_band(plan, m, r0, r1, bq, dims)
        kind = torch.minimum(kind, classify(maybe_any, surely_all))
    if plan.mask is not None:
        kind = torch.minimum(kind, _tensor_band(plan.mask, r0, r1, bq, nq, nk))
    return kind


def _scan_band(plan, rule: Mask, r0: int, r1: int, bq: int, dims):
    """any / all of a rule without tile bounds, per tile of query-tile rows r0 … r1−1,
    evaluated a few tile rows at a time."""
    nq, nk = plan.q_len, plan.kv_len
    nkb = -(-nk // BLOCK_K)
    bi = torch.arange(dims[0]).view(-1, 1, 1, 1)
    hi = torch.arange(dims[1]).view(1, -1, 1, 1)
    cols = torch.arange(nkb * BLOCK_K).view(1, 1, 1, -1)
    valid = cols.view(-1) < nk
    step = max(1, _BAND_ELEMENTS // max(1, bq * nkb * BLOCK_K * dims[0] * dims[1]))
    any_parts, all_parts = [], []
    for t0 in range(r0, r1, step):
        t1 = min(r1, t0 + step)
        rows = torch.arange(t0 * bq, t1 * bq).view(1, 1, -1, 1)
        inside = (rows < nq).view(-1, 1)
        m = rule.evaluate(bi, hi, rows.clamp(max=nq - 1), cols.clamp(max=nk - 1), nq, nk)
        m = m.expand(dims[0], dims[1], rows.shape[2], cols.shape[3])
        m_any = m.any(0).any(0) & valid & inside
        m_all = m.all(0).all(0) | ~valid | ~inside
        any_parts.append(m_any.view(t1 - t0, bq, nkb, BLOCK_K).any(3).any(1))
        all_parts.append(m_all.view(t1 - t0, bq, nkb, BLOCK_K).all(3).all(1))
    return torch.cat(any_parts), torch.cat(all_parts)


def _tensor_band(mask: torch.Tensor, r0: int, r1: int, bq: int, nq: int, nk: int):
    """Tile kinds of a bool mask `(B|1, H|1, Nq|1, Nk|1)` for query-tile rows r0 … r1−1."""
    nkb = -(-nk // BLOCK_K)
    rows = slice(r0 * bq, min(nq, r1 * bq)) if mask.shape[2] > 1 else slice(None)
    m = mask[:, :, rows].to("cpu")
    m_any, m_all = m.any(1).any(0), m.all(1).all(0)  # (rows|1, Nk|1)
    n_rows = min(nq, r1 * bq) - r0 * bq

    def per_tile(t: torch.Tensor, reduce_any: bool) -> torch.Tensor:
        t = t.expand(n_rows, nk)
        pad_r, pad_c = (r1 - r0) * bq - n_rows, nkb * BLOCK_K - nk
        t = torch.nn.functional.pad(t, (0, pad_c, 0, pad_r), value=not reduce_any)
        t = t.view(r1 - r0, bq, nkb, BLOCK_K)
        return t.any(3).any(1) if reduce_any else t.all(3).all(1)

    return classify(per_tile(m_any, True), per_tile(m_all, False))


def _allowed(plan: AttentionPlan, rows: torch.Tensor, cols: torch.Tensor, dims) -> torch.Tensor:
    """Which (row, key) pairs may attend, `(Bm, Hm, *rows/cols broadcast)` bool: rows and cols
    are int64 index tensors already inside the problem."""
    bm, hm = dims
    nq, nk = plan.q_len, plan.kv_len
    shape = torch.broadcast_shapes(rows.shape, cols.shape)
    extra = (1,) * len(shape)
    parts = []
    if plan.causal:
        parts.append(cols <= rows + (nk - nq))
    if plan.mask_rule is not None:
        bi = torch.arange(bm).view(-1, 1, *extra)
        hi = torch.arange(hm).view(1, -1, *extra)
        parts.append(plan.mask_rule.evaluate(bi, hi, rows, cols, nq, nk))
    if plan.mask is not None:
        m = plan.mask.to("cpu")
        b_idx = torch.arange(bm).view(-1, 1, *extra) if m.shape[0] > 1 else 0
        h_idx = torch.arange(hm).view(1, -1, *extra) if m.shape[1] > 1 else 0
        parts.append(m[b_idx, h_idx, rows if m.shape[2] > 1 else 0, cols if m.shape[3] > 1 else 0])
    allowed = parts[0]
    for part in parts[1:]:
        allowed = allowed & part
    return allowed.expand(bm, hm, *shape)


_BYTE_BITS = 1 << torch.arange(8, dtype=torch.uint8)  # weights of the 8 bits of a byte


def _pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """`(..., 64)` bool → `(...)` int64 with bit c set where key c is allowed: 8 keys to a byte,
    then the 8 bytes read as one little-endian int64 (the byte order of x86 and ARM)."""
    eights = allowed.reshape(*allowed.shape[:-1], 8, 8).to(torch.uint8) * _BYTE_BITS
    return eights.sum(-1, dtype=torch.uint8).contiguous().view(torch.int64).squeeze(-1)


def _partial_bits(plan: AttentionPlan, tiles: torch.Tensor, bq: int, dims) -> torch.Tensor:
    """bits `(P, Bm, Hm, bq)` int64 of the PARTIAL tiles `tiles (P, 2)` = (query tile, key tile),
    evaluated a chunk of tiles at a time."""
    nq, nk = plan.q_len, plan.kv_len
    bm, hm = dims
    out = torch.empty(tiles.shape[0], bm, hm, bq, dtype=torch.int64)
    per_chunk = max(1, _BAND_ELEMENTS // (bq * BLOCK_K * bm * hm))
    r_off = torch.arange(bq).view(1, bq, 1)
    c_off = torch.arange(BLOCK_K).view(1, 1, BLOCK_K)
    for a in range(0, tiles.shape[0], per_chunk):
        t = tiles[a : a + per_chunk]
        rows = t[:, 0].view(-1, 1, 1) * bq + r_off  # (p, bq, 1)
        cols = t[:, 1].view(-1, 1, 1) * BLOCK_K + c_off  # (p, 1, 64)
        allowed = _allowed(plan, rows.clamp(max=nq - 1), cols.clamp(max=nk - 1), dims)
        if (rows[:, -1, 0] >= nq).any() or (cols[:, 0, -1] >= nk).any():  # tiles on an edge
            allowed = allowed & (rows < nq) & (cols < nk)
        out[a : a + per_chunk] = _pack_bits(allowed).permute(2, 0, 1, 3)
    return out


def build_layout(plan: AttentionPlan, block_q: int) -> CpuLayout:
    """The kernel's block layout for `plan` with `block_q × 64` tiles (module docstring).

    Layouts that only the causal flag shapes (no mask) depend on (Nq, Nk, block_q, causal)
    alone and are kept in a small cache; masks are evaluated at every call."""
    if plan.mask is None and plan.mask_rule is None:
        return _unmasked_layout(plan.q_len, plan.kv_len, block_q, plan.causal)
    return _build(plan, block_q)


@functools.lru_cache(maxsize=32)
def _unmasked_layout(nq: int, nk: int, block_q: int, causal: bool) -> CpuLayout:
    plan = _ShapeOnly(nq, nk, causal)
    return _build(plan, block_q)


@dataclass(frozen=True)
class _ShapeOnly:
    """The fields of a plan that an unmasked layout reads."""

    q_len: int
    kv_len: int
    causal: bool
    batch: int = 1
    heads: int = 1
    mask: None = None
    mask_rule: None = None


class _Rows:
    """A growing (n, width) int64 buffer, filled band by band. One buffer (doubled when full)
    instead of a list of small tensors: small long-lived allocations between each band's
    megabyte temporaries keep glibc from reusing or returning them (measured: RSS grew by
    hundreds of MiB over the bands of N = 1,048,576)."""

    def __init__(self, width: int, capacity: int):
        self.data = torch.empty(max(16, capacity), width, dtype=torch.int64)
        self.n = 0

    def append(self, rows: torch.Tensor) -> None:
        if self.n + rows.shape[0] > self.data.shape[0]:
            bigger = torch.empty(
                2 * (self.n + rows.shape[0]), self.data.shape[1], dtype=torch.int64
            )
            bigger[: self.n] = self.data[: self.n]
            self.data = bigger
        self.data[self.n : self.n + rows.shape[0]] = rows
        self.n += rows.shape[0]

    def rows(self) -> torch.Tensor:
        return self.data[: self.n]


def _build(plan, block_q: int) -> CpuLayout:
    nq, nk, bq = plan.q_len, plan.kv_len, block_q
    nqb, nkb = -(-nq // bq), -(-nk // BLOCK_K)
    dims = _mask_dims(plan)
    band = max(1, _BAND_TILES // max(1, nkb * dims[0] * dims[1]))
    kept = _Rows(3, nqb * min(nkb, 16))  # (query tile, key tile, code) of each kept tile
    n_partial = 0
    for r0 in range(0, nqb, band):
        r1 = min(nqb, r0 + band)
        kind = _band_kinds(plan, r0, r1, bq, dims)  # (r1 − r0, nkb)
        idx = (kind != EMPTY).nonzero()  # row-major: by row, then column
        part = kind[idx[:, 0], idx[:, 1]] == PARTIAL
        code = torch.full((idx.shape[0],), TILE_FULL, dtype=torch.int64)
        n_new = int(part.sum())
        code[part] = torch.arange(n_partial, n_partial + n_new)
        n_partial += n_new
        kept.append(torch.stack([idx[:, 0] + r0, idx[:, 1], code], 1))
    tiles = kept.rows()
    rows, cols, codes = tiles[:, 0], tiles[:, 1], tiles[:, 2].to(torch.int32)
    partial = tiles[tiles[:, 2] >= 0, :2]  # in code order
    row_ptr = torch.zeros(nqb + 1, dtype=torch.int64)
    row_ptr[1:] = torch.bincount(rows, minlength=nqb).cumsum(0)
    order = torch.argsort(cols * max(nqb, 1) + rows)  # by column, then row
    col_ptr = torch.zeros(nkb + 1, dtype=torch.int64)
    col_ptr[1:] = torch.bincount(cols, minlength=nkb).cumsum(0)
    return CpuLayout(
        block_q=bq,
        q_len=nq,
        kv_len=nk,
        row_ptr=row_ptr,
        col_idx=cols.to(torch.int32),
        code=codes,
        col_ptr=col_ptr,
        row_idx=rows[order].to(torch.int32),
        code_t=codes[order],
        bits=_partial_bits(plan, partial, bq, dims),
    )
