"""BigBird (Zaheer et al. 2020) at block granularity: a band, global blocks and seeded random
blocks, whose picks are kept in qkv's bounded cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import CACHE
from .checks import check_int, check_queries_within_keys
from .mask import Mask


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
        check_queries_within_keys("bigbird", nq, nk)

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
    window, n_global = check_int("window", window, 0), check_int("n_global", n_global, 0)
    n_random, block = check_int("n_random", n_random, 0), check_int("block", block, 1)
    seed = check_int("seed", seed, 0)
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
