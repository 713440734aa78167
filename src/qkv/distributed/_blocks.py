"""One block of ring attention: queries of this rank × keys of one rank, at global positions.

A rank's shard is one run of positions (contiguous layout) or two (zigzag). A *block* pairs a
run of query rows with a run of key rows. Its pairs are derived from the one description of the
whole problem, a `qkv.pairs.Pairs` over global positions (`block_pairs`): causality is decided
per block from the global positions (a block is entirely in the future, entirely in the past,
or on the diagonal, because the runs are equal, aligned chunks), and a structured
`qkv.masks.Mask` is seen from the block's global positions (`Mask.shifted`), which also lets
its tile bounds skip a block that the mask leaves empty.

The per-block kernels are the tiled backend's forward and backward loops. The backward is
handed the *merged* (global) output and lse of the query rows: with those,
`P = exp(S − lse)` of the block is exactly the block's share of the global softmax, so the
block's dQ, dK, dV are its exact contributions to the global gradients (FlashAttention-2's
backward is already written per tile this way).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..kernels.tiled.steps import RowStats, TileProblem, Tiling, backward_loop, fold_run
from ..layout import build, causal_bounds, layout_for
from ..masks import Mask
from ..numerics import row_dot
from ..pairs import Pairs
from ..plan import make_plan
from .sharding import Segment, segments


def block_pairs(
    pairs: Pairs, q: Segment, k: Segment, head_start: int = 0, heads: int | None = None
) -> Pairs | None:
    """The pairs of one block of the whole problem `pairs` (N × N at global positions; a
    sharded problem holds the causal flag and a structured rule, nothing else): queries in the
    run `q` against keys in the run `k`, for query heads `head_start …` (`heads` of them; by
    default every head the rule is written for). None when causality hides the whole block
    (every key after every query); the flag is kept on the diagonal only, where the runs are
    equal and the block's own bottom-right alignment is the global rule. The rule is seen from
    the block's positions and heads (`Mask.shifted`)."""
    diagonal = False
    if pairs.causal:
        some, every = causal_bounds(q.start, q.stop - 1, k.start, k.stop - 1)
        if not some:  # every key after every query
            return None
        diagonal = not every  # some key after some query
        if diagonal and (k.start, k.length) != (q.start, q.length):
            raise AssertionError("runs of equal, aligned chunks overlap only as equals")
    rule = pairs.rule
    if rule is not None:
        h = rule.heads if heads is None else heads
        rule = rule.shifted(q.start, k.start, pairs.kv_len, head_start, h)
    return Pairs(q.length, k.length, causal=diagonal, rule=rule)


@dataclass(frozen=True)
class Block:
    """Query rows `q` of this rank's shard against key rows `k` of another rank's shard."""

    q: Segment  # the query run (global start, length, rows in the shard)
    k: Segment  # the key run
    pairs: Pairs  # which of its pairs may attend (`block_pairs`), every head

    def heads(self, whole: Pairs, start: int, count: int) -> Pairs:
        """Its pairs for query heads `start … start + count − 1` of the whole problem `whole`
        (a ring pass over a slice of the heads; a Ulysses rank's heads)."""
        pairs = block_pairs(whole, self.q, self.k, start, count)
        assert pairs is not None  # a block that causality hides is never scheduled
        return pairs


def schedule(
    q_rank: int, k_rank: int, world: int, n_local: int, layout: str, pairs: Pairs
) -> tuple[list[Block], int]:
    """The blocks rank `q_rank` computes against the keys of `k_rank` in the whole problem
    `pairs`, and how many it skips.

    Without causality or a mask the whole shard is one block (one kernel call)."""
    q_segs = segments(q_rank, world, n_local, layout)
    k_segs = segments(k_rank, world, n_local, layout)
    if not pairs.restricted:
        whole_q = Segment(q_segs[0].start, n_local, 0)
        whole_k = Segment(k_segs[0].start, n_local, 0)
        return [Block(whole_q, whole_k, Pairs(n_local, n_local))], 0
    blocks, skipped = [], 0
    for qs in q_segs:
        for ks in k_segs:
            mine = block_pairs(pairs, qs, ks)
            if mine is None or _rule_empties(mine):
                skipped += 1
                continue
            blocks.append(Block(qs, ks, mine))
    return blocks, skipped


def _rule_empties(pairs: Pairs) -> bool:
    """Whether the rule's tile bounds say that it leaves the whole block empty (read as one
    tile; a rule without bounds is never asked)."""
    rule = pairs.rule
    if rule is None or not rule.has_bounds:
        return False
    n, m = pairs.q_len, pairs.kv_len
    return build(n, m, n, m, rule=rule).nnz == 0


def _plan(q, k, v, pairs: Pairs, scale: float):
    """The block's plan: its shapes and scale, and its pairs as derived (`block_pairs`)."""
    return replace(make_plan(q, k, v, scale=scale, return_lse=True), pairs=pairs)


