"""Fused strips: the tiled backend's forward for structured masks on the CPU when no gradient
will be taken, on torch's fused C++ flash kernel
(`aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=, scale=)`: grouped kv
heads, any strides, lse in natural units). The op cannot skip keys, so this module hands it only
the keys each group of query rows keeps:

1. **Layout.** The plan's `qkv.layout.BlockLayout` for the backend's tiles.
2. **Strips.** Rows of tiles merge into strips of at most `rows` query rows while the union of
   their kept key tiles stays within `waste` times what they keep alone. A strip's *window* is
   the concatenation of its kept key ranges (one range for a band, several for global columns).
3. **Groups.** Strips with one contiguous window whose starts advance by a constant step (the
   inside of a band) reach the op as `as_strided` views of q and k/v, no copy; other strips are
   grouped by rows and a width bucket and gathered (batch folded into heads), padded columns
   masked out. Groups are cut into batches of at most `budget` bytes, one op call each. Masks
   are built per tile: FULL tiles cost nothing, the rule runs on PARTIAL tiles only, one mask is
   broadcast when every strip of a batch shares it. Schedules and masks (within `mask_cache`
   bytes) live in qkv's cache, held against the Mask weakly.
4. **Wide strips** (window wider than `wide` keys: a global token's row) run alone.

Around the op: a row with no allowed key gets out 0 and lse −inf; masks that depend on the
batch element run one element at a time. Training runs the tiled loop instead (its backward
needs the loop's row max and denominator; the op's float32 lse and its own backward put float32
gradients outside the error rule). What else stays on the loop is in `reason`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ...cache import CACHE
from ...layout import allowed as layout_allowed
from ...layout import layout_for
from ...plan import AttentionPlan

_OPS = torch.ops.aten
# torch's op loses a NaN of q when it sees fewer than 16 keys and no mask: narrower windows
# are padded to 16 keys with masked-out columns.
NARROW = 16
_FWD_NAME = "_scaled_dot_product_flash_attention_for_cpu"


def _op_available() -> bool:
    return hasattr(_OPS, _FWD_NAME)


def fused_forward_op(q, k, v, mask, scale):
    """The fused op's forward (a module-level name, so tests can count the calls)."""
    return getattr(_OPS, _FWD_NAME)(q, k, v, attn_mask=mask, scale=scale)


