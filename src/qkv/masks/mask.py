"""The `Mask` class and its algebra: `&`, `|`, `~` and `shifted` build new masks from old ones,
and the rule objects they hold (`_FnRule`, `_Not`, `_Combined`, `_Shifted`) live beside it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import layout
from ..layout import BlockLayout

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
    """A named rule saying which (query, key) pairs may attend. Build with the functions of
    `qkv.masks` (or `Mask(fn, name)` for a custom vectorised `fn(b, h, q, kv) -> bool`)."""

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
        if fn is not None:
            rule = _FnRule(fn)
        assert rule is not None  # exactly one of them, checked above
        self._rule: Rule = rule
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
        total, rows_per_chunk = 0.0, max(1, 2**22 // max(nk, 1))
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
# collectives, torch.save) by value. They are private: build masks with the functions of
# `qkv.masks` (the pattern modules hold theirs the same way).
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
        assert self.a._bounds is not None  # handed out only when the mask has bounds
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
        assert self.a._bounds is not None and self.c._bounds is not None  # both have bounds
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
        assert self.base._bounds is not None  # handed out only when the base has bounds
        return self.base._bounds(b, hh, ql + qs, qh + qs, kl + ks, kh + ks, self.n_total)

    def ranges(self, ql, qh, n):
        assert self.base._ranges is not None  # handed out only when the base has ranges
        got = self.base._ranges(ql + self.q_start, qh + self.q_start, self.n_total)
        return None if got is None else (got[0] - self.k_start, got[1] - self.k_start)


def span(lo: torch.Tensor | int, hi: torch.Tensor | int, like: torch.Tensor):
    """One interval per query tile, `(1, n)` each (a `Ranges` answer of one interval)."""
    return (torch.as_tensor(lo).expand(like.shape)[None].clone(),
            torch.as_tensor(hi).expand(like.shape)[None].clone())  # fmt: skip