class Softmax:
    """The online-softmax state of this rank's query rows, carried from block to block.

    For every query row: `m`, the largest score seen so far, `l`, the sum of `exp(s − m)` over
    the keys seen so far, and `acc`, the sum of `exp(s − m) v`. Folding in a block is the tiled
    kernel's online softmax continued over the block's keys; `lse = m + log l` and
    `out = acc / l` come out once, at the end. This is the log-sum-exp merge of partial
    results, held as the pair (m, l) instead of one rounded lse per block: the rescaling
    factors `exp(m_old − m_new)` are then exact differences of scores, and the merged result is
    as accurate as the single-process kernel's.
    """

    def __init__(self, B, Hkv, G, n, Dv, dtype, device, scale: float):
        self.m = torch.full((B, Hkv, G, n), -torch.inf, dtype=dtype, device=device)
        self.l = torch.zeros(B, Hkv, G, n, dtype=dtype, device=device)
        self.acc = torch.zeros(B, Hkv, G, n, Dv, dtype=dtype, device=device)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out `(B, H, n, Dv)`, lse `(B, H, n)`) in the compute dtype; a row that no key
        reached has out 0 and lse −inf."""
        B, Hkv, G, n, Dv = self.acc.shape
        empty = self.l == 0
        l_safe = torch.where(empty, 1.0, self.l)
        out = self.acc / l_safe.unsqueeze(-1)
        lse = torch.where(empty, -torch.inf, self.m + torch.log(l_safe))
        return out.view(B, Hkv * G, n, Dv), lse.view(B, Hkv * G, n)


def forward(
    tiling: Tiling,
    state: Softmax,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block: Block,
    pairs: Pairs,
    scale: float,
) -> int:
    """Fold one block into `state` (rows `block.q.rows`; `pairs`: its pairs for these heads);
    return the tiles computed. q, k, v are already cut to the block, in the compute dtype. The
    loop is the tiled kernel's forward (its step `qkv.kernels.tiled.steps.fold_run`) with the
    running (m, l, acc) read from and written back to `state` instead of starting afresh."""
    T = TileProblem(_plan(q, k, v, pairs, scale), q, tiling)
    plan = T.plan
    B, Hkv, G, D, Dv = plan.batch, plan.kv_heads, plan.groups, plan.head_dim, plan.v_dim
    qs = q.reshape(B, Hkv, G, plan.q_len, D)  # (B, Hkv, G, n, D)
    base = block.q.local
    for strip in T.forward_strips():
        i0, i1 = strip.start, strip.stop  # rows of the block
        r0, r1, n = base + i0, base + i1, i1 - i0  # the same rows of the rank's shard
        q_t = qs[:, :, :, i0:i1].reshape(B, Hkv, G * n, D)
        # copies: fold_run updates l and acc in place, and they are written back below
        m = state.m[..., r0:r1].reshape(B, Hkv, G * n, 1)
        l = state.l[..., r0:r1].reshape(B, Hkv, G * n, 1).clone()
        acc = state.acc[..., r0:r1, :].reshape(B, Hkv, G * n, Dv).clone()
        for run in strip.runs:
            m, l, acc = fold_run(T, q_t, k, v, i0, i1, run, m, l, acc)
        state.m[..., r0:r1] = m.view(B, Hkv, G, n)
        state.l[..., r0:r1] = l.view(B, Hkv, G, n)
        state.acc[..., r0:r1, :] = acc.view(B, Hkv, G, n, Dv)
    return T.layout.nnz


def backward(
    tiling: Tiling,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor | None,
    dlse: torch.Tensor | None,
    pairs: Pairs,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's contributions (dq, dk, dv), given the merged out/lse of its query rows
    (`pairs`: the block's pairs for these heads)."""
    tiles = TileProblem(_plan(q, k, v, pairs, scale), q, tiling)
    # D_i over the row's keys on every rank: rowsum(dO ∘ O) of the merged output
    delta = row_dot(out.new_zeros(out.shape) if dout is None else dout, out, torch.float64)
    if dlse is not None:
        delta = delta - dlse.double()
    stats = RowStats.from_lse(lse, tiles.cdt)
    dq, dk, dv, _ = backward_loop(tiles, q, k, v, stats, dout, None, delta=delta)
    return dq, dk, dv


def tiles_per_rank(
    seq_len: int,
    world: int,
    layout: str = "contiguous",
    causal: bool = False,
    mask: Mask | None = None,
    block: int = 64,
) -> list[int]:
    """Tiles (block × block of the tiled kernel) each rank computes in one ring forward over a
    sequence of `seq_len` tokens, without running it: the work balance of a layout."""
    n_local = seq_len // world
    whole = Pairs(seq_len, seq_len, causal=causal, rule=mask)
    counts = []
    for rank in range(world):
        total = 0
        for step in range(world):
            src = (rank - step) % world
            blocks, _ = schedule(rank, src, world, n_local, layout, whole)
            total += sum(layout_for(blk.pairs, block, block).nnz for blk in blocks)
        counts.append(total)
    return counts
