"""The block layout: which tiles of the (Nq × Nk) score matrix a kernel computes, and how.

The score matrix is cut into `block_q × block_k` tiles. A tile is EMPTY (nothing allowed: never
computed), FULL (everything allowed: no mask arithmetic) or PARTIAL (the rule is evaluated per
pair, by `allowed`). This module is the one place that works tile kinds out, from whatever the
caller passed: the causal flag, a structured `qkv.masks.Mask` (varlen offsets arrive as
`masks.varlen`), a bool mask tensor. A float bias never empties a tile: its −inf entries are
applied per pair by the kernels.

`BlockLayout` holds only the kept tiles, as compressed rows (forward: the kept key tiles of each
query tile) and compressed columns (backward: the kept query tiles of each key tile), so it is
O(kept tiles), never O((N/tile)²): a rule that knows which keys a tile of queries may reach
(`Mask.key_ranges`) is asked about those tiles only; one that does not (a custom function, a
dense tensor) is examined tile by tile. A tile is EMPTY only if it is empty for every batch
element and head, FULL only if full for all of them.

Packed sequences (a Mask with `segments`: `masks.document`, `masks.varlen`) can also be cut at
their segment boundaries instead of a uniform grid (`segment_tiles`), for a kernel that reads
ragged tile origins (the compiled CPU kernel): a short segment is then one tile, not pieces of
two.

`layout_for(pairs, ...)` keeps the layouts of a Mask in qkv's cache, held against the Mask
weakly, so a training loop builds each once; `block_layout(...)` builds one to hold, as
FlexAttention users hold a `BlockMask`, and `qkv.attention(..., mask=layout)` runs it.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .cache import CACHE

EMPTY, PARTIAL, FULL = 0, 1, 2
CHUNK = 1 << 22  # pairs evaluated at once when a rule or tensor is examined tile by tile


def tile_grid(
    nq: int, nk: int, block_q: int, block_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inclusive position ranges of every tile: q_lo, q_hi `(nqb,)` (in key coordinates,
    bottom-right aligned: query row i is position i + Nk − Nq) and k_lo, k_hi `(nkb,)`."""
    nqb, nkb = -(-nq // block_q), -(-nk // block_k)
    rows0 = torch.arange(nqb) * block_q
    cols0 = torch.arange(nkb) * block_k
    off = nk - nq
    q_lo, q_hi = rows0 + off, torch.clamp(rows0 + block_q, max=nq) - 1 + off
    k_lo, k_hi = cols0, torch.clamp(cols0 + block_k, max=nk) - 1
    return q_lo, q_hi, k_lo, k_hi


def classify(maybe_any: torch.Tensor, surely_all: torch.Tensor) -> torch.Tensor:
    """Tile kinds (int8) from bounds: EMPTY where nothing may be allowed, FULL where everything
    surely is, PARTIAL otherwise."""
    kind = torch.full(maybe_any.shape, PARTIAL, dtype=torch.int8)
    kind[surely_all & maybe_any] = FULL
    kind[~maybe_any] = EMPTY
    return kind


# ------------------------------------------------------------------------- what to evaluate


def allowed(
    b: torch.Tensor | int,
    h: torch.Tensor | int,
    rows: torch.Tensor,
    cols: torch.Tensor,
    *,
    q_len: int,
    kv_len: int,
    causal: bool = False,
    rule: Any = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Which pairs (query row, key) may attend: the causal rule (bottom-right), a Mask's rule
    and a bool mask `(B|1, H|1, Nq|1, Nk|1)`, combined by "and". All index arguments are
    broadcastable int64 tensors (`b`, `h` may be 0 when neither a rule nor a mask is given);
    None when nothing restricts the pairs."""
    ok = None
    if causal:
        ok = cols <= rows + (kv_len - q_len)  # bottom-right: row i sees keys j ≤ i + Nk − Nq
    if rule is not None:
        r = rule.evaluate(b, h, rows, cols, q_len, kv_len)
        ok = r if ok is None else ok & r
    if mask is not None:
        idx = (
            b if mask.shape[0] > 1 else 0,
            h if mask.shape[1] > 1 else 0,
            rows if mask.shape[2] > 1 else 0,
            cols if mask.shape[3] > 1 else 0,
        )
        m = mask[idx]
        ok = m if ok is None else ok & m
    return ok


def dense_allowed(
    q_len: int,
    kv_len: int,
    *,
    causal: bool = False,
    rule: Any = None,
    mask: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor | None:
    """`allowed` over the whole problem: bool `(Bm, Hm, Nq, Nk)` (Bm, Hm: what the rule and the
    mask depend on, else 1), None when nothing restricts the pairs."""
    if not causal and rule is None and mask is None:
        return None
    nb = max(rule.batch or 1 if rule is not None else 1, mask.shape[0] if mask is not None else 1)
    nh = max(rule.heads or 1 if rule is not None else 1, mask.shape[1] if mask is not None else 1)
    b = torch.arange(nb, device=device).view(-1, 1, 1, 1)
    h = torch.arange(nh, device=device).view(1, -1, 1, 1)
    rows = torch.arange(q_len, device=device).view(1, 1, -1, 1)
    cols = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
    ok = allowed(b, h, rows, cols, q_len=q_len, kv_len=kv_len, causal=causal, rule=rule, mask=mask)
    assert ok is not None  # something restricts the pairs (returned above otherwise)
    return ok.expand(nb, nh, q_len, kv_len)


def causal_bounds(ql, qh, kl, kh) -> tuple:
    """(maybe_any, surely_all) of the causal rule over the rectangles of query positions
    [ql, qh] × keys [kl, kh] (inclusive, in key coordinates: a query row plus Nk − Nq): some key
    is visible when kl ≤ qh, every key when kh ≤ ql. Ints or tensors."""
    return kl <= qh, kh <= ql


def causal_hidden(
    r0: int, r1: int, c0: int, c1: int, q_len: int, kv_len: int, device=None
) -> tuple[int, torch.Tensor | None, bool]:
    """What the causal rule hides from query rows r0:r1 within keys c0:c1: `(d0, hidden,
    blind)`: keys before d0 are visible to every row, `hidden` (bool `(r1 − r0, c1 − d0)`, or
    None when nothing is hidden) is True where a key from d0 on is hidden, and `blind` says
    that the first row sees no key at all (Nq > Nk)."""
    first_hidden = r0 + (kv_len - q_len) + 1  # the first key row r0 may not see
    blind = first_hidden <= 0
    d0 = max(c0, first_hidden)
    if d0 >= c1:
        return c1, None, blind
    rows = torch.arange(r0, r1, device=device).unsqueeze(1)
    cols = torch.arange(d0, c1, device=device)
    ok = allowed(0, 0, rows, cols, q_len=q_len, kv_len=kv_len, causal=True)
    assert ok is not None  # the causal rule restricts
    return d0, ~ok, blind


# --------------------------------------------------------------------------------- the layout


@dataclass(frozen=True)
class Run:
    """Keys [start, stop) of a strip, computed as one product."""

    start: int  # first key (element index)
    stop: int  # one past the last
    partial: tuple[tuple[int, int], ...]  # key ranges inside the run that need the mask


@dataclass(frozen=True)
class Strip:
    """A band of query rows and the runs of keys it computes, left to right."""

    start: int  # first query row
    stop: int  # one past the last
    runs: tuple[Run, ...]


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """The kept tiles of one (Nq × Nk) problem for `block_q × block_k` tiles.

    Forward order (compressed rows): the kept tiles of query tile r are
    `col[row_ptr[r]:row_ptr[r+1]]`, ascending, FULL where `full`. Backward order (compressed
    columns): those of key tile c are `by_col[col_ptr[c]:col_ptr[c+1]]`, indices into the
    forward arrays, by ascending query tile."""

    q_len: int  # Nq
    kv_len: int  # Nk
    block_q: int  # query rows per tile
    block_k: int  # keys per tile
    causal: bool  # built with bottom-right causality
    row_ptr: torch.Tensor  # int64 (nqb + 1)
    col: torch.Tensor  # int64 (nnz): the key tile of each kept tile
    full: torch.Tensor  # bool (nnz)
    col_ptr: torch.Tensor  # int64 (nkb + 1)
    by_col: torch.Tensor  # int64 (nnz)
    mask: Any = field(default=None, repr=False)  # the Mask, in a layout built to be held

    @property
    def shape(self) -> tuple[int, int]:
        """(query tiles, key tiles)."""
        return -(-self.q_len // self.block_q), -(-self.kv_len // self.block_k)

    @property
    def nnz(self) -> int:
        """Kept (computed) tiles."""
        return self.col.numel()

    @property
    def kept_fraction(self) -> float:
        """Fraction of all tiles that are computed (partial or full)."""
        nqb, nkb = self.shape
        return self.nnz / (nqb * nkb) if nqb * nkb else 0.0

    @property
    def bytes(self) -> int:
        """Memory the layout holds."""
        return sum(t.numel() * t.element_size() for t in self._arrays())

    def _arrays(self) -> tuple[torch.Tensor, ...]:
        return (self.row_ptr, self.col, self.full, self.col_ptr, self.by_col)

    @property
    def kind(self) -> torch.Tensor:
        """The dense `(nqb, nkb)` int8 grid of kinds (for pictures and tests; O(tiles²))."""
        nqb, nkb = self.shape
        kind = torch.zeros(nqb * nkb, dtype=torch.int8)
        kind[self.tile_rows() * nkb + self.col] = torch.where(self.full, FULL, PARTIAL).to(
            torch.int8
        )
        return kind.view(nqb, nkb)

    def tile_rows(self) -> torch.Tensor:
        """int64 (nnz): the query tile of each kept tile (forward order)."""
        return torch.repeat_interleave(torch.arange(self.shape[0]), self.row_ptr.diff())

    def show(self) -> str:
        """A text picture: '#' full, '+' partial, '.' empty tiles."""
        chars = {EMPTY: ".", PARTIAL: "+", FULL: "#"}
        return "\n".join("".join(chars[int(x)] for x in row) for row in self.kind)

    @functools.cached_property
    def _rows(self) -> list[list[tuple[int, bool]]]:
        cols, full, ptr = self.col.tolist(), self.full.tolist(), self.row_ptr.tolist()
        return [list(zip(cols[a:b], full[a:b], strict=True)) for a, b in itertools.pairwise(ptr)]

    def rows(self) -> list[list[tuple[int, bool]]]:
        """Per query tile, its kept (key tile, full) pairs (Python lists, built once)."""
        return self._rows

    @functools.cached_property
    def _strip_cache(self) -> dict:
        return {}

    def strips(self, max_rows: int, max_cols: int, waste: float = 1.125) -> list[Strip]:
        """Query tiles grouped into strips (one taller product) and each strip's kept key
        tiles into runs (one product each, cut at `max_cols` keys), built once per settings.

        Consecutive query tiles merge while the strip stays within `max_rows` rows and the
        union of their kept tiles is at most `waste` times what they keep on their own:
        identical rows always merge (dense attention, the inside of a document); a sliding
        window, whose rows are shifted copies, does not at the default. In a merged strip a
        tile is full only if full in every row, kept if kept in any."""
        key = (max_rows, max_cols, waste)
        if key not in self._strip_cache:
            self._strip_cache[key] = _strips(self, max_rows, max_cols, waste)
        return self._strip_cache[key]

    @functools.cached_property
    def transposed(self) -> BlockLayout:
        """The layout of the transposed problem (key tiles as rows), for by-column loops."""
        rows = self.tile_rows()
        return BlockLayout(
            q_len=self.kv_len,
            kv_len=self.q_len,
            block_q=self.block_k,
            block_k=self.block_q,
            causal=self.causal,
            row_ptr=self.col_ptr,
            col=rows[self.by_col],
            full=self.full[self.by_col],
            col_ptr=self.row_ptr,
            by_col=torch.argsort(self.by_col),
            mask=self.mask,
        )


def _strips(layout: BlockLayout, max_rows: int, max_cols: int, waste: float) -> list[Strip]:
    bq, bk, nq, nk = layout.block_q, layout.block_k, layout.q_len, layout.kv_len
    rows_per_strip = max(1, max_rows // bq)
    groups: list[list] = []  # [first tile row, last + 1, {key tile: full}, tiles kept alone]
    for r, tiles in enumerate(layout.rows()):
        if not tiles:  # a row of empty tiles: no strip, and it ends the one before
            groups.append([r, r + 1, {}, 0])
            continue
        row = dict(tiles)
        last = groups[-1] if groups else None
        if last is not None and last[2] and last[1] - last[0] < rows_per_strip:
            union = {c: last[2].get(c, False) and row.get(c, False) for c in last[2].keys() | row}
            if len(union) * (last[1] - last[0] + 1) <= waste * (last[3] + len(tiles)):
                last[1], last[2], last[3] = r + 1, union, last[3] + len(tiles)
                continue
        groups.append([r, r + 1, row, len(tiles)])
    step = max(bk, (max_cols // bk) * bk)
    out = []
    for r0, r1, union, _ in groups:
        if not union:
            continue
        cols = sorted(union)
        runs = []
        t = 0
        while t < len(cols):
            t1 = t
            while t1 + 1 < len(cols) and cols[t1 + 1] == cols[t1] + 1:
                t1 += 1
            c0, c1 = cols[t] * bk, min((cols[t1] + 1) * bk, nk)
            for a in range(c0, c1, step):
                b = min(a + step, c1)
                part = tuple(
                    (u * bk, min((u + 1) * bk, nk))
                    for u in range(a // bk, -(-b // bk))
                    if not union[u]
                )
                runs.append(Run(a, b, _join(part)))
            t = t1 + 1
        out.append(Strip(r0 * bq, min(r1 * bq, nq), tuple(runs)))
    return out


def _join(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """Join touching ranges: fewer, larger mask operations."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


# ------------------------------------------------------------------------------- building


def build(
    q_len: int,
    kv_len: int,
    block_q: int,
    block_k: int,
    *,
    causal: bool = False,
    rule: Any = None,
    mask: torch.Tensor | None = None,
    batch: int = 1,
    heads: int = 1,
) -> BlockLayout:
    """The layout of an (Nq × Nk) problem: kept tiles under the causal flag, a Mask `rule`
    and a bool `mask (B|1, H|1, Nq|1, Nk|1)`, combined by "and" (see the module docstring)."""
    nqb, nkb = -(-q_len // block_q), -(-kv_len // block_k)
    if nqb == 0 or nkb == 0:
        return _from_tiles(q_len, kv_len, block_q, block_k, causal, *(_empty(),) * 3)
    q_lo, q_hi, k_lo, k_hi = tile_grid(q_len, kv_len, block_q, block_k)
    # Which key positions each query tile may reach: intervals (R, nqb), inclusive.
    lo = torch.zeros(1, nqb, dtype=torch.long)
    hi = torch.full((1, nqb), kv_len - 1, dtype=torch.long)
    if causal:
        lo, hi = _intersect(lo, hi, torch.zeros_like(q_hi)[None], q_hi[None])
    if rule is not None:
        reach = rule.key_ranges(q_lo, q_hi, kv_len)
        if reach is not None:
            lo, hi = _intersect(lo, hi, *reach)
    rows, cols = _candidates(lo, hi, block_k, nkb)
    # Classify the candidates: any/all over every (b, h) the rule or mask depends on.
    ql, qh, kl, kh = q_lo[rows], q_hi[rows], k_lo[cols], k_hi[cols]
    maybe, surely = _bound_tiles(ql, qh, kl, kh, kv_len, causal, rule)
    scan = [] if rule is None or rule.has_bounds else [("rule", rule)]
    if mask is not None:
        scan.append(("mask", mask))
    if scan and rows.numel():
        s_any, s_all = _examine(rows, cols, block_q, block_k, q_len, kv_len, scan, maybe)
        maybe &= s_any.flatten(1).any(1)
        surely &= s_all.flatten(1).all(1)
    keep = maybe
    return _from_tiles(
        q_len, kv_len, block_q, block_k, causal, rows[keep], cols[keep], (surely & maybe)[keep]
    )


def _bound_tiles(ql, qh, kl, kh, kv_len: int, causal: bool, rule: Any):
    """(maybe_any, surely_all) per candidate tile [ql, qh] × [kl, kh] (key coordinates) from
    the causal flag and, where the rule has them, its tile bounds over every (b, h) it depends
    on; a rule without bounds leaves its tiles to `_examine`."""
    maybe = torch.ones(ql.numel(), dtype=torch.bool)
    surely = maybe.clone()
    if causal:
        some, every = causal_bounds(ql, qh, kl, kh)
        maybe &= some
        surely &= every
    if rule is not None and rule.has_bounds and ql.numel():
        shape = (rule.batch or 1, rule.heads or 1, ql.numel())
        bi = torch.arange(shape[0]).view(-1, 1, 1)
        hi = torch.arange(shape[1]).view(1, -1, 1)
        any_, all_ = (
            torch.broadcast_to(x, shape).reshape(-1, ql.numel())
            for x in rule.tile_bounds(bi, hi, ql, qh, kl, kh, kv_len)
        )
        maybe &= any_.any(0)
        surely &= all_.all(0)
    return maybe, surely


def _empty() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.long)


def _intersect(lo_a, hi_a, lo_b, hi_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Intervals (Ra, n) ∩ (Rb, n) → (Ra·Rb, n): every pairwise intersection."""
    lo = torch.maximum(lo_a[:, None], lo_b[None]).reshape(-1, lo_a.shape[-1])
    hi = torch.minimum(hi_a[:, None], hi_b[None]).reshape(-1, hi_a.shape[-1])
    return lo, hi


def _candidates(lo, hi, block_k: int, nkb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (query tile, key tile) pairs the intervals touch, each once, sorted."""
    R, nqb = lo.shape
    lo_t = lo.clamp(min=0) // block_k
    hi_t = torch.minimum(hi // block_k, torch.tensor(nkb - 1))
    count = (hi_t - lo_t + 1).clamp(min=0) * (hi >= lo) * (hi >= 0)
    row = torch.arange(nqb).expand(R, nqb).reshape(-1)
    count, lo_t = count.reshape(-1), lo_t.reshape(-1)
    total = int(count.sum())
    rows = torch.repeat_interleave(row, count, output_size=total)
    starts = torch.repeat_interleave(lo_t, count, output_size=total)
    first = torch.repeat_interleave(torch.cumsum(count, 0) - count, count, output_size=total)
    cols = starts + torch.arange(total) - first
    if R == 1:  # one interval a row: already sorted, each tile once
        return rows, cols
    keys = torch.unique(rows * nkb + cols)  # sorted: by row, then column
    return keys // nkb, keys % nkb


def _examine(rows, cols, bq, bk, nq, nk, scan, live) -> tuple[torch.Tensor, torch.Tensor]:
    """`(any, all)` bool `(T, Bm, Hm)` per candidate tile and (b, h), by evaluating rules
    without bounds and bool tensors pair by pair, a chunk of tiles at a time (O(chunk)
    memory); tiles not `live` (already known empty) are skipped and read False."""
    B = max([obj.batch or 1 if kind == "rule" else obj.shape[0] for kind, obj in scan])
    H = max([obj.heads or 1 if kind == "rule" else obj.shape[1] for kind, obj in scan])
    n = rows.numel()
    any_ = torch.zeros(n, B, H, dtype=torch.bool)
    all_ = torch.zeros(n, B, H, dtype=torch.bool)
    idx = live.nonzero().view(-1)
    ar_q, ar_k = torch.arange(bq), torch.arange(bk)
    b = torch.arange(B).view(1, -1, 1, 1, 1)
    h = torch.arange(H).view(1, 1, -1, 1, 1)
    per = max(1, CHUNK // (bq * bk * B * H))
    for c0 in range(0, idx.numel(), per):
        t = idx[c0 : c0 + per]
        r = (rows[t, None] * bq + ar_q).view(-1, 1, 1, bq, 1)  # (T, 1, 1, bq, 1)
        c = (cols[t, None] * bk + ar_k).view(-1, 1, 1, 1, bk)
        inside = (r < nq) & (c < nk)
        r, c = r.clamp(max=nq - 1), c.clamp(max=nk - 1)
        ok = inside
        for kind, obj in scan:
            if kind == "rule":
                ok = ok & obj.evaluate(b % (obj.batch or 1), h % (obj.heads or 1), r, c, nq, nk)
            else:
                ok = ok & allowed(b, h, r, c, q_len=nq, kv_len=nk, mask=obj.cpu())
        ok = torch.broadcast_to(ok, (t.numel(), B, H, bq, bk))
        any_[t] = ok.flatten(3).any(3)
        all_[t] = (ok | ~inside).flatten(3).all(3)
    return any_, all_


def _from_tiles(nq, nk, bq, bk, causal, rows, cols, full) -> BlockLayout:
    nqb, nkb = -(-nq // bq), -(-nk // bk)
    row_ptr = torch.zeros(nqb + 1, dtype=torch.long)
    row_ptr[1:] = torch.cumsum(torch.bincount(rows, minlength=nqb), 0)
    by_col = torch.argsort(cols * max(nqb, 1) + rows)
    col_ptr = torch.zeros(nkb + 1, dtype=torch.long)
    col_ptr[1:] = torch.cumsum(torch.bincount(cols, minlength=nkb), 0)
    return BlockLayout(nq, nk, bq, bk, causal, row_ptr, cols, full.to(torch.bool), col_ptr, by_col)


# ------------------------------------------------------------------------------- front doors


@dataclass(frozen=True)
class SegmentTiles:
    """Kept tiles of a packed-sequence problem cut at its segment boundaries (`segment_tiles`):
    query tile i holds rows `q_starts[i] … q_starts[i+1]`, key tile j keys `k_starts[j] …
    k_starts[j+1]`; kept tile t is (rows[t], cols[t]), row by row, FULL where `full[t]`."""

    q_starts: torch.Tensor  # int64 (nqb + 1)
    k_starts: torch.Tensor  # int64 (nkb + 1)
    rows: torch.Tensor  # int64 (nnz)
    cols: torch.Tensor  # int64 (nnz)
    full: torch.Tensor  # bool (nnz)


def tile_starts(cu: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Segments `cu` (int64, from 0 to the total) cut into tiles of at most `block`: the tiles'
    starts followed by the total `(T + 1,)`, and each tile's segment `(T,)`."""
    lengths = cu.diff()
    count = (lengths + block - 1) // block  # tiles per segment; 0 for an empty one
    seg = torch.repeat_interleave(torch.arange(count.numel()), count)
    first = torch.repeat_interleave(count.cumsum(0) - count, count)  # the segment's first tile
    starts = cu[:-1][seg] + (torch.arange(seg.numel()) - first) * block
    return torch.cat([starts, cu[-1:]]), seg


def segment_tiles(
    q_len: int,
    kv_len: int,
    block_q: int,
    block_k: int,
    *,
    causal: bool = False,
    rule: Any = None,
    max_candidates: int | None = None,
) -> SegmentTiles | None:
    """Tiles cut at the segments of a packed-sequence rule (`Mask.segments`): each segment's
    rows in pieces of at most `block_q`, its keys in pieces of at most `block_k`; a segment's
    own tiles are the candidates (no pair crosses a segment), classified by the causal flag and
    the rule's tile bounds. None when the rule has no segments or no bounds, when every segment
    starts on the uniform grid's tile boundaries (the cut would be that grid), or when the
    candidates number more than `max_candidates`."""
    cu = None if rule is None or not rule.has_bounds else rule.segments(q_len, kv_len)
    if cu is None or bool((cu[0] % block_q == 0).all() and (cu[1] % block_k == 0).all()):
        return None
    q_starts, q_seg = tile_starts(cu[0], block_q)
    k_starts, k_seg = tile_starts(cu[1], block_k)
    k_count = torch.bincount(k_seg, minlength=cu[0].numel() - 1)
    per_row = k_count[q_seg]  # every key tile of the row's segment
    if max_candidates is not None and int(per_row.sum()) > max_candidates:
        return None
    rows = torch.repeat_interleave(torch.arange(q_seg.numel()), per_row)
    row_first = torch.repeat_interleave(per_row.cumsum(0) - per_row, per_row)
    cols = (k_count.cumsum(0) - k_count)[q_seg[rows]] + torch.arange(rows.numel()) - row_first
    off = kv_len - q_len  # bounds take positions in key coordinates
    ql, qh = q_starts[rows] + off, q_starts[rows + 1] - 1 + off
    kl, kh = k_starts[cols], k_starts[cols + 1] - 1
    maybe, surely = _bound_tiles(ql, qh, kl, kh, kv_len, causal, rule)
    return SegmentTiles(q_starts, k_starts, rows[maybe], cols[maybe], surely[maybe])


def layout_for(pairs: Any, block_q: int, block_k: int) -> BlockLayout:
    """The layout a kernel reads for a problem's `qkv.pairs.Pairs`: a held `BlockLayout` the
    caller passed (rebuilt for other tile sizes), else built and kept in qkv's cache per (Mask,
    shapes, tiles, causal) for a Mask or plain problem; a bool mask tensor is read anew every
    call (its content may change: pass `masks.from_tensor(t)` to keep its layout)."""
    held = pairs.layout
    if held is not None and (held.block_q, held.block_k) == (block_q, block_k):
        return held
    rule, causal = pairs.rule, pairs.causal
    nq, nk = pairs.q_len, pairs.kv_len
    if pairs.mask is not None:
        return build(nq, nk, block_q, block_k, causal=causal, rule=rule, mask=pairs.mask)
    key = ("layout", nq, nk, block_q, block_k, causal)
    return CACHE.get(
        key, lambda: build(nq, nk, block_q, block_k, causal=causal, rule=rule), owner=rule
    )


def block_layout(
    mask: Any,
    q_len: int,
    kv_len: int | None = None,
    *,
    causal: bool = False,
    block_q: int = 64,
    block_k: int = 64,
) -> BlockLayout:
    """Build the layout of a `qkv.masks.Mask` (None: dense) for an (Nq × Nk) problem, to hold
    and pass as `qkv.attention(..., mask=layout)`: the tiles are worked out once, here."""
    kv_len = q_len if kv_len is None else kv_len
    if mask is not None:
        mask.check(q_len, kv_len)
    lay = build(q_len, kv_len, block_q, block_k, causal=causal, rule=mask)
    held = BlockLayout(**{**lay.__dict__, "mask": mask})
    held.rows()  # the kept tiles as Python lists, read here once, not by the kernel's call
    return held


def causal_last(q_len: int, kv_len: int, causal: bool) -> torch.Tensor | None:
    """int64 `(Nq,)`: the last key each query row may see under the causal rule (bottom-right:
    row i's position, i + Nk − Nq; negative: none), or None where the rule hides no key: without
    the flag, and for a single query row (a decoding step's), which sits at the last key."""
    if not causal or q_len <= 1:
        return None
    return torch.arange(kv_len - q_len, kv_len)


def row_intervals(
    rule: Any, q_len: int, kv_len: int, causal: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """`(lo, hi)`, each int64 `(R, Nq)` or None (lo: from key 0, hi: to the last key): the keys
    query row i may reach are exactly the union of [lo[k, i], hi[k, i]] (unclipped; empty where
    lo > hi) under a rule with exact key ranges (`Mask.exact_ranges`; None: every key) and the
    causal flag (`causal_last`); None for other rules. Rows sit at positions i + Nk − Nq."""
    if rule is not None and not rule.exact_ranges:
        return None
    last = causal_last(q_len, kv_len, causal)
    if rule is None:
        return None, None if last is None else last[None]
    pos = torch.arange(kv_len - q_len, kv_len) if last is None else last  # the same positions
    lo, hi = rule.key_ranges(pos, pos, kv_len)
    return lo, hi if last is None else torch.minimum(hi, last)


@dataclass(frozen=True)
class TilePlan:
    """How the tiles of one problem are found, decided once from its `qkv.pairs.Pairs`
    (`tile_plan`), for a kernel that reads each tile row's allowed keys as bits and may take
    ragged tile origins (the compiled CPU kernel):

    - `intervals`: each query row's allowed keys are a union of intervals (`row_keys`), which a
      one-pass builder turns into tiles: no mask, a rule with exact key ranges, a bool mask
      tensor the same for every query row (key padding), with the causal flag. Otherwise the
      tiles are `layout_for`'s, and the bits are `allowed`'s (a rule without exact ranges, a
      mask that varies by row, a held layout);
    - `segments`: a rule alone (no mask tensor, no held layout): where it packs sequences
      (`Mask.segments`), tiles cut at their boundaries may keep fewer than the uniform grid
      (`cut`)."""

    pairs: Any
    block_q: int
    block_k: int
    intervals: bool
    segments: bool

    def row_keys(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """`(lo, hi, keys)` where `intervals`: the rows' key intervals (`row_intervals`, the
        causal rule in them) and the key mask `(B|1, H|1, Nk|1)` every row shares (None: no
        mask). O(Nq) memory, made when asked."""
        p = self.pairs
        found = row_intervals(p.rule, p.q_len, p.kv_len, p.causal)
        assert found is not None, "row_keys is for plans with intervals"
        lo, hi = found
        return lo, hi, None if p.mask is None else p.mask[:, :, 0, :].cpu()

    def cut(self, uniform_tiles: int) -> SegmentTiles | None:
        """The tiles cut at the segments (`segment_tiles`) where they keep no more tiles than
        the uniform grid's `uniform_tiles`; None otherwise, and without a list of candidates
        four times that many (the cut could not win; this bounds its cost)."""
        if not self.segments:
            return None
        p = self.pairs
        cut = segment_tiles(
            p.q_len, p.kv_len, self.block_q, self.block_k, causal=p.causal, rule=p.rule,
            max_candidates=4 * uniform_tiles,
        )  # fmt: skip
        return cut if cut is not None and cut.rows.numel() <= uniform_tiles else None


def tile_plan(pairs: Any, block_q: int, block_k: int) -> TilePlan:
    """How the `block_q × block_k` tiles of `pairs` are found (`TilePlan`)."""
    rule, mask, free = pairs.rule, pairs.mask, pairs.layout is None  # free: not held
    intervals = (
        free
        and pairs.q_len > 0
        and pairs.kv_len > 0
        and (rule is None or rule.exact_ranges)
        and (mask is None or mask.shape[2] == 1)
    )
    return TilePlan(pairs, block_q, block_k, intervals, free and rule is not None and mask is None)


class ChosenTiles(NamedTuple):
    """Blocks chosen per (b, kv head) (`Pairs.kv_choice`) as a one-pass builder reads them:
    blocks of `block` keys (whole key tiles holding whole query tiles), and the last key each
    query row may see (`last`, int64 `(Nq,)`, negative: none; None: every key)."""

    block: int
    last: torch.Tensor | None


def chosen_tiles(pairs: Any, block_q: int, block_k: int) -> ChosenTiles | None:
    """The `ChosenTiles` of a problem whose rule is blocks chosen per (b, kv head), or None
    where the blocks are not whole tiles (the tiles of each group's own layout then). The
    causal rule, the choice's or the problem's, gives the rows' `last` keys (`causal_last`)."""
    rule, nq, nk = pairs.rule, pairs.q_len, pairs.kv_len
    if rule.block % block_k or rule.block % block_q or nq == 0 or nk == 0:
        return None
    return ChosenTiles(rule.block, causal_last(nq, nk, rule.causal or pairs.causal))


def dense_kinds(rule: Any, nq: int, nk: int, block_q: int, block_k: int) -> torch.Tensor:
    """int8 `(Bm, Hm, nqb, nkb)`: every tile's kind per batch element and head of a rule
    (Bm, Hm = 1 where it does not depend on them); O(tiles²), for pictures and tests."""
    q_lo, q_hi, k_lo, k_hi = tile_grid(nq, nk, block_q, block_k)
    B, H = rule.batch or 1, rule.heads or 1
    nqb, nkb = q_lo.numel(), k_lo.numel()
    if rule.has_bounds:
        bi = torch.arange(B).view(-1, 1, 1, 1)
        hi = torch.arange(H).view(1, -1, 1, 1)
        qs = (q_lo.view(1, 1, -1, 1), q_hi.view(1, 1, -1, 1))
        ks = (k_lo.view(1, 1, 1, -1), k_hi.view(1, 1, 1, -1))
        any_, all_ = rule.tile_bounds(bi, hi, *qs, *ks, nk)
        shape = (B, H, nqb, nkb)
        return classify(torch.broadcast_to(any_, shape), torch.broadcast_to(all_, shape))
    rows = torch.arange(nqb).repeat_interleave(nkb)
    cols = torch.arange(nkb).repeat(nqb)
    live = torch.ones(rows.numel(), dtype=torch.bool)
    any_, all_ = _examine(rows, cols, block_q, block_k, nq, nk, [("rule", rule)], live)
    kind = classify(any_, all_)  # (nqb·nkb, B, H)
    return kind.permute(1, 2, 0).reshape(B, H, nqb, nkb)
