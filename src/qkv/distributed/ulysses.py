"""All-to-all (DeepSpeed-Ulysses) attention: trade sequence shards for head shards and back.

Each rank holds N/P tokens of all H heads. One all-to-all per tensor gives every rank all N
tokens of H/P heads; each rank runs ordinary `qkv.attention` over the whole sequence for its
heads (any backend, any mask, causal or not, with no merging); a last all-to-all returns the
output to sequence shards::

    q, k, v  (B, H, N/P, D)  ──all-to-all──▶  (B, H/P, N, D)  ──qkv.attention──▶  (B, H/P, N, Dv)
    out      (B, H, N/P, Dv) ◀──all-to-all──────────────────────────────────────────┘

When it beats the ring: each rank sends 4·(P−1)/P of its shard (q, k, v, out) in four
collective steps, whatever P, against the ring's P−1 sends of its key/value block (and twice
that again in the backward), so on a fast all-to-all interconnect (NVLink within a node) Ulysses
moves fewer bytes once P ≥ 3 and runs the local kernel at full efficiency (one big problem per
rank, no merging). It needs H divisible by P (with grouped-query heads, the key/value heads are
repeated up to a multiple of P, which costs memory and bytes), so P is capped by the head count,
and each rank holds the whole sequence for H/P heads, so per-rank memory still grows with N.
The ring has no head constraint, overlaps its transfers with compute, needs only neighbour
links (it scales across nodes), and skips blocks that causality or a sparse mask leave empty.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..functional import attention
from ..masks import Mask
from ..plan import from_4d, to_4d
from . import _comm
from ._blocks import Block
from ._problem import validate
from .sharding import Segment, segments


def _runs(world: int, n: int, layout: str) -> list[tuple[int, slice, slice]]:
    """(source rank p, rows in p's shard, positions in the sequence) of every run of tokens."""
    return [
        (p, seg.rows, slice(seg.start, seg.stop))
        for p in range(world)
        for seg in segments(p, world, n, layout)
    ]


def _seq_to_heads(x: torch.Tensor, world: int, layout: str, group: _comm.Group) -> torch.Tensor:
    """`(B, Hx, n, …)` this rank's tokens of every head → `(B, Hx/P, N, …)` every token (in
    sequence order) of this rank's heads."""
    B, Hx, n = x.shape[:3]
    rest = x.shape[3:]
    send = x.reshape(B, world, Hx // world, n, *rest).transpose(0, 1)  # (P, B, Hx/P, n, …)
    got = _comm.all_to_all(send, group)  # got[p]: rank p's tokens of our heads
    out = x.new_empty(B, Hx // world, world * n, *rest)
    for p, rows, span in _runs(world, n, layout):
        out[:, :, span] = got[p, :, :, rows]
    return out


def _heads_to_seq(y: torch.Tensor, world: int, layout: str, group: _comm.Group) -> torch.Tensor:
    """The inverse: `(B, Hx/P, N, …)` → `(B, Hx, n, …)`."""
    B, h, N = y.shape[:3]
    rest = y.shape[3:]
    n = N // world
    send = y.new_empty(world, B, h, n, *rest)
    for p, rows, span in _runs(world, n, layout):
        send[p, :, :, rows] = y[:, :, span]
    got = _comm.all_to_all(send, group)  # got[p]: head group p's results for our tokens
    return got.transpose(0, 1).reshape(B, h * world, n, *rest)


class _SeqToHeads(torch.autograd.Function):
    """A permutation of the tokens × heads across ranks: its adjoint is its inverse."""

    @staticmethod
    def forward(ctx, x, world, layout, group):
        ctx.args = (world, layout, group)
        return _seq_to_heads(x, world, layout, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), *ctx.args), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, world, layout, group):
        ctx.args = (world, layout, group)
        return _heads_to_seq(y, world, layout, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), *ctx.args), None, None, None


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    mask: Mask | None = None,
    scale: float | None = None,
    layout: str = "contiguous",
    group: _comm.Group = None,
    return_lse: bool = False,
    backend: object = "auto",
):
    """Exact attention over a sequence sharded across ranks, by all-to-all (Ulysses).

    Same arguments, shapes and result as `qkv.distributed.ring_attention` (this rank's shard
    of `qkv.attention` over the whole sequence), plus `backend` for the local attention. The
    query heads H must be divisible by the number of ranks P; key/value heads that are not are
    repeated up to the smallest multiple of P that H allows.

    Prefer it to the ring when H is divisible by P and the all-to-all is fast (GPUs of one node):
    it sends 4·(P−1)/P of a shard per rank in the forward where the ring sends P−1 key/value
    blocks, and runs one big local problem. Prefer the ring across slow links, for P > H, for
    causal or sparse masks (the ring skips empty blocks) and when memory per rank must shrink
    with P for every head (Ulysses holds the whole sequence for its H/P heads).
    """

    def extra(world, heads, kv_heads, n_local):
        if heads % world:
            raise ValueError(
                f"ulysses_attention gives each rank H/P heads: the query heads H={heads} must "
                f"be divisible by the number of ranks P={world}; use ring_attention"
            )

    problem = validate(
        "ulysses_attention",
        q,
        k,
        v,
        causal=causal,
        mask=mask,
        scale=scale,
        layout=layout,
        group=group,
        return_lse=return_lse,
        extra=extra,
    )
    P, rank = problem.world, problem.rank
    kwargs: dict[str, Any] = dict(scale=problem.scale, return_lse=return_lse, backend=backend)
    if P == 1:  # the whole problem, every head
        return attention(q, k, v, causal=problem.pairs.causal, mask=problem.pairs.rule, **kwargs)
    H, Hkv = problem.heads, problem.kv_heads
    # this rank's problem: the whole sequence, its H/P heads
    whole = Segment(0, problem.n_global, 0)
    pairs = Block(whole, whole, problem.pairs).heads(problem.pairs, rank * (H // P), H // P)
    q4, k4, v4 = to_4d(q), to_4d(k), to_4d(v)
    repeat = P // math.gcd(Hkv, P)  # divides H/Hkv because P divides H
    if repeat > 1:  # query head h still reads kv head h // (H/Hkv) of the original
        k4, v4 = k4.repeat_interleave(repeat, 1), v4.repeat_interleave(repeat, 1)
    layout, group = problem.layout, problem.group

    def gather(x):
        return _SeqToHeads.apply(x, P, layout, group)

    def scatter(y):
        return _HeadsToSeq.apply(y, P, layout, group)

    res = attention(
        gather(q4), gather(k4), gather(v4), causal=pairs.causal, mask=pairs.rule, **kwargs
    )
    out, lse = res if return_lse else (res, None)
    out = from_4d(scatter(out), problem.input_rank)
    if lse is None:
        return out
    return out, from_4d(scatter(lse.unsqueeze(-1)).squeeze(-1), problem.input_rank)