@dataclass(frozen=True)
class FusedStrips:
    """Settings of the fused-strips path (`TiledBackend(fused=FusedStrips(...))`)."""

    rows: int = 64  # most query rows per strip
    waste: float = 1.25  # merge rows of tiles while the union of kept tiles grows ≤ 25%
    wide: int = 4096  # a strip whose window is wider than this runs alone
    budget: int = 4 * 2**20  # bytes of gathered tensors (and mask) per batched call
    mask_cache: int = 64 * 2**20  # bytes of masks a cached schedule keeps (beyond: rebuilt)

    def __post_init__(self):
        for name in ("rows", "wide", "budget", "mask_cache"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not self.waste >= 1.0:
            raise ValueError(f"waste must be ≥ 1, got {self.waste!r}")


def reason(plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when the fused path computes this plan exactly, else why the tiled loop runs."""
    if plan.pairs.rule is None:
        return "no structured qkv.masks.Mask"
    if q.device.type != "cpu":
        return "the fused op runs on the CPU only"
    if not _op_available():
        return f"this torch has no aten.{_FWD_NAME}"
    if plan.dropout_p > 0:
        return "dropout (qkv's counter-based mask) is applied by the tiled loop"
    if plan.score_mod is not None:
        return "score modifiers are applied by the tiled loop"
    if plan.return_weights:
        return "weights are not returned by the fused op"
    if plan.pairs.mask is not None or plan.pairs.bias is not None:
        return "a tensor mask is applied by the tiled loop"
    if plan.head_dim != plan.v_dim:
        return "the fused op needs Dv == D"
    if plan.q_len == 0 or plan.kv_len == 0 or plan.head_dim == 0:
        return "empty problem"
    if not plan.finite_inputs:
        return "k/v may hold NaN/inf in masked slots (the fused op would let 0·NaN through)"
    return None


# ---------------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class _Strided:
    """Evenly spaced equal ranges `start + i·step + [0, length)` for i < count: a view."""

    start: int
    step: int
    count: int
    length: int


Sel = torch.Tensor | slice | _Strided


@dataclass
class _Batch:
    """Strips run as one call: same row count, windows of one width."""

    rows: Sel  # query rows: (n·R,) indices, a slice (n == 1) or evenly spaced strips (a view)
    r0: torch.Tensor  # (n,) first row of each strip
    n_rows: int  # R
    cols: Sel  # keys: (n·W,) indices, a slice or evenly spaced windows (a view)
    col_pos: torch.Tensor  # (n, W) key positions (clamped)
    col_ok: torch.Tensor | None  # (n, W) bool: a real column of the window (None: all real)
    width: int  # W
    # Partial tiles: (strip, window offset, first key, keys) of every tile the rule decides.
    partial: torch.Tensor  # (P, 4) int64
    full: bool  # every kept tile FULL and no padding: no mask needed


def _bucket(w: int, step: int) -> int:
    """Round a width up by at most 1/8 (and to a multiple of `step`)."""
    g = max(step, 1 << max(0, w.bit_length() - 4))
    return -(-w // g) * g


def _progressions(items: list) -> list[list]:
    """Split items sorted by first row into runs whose first rows and window starts advance by
    constant steps (each run becomes one strided view of q and of k/v)."""
    runs: list[list] = []
    for it in items:
        cur = runs[-1] if runs else None
        if cur is not None and (
            len(cur) == 1
            or (
                it[0] - cur[-1][0] == cur[1][0] - cur[0][0]
                and it[2][0][0] - cur[-1][2][0][0] == cur[1][2][0][0] - cur[0][2][0][0]
            )
        ):
            cur.append(it)
        else:
            runs.append([it])
    return runs


class Schedule:
    """Strips of a plan grouped into batched calls, and their masks: built once per
    (Mask, shapes, settings) and kept in qkv's cache (`qkv.cache`), like FlexAttention's
    BlockMask, so that a training loop pays for them once. It holds no reference to the plan
    or its Mask (the cache holds the Mask weakly and drops the schedule with it)."""

    def __init__(self, plan: AttentionPlan, block_q: int, block_k: int, cfg: FusedStrips):
        self.cfg = cfg
        self.block_k = block_k
        nq, nk = plan.q_len, plan.kv_len
        lay = layout_for(plan.pairs, block_q, block_k)
        self.kept_fraction = lay.kept_fraction
        groups: dict[tuple, list] = {}
        singles = []
        covered = torch.zeros(nq, dtype=torch.bool)
        for s in lay.strips(max(cfg.rows, block_q), nk, cfg.waste):
            covered[s.start : s.stop] = True
            merged: list[tuple[int, int]] = []
            for r in s.runs:  # runs are cut at max_cols = Nk: only gaps separate them
                if merged and merged[-1][1] == r.start:
                    merged[-1] = (merged[-1][0], r.stop)
                else:
                    merged.append((r.start, r.stop))
            width = sum(b - a for a, b in merged)
            partial = [p for r in s.runs for p in r.partial]
            item = (s.start, s.stop, merged, width, partial)
            if width > cfg.wide:
                singles.append(item)
            elif len(merged) == 1 and width >= NARROW:  # one window: exact width, views
                groups.setdefault((s.stop - s.start, width, True), []).append(item)
            else:
                groups.setdefault((s.stop - s.start, _bucket(width, 16), False), []).append(item)
        self.batches: list[_Batch] = []
        for (n_rows, width, contiguous), items in groups.items():
            per = max(1, cfg.budget // self._strip_bytes(plan, n_rows, width, contiguous))
            runs = _progressions(items) if contiguous else [items]
            for run in runs:
                for i in range(0, len(run), per):
                    self.batches.append(self._batch(run[i : i + per], n_rows, width, contiguous))
        for item in singles:
            self.batches.append(self._batch([item], item[1] - item[0], item[3], False))
        self.uncovered = (~covered).nonzero().view(-1)  # query rows no strip computes
        self._masks: dict[tuple, tuple] = {}  # (batch, b) -> (mask, empty rows)
        self.mask_bytes = 0
        # Masks are built now, while they fit in cfg.mask_cache; the rest at every call.
        for i, b in itertools.product(range(len(self.batches)), _batch_elements(plan)):
            result = self._build_mask(i, b, plan)
            size = sum(t.numel() * t.element_size() for t in result if t is not None)
            if self.mask_bytes + size > cfg.mask_cache:
                break
            self._masks[(i, b)] = result
            self.mask_bytes += size

    def _strip_bytes(self, p: AttentionPlan, n_rows: int, width: int, views: bool) -> int:
        """Bytes one strip of a batch allocates: the op's output rows and the additive mask
        with its bool, plus gathered copies of q (rows) and k, v (window) unless the batch
        reads them as strided views."""
        elt = torch.empty((), dtype=p.dtype).element_size()
        bh, bhkv = p.batch * p.heads, p.batch * p.kv_heads
        mask_heads = p.heads if p.pairs.rule is not None and p.pairs.rule.heads else 1
        rows, window = n_rows * bh * p.head_dim, width * bhkv * p.head_dim
        tensors = rows if views else 2 * rows + 2 * window
        return elt * tensors + (elt + 1) * n_rows * width * mask_heads

    def _batch(self, items, n_rows: int, width: int, contiguous: bool) -> _Batch:
        n = len(items)
        r0 = torch.tensor([it[0] for it in items], dtype=torch.long)
        rows: Sel
        cols: Sel
        if n == 1:
            rows = slice(items[0][0], items[0][1])
        elif contiguous:
            rows = _Strided(items[0][0], items[1][0] - items[0][0], n, n_rows)
        else:
            rows = (r0.view(-1, 1) + torch.arange(n_rows)).reshape(-1)
        pos, ok, tiles = [], [], []
        padded = False
        for i, (_, _, ranges, w, partial) in enumerate(items):
            idx = torch.cat([torch.arange(a, b) for a, b in ranges])
            good = torch.ones(width, dtype=torch.bool)
            if w < width:
                padded = True
                idx = torch.cat([idx, idx.new_full((width - w,), idx[-1].item())])
                good[w:] = False
            pos.append(idx)
            ok.append(good)
            offset = 0
            for a, b in ranges:  # window offset of each partial tile
                for c0, c1 in partial:
                    for t0 in range(max(a, c0), min(b, c1), self.block_k):
                        t1 = min(t0 + self.block_k, b, c1)
                        tiles.append((i, offset + t0 - a, t0, t1 - t0))
                offset += b - a
        col_pos = torch.stack(pos)
        if contiguous and n > 1:
            c0 = items[0][2][0][0]
            cols = _Strided(c0, items[1][2][0][0] - c0, n, width)
        elif contiguous or (n == 1 and len(items[0][2]) == 1 and not padded):
            cols = slice(items[0][2][0][0], items[0][2][0][0] + width)
        else:
            cols = col_pos.reshape(-1)
        return _Batch(
            rows=rows,
            r0=r0,
            n_rows=n_rows,
            cols=cols,
            col_pos=col_pos,
            col_ok=torch.stack(ok) if padded else None,
            width=width,
            partial=torch.tensor(tiles, dtype=torch.long).view(-1, 4),
            full=not tiles and not padded,
        )

    def mask(self, i: int, b: int | None, plan: AttentionPlan):
        """Additive mask `(n|1, 1|H, R, W)` of batch i (None: all FULL) and its bool empty rows
        `(n|1, 1|H, R)` (None: none), in the plan's dtype: those built with the schedule
        (within the settings' `mask_cache` bytes), the others built now."""
        hit = self._masks.get((i, b))
        return hit if hit is not None else self._build_mask(i, b, plan)

    def _build_mask(self, i: int, b: int | None, plan: AttentionPlan):
        batch = self.batches[i]
        if batch.full:
            return None, None
        allowed = _allowed(plan, batch, b, self.block_k)
        empty = ~allowed.any(-1)
        return _additive(allowed, plan.dtype), (empty if bool(empty.any()) else None)


def schedule(plan: AttentionPlan, block_q: int, block_k: int, cfg: FusedStrips) -> Schedule:
    """The schedule of (plan's Mask object, shapes, dtype, tiles, settings), from qkv's cache
    (held against the Mask weakly: dropping the Mask drops it)."""
    key = (
        "fused-schedule",
        plan.batch,
        plan.heads,
        plan.kv_heads,
        plan.q_len,
        plan.kv_len,
        plan.head_dim,
        plan.pairs.causal,
        plan.dtype,
        str(plan.device),
        block_q,
        block_k,
        cfg,
    )
    return CACHE.get(key, lambda: Schedule(plan, block_q, block_k, cfg), owner=plan.pairs.rule)


# ------------------------------------------------------------------------------ the pieces


def _view(t: torch.Tensor, s: _Strided) -> torch.Tensor:
    """`(count, length, X, D)` view of the ranges `s` of a `(N, X, D)` tensor (no copy)."""
    n_, x_, d_ = t.stride()
    return t.as_strided(
        (s.count, s.length, t.shape[1], t.shape[2]),
        (s.step * n_, n_, x_, d_),
        t.storage_offset() + s.start * n_,
    )


def _take(t: torch.Tensor, sel: Sel, n: int, ws: _Workspace) -> torch.Tensor:
    """Rows `sel` of a `(N, X, D)` tensor in the op's `(n, X, R, D)` layout: a view for a slice
    or evenly spaced ranges, a copy gathered into the workspace otherwise."""
    if isinstance(sel, _Strided):
        return _view(t, sel).transpose(1, 2)
    rows = t[sel] if isinstance(sel, slice) else ws.gather(t, sel)
    return _to_op(rows, n)


class _Workspace:
    """One buffer that every batch's gathered q, k and v are copied into, reused batch after
    batch: a forward touches a few MiB of fresh memory instead of allocating every gather anew
    (each fresh page costs a fault)."""

    def __init__(self, elements: int, dtype: torch.dtype):
        self.buf = torch.empty(elements, dtype=dtype)
        self.used = 0

    def gather(self, t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        shape = (index.numel(), *t.shape[1:])
        size = shape[0] * t.shape[1] * t.shape[2]
        out = self.buf[self.used : self.used + size].view(shape)
        self.used += size
        return torch.index_select(t, 0, index, out=out)

    @staticmethod
    def elements(batches: list[_Batch], x_q: int, x_kv: int, d: int) -> int:
        """Most elements one batch gathers (q rows with x_q heads, k and v with x_kv)."""

        def count(sel: Sel) -> int:
            return sel.numel() if isinstance(sel, torch.Tensor) else 0

        return max(
            ((count(b.rows) * x_q + 2 * count(b.cols) * x_kv) * d for b in batches), default=0
        )


def _to_op(t: torch.Tensor, n: int) -> torch.Tensor:
    """`(n·R, X, D)` → the op's `(n, X, R, D)` view (its own favoured memory layout)."""
    return t.view(n, t.shape[0] // n, t.shape[1], t.shape[2]).transpose(1, 2)


def _from_op(t: torch.Tensor) -> torch.Tensor:
    """The op's `(n, X, R, D)` result → `(n·R, X, D)` (a view for the op's layout)."""
    n, x, r, d = t.shape
    return t.transpose(1, 2).reshape(n * r, x, d)


def _allowed(plan: AttentionPlan, batch: _Batch, b: int | None, block_k: int) -> torch.Tensor:
    """bool `(n, 1|H, R, W)`: which window columns each strip row may attend. FULL tiles are
    True without arithmetic; the rule (and causal flag) is evaluated on the PARTIAL tiles only,
    all at once as `(P, 1|H, R, block_k)` blocks; padded columns are False. When every strip's
    mask is the same (the inside of a band), one `(1, 1|H, R, W)` mask serves all (broadcast)."""
    rule = plan.pairs.rule
    assert rule is not None
    n, R, W = batch.r0.numel(), batch.n_rows, batch.width
    hm = plan.heads if rule.heads else 1
    allowed = torch.ones(n, hm, R, W, dtype=torch.bool)
    if batch.partial.numel():
        strip, off, c0, length = batch.partial.unbind(1)  # (P,) each
        j = torch.arange(block_k)
        rows = (batch.r0[strip].view(-1, 1) + torch.arange(R)).view(-1, 1, R, 1)
        cols = (c0.view(-1, 1) + j).clamp(max=plan.kv_len - 1).view(-1, 1, 1, block_k)
        bi = torch.zeros(1, 1, 1, 1, dtype=torch.long) + (b or 0)
        hi = torch.arange(hm).view(1, -1, 1, 1)
        vals = layout_allowed(
            bi,
            hi,
            rows,
            cols,
            q_len=plan.q_len,
            kv_len=plan.kv_len,
            causal=plan.pairs.causal,
            rule=rule,
        )
        assert vals is not None  # partial tiles exist only where something restricts the pairs
        vals = vals.expand(-1, hm, R, block_k)
        inside = j.view(1, -1) < length.view(-1, 1)  # (P, bk): a tile cut short at its end
        p_idx, j_idx = inside.nonzero(as_tuple=True)
        allowed[strip[p_idx], :, :, off[p_idx] + j_idx] = vals[p_idx, :, :, j_idx]
    if batch.col_ok is not None:
        allowed &= batch.col_ok.view(n, 1, 1, W)
    if n > 1 and bool((allowed == allowed[:1]).all()):
        return allowed[:1].expand(n, hm, R, W)  # one pattern for every strip (a band)
    return allowed


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where allowed, −inf elsewhere; a broadcast (stride-0) first dim stays broadcast."""
    if allowed.shape[0] > 1 and allowed.stride(0) == 0:
        return _additive(allowed[:1], dtype).expand(allowed.shape)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, -torch.inf)


def forward(plan: AttentionPlan, sched: Schedule, q, k, v):
    """`(out (B, H, Nq, Dv), lse (B, H, Nq))` of a plan `reason` accepted (no autograd: the
    tiled backend's autograd Function calls this and runs its own backward)."""
    B, H, Nq, Dv = plan.batch, plan.heads, plan.q_len, plan.v_dim
    lse_dtype = torch.float64 if plan.dtype == torch.float64 else torch.float32
    out = torch.empty(B, H, Nq, Dv, dtype=plan.dtype)  # every row is written once:
    lse = torch.empty(B, H, Nq, dtype=lse_dtype)
    out[:, :, sched.uncovered] = 0  # by no strip (every tile empty): 0 and −inf,
    lse[:, :, sched.uncovered] = -torch.inf
    elements = _batch_elements(plan)
    fold = plan.batch if elements == [None] else 1  # batch folded into the heads
    x_q, x_kv = fold * plan.heads, fold * plan.kv_heads
    ws = _Workspace(_Workspace.elements(sched.batches, x_q, x_kv, plan.head_dim), plan.dtype)
    for b in elements:
        qt, kt, vt = (_rows(t, b) for t in (q, k, v))
        out_t, lse_t = _rows(out, b), _rows(lse.unsqueeze(-1), b)
        for i, batch in enumerate(sched.batches):
            n = batch.r0.numel()
            mask, empty = sched.mask(i, b, plan)
            ws.used = 0
            o, lse_b = fused_forward_op(
                _take(qt, batch.rows, n, ws),
                _take(kt, batch.cols, n, ws),
                _take(vt, batch.cols, n, ws),
                mask,
                plan.scale,
            )
            if empty is not None:
                lse_b = lse_b.masked_fill(empty, -torch.inf)
            _put(out_t, batch.rows, o)  # or by the strip that computes it
            _put(lse_t, batch.rows, lse_b.unsqueeze(-1))
    return out, lse


def _batch_elements(plan: AttentionPlan) -> list[int | None]:
    """None: batch folded into heads. A rule that depends on the batch element (or on the head,
    with B > 1) runs one element at a time, so its mask is never repeated B times."""
    rule = plan.pairs.rule
    assert rule is not None
    if rule.batch is not None or (rule.heads is not None and plan.batch > 1):
        return list(range(plan.batch))
    return [None]


def _rows(t: torch.Tensor, b: int | None) -> torch.Tensor:
    """`(B, X, N, D)` → `(N, B·X, D)` (folded) or `(N, X, D)` for batch element b."""
    B, X, N, D = t.shape
    if b is None:
        return t.reshape(B * X, N, D).transpose(0, 1)
    return t[b].transpose(0, 1)


def _put(dst: torch.Tensor, sel: Sel, src: torch.Tensor) -> None:
    """Write the op's `(n, X, R, D)` result to rows `sel` of a `(N, X, D)` tensor."""
    if isinstance(sel, _Strided):
        _view(dst, sel).copy_(src.transpose(1, 2))
    elif isinstance(sel, slice):
        dst[sel] = _from_op(src)
    else:
        dst.index_copy_(0, sel, _from_op(src))
