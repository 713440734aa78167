"""Which tiles the tiled kernel computes, and how they are grouped into matrix products.

The score matrix is cut into `block_q × block_k` tiles and each tile is classified EMPTY
(nothing allowed: never computed), FULL (everything allowed: no mask arithmetic) or PARTIAL (the
rule is applied element-wise), from the causal flag, a structured `qkv.masks.Mask` (by its tile
bounds, without an N×N matrix) and a dense bool mask (by reducing it per tile). A tile counts as
empty/full only if it is so for every batch element and head.

Consecutive kept tiles in a row of tiles form a *run*; a run (cut at `max_cols` columns) is one
matrix product `(rows × run width)` batched over batch and heads, followed by one online-softmax
update, and only its partial tiles get mask arithmetic. Neighbouring rows of tiles are merged
into one taller product when that adds little work (see `strips`). The backward does the same
by columns of tiles.

Why a loop over rows of tiles and not one batched product over all of them: measured on a
2-core CPU (torch 2.13, 8 heads, D=64), a Python loop of per-row products ran at ~135-160
GFLOP/s, while one `bmm` batched over the rows (strided or gathered windows) reached 70-95.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..masks import EMPTY, FULL, causal, classify, tile_grid
from ..plan import AttentionPlan


@dataclass(frozen=True)
class Run:
    """Columns [start, stop) of a strip, computed as one product."""

    start: int  # first column (element index)
    stop: int  # one past the last column
    partial: tuple[tuple[int, int], ...]  # column ranges inside the run that need the mask


@dataclass(frozen=True)
class Strip:
    """A band of rows (forward: queries; backward: keys) and the runs it computes."""

    start: int  # first row index (element, not tile)
    stop: int  # one past the last row index
    runs: tuple[Run, ...]  # what the rows compute, left to right


def tile_kinds(plan: AttentionPlan, block_q: int, block_k: int) -> torch.Tensor:
    """int8 `(nqb, nkb)`: EMPTY / PARTIAL / FULL for every tile of the problem."""
    nq, nk = plan.q_len, plan.kv_len
    nqb, nkb = -(-nq // block_q), -(-nk // block_k)
    kind = torch.full((nqb, nkb), FULL, dtype=torch.int8)
    if plan.causal:
        q_lo, q_hi, k_lo, k_hi = tile_grid(nq, nk, block_q, block_k)
        maybe_any, surely_all = causal()._bounds(None, None, q_lo, q_hi, k_lo, k_hi, nk)
        kind = torch.minimum(kind, classify(maybe_any, surely_all)[0, 0])
    if plan.mask_rule is not None:
        kind = torch.minimum(
            kind, _over_batch_heads(plan.mask_rule.blocks(nq, nk, block_q, block_k).kind)
        )
    if plan.mask is not None:
        kind = torch.minimum(kind, _dense_kinds(plan.mask, nq, nk, block_q, block_k))
    return kind


def _over_batch_heads(kind: torch.Tensor) -> torch.Tensor:
    """Collapse `(Bm, Hm, nqb, nkb)` kinds: empty/full only where so for every (b, h)."""
    hi = kind.amax(dim=(0, 1))
    lo = kind.amin(dim=(0, 1))
    out = torch.full_like(hi, 1)
    out[hi == EMPTY] = EMPTY
    out[lo == FULL] = FULL
    return out


def _dense_kinds(mask: torch.Tensor, nq: int, nk: int, bq: int, bk: int) -> torch.Tensor:
    """Tile kinds of a bool mask `(B|1, H|1, Nq|1, Nk|1)` by any/all reduction per tile."""
    m_any = mask.any(dim=1).any(dim=0).to("cpu")  # (Nq|1, Nk|1)
    m_all = mask.all(dim=1).all(dim=0).to("cpu")
    nqb, nkb = -(-nq // bq), -(-nk // bk)

    def per_tile(m: torch.Tensor, reduce_any: bool) -> torch.Tensor:
        rows, cols = m.shape
        pad_r = nqb * bq - nq if rows > 1 else 0
        pad_c = nkb * bk - nk if cols > 1 else 0
        m = F.pad(m, (0, pad_c, 0, pad_r), value=not reduce_any)
        r, c = (nqb, bq) if rows > 1 else (1, 1), (nkb, bk) if cols > 1 else (1, 1)
        t = m.view(r[0], r[1], c[0], c[1])
        t = t.any(3).any(1) if reduce_any else t.all(3).all(1)
        return t.expand(nqb, nkb)

    if nq == 0 or nk == 0:
        return torch.full((nqb, nkb), EMPTY, dtype=torch.int8)
    return classify(per_tile(m_any, True), per_tile(m_all, False))


WASTE = 1.125  # merge rows of tiles while the merged strip computes ≤ 12.5% more tiles


def strips(
    kind: torch.Tensor,
    block_rows: int,
    block_cols: int,
    n_rows: int,
    n_cols: int,
    max_rows: int,
    max_cols: int,
    waste: float = WASTE,
) -> list[Strip]:
    """Group tiles row by row (use `kind.T` and swapped sizes for the backward's columns).

    Consecutive rows of tiles are merged into one strip (one taller product) while the strip
    stays within `max_rows` rows and the union of their kept tiles is at most `waste` (default
    `WASTE`) times the tiles they keep on their own: identical rows always merge (dense
    attention, the inside of a document); the staircase of causal attention merges once rows
    are long; a sliding window, whose rows are shifted copies, does not (at the default). In
    the merged strip a tile is full only if full in every row, empty only if empty in every
    row, and partial (masked) otherwise. Each run of kept tiles is cut into pieces of at most
    `max_cols` columns."""
    kept = kind != EMPTY
    full = kind == FULL
    per_row_kept = kept.sum(1).tolist()
    rows_per_strip = max(1, max_rows // block_rows)
    groups: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
    for r in range(kind.shape[0]):
        if groups:
            r0, r1, g_any, g_all = groups[-1]
            new_any, new_all = g_any | kept[r], g_all & full[r]
            size = r1 - r0 + 1
            union = int(new_any.sum()) * size
            if size <= rows_per_strip and union <= waste * sum(per_row_kept[r0 : r1 + 1]):
                groups[-1] = (r0, r1 + 1, new_any, new_all)
                continue
        groups.append((r, r + 1, kept[r], full[r]))
    out = []
    step = max(block_cols, (max_cols // block_cols) * block_cols)
    for r0, r1, g_any, g_all in groups:
        runs = []
        flags = torch.stack([g_any, g_all & g_any]).tolist()
        t = 0
        while t < len(flags[0]):
            if not flags[0][t]:
                t += 1
                continue
            t1 = t
            while t1 < len(flags[0]) and flags[0][t1]:
                t1 += 1
            c0, c1 = t * block_cols, min(t1 * block_cols, n_cols)
            for a in range(c0, c1, step):
                b = min(a + step, c1)
                part = tuple(
                    (u * block_cols, min((u + 1) * block_cols, n_cols))
                    for u in range(a // block_cols, -(-b // block_cols))
                    if not flags[1][u]
                )
                runs.append(Run(a, b, _merge(part)))
            t = t1
        if runs:
            out.append(Strip(r0 * block_rows, min(r1 * block_rows, n_rows), tuple(runs)))
    return out


def _merge(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """Join touching ranges: fewer, larger mask operations."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)
