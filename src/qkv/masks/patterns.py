"""Patterns over positions alone: causal, sliding and dilated windows, global tokens, the Sparse
Transformer's strided and fixed patterns, and a bidirectional prefix (`prefix_lm`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .checks import check_int, check_ints
from .mask import Mask, span


@dataclass(frozen=True)
class _Causal:
    """`causal()`: key ≤ query."""

    def rule(self, b, h, q, kv, n):
        return kv <= q

    def bounds(self, b, h, ql, qh, kl, kh, n):
        return kl <= qh, kh <= ql

    def ranges(self, ql, qh, n):
        return span(0, qh, ql)


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
        return span(ql - self.left, qh + self.right, ql)

    def bounds(self, b, h, ql, qh, kl, kh, n):
        left, right = self.left, self.right
        return (
            (kl <= qh + right) & (kh >= ql - left),
            (kl >= qh - left) & (kh <= ql + right),
        )


def sliding_window(left: int, right: int | None = None) -> Mask:
    """Longformer's local band: `q − left ≤ kv ≤ q + right` (`right` defaults to `left`;
    `right=0` is a causal local window)."""
    left = check_int("left", left, 0)
    right = left if right is None else check_int("right", right, 0)
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
    window, dilation = check_int("window", window, 0), check_int("dilation", dilation, 1)
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
    idx = check_ints("indices", indices)
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
    stride = check_int("stride", stride, 1)
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
    block, summary = check_int("block", block, 1), check_int("summary", summary, 1)
    if summary > block:
        raise ValueError(f"summary={summary} must be ≤ block={block}")
    rule = _Fixed(block, summary)
    return Mask(rule=rule.rule, bounds=rule.bounds, name=f"fixed({block}, {summary})")


@dataclass(frozen=True)
class _KeysBelow:
    """`key < n_prefix` (the bidirectional part of `prefix_lm`)."""

    n_prefix: int

    def rule(self, b, h, q, kv, n):
        return kv < self.n_prefix

    def ranges(self, ql, qh, n):
        return span(0, self.n_prefix - 1, ql)

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
    n_prefix = check_int("n_prefix", n_prefix, 0)
    m = _key_below(n_prefix) | causal()
    m.name = f"prefix_lm({n_prefix})"
    return m
