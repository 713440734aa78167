"""One block of ring attention: queries of this rank × keys of one rank, at global positions.

A rank's shard is one run of positions (contiguous layout) or two (zigzag). A *block* pairs a
run of query rows with a run of key rows. Causality is decided per block from the global
positions (a block is entirely in the future, entirely in the past, or on the diagonal, because
the runs are equal, aligned chunks), and a structured `qkv.masks.Mask` is evaluated at the
block's global positions through `at_offset`, which also lets its tile bounds skip a block that
the mask leaves empty.

The per-block kernels are the tiled backend's forward and backward loops. The backward is
handed the *merged* (global) output and lse of the query rows: with those,
`P = exp(S − lse)` of the block is exactly the block's share of the global softmax, so the
block's dQ, dK, dV are its exact contributions to the global gradients (FlashAttention-2's
backward is already written per tile this way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.tiled.steps import RowStats, TileProblem, Tiling, backward_loop, fold_run
from ..layout import build, causal_bounds, layout_for
from ..masks import Mask
from ..numerics import row_dot
from ..plan import make_plan
from .sharding import Segment, segments


def at_offset(
    mask: Mask,
    q_start: int,
    k_start: int,
    n_global: int,
    head_start: int = 0,
    heads: int | None = None,
) -> Mask:
    """`mask` (written for the whole N×N problem and all H heads) seen from a square block
    whose query rows start at global position `q_start` and keys at `k_start` (`Mask.shifted`)."""
    return mask.shifted(q_start, k_start, n_global, head_start, heads)


@dataclass(frozen=True)
class Block:
    """Query rows `q` of this rank's shard against key rows `k` of another rank's shard."""

    q: Segment  # the query run (global start, length, rows in the shard)
    k: Segment  # the key run
    causal: bool  # on the diagonal: apply causality inside the block


def schedule(
    q_rank: int,
    k_rank: int,
    world: int,
    n_local: int,
    layout: str,
    causal: bool,
    mask: Mask | None,
) -> tuple[list[Block], int]:
    """The blocks rank `q_rank` computes against the keys of `k_rank`, and how many it skips.

    Without causality or a mask the whole shard is one block (one kernel call)."""
    q_segs = segments(q_rank, world, n_local, layout)
    k_segs = segments(k_rank, world, n_local, layout)
    if not causal and mask is None:
        whole_q = Segment(q_segs[0].start, n_local, 0)
        whole_k = Segment(k_segs[0].start, n_local, 0)
        return [Block(whole_q, whole_k, False)], 0
    n_global = n_local * world
    blocks, skipped = [], 0
    for qs in q_segs:
        for ks in k_segs:
            diagonal = False
            if causal:
                some, every = causal_bounds(qs.start, qs.stop - 1, ks.start, ks.stop - 1)
                if not some:  # every key after every query
                    skipped += 1
                    continue
                diagonal = not every  # some key after some query
                if diagonal and (ks.start, ks.length) != (qs.start, qs.length):
                    raise AssertionError("runs of equal, aligned chunks overlap only as equals")
            if mask is not None and mask.has_bounds:
                shifted = at_offset(mask, qs.start, ks.start, n_global, 0, mask.heads)
                if build(qs.length, ks.length, qs.length, ks.length, rule=shifted).nnz == 0:
                    skipped += 1
                    continue
            blocks.append(Block(qs, ks, diagonal))
    return blocks, skipped


def block_mask(
    block: Block, mask: Mask | None, n_global: int, head_start: int, heads: int
) -> Mask | None:
    if mask is None:
        return None
    return at_offset(mask, block.q.start, block.k.start, n_global, head_start, heads)


def _plan(q, k, v, block: Block, mask: Mask | None, scale: float):
    return make_plan(q, k, v, mask=mask, causal=block.causal, scale=scale, return_lse=True)


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
    mask: Mask | None,
    scale: float,
) -> int:
    """Fold one block into `state` (rows `block.q.rows`); return the tiles computed. q, k, v
    are already cut to the block, in the compute dtype. The loop is the tiled kernel's forward
    (its step `qkv.kernels.tiled.steps.fold_run`) with the running (m, l, acc) read from and
    written back to `state` instead of starting afresh."""
    T = TileProblem(_plan(q, k, v, block, mask, scale), q, tiling)
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
    block: Block,
    mask: Mask | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's contributions (dq, dk, dv), given the merged out/lse of its query rows."""
    tiles = TileProblem(_plan(q, k, v, block, mask, scale), q, tiling)
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
    tiling = Tiling(block, block)
    counts = []
    for rank in range(world):
        total = 0
        for step in range(world):
            src = (rank - step) % world
            blocks, _ = schedule(rank, src, world, n_local, layout, causal, mask)
            for blk in blocks:
                q = torch.empty(1, 1, blk.q.length, 1, device="meta")
                k = torch.empty(1, 1, blk.k.length, 1, device="meta")
                m = block_mask(blk, mask, seq_len, 0, mask.heads if mask else None)
                plan = _plan(q, k, k, blk, m, 1.0)
                total += layout_for(plan.pairs, tiling.block_q, tiling.block_k).nnz
        counts.append(total)
    return counts
