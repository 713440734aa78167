"""Mask algebra: which (query, key) pairs may attend, as small named rules.

A `Mask` is a vectorised rule `(b, h, q, kv) -> bool` over broadcastable int64 index tensors.
Compose masks with `&`, `|` and `~`::

    longformer = masks.sliding_window(256) | masks.global_tokens([0, 1, 2])
    qkv.attention(q, k, v, mask=longformer)

Positions: `q` is a query's *position in key coordinates*. When Nq == Nk it is just the query
index; when Nq < Nk the queries are the last Nq positions of the key sequence (bottom-right
alignment, what KV-cache decoding needs): query row i has position `i + Nk − Nq`. So
`masks.causal()` is exactly `causal=True`.

Each rule may also know, without looking at pairs, which keys a run of queries may reach
(`key_ranges`: intervals of key positions) and how to bound a whole tile (`tile_bounds`:
could any pair be allowed? is every pair?). `qkv.layout` uses both to find the kept tiles
without building the N×N matrix, which is what lets the kernels skip work. Both stay safe
under composition: an uncertain tile is partial and its rule is applied element-wise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import layout
from .cache import CACHE
from .layout import EMPTY as EMPTY  # tile kinds, re-exported for callers of Mask.blocks
from .layout import FULL as FULL
from .layout import PARTIAL as PARTIAL
from .layout import BlockLayout

# rule(b, h, q, kv, n_k) -> bool tensor; b, h, q, kv broadcastable int64 tensors, n_k = Nk.
Rule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
# bounds(b, h, q_lo, q_hi, k_lo, k_hi, n_k) -> (maybe_any, surely_all); inclusive position ranges.
Bounds = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# key_ranges(q_lo, q_hi, n_k) -> (lo, hi), each (R, n) int64: R intervals [lo, hi] of key
# positions per query tile (tile i holds positions q_lo[i] … q_hi[i]); None: any key.
Ranges = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor] | None]

# segments(n_q, n_k) -> (cu_q, cu_k): query rows and keys of each packed segment (Mask.segments).
Segments = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


class Mask:
    """A named rule saying which (query, key) pairs may attend. Build with the functions of this
    module (or `Mask(fn, name)` for a custom vectorised `fn(b, h, q, kv) -> bool`)."""

    def __init__(
        self,
        fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
        | None = None,
        name: str = "custom",
        *,
        rule: Rule | None = None,
        bounds: Bounds | None = None,
        batch: int | None = None,
        heads: int | None = None,
        check: Callable[[int, int], None] | None = None,
        ranges: Ranges | None = None,
        segments: Segments | None = None,
        exact_ranges: bool = False,
    ):
        if (fn is None) == (rule is None):
            raise TypeError("Mask needs exactly one of fn(b, h, q, kv) or rule")
        if fn is not None and not callable(fn):
            raise TypeError(f"fn must be callable as fn(b, h, q, kv), got {type(fn).__name__}")
        self._rule: Rule = rule if rule is not None else _FnRule(fn)
        self._bounds = bounds
        self._ranges = ranges
        self.name = name
        self.batch = batch  # the batch size the rule is written for, or None if independent
        self.heads = heads  # the head count the rule is written for, or None if independent
        self._check = check
        self._segments = segments
        # `ranges` of one position (q_lo == q_hi) are exactly its allowed keys, for every b, h
        self.exact_ranges = exact_ranges and ranges is not None and batch is None and heads is None

    def __repr__(self) -> str:
        return self.name

    # -- algebra -------------------------------------------------------------------------------
    def __and__(self, other: Mask) -> Mask:
        return _combine(self, other, "&")

    def __or__(self, other: Mask) -> Mask:
        return _combine(self, other, "|")

    def __invert__(self) -> Mask:
        a = self
        inverted = _Not(a)
        return Mask(
            rule=inverted.rule,
            bounds=inverted.bounds if a._bounds is not None else None,
            name=f"~{_paren(a)}",
            batch=a.batch,
            heads=a.heads,
            check=a._check,
        )

    # -- evaluation ----------------------------------------------------------------------------
    def check(self, nq: int, nk: int, batch: int | None = None, heads: int | None = None) -> None:
        """Raise ValueError if this mask cannot describe an (Nq × Nk) problem of that shape."""
        if batch is not None and self.batch not in (None, batch):
            raise ValueError(f"mask {self!r} is written for batch size {self.batch}, got B={batch}")
        if heads is not None and self.heads not in (None, heads):
            raise ValueError(f"mask {self!r} is written for {self.heads} heads, got H={heads}")
        if self._check is not None:
            self._check(nq, nk)

    @property
    def has_bounds(self) -> bool:
        """Whether `tile_bounds` can classify tiles without evaluating pairs."""
        return self._bounds is not None

    def tile_bounds(
        self,
        b: torch.Tensor,
        h: torch.Tensor,
        q_lo: torch.Tensor,
        q_hi: torch.Tensor,
        k_lo: torch.Tensor,
        k_hi: torch.Tensor,
        nk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(maybe_any, surely_all)` for tiles of positions [q_lo, q_hi] × [k_lo, k_hi]
        (inclusive, key coordinates; broadcastable int64 tensors with b and h): could any pair
        be allowed, and surely is every pair? Raises if the rule has no bounds."""
        if self._bounds is None:
            raise ValueError(f"mask {self!r} has no tile bounds; evaluate its pairs instead")
        return self._bounds(b, h, q_lo, q_hi, k_lo, k_hi, nk)

    def segments(self, nq: int, nk: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For packed sequences (`document`, `varlen`): `(cu_q, cu_k)`, int64, the query rows
        and keys of each segment — no pair crosses a segment — so a kernel can cut its tiles at
        the segment boundaries; None for other masks (a composed mask never has segments)."""
        return None if self._segments is None else self._segments(nq, nk)

    def key_ranges(
        self, q_lo: torch.Tensor, q_hi: torch.Tensor, nk: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Intervals of key positions `(lo, hi)`, each `(R, n)`, that queries at positions
        q_lo[i] … q_hi[i] may reach (for some batch element and head); None: any key."""
        return None if self._ranges is None else self._ranges(q_lo, q_hi, nk)

    def shifted(
        self,
        q_start: int,
        k_start: int,
        n_total: int,
        head_start: int = 0,
        heads: int | None = None,
    ) -> Mask:
        """This mask (written for the whole problem: `n_total` keys, all its heads) seen from
        a square block whose queries start at position `q_start` and keys at `k_start`,
        holding heads `head_start …` (`heads` of them): what a sequence-parallel rank runs."""
        view = _Shifted(self, q_start, k_start, n_total, head_start)
        return Mask(
            rule=view.rule,
            bounds=view.bounds if self._bounds is not None else None,
            ranges=view.ranges if self._ranges is not None else None,
            name=f"{self!r} @ (q+{q_start}, k+{k_start}, h+{head_start})",
            batch=self.batch,
            heads=heads if self.heads is not None else None,
        )

    def evaluate(
        self,
        b: torch.Tensor,
        h: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
        nq: int,
        nk: int,
    ) -> torch.Tensor:
        """The rule on query rows `rows` and keys `cols` of an (Nq × Nk) problem (row indices are
        turned into positions here). All arguments broadcastable int64 tensors."""
        return self._rule(b, h, rows + (nk - nq), cols, nk)

    def dense4(self, nq: int, nk: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The mask as a bool `(Bm, Hm, Nq, Nk)` tensor (Bm = batch or 1, Hm = heads or 1)."""
        bi, hi = self._index(None, self.batch, device), self._index(None, self.heads, device)
        hi = hi.view(1, -1, 1, 1)
        rows = torch.arange(nq, device=device).view(1, 1, nq, 1)
        cols = torch.arange(nk, device=device).view(1, 1, 1, nk)
        dense = self.evaluate(bi, hi, rows, cols, nq, nk)
        return dense.expand(bi.shape[0], hi.shape[1], nq, nk)

    def to_dense(
        self,
        nq: int,
        nk: int,
        b: int | None = None,
        h: int | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The mask as a bool tensor: `(Nq, Nk)` for a rule independent of batch and head,
        otherwise `(Bm, Hm, Nq, Nk)` (Bm = mask.batch or 1, Hm = mask.heads or 1); `b` / `h`
        select one batch element / head (and drop that dim)."""
        self.check(nq, nk)
        dense = self.dense4(nq, nk, device)
        if b is not None:
            self._index(b, self.batch, device)  # range check
            dense = dense[b : b + 1] if self.batch is not None else dense
        if h is not None:
            self._index(h, self.heads, device)
            dense = dense[:, h : h + 1] if self.heads is not None else dense
        if (self.batch is None or b is not None) and (self.heads is None or h is not None):
            return dense[0, 0].contiguous()
        return dense.contiguous()

    @staticmethod
    def _index(i: int | None, size: int | None, device) -> torch.Tensor:
        if i is not None:
            if size is not None and not 0 <= i < size:
                raise ValueError(f"index {i} is out of range [0, {size})")
            return torch.tensor([i], device=device).view(-1, 1, 1, 1)
        return torch.arange(size or 1, device=device).view(-1, 1, 1, 1)

    def density(self, nq: int, nk: int) -> float:
        """Fraction of (query, key) pairs allowed (averaged over batch and heads)."""
        if nq == 0 or nk == 0:
            return 0.0
        total, rows_per_chunk = 0, max(1, 2**22 // max(nk, 1))
        bi, hi = self._index(None, self.batch, None), self._index(None, self.heads, None)
        hi = hi.view(1, -1, 1, 1)
        cols = torch.arange(nk).view(1, 1, 1, nk)
        for r0 in range(0, nq, rows_per_chunk):
            rows = torch.arange(r0, min(nq, r0 + rows_per_chunk)).view(1, 1, -1, 1)
            m = self.evaluate(bi, hi, rows, cols, nq, nk)
            total += m.expand(bi.shape[0], hi.shape[1], rows.shape[2], nk).sum().item()
        return total / ((self.batch or 1) * (self.heads or 1) * nq * nk)

    def blocks(self, nq: int, nk: int, block_q: int = 128, block_k: int = 128) -> BlockLayout:
        """The kept tiles of an (Nq × Nk) problem under this mask (`qkv.layout.BlockLayout`:
        `.show()`, `.kind`, `.kept_fraction`), worked out from the rule's key ranges and tile
        bounds (no N×N matrix) or, for a rule without them, its pairs tile by tile."""
        self.check(nq, nk)
        return layout.block_layout(self, nq, nk, block_q=block_q, block_k=block_k)

    def tile_kinds(self, nq: int, nk: int, block_q: int = 128, block_k: int = 128) -> torch.Tensor:
        """int8 `(Bm, Hm, nqb, nkb)`: EMPTY / PARTIAL / FULL of every tile per batch element and
        head (Bm, Hm = 1 where the rule does not depend on them); O(tiles²), for pictures and
        tests."""
        self.check(nq, nk)
        return layout.dense_kinds(self, nq, nk, block_q, block_k)


def _paren(m: Mask) -> str:
    r = repr(m)
    return f"({r})" if (" & " in r or " | " in r) else r


def _combine(a: Mask, c: Mask, op: str) -> Mask:
    if not isinstance(c, Mask):
        return NotImplemented
    for attr in ("batch", "heads"):
        x, y = getattr(a, attr), getattr(c, attr)
        if x is not None and y is not None and x != y:
            raise ValueError(f"cannot combine {a!r} ({attr}={x}) with {c!r} ({attr}={y})")
    both = _Combined(a, c, op)
    return Mask(
        rule=both.rule,
        bounds=both.bounds if a._bounds is not None and c._bounds is not None else None,
        ranges=both.ranges,
        exact_ranges=a.exact_ranges and c.exact_ranges,
        name=f"{_paren(a)} {op} {_paren(c)}",
        batch=a.batch if a.batch is not None else c.batch,
        heads=a.heads if a.heads is not None else c.heads,
        check=both.check,
    )


# ---------------------------------------------------------------------------------------------
# Rules as objects: every rule, bound, range and check a Mask holds is a method of one of these
# module-level classes (never a closure), so that a Mask pickles (spawn workers, object
# collectives, torch.save) by value. They are private: build masks with the functions below.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _FnRule:
    """`Mask(fn)`: a user's `fn(b, h, q, kv)` as a rule (it pickles if `fn` does)."""

    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

    def __call__(self, b, h, q, kv, n):
        return self.fn(b, h, q, kv)


@dataclass(frozen=True, eq=False)
class _Not:
    """`~a`."""

    a: Mask

    def rule(self, b, h, q, kv, n):
        return ~self.a._rule(b, h, q, kv, n)

    def bounds(self, *args):
        maybe_any, surely_all = self.a._bounds(*args)
        return ~surely_all, ~maybe_any


@dataclass(frozen=True, eq=False)
class _Combined:
    """`a & c` or `a | c` (`op`)."""

    a: Mask
    c: Mask
    op: str

    def rule(self, b, h, q, kv, n):
        x, y = self.a._rule(b, h, q, kv, n), self.c._rule(b, h, q, kv, n)
        return x & y if self.op == "&" else x | y

    def bounds(self, *args):
        x, y = self.a._bounds(*args), self.c._bounds(*args)
        if self.op == "&":
            # any(a & c) ≤ any(a) & any(c) (an upper bound); all(a & c) = all(a) & all(c).
            return x[0] & y[0], x[1] & y[1]
        # any(a | c) = any(a) | any(c); all(a | c) ≥ all(a) | all(c) (a lower bound).
        return x[0] | y[0], x[1] | y[1]

    def check(self, nq, nk):
        for m in (self.a, self.c):
            if m._check is not None:
                m._check(nq, nk)

    def ranges(self, ql, qh, n):
        ra, rc = self.a.key_ranges(ql, qh, n), self.c.key_ranges(ql, qh, n)
        if self.op == "|":  # reach(a | c) = reach(a) ∪ reach(c): unbounded if either is
            return None if ra is None or rc is None else (torch.cat([ra[0], rc[0]]),
                                                          torch.cat([ra[1], rc[1]]))  # fmt: skip
        if ra is None or rc is None:  # reach(a & c) ⊆ reach(a) ∩ reach(c)
            return ra if rc is None else rc
        lo = torch.maximum(ra[0][:, None], rc[0][None]).reshape(-1, ql.numel())
        hi = torch.minimum(ra[1][:, None], rc[1][None]).reshape(-1, ql.numel())
        return lo, hi


@dataclass(frozen=True, eq=False)
class _Shifted:
    """`base.shifted(q_start, k_start, n_total, head_start)`."""

    base: Mask
    q_start: int
    k_start: int
    n_total: int
    head_start: int

    def rule(self, b, h, q, kv, n):
        return self.base._rule(
            b, h + self.head_start, q + self.q_start, kv + self.k_start, self.n_total
        )

    def bounds(self, b, h, ql, qh, kl, kh, n):
        hh = h + self.head_start
        qs, ks = self.q_start, self.k_start
        return self.base._bounds(b, hh, ql + qs, qh + qs, kl + ks, kh + ks, self.n_total)

    def ranges(self, ql, qh, n):
        got = self.base._ranges(ql + self.q_start, qh + self.q_start, self.n_total)
        return None if got is None else (got[0] - self.k_start, got[1] - self.k_start)


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------


def _int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be ≥ {minimum}")
    return value


def _int_list(name: str, values: object) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    out = []
    for x in values:
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must hold ints, got {type(x).__name__} {x!r}")
        out.append(x)
    return out


def _span(lo: torch.Tensor | int, hi: torch.Tensor | int, like: torch.Tensor):
    """One interval per query tile, `(1, n)` each."""
    return (torch.as_tensor(lo).expand(like.shape)[None].clone(),
            torch.as_tensor(hi).expand(like.shape)[None].clone())  # fmt: skip


def _all_true(*like: torch.Tensor) -> torch.Tensor:
    return torch.ones(torch.broadcast_shapes(*(t.shape for t in like)), dtype=torch.bool)


def _queries_within_keys(name: str, nq: int, nk: int) -> None:
    if nq > nk:
        raise ValueError(
            f"{name} needs Nq ≤ Nk (queries are the last Nq key positions), got Nq={nq}, Nk={nk}"
        )


# ---------------------------------------------------------------------------------------------
# The patterns
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Causal:
    """`causal()`: key ≤ query."""

    def rule(self, b, h, q, kv, n):
        return kv <= q

    def bounds(self, b, h, ql, qh, kl, kh, n):
        return kl <= qh, kh <= ql

    def ranges(self, ql, qh, n):
        return _span(0, qh, ql)


def causal() -> Mask:
    """Key position ≤ query position (bottom-right aligned, like `causal=True`)."""
    rule = _Causal()
    return Mask(
        rule=rule.rule,
        bounds=rule.bounds,
        ranges=rule.ranges,
        exact_ranges=True,
        name="causal()",
    )


@dataclass(frozen=True)
class _Window:
    """`sliding_window(left, right)`: q − left ≤ kv ≤ q + right."""

    left: int
    right: int

    def rule(self, b, h, q, kv, n):
        return (kv >= q - self.left) & (kv <= q + self.right)

    def ranges(self, ql, qh, n):
        return _span(ql - self.left, qh + self.right, ql)

    def bounds(self, b, h, ql, qh, kl, kh, n):
        left, right = self.left, self.right
        return (
            (kl <= qh + right) & (kh >= ql - left),
            (kl >= qh - left) & (kh <= ql + right),
        )


def sliding_window(left: int, right: int | None = None) -> Mask:
    """Longformer's local band: `q − left ≤ kv ≤ q + right` (`right` defaults to `left`;
    `right=0` is a causal local window)."""
    left = _int("left", left, 0)
    right = left if right is None else _int("right", right, 0)
    rule = _Window(left, right)
    return Mask(
        rule=rule.rule,
        ranges=rule.ranges,
        exact_ranges=True,
        bounds=rule.bounds,
        name=f"sliding_window({left}, {right})",
    )


@dataclass(frozen=True)
class _Dilated:
    """`dilated_window(window, dilation)`: |q − kv| ≤ reach and a multiple of `dilation`."""

    reach: int
    dilation: int

    def rule(self, b, h, q, kv, n):
        return ((q - kv).abs() <= self.reach) & ((q - kv) % self.dilation == 0)

    def bounds(self, *a):
        maybe_any, surely_all = _Window(self.reach, self.reach).bounds(*a)
        return maybe_any, surely_all & (self.dilation == 1)


def dilated_window(window: int, dilation: int) -> Mask:
    """Longformer's dilated window: keys at `q ± m·dilation` for m = 0 … window."""
    window, dilation = _int("window", window, 0), _int("dilation", dilation, 1)
    reach = window * dilation
    rule = _Dilated(reach, dilation)
    return Mask(
        rule=rule.rule,
        bounds=rule.bounds,
        ranges=_Window(reach, reach).ranges,
        name=f"dilated_window({window}, {dilation})",
    )


def _count_in(sorted_idx: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """How many of `sorted_idx` fall in [lo, hi] (elementwise, broadcast)."""
    shape = torch.broadcast_shapes(lo.shape, hi.shape)
    lo, hi = lo.expand(shape).contiguous(), hi.expand(shape).contiguous()
    upper = torch.searchsorted(sorted_idx, hi.flatten(), right=True)
    lower = torch.searchsorted(sorted_idx, lo.flatten(), right=False)
    return (upper - lower).view(shape)


@dataclass(frozen=True, eq=False)
class _Global:
    """`global_tokens(indices)`: `table` the sorted positions, as runs [starts[r], ends[r]];
    `last` the largest (a Python int: checking reads no tensor)."""

    table: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    last: int

    def is_global(self, p):
        return torch.isin(p, self.table.to(p.device))

    def rule(self, b, h, q, kv, n):
        return self.is_global(q) | self.is_global(kv)

    def bounds(self, b, h, ql, qh, kl, kh, n):
        nq_glob, nk_glob = _count_in(self.table, ql, qh), _count_in(self.table, kl, kh)
        return (nq_glob > 0) | (nk_glob > 0), (nq_glob == qh - ql + 1) | (nk_glob == kh - kl + 1)

    def check(self, nq, nk):
        if self.last >= nk:
            raise ValueError(
                f"global token index {self.last} is out of range for a sequence of {nk} keys"
            )

    def ranges(self, ql, qh, n):
        has_global = _count_in(self.table, ql, qh) > 0  # such a query tile reaches every key
        starts, ends = self.starts, self.ends
        lo = torch.cat(
            [torch.where(has_global, 0, n)[None], starts[:, None].expand(-1, ql.numel())]
        )
        hi = torch.cat([torch.full_like(ql, n - 1)[None], ends[:, None].expand(-1, ql.numel())])
        return lo, hi


def global_tokens(indices: Sequence[int] | torch.Tensor) -> Mask:
    """These positions attend everywhere and every position attends to them."""
    idx = _int_list("indices", indices)
    if any(i < 0 for i in idx):
        raise ValueError(f"global token indices must be ≥ 0, got {sorted(idx)[:5]}")
    table = torch.tensor(sorted(set(idx)), dtype=torch.long)
    # the global keys as runs of consecutive positions: [starts[r], ends[r]]
    if len(table):
        brk = torch.nonzero(table.diff() != 1).view(-1)
        starts = torch.cat([table[:1], table[brk + 1]])
        ends = torch.cat([table[brk], table[-1:]])
    else:
        starts = ends = table
    rule = _Global(table, starts, ends, max(idx, default=-1))
    shown = idx if len(idx) <= 6 else [*sorted(idx)[:3], "…", sorted(idx)[-1]]
    return Mask(
        rule=rule.rule,
        bounds=rule.bounds,
        ranges=rule.ranges,
        exact_ranges=True,
        name=f"global_tokens({shown})".replace("'", ""),
        check=rule.check,
    )


@dataclass(frozen=True)
class _Strided:
    """`strided(stride)`: |q − kv| < stride, or a multiple of `stride` apart."""

    stride: int

    def rule(self, b, h, q, kv, n):
        return ((q - kv).abs() < self.stride) | ((q - kv) % self.stride == 0)

    def bounds(self, *a):
        maybe_any, surely_all = _Window(self.stride - 1, self.stride - 1).bounds(*a)
        return torch.ones_like(maybe_any), surely_all


def strided(stride: int) -> Mask:
    """Sparse Transformer "strided" pattern (Child et al. 2019): the previous/next `stride`
    positions, plus every `stride`-th position. Compose with `causal()` for the paper's
    autoregressive form."""
    stride = _int("stride", stride, 1)
    rule = _Strided(stride)
    return Mask(rule=rule.rule, bounds=rule.bounds, name=f"strided({stride})")


@dataclass(frozen=True)
class _Fixed:
    """`fixed(block, summary)`: the same block, or one of the last `summary` of a block."""

    block: int
    summary: int

    def n_summary_below(self, x):  # number of summary columns in [0, x)
        block, summary = self.block, self.summary
        return (x // block) * summary + torch.clamp(x % block - (block - summary), min=0)

    def rule(self, b, h, q, kv, n):
        block = self.block
        return (q // block == kv // block) | (kv % block >= block - self.summary)

    def bounds(self, b, h, ql, qh, kl, kh, n):
        block = self.block
        same_any = (kl // block <= qh // block) & (kh // block >= ql // block)
        same_all = (
            (ql // block == qh // block)
            & (kl // block == ql // block)
            & (kh // block == ql // block)
        )
        count = self.n_summary_below(kh + 1) - self.n_summary_below(kl)
        return same_any | (count > 0), same_all | (count == kh - kl + 1)


def fixed(block: int, summary: int) -> Mask:
    """Sparse Transformer "fixed" pattern: attend within your block of `block` positions, and to
    the last `summary` positions of every block. Compose with `causal()` for the paper's form."""
    block, summary = _int("block", block, 1), _int("summary", summary, 1)
    if summary > block:
        raise ValueError(f"summary={summary} must be ≤ block={block}")
    rule = _Fixed(block, summary)
    return Mask(rule=rule.rule, bounds=rule.bounds, name=f"fixed({block}, {summary})")


def _doc_ids(bounds_t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    flat = p.reshape(-1).contiguous()
    return torch.searchsorted(bounds_t.to(p.device), flat, right=True).view(p.shape)


@dataclass(frozen=True, eq=False)
class _Document:
    """`document(lengths)`: doc d covers positions [starts[d], ends[d]); `total` keys."""

    ends: torch.Tensor
    starts: torch.Tensor
    total: int

    def rule(self, b, h, q, kv, n):
        return _doc_ids(self.ends, q) == _doc_ids(self.ends, kv)

    def bounds(self, b, h, ql, qh, kl, kh, n):
        dql, dqh, dkl, dkh = (_doc_ids(self.ends, x) for x in (ql, qh, kl, kh))
        return (dkl <= dqh) & (dkh >= dql), (dql == dqh) & (dkl == dkh) & (dql == dkl)

    def check(self, nq, nk):
        if self.total != nk:
            raise ValueError(
                f"document lengths sum to {self.total}, but the sequence has {nk} keys"
            )
        _queries_within_keys("document", nq, nk)

    def ranges(self, ql, qh, n):
        starts, ends = self.starts, self.ends
        return _span(starts[_doc_ids(ends, ql)], starts[_doc_ids(ends, qh) + 1] - 1, ql)

    def segments(self, nq, nk):  # query row i sits at position i + nk − nq
        return (self.starts - (nk - nq)).clamp(0, nq), self.starts


def document(lengths: Sequence[int] | torch.Tensor) -> Mask:
    """Packed sequences: positions attend only within their own document (block diagonal).
    `lengths` must sum to the key length."""
    lens = _int_list("lengths", lengths)
    if any(n < 0 for n in lens):
        raise ValueError(f"document lengths must be ≥ 0, got {lens}")
    ends = torch.tensor(lens, dtype=torch.long).cumsum(0)  # doc d covers [ends[d-1], ends[d])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), ends])
    rule = _Document(ends, starts, sum(lens))
    return Mask(
        rule=rule.rule,
        bounds=rule.bounds,
        ranges=rule.ranges,
        exact_ranges=True,
        segments=rule.segments,
        name=f"document({lens})",
        check=rule.check,
    )


@dataclass(frozen=True)
class _KeysBelow:
    """`key < n_prefix` (the bidirectional part of `prefix_lm`)."""

    n_prefix: int

    def rule(self, b, h, q, kv, n):
        return kv < self.n_prefix

    def ranges(self, ql, qh, n):
        return _span(0, self.n_prefix - 1, ql)

    def bounds(self, b, h, ql, qh, kl, kh, n):
        return (kl < self.n_prefix) & (qh >= ql), (kh < self.n_prefix) & (qh >= ql)


def _key_below(n_prefix: int) -> Mask:
    rule = _KeysBelow(n_prefix)
    return Mask(
        rule=rule.rule,
        ranges=rule.ranges,
        exact_ranges=True,
        bounds=rule.bounds,
        name=f"keys_below({n_prefix})",
    )


def prefix_lm(n_prefix: int) -> Mask:
    """A bidirectional prefix (image tokens, a prompt) then causal text: key < n_prefix or
    key ≤ query."""
    n_prefix = _int("n_prefix", n_prefix, 0)
    m = _key_below(n_prefix) | causal()
    m.name = f"prefix_lm({n_prefix})"
    return m


@dataclass(frozen=True, eq=False)
class _Padding:
    """`padding(lengths)`: key < table[b]."""

    table: torch.Tensor
    longest: int

    def rule(self, b, h, q, kv, n):
        return kv < self.table.to(kv.device)[b]

    def bounds(self, b, h, ql, qh, kl, kh, n):
        L = self.table[b]
        return kl < L, kh < L

    def check(self, nq, nk):
        if self.longest > nk:
            raise ValueError(f"padding length {self.longest} exceeds the sequence of {nk} keys")

    def ranges(self, ql, qh, n):
        return _span(0, self.longest - 1, ql)


def padding(lengths: Sequence[int] | torch.Tensor) -> Mask:
    """Per batch element b, only the first `lengths[b]` keys are real (the rest is padding).
    Queries are not masked: a padded query still gets an output (ignore it)."""
    lens = _int_list("lengths", lengths)
    if any(n < 0 for n in lens):
        raise ValueError(f"padding lengths must be ≥ 0, got {lens}")
    rule = _Padding(torch.tensor(lens, dtype=torch.long), max(lens, default=0))
    return Mask(
        rule=rule.rule,
        bounds=rule.bounds,
        ranges=rule.ranges,
        name=f"padding({lens})",
        batch=len(lens),
        check=rule.check,
    )


@dataclass(frozen=True, eq=False)
class _KeyMask:
    """`key_mask(valid)`: `valid` (B, Nk) on its device, `table` on the CPU (the same tensor
    when `valid` is there), `counts` the real keys before each key, [first, last] the keys real
    in some batch element."""

    valid: torch.Tensor
    table: torch.Tensor
    counts: torch.Tensor
    first: int
    last: int

    def rule(self, b, h, q, kv, n):
        return self.valid[b, kv]

    def bounds(self, b, h, ql, qh, kl, kh, n):
        real = self.counts[b, kh + 1] - self.counts[b, kl]  # real keys in each tile, per b
        return real > 0, real == kh - kl + 1

    def check(self, nq, nk):
        if self.table.shape[1] != nk:
            raise ValueError(
                f"key_mask covers {self.table.shape[1]} keys, but the sequence has {nk}"
            )

    def ranges(self, ql, qh, n):
        return _span(self.first, self.last, ql)


def key_mask(valid: torch.Tensor) -> Mask:
    """Per batch element, which keys are real: `valid` is bool `(B, Nk)` (True = a real token),
    as in a transformers `attention_mask`; padding may sit anywhere (left or right).

    The Mask holds a copy of `valid` taken here: changing `valid` in place afterwards does not
    change the Mask (build a new one for new padding)."""
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or valid.dim() != 2:
        got = f"{valid.dtype} {tuple(valid.shape)}" if isinstance(valid, torch.Tensor) else valid
        raise TypeError(f"key_mask needs a bool tensor (B, Nk), got {got}")
    valid = valid.detach().clone()
    table = valid.to("cpu")
    counts = torch.nn.functional.pad(table.long().cumsum(1), (1, 0))  # (B, Nk + 1)
    real = table.any(0).nonzero().view(-1)  # keys real in some batch element
    first, last = (int(real[0]), int(real[-1])) if real.numel() else (1, 0)
    rule = _KeyMask(valid, table, counts, first, last)
    return Mask(
        rule=rule.rule,
        bounds=rule.bounds,
        ranges=rule.ranges,
        name=f"key_mask(B={table.shape[0]}, Nk={table.shape[1]})",
        batch=table.shape[0],
        check=rule.check,
    )


@dataclass(frozen=True)
class _BigBird:
    """`bigbird(window, n_global, n_random, block, seed)`, at block granularity."""

    window: int
    n_global: int
    n_random: int
    block: int
    seed: int

    def picks(self, n: int) -> torch.Tensor:
        """`(nb, n_random)` int64: the random key blocks of each query block, for n positions."""
        nb = max(1, -(-n // self.block))
        r = min(self.n_random, nb)
        seed = self.seed

        def build() -> torch.Tensor:
            g = torch.Generator().manual_seed(seed)
            rows = max(1, 2**22 // nb)  # draw a few MB of uniforms at a time
            parts = [
                torch.rand(min(rows, nb - i), nb, generator=g).topk(r, largest=False).indices
                for i in range(0, nb, rows)
            ]
            return torch.cat(parts).sort(-1).values

        return CACHE.get(("bigbird-picks", seed, nb, r), build)

    def rule(self, b, h, q, kv, n):
        block, window, n_global = self.block, self.window, self.n_global
        i, j = q // block, kv // block
        allowed = ((i - j).abs() <= window) | (i < n_global) | (j < n_global)
        if self.n_random:
            p = self.picks(n).to(q.device)
            i_, j_ = torch.broadcast_tensors(i, j)
            rows = p[i_.clamp(max=p.shape[0] - 1)]  # (..., n_random)
            for t in range(rows.shape[-1]):  # one comparison per pick: no (..., R) temporary
                allowed = allowed | (rows[..., t] == j_)
        return allowed

    def check(self, nq, nk):
        _queries_within_keys("bigbird", nq, nk)

    def blocks_allowed(self, i, j, p):
        ok = ((i - j).abs() <= self.window) | (i < self.n_global) | (j < self.n_global)
        if p is not None:
            ok = ok | (p[i.clamp(max=p.shape[0] - 1)] == j.unsqueeze(-1)).any(-1)
        return ok

    def bounds(self, b, h, ql, qh, kl, kh, n):
        block, window, n_global = self.block, self.window, self.n_global
        i0, i1, j0, j1 = ql // block, qh // block, kl // block, kh // block  # inclusive
        p = self.picks(n) if self.n_random else None
        if int((i1 - i0).max()) + 1 <= 8 and int((j1 - j0).max()) + 1 <= 8:
            # few block pairs per rectangle (tiles of about a block): enumerate them, exact
            shape = torch.broadcast_shapes(i0.shape, i1.shape, j0.shape, j1.shape)
            any_ = torch.zeros(shape, dtype=torch.bool)
            all_ = torch.ones(shape, dtype=torch.bool)
            for di in range(int((i1 - i0).max()) + 1):
                for dj in range(int((j1 - j0).max()) + 1):
                    i, j = (i0 + di).expand(shape), (j0 + dj).expand(shape)
                    inside = (i <= i1) & (j <= j1)
                    ok = self.blocks_allowed(i, j, p)
                    any_ |= inside & ok
                    all_ &= ~inside | ok
            return any_, all_
        any_ = (j0 <= i1 + window) & (j1 >= i0 - window) | (i0 < n_global) | (j0 < n_global)
        all_ = (j0 >= i1 - window) & (j1 <= i0 + window) | (i1 < n_global) | (j1 < n_global)
        if p is not None:  # a random pick inside makes it non-empty (full: left to the rule)
            any_ = any_ | _picks_in(p, i0, i1, j0, j1)
        return any_, all_

    def ranges(self, ql, qh, n):
        block, window, n_global = self.block, self.window, self.n_global
        i0, i1 = ql // block, qh // block
        lo = [(i0 - window) * block, torch.zeros_like(ql), torch.where(i0 < n_global, 0, n)]
        hi = [(i1 + window + 1) * block - 1, torch.full_like(ql, n_global * block - 1)]
        hi.append(torch.full_like(ql, n - 1))
        if self.n_random:  # the picks of every block row the tile spans
            p = self.picks(n)
            for d in range(int((i1 - i0).max()) + 1 if ql.numel() else 0):
                row = (i0 + d).clamp(max=p.shape[0] - 1)
                live = (i0 + d) <= i1
                for t in range(p.shape[1]):
                    lo.append(torch.where(live, p[row, t] * block, n))
                    hi.append(torch.where(live, (p[row, t] + 1) * block - 1, -1))
        return torch.stack(lo), torch.stack(hi)


def bigbird(window: int, n_global: int, n_random: int, block: int, seed: int = 0) -> Mask:
    """BigBird (Zaheer et al. 2020) at block granularity: with blocks of `block` positions, query
    block i attends key blocks j with |i − j| ≤ window, the first `n_global` blocks attend and
    are attended everywhere, and each query block attends `n_random` random key blocks (a
    function of `seed` and i).

    Memory is O(blocks · n_random): the random picks are kept (in qkv's bounded cache), never
    an n_blocks² table."""
    window, n_global = _int("window", window, 0), _int("n_global", n_global, 0)
    n_random, block = _int("n_random", n_random, 0), _int("block", block, 1)
    seed = _int("seed", seed, 0)
    rule = _BigBird(window, n_global, n_random, block, seed)
    return Mask(
        rule=rule.rule,
        bounds=rule.bounds,
        ranges=rule.ranges,
        name=f"bigbird(window={window}, n_global={n_global}, n_random={n_random}, "
        f"block={block}, seed={seed})",
        check=rule.check,
    )


def _picks_in(picks: torch.Tensor, i0, i1, j0, j1) -> torch.Tensor:
    """Whether any row r in [i0, i1] of `picks (nb, R)` (sorted rows) holds a value in [j0, j1];
    the ranges are broadcastable int64 tensors of block indices."""
    shape = torch.broadcast_shapes(i0.shape, i1.shape, j0.shape, j1.shape)
    i0, i1, j0, j1 = (x.expand(shape).reshape(-1) for x in (i0, i1, j0, j1))
    nb = picks.shape[0]
    i0, i1 = i0.clamp(0, nb - 1), i1.clamp(0, nb - 1)
    out = torch.zeros(i0.shape, dtype=torch.bool)
    span = int((i1 - i0).max()) + 1 if i0.numel() else 0
    for d in range(span):  # rows of the rectangles, one offset at a time
        r = (i0 + d).clamp(max=nb - 1)
        live = (i0 + d) <= i1
        row = picks[r]  # (M, R)
        out |= live & ((row >= j0.unsqueeze(-1)) & (row <= j1.unsqueeze(-1))).any(-1)
    return out.view(shape)


@dataclass(frozen=True, eq=False)
class _FromTensor:
    """`from_tensor(mask)`: `m4` the held copy `(B, H, Nq, Nk)`."""

    m4: torch.Tensor

    def rule(self, b, h, q, kv, n):
        B, H, nq_t, nk_t = self.m4.shape
        t = self.m4.to(q.device)
        rows = q - (nk_t - nq_t)
        return t[b if B > 1 else 0, h if H > 1 else 0, rows.clamp(0, nq_t - 1), kv] & (rows >= 0)

    def check(self, nq, nk):
        nq_t, nk_t = self.m4.shape[2:]
        if (nq, nk) != (nq_t, nk_t):
            raise ValueError(
                f"mask from_tensor has shape (Nq, Nk)=({nq_t}, {nk_t}) but the problem is "
                f"({nq}, {nk})"
            )


def from_tensor(mask: torch.Tensor) -> Mask:
    """A dense bool tensor `(Nq, Nk)`, `(H, Nq, Nk)` or `(B, H, Nq, Nk)` as a Mask (True = may
    attend). Its size must match the problem it is used on.

    The Mask holds a copy of `mask` taken here, so the layouts qkv keeps for it stay true:
    changing `mask` in place afterwards does not change the Mask (build a new one)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"from_tensor needs a bool tensor, got {got}")
    if mask.dim() not in (2, 3, 4):
        raise ValueError(f"from_tensor needs 2 to 4 dims, got shape {tuple(mask.shape)}")
    m4 = mask.detach().clone().reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    B, H = m4.shape[:2]
    rule = _FromTensor(m4)
    return Mask(
        rule=rule.rule,
        name=f"from_tensor(shape={tuple(mask.shape)})",
        batch=B if B > 1 else None,
        heads=H if H > 1 else None,
        check=rule.check,
    )


def _check_cu(name: str, cu: object) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor) or cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32/int64 tensor, got {cu!r}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D with at least one entry, got {tuple(cu.shape)}")
    cu = cu.detach().to("cpu", torch.long, copy=True)  # a copy: the Mask never goes stale
    if cu[0] != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must start at 0 and never decrease, got {cu.tolist()[:8]}")
    return cu


@dataclass(frozen=True, eq=False)
class _Varlen:
    """`varlen(cu_q, cu_k, causal)`: `tq`, `tk` query and key tokens in all."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    causal: bool
    tq: int
    tk: int

    @property
    def ends_q(self) -> torch.Tensor:
        return self.cu_q[1:]

    @property
    def ends_k(self) -> torch.Tensor:
        return self.cu_k[1:]

    def seq_q(self, row):
        return _doc_ids(self.ends_q, row)

    def rule(self, b, h, q, kv, n):
        cu_q, cu_k = self.cu_q, self.cu_k
        row = q - (self.tk - self.tq)
        d = self.seq_q(row)
        same = d == _doc_ids(self.ends_k, kv)
        if not self.causal:
            return same
        dc = d.clamp(max=cu_q.numel() - 2)
        cq, ck = cu_q.to(q.device), cu_k.to(q.device)
        off = (ck[dc + 1] - ck[dc]) - (cq[dc + 1] - cq[dc])
        return same & (kv - ck[dc] <= row - cq[dc] + off)

    def bounds(self, b, h, ql, qh, kl, kh, n):
        cu_q, cu_k = self.cu_q, self.cu_k
        rl, rh = ql - (self.tk - self.tq), qh - (self.tk - self.tq)
        dql, dqh = self.seq_q(rl), self.seq_q(rh)
        dkl, dkh = _doc_ids(self.ends_k, kl), _doc_ids(self.ends_k, kh)
        maybe_any = (dkl <= dqh) & (dkh >= dql)
        surely_all = (dql == dqh) & (dkl == dkh) & (dql == dkl)
        if self.causal:
            d = dql.clamp(max=cu_q.numel() - 2)
            off = (cu_k[d + 1] - cu_k[d]) - (cu_q[d + 1] - cu_q[d])
            surely_all = surely_all & (kh - cu_k[d] <= rl - cu_q[d] + off)
        return maybe_any, surely_all

    def check(self, nq, nk):
        tq, tk = self.tq, self.tk
        if (nq, nk) != (tq, tk):
            raise ValueError(
                f"cu_seqlens describe {tq} query and {tk} key tokens, got Nq={nq}, Nk={nk}"
            )

    def ranges(self, ql, qh, n):  # the keys of the sequences the tile's query rows belong to
        last = self.cu_q.numel() - 2
        d0 = self.seq_q(ql - (self.tk - self.tq)).clamp(max=last)
        d1 = self.seq_q(qh - (self.tk - self.tq)).clamp(max=last)
        return _span(self.cu_k[d0], self.cu_k[d1 + 1] - 1, ql)

    def segments(self, nq, nk):
        return self.cu_q, self.cu_k


def varlen(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, causal: bool = False) -> Mask:
    """Packed variable-length sequences (FlashAttention's `cu_seqlens`): query row i of
    sequence s attends only keys of sequence s; with `causal`, bottom-right aligned within each
    sequence. Sequence s holds query rows `cu_seqlens_q[s] … cu_seqlens_q[s+1]` and keys
    `cu_seqlens_k[s] … cu_seqlens_k[s+1]`."""
    cu_q, cu_k = _check_cu("cu_seqlens_q", cu_seqlens_q), _check_cu("cu_seqlens_k", cu_seqlens_k)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"{cu_q.numel() - 1} and {cu_k.numel() - 1}"
        )
    rule = _Varlen(cu_q, cu_k, bool(causal), int(cu_q[-1]), int(cu_k[-1]))
    n_seq = cu_q.numel() - 1
    return Mask(
        rule=rule.rule,
        bounds=rule.bounds,
        ranges=rule.ranges,
        segments=rule.segments,
        name=f"varlen({n_seq} sequences, causal={causal})",
        check=rule.check,
    )


# ---------------------------------------------------------------------- blocks chosen per head


@dataclass(frozen=True, eq=False)
class _Chosen:
    """`ChosenBlocks`: `index` int64 `(Bi, Hi, nqs, kmax)`, the key blocks query block r (rows
    r·block …) of batch element b and kv head g reads, ascending, −1 past its count; `groups`
    query heads share a kv head's choice. Bi, Hi are 1 in a view of one (b, g)."""

    index: torch.Tensor
    block: int
    groups: int
    causal: bool
    q_len: int
    kv_len: int

    def _blocks(self, b, h, qb, device):
        """`index[b, g, qb]` as `kmax` tensors of the broadcast shape (no (..., kmax) one)."""
        idx = self.index.to(device)
        zero = torch.zeros((), dtype=torch.long, device=device)
        bi = torch.as_tensor(b, device=device) if idx.shape[0] > 1 else zero
        g = torch.as_tensor(h, device=device) // self.groups if idx.shape[1] > 1 else zero
        bi, g, qb = torch.broadcast_tensors(bi, g, qb.clamp(0, idx.shape[2] - 1))
        return [idx[..., t][bi, g, qb] for t in range(idx.shape[3])]

    def chosen(self, b, h, qb, kb):
        """Whether key block kb is among query block qb's (broadcastable tensors)."""
        ok = torch.zeros(torch.broadcast_shapes(qb.shape, kb.shape, torch.as_tensor(b).shape,
                                                torch.as_tensor(h).shape), dtype=torch.bool,
                         device=qb.device)  # fmt: skip
        for picks in self._blocks(b, h, qb, qb.device):
            ok |= picks == kb
        return ok

    def rule(self, b, h, q, kv, n):
        row = q - (n - self.q_len)
        ok = self.chosen(b, h, row // self.block, kv // self.block)
        if self.causal:
            ok = ok & (kv <= q)
        return ok

    def bounds(self, b, h, ql, qh, kl, kh, n):
        off, block = n - self.q_len, self.block
        i0, i1 = ((ql - off) // block).clamp(min=0), ((qh - off) // block).clamp(min=0)
        j0, j1 = kl // block, kh // block
        si = int((i1 - i0).max()) + 1 if ql.numel() else 1
        sj = int((j1 - j0).max()) + 1 if kl.numel() else 1
        shape = torch.broadcast_shapes(torch.as_tensor(b).shape, torch.as_tensor(h).shape,
                                       i0.shape, j0.shape)  # fmt: skip
        if si * sj > 64:  # tiles of many blocks: bounded loosely (the kernels evaluate pairs)
            any_, all_ = torch.ones(shape, dtype=torch.bool), torch.zeros(shape, dtype=torch.bool)
        else:
            any_, all_ = torch.zeros(shape, dtype=torch.bool), torch.ones(shape, dtype=torch.bool)
            for di in range(si):
                for dj in range(sj):
                    i, j = i0 + di, j0 + dj
                    inside = (i <= i1) & (j <= j1)
                    ok = self.chosen(b, h, i, j)
                    any_ |= inside & ok
                    all_ &= ~inside | ok
        if self.causal:
            any_ = any_ & (kl <= qh)
            all_ = all_ & (kh <= ql)
        return any_, all_

    def check(self, nq, nk):
        if (nq, nk) != (self.q_len, self.kv_len):
            raise ValueError(
                f"these blocks were chosen for (Nq, Nk)=({self.q_len}, {self.kv_len}), got "
                f"({nq}, {nk})"
            )

    def ranges(self, ql, qh, n):
        """The chosen blocks of every (b, g) and every query block the tiles span."""
        idx, block, off = self.index, self.block, n - self.q_len
        i0 = ((ql - off) // block).clamp(0, idx.shape[2] - 1)
        i1 = ((qh - off) // block).clamp(0, idx.shape[2] - 1)
        lo, hi = [], []
        for d in range(int((i1 - i0).max()) + 1 if ql.numel() else 0):
            i = (i0 + d).clamp(max=idx.shape[2] - 1)
            picks = idx[:, :, i].reshape(-1, ql.numel(), idx.shape[3])  # (Bi·Hi, tiles, kmax)
            picks = picks.permute(0, 2, 1).reshape(-1, ql.numel())
            live = (picks >= 0) & ((i0 + d) <= i1)
            top = torch.clamp((picks + 1) * block, max=n) - 1
            if self.causal:
                top = torch.minimum(top, qh)
            lo.append(torch.where(live, picks * block, n))
            hi.append(torch.where(live, top, -1))
        if not lo:
            return torch.full((1, ql.numel()), n), torch.full((1, ql.numel()), -1)
        return torch.cat(lo), torch.cat(hi)


class ChosenBlocks(Mask):
    """Key blocks chosen per query block, batch element and kv head (`qkv.sparse.select_blocks`
    chooses them from the content; any other chooser may build one): query row i of batch
    element b and query head h attends key j when j's block is among `index[b, h // G, i //
    block]` (G = H / Hkv: the heads of a GQA group share their kv head's choice), and, with
    `causal`, j ≤ i + Nk − Nq.

    `index` int64 `(B, Hkv, ceil(Nq / block), kmax)`: ascending key-block indices, −1 past each
    row's count. Kernels run it one (b, kv head) at a time, each over its own kept tiles
    (`group`); a chosen block never costs a tile of another head."""

    def __init__(
        self,
        index: torch.Tensor,
        block: int,
        *,
        heads: int,
        q_len: int,
        kv_len: int,
        causal: bool = True,
        name: str | None = None,
        one_group: bool = False,
    ):
        block, heads = _int("block", block, 1), _int("heads", heads, 1)
        q_len, kv_len = _int("q_len", q_len, 0), _int("kv_len", kv_len, 0)
        if not isinstance(index, torch.Tensor) or index.dim() != 4:
            raise ValueError("index must be an int64 (B, Hkv, query blocks, kmax) tensor")
        if index.dtype.is_floating_point or index.dtype == torch.bool:
            raise TypeError(f"index must hold ints, got {index.dtype}")
        B, hkv, nqs, _ = index.shape
        if nqs != max(1, -(-q_len // block)):
            raise ValueError(
                f"index has {nqs} query blocks; Nq={q_len} with block={block} needs "
                f"{max(1, -(-q_len // block))}"
            )
        if hkv < 1 or heads % hkv:
            raise ValueError(f"heads={heads} is not a multiple of the index's {hkv} kv heads")
        nks = -(-kv_len // block)
        index = index.detach().to("cpu", torch.long).contiguous()
        low, high = index.aminmax() if index.numel() else (-1, -1)
        if not one_group and (int(high) >= nks or int(low) < -1):
            raise ValueError(f"index holds a key block outside [-1, {nks})")
        self.index = index
        self.block = block
        self.causal = bool(causal)
        self.kv_heads = hkv
        if one_group and (B, hkv) != (1, 1):
            raise ValueError("a one-group view holds one batch element and one kv head")
        rule = _Chosen(index, block, heads // hkv, self.causal, q_len, kv_len)
        super().__init__(
            rule=rule.rule, bounds=rule.bounds, ranges=rule.ranges, check=rule.check,
            batch=None if one_group else B, heads=None if one_group else heads,
            exact_ranges=one_group, name=name or f"chosen_blocks(block={block})",
        )  # fmt: skip
        self.one_group = one_group
        self.group_heads = heads  # query heads: all of them, or a view's group
        self._views: dict[tuple[int, int], ChosenBlocks] = {}
        self._shape = (q_len, kv_len)

    def group(self, b: int, hkv: int) -> ChosenBlocks:
        """The blocks of batch element b and kv head hkv alone (`one_group`): the mask of a
        one-(b, kv head) problem of its G query heads, independent of batch and head, whose key
        ranges are exact: what a kernel runs."""
        view = self._views.get((b, hkv))
        if view is None:
            q_len, kv_len = self._shape
            view = ChosenBlocks(
                self.index[b : b + 1, hkv : hkv + 1], self.block,
                heads=self.group_heads // self.kv_heads, q_len=q_len, kv_len=kv_len,
                causal=self.causal, name=f"{self!r}[b={b}, kv head={hkv}]", one_group=True,
            )  # fmt: skip
            self._views[(b, hkv)] = view
        return view

    def counts(self) -> torch.Tensor:
        """int64 `(B, Hkv, query blocks)`: how many key blocks each query block reads."""
        return (self.index >= 0).sum(-1)

    def show(self, b: int = 0, hkv: int = 0) -> str:
        """A text picture of one (b, kv head)'s choice: a row per query block, '#' a chosen key
        block, '.' one left out."""
        nks = -(-self._shape[1] // self.block)
        grid = torch.zeros(self.index.shape[2], nks + 1, dtype=torch.bool)
        picks = self.index[b, hkv]
        grid.scatter_(1, torch.where(picks >= 0, picks, nks), True)
        return "\n".join("".join("#" if x else "." for x in row[:nks].tolist()) for row in grid)

    def __reduce__(self):
        q_len, kv_len = self._shape
        return (_rebuild_chosen, (self.index, self.block, self.group_heads, q_len, kv_len,
                                  self.causal, self.name, self.one_group))  # fmt: skip


def _rebuild_chosen(index, block, heads, q_len, kv_len, causal, name, one) -> ChosenBlocks:
    return ChosenBlocks(index, block, heads=heads, q_len=q_len, kv_len=kv_len, causal=causal,
                        name=name, one_group=one)  # fmt: skip


def chosen_blocks(
    index: torch.Tensor,
    block: int,
    *,
    heads: int,
    q_len: int,
    kv_len: int,
    causal: bool = True,
) -> ChosenBlocks:
    """Key blocks chosen per query block, batch element and kv head, as a mask (`ChosenBlocks`:
    `index` `(B, Hkv, ceil(Nq / block), kmax)`, ascending, −1 past each row's count)."""
    return ChosenBlocks(index, block, heads=heads, q_len=q_len, kv_len=kv_len, causal=causal)
