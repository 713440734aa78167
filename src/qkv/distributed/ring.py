"""Ring attention: exact attention over a sequence sharded across P ranks.

Each rank holds the queries, keys and values of its N/P tokens. Key/value blocks travel around
the ring of ranks; at step t, rank r holds the keys/values of rank r − t::

    step 0      step 1      step 2      step 3        (P = 4; rank r computes Q_r against K_s)
    r0: K0      r0: K3      r0: K2      r0: K1
    r1: K1      r1: K0      r1: K3      r1: K2
    r2: K2      r2: K1      r2: K0      r2: K3
    r3: K3      r3: K2      r3: K1      r3: K0

The transfer for step t + 1 is posted (`batch_isend_irecv`: send to r + 1, receive from r − 1)
before the block of step t is computed, so communication overlaps computation. Each block
yields a partial result that merges exactly through log-sum-exps (in fp32, fp64 for fp64)::

    lse = log(e^lse_a + e^lse_b),   out = e^(lse_a − lse) out_a + e^(lse_b − lse) out_b

held, as in the tiled kernel's online softmax, as a running row max m and sum l (lse = m + log l)
so that no per-block rounding of lse enters the weights (see `_blocks.Softmax`).

The backward is a second ring. The forward saved only q, k, v, the merged output and lse. Key
/value blocks travel the ring again; each rank recomputes its blocks with the tiled kernel's
backward (which, given the merged out and lse, yields the exact contributions dQ, dK, dV), keeps
dQ, and adds its dK, dV to an accumulator that travels with the block: after P steps the
accumulator has visited every rank and one more hop brings it home.

Memory per rank: O(N/P · d) (the shards, the merged output, two key/value blocks in flight and,
in the backward, the travelling dK/dV accumulator), plus the kernel's tile buffers. The buffers
in flight (two key/value blocks, and in the backward three dK/dV blocks: the one arriving, the
one leaving, this rank's contributions) would hold ten shards' worth of keys and values, more
than the rank's own inputs, outputs and gradients together; so by default the ring runs once
per key/value head (`head_chunks="auto"`), which divides them and the kernel's tile buffers by
Hkv for more, smaller messages of the same total size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.tiled.backend import TiledBackend
from ..masks import Mask
from ..numerics import once_differentiable
from ..plan import from_4d, to_4d
from . import _blocks, _comm
from ._problem import Problem, validate

TAG_KV, TAG_DKV = 11, 12


@dataclass(frozen=True)
class _Config:
    problem: Problem
    backend: TiledBackend  # the per-block kernel (its tile size is the unit that can be skipped)
    head_chunks: int  # run the ring this many times, over a slice of the heads each


def _chunk(t: torch.Tensor, c: int, g: int) -> torch.Tensor:
    """Heads c·H/g … (c+1)·H/g of a `(B, H, …)` tensor (a view)."""
    h = t.shape[1] // g
    return t[:, c * h : (c + 1) * h]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _ring_forward(cfg: _Config, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    P = cfg.problem
    g, cdt = cfg.head_chunks, _compute_dtype(q.dtype)
    B, H, n, Dv = P.batch, P.heads, P.n_local, P.v_dim
    out = torch.empty(B, H, n, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, n, dtype=cdt, device=q.device)
    ring = _comm.Ring(P.group, P.rank, P.world)
    for c in range(g):
        q_c = _chunk(q, c, g)  # (B, H/g, n, D)
        kv = [_chunk(k, c, g), _chunk(v, c, g)]  # this rank's keys/values travel first
        hkv = kv[0].shape[1]
        state = _blocks.Softmax(B, hkv, H // g // hkv, n, Dv, cdt, q.device, P.scale)
        for step in range(P.world):
            src = (P.rank - step) % P.world  # whose keys/values we hold now
            pending = ring.shift(kv, TAG_KV) if step < P.world - 1 else None
            blocks, skipped = _blocks.schedule(P.rank, src, P.world, P.n_local, P.layout, P.pairs)
            for blk in blocks:
                tiles = _blocks.forward(
                    cfg.backend.tiling,
                    state,
                    q_c[:, :, blk.q.rows].to(cdt),
                    kv[0][:, :, blk.k.rows].to(cdt),
                    kv[1][:, :, blk.k.rows].to(cdt),
                    blk,
                    blk.heads(P.pairs, c * (H // g), H // g),
                    P.scale,
                )
                if c == 0:
                    _comm.COUNTERS.tiles += tiles
            if c == 0:
                _comm.COUNTERS.blocks += len(blocks)
                _comm.COUNTERS.blocks_skipped += skipped
            if pending is not None:
                kv = pending.wait()  # the previous rank's keys/values, for step + 1
        out_c, lse_c = state.result()
        _chunk(out, c, g).copy_(out_c)
        _chunk(lse, c, g).copy_(lse_c)
    return out, lse


def _ring_backward(cfg: _Config, q, k, v, out, lse, dout, dlse):
    P = cfg.problem
    g, cdt = cfg.head_chunks, _compute_dtype(q.dtype)
    H = P.heads
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    ring = _comm.Ring(P.group, P.rank, P.world)
    for c in range(g):
        q_c, dq_c = _chunk(q, c, g).to(cdt), _chunk(dq, c, g)
        out_c, lse_c = _chunk(out, c, g), _chunk(lse, c, g)
        do_c = None if dout is None else _chunk(dout, c, g)
        dl_c = None if dlse is None else _chunk(dlse, c, g)
        kv = [_chunk(k, c, g), _chunk(v, c, g)]
        carried = None  # the dK/dV accumulator in flight from the previous rank
        for step in range(P.world):
            src = (P.rank - step) % P.world
            pending_kv = ring.shift(kv, TAG_KV) if step < P.world - 1 else None
            # This rank's contributions to the gradients of rank src's keys/values.
            dk_acc = torch.zeros(kv[0].shape, dtype=cdt, device=q.device)
            dv_acc = torch.zeros(kv[1].shape, dtype=cdt, device=q.device)
            blocks, _ = _blocks.schedule(P.rank, src, P.world, P.n_local, P.layout, P.pairs)
            for blk in blocks:
                rows, cols = blk.q.rows, blk.k.rows
                dq_b, dk_b, dv_b = _blocks.backward(
                    cfg.backend.tiling,
                    q_c[:, :, rows],
                    kv[0][:, :, cols].to(cdt),
                    kv[1][:, :, cols].to(cdt),
                    out_c[:, :, rows],
                    lse_c[:, :, rows],
                    None if do_c is None else do_c[:, :, rows],
                    None if dl_c is None else dl_c[:, :, rows],
                    blk.heads(P.pairs, c * (H // g), H // g),
                    P.scale,
                )
                dq_c[:, :, rows] += dq_b
                dk_acc[:, :, cols] += dk_b
                dv_acc[:, :, cols] += dv_b
            if carried is not None:  # what the ranks before us added for the same block
                got_k, got_v = carried.wait()
                dk_acc += got_k
                dv_acc += got_v
            if P.world > 1:
                carried = ring.shift([dk_acc, dv_acc], TAG_DKV)  # on to rank r + 1
            if pending_kv is not None:
                kv = pending_kv.wait()
        if carried is not None:  # our own block, home after visiting every rank
            dk_acc, dv_acc = carried.wait()
        _chunk(dk, c, g).copy_(dk_acc)
        _chunk(dv, c, g).copy_(dv_acc)
    return dq.to(q.dtype), dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg):
        out, lse = _ring_forward(cfg, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.no_grad():
            grads = _ring_backward(ctx.cfg, q, k, v, out, lse, dout, dlse)
        return *once_differentiable("ring_attention", grads, (q, k, v)), None


def ring_attention(
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
    head_chunks: int | str = "auto",
    backend: TiledBackend | None = None,
):
    """Exact attention over a sequence sharded across the ranks of `group` (ring attention).

    Every rank of the group calls it with its own shard; the result is this rank's shard of
    `qkv.attention` over the whole sequence (forward and backward, to rounding).

    Args:
        q: this rank's queries `(B, H, N/P, D)` (or `(H, N/P, D)`, `(N/P, D)`), cut from the
            full sequence by `layout` (see `qkv.distributed.shard`).
        k: this rank's keys `(B, Hkv, N/P, D)`, the same tokens as q; `H % Hkv == 0`
            (grouped-query heads: the Hkv heads travel, never the repeat).
        v: this rank's values `(B, Hkv, N/P, Dv)`.
        causal: query at global position i sees keys at positions ≤ i.
        mask: a structured `qkv.masks.Mask` over global positions of the whole N×N problem
            (sliding window, document, …); blocks it leaves empty for a pair of ranks are
            skipped. Dense tensor masks are not accepted.
        scale: multiplies Q Kᵀ; default `1/√D`.
        layout: `"contiguous"` (rank r holds tokens `r·N/P …`) or `"zigzag"` (rank r holds
            chunks r and 2P−1−r of 2P: balanced work under causal masking).
        group: the process group; None is the default group. Without an initialised default
            group, one process is rank 0 of 1.
        return_lse: also return lse `(B, H, N/P)` (float32; float64 for float64 inputs) of the
            global softmax; differentiable.
        head_chunks: run the ring this many times, over H/head_chunks heads each (must divide
            Hkv); the in-flight key/value and dK/dV buffers and the kernel's tile buffers shrink
            by that factor, for more (smaller) messages of the same total size. `"auto"` (the
            default) is Hkv: one pass per key/value head, so that the transfer buffers stay
            small next to the shards themselves; 1 is the classic single pass.
        backend: the per-block kernel, a `qkv.kernels.TiledBackend` (default tiles 64×64).

    Returns:
        `out (B, H, N/P, Dv)` in the input dtype, or `(out, lse)`.

    Every rank must pass shards of the same shape and dtype, the same flags and the same mask;
    this is checked up front with one small all-gather, and if anything differs (or any rank's
    arguments are invalid) every rank raises the same ValueError/TypeError instead of waiting on
    the others. fp16/bf16 inputs travel in their dtype and are computed and merged in fp32.
    """
    if backend is None:
        backend = TiledBackend()
    if not isinstance(backend, TiledBackend):
        raise TypeError(f"backend must be a qkv.kernels.TiledBackend, got {backend!r}")

    def extra(world, heads, kv_heads, n_local):
        if head_chunks == "auto":
            return
        if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
            raise TypeError(f"head_chunks must be 'auto' or a positive int, got {head_chunks!r}")
        if kv_heads % head_chunks:
            raise ValueError(
                f"head_chunks={head_chunks} must divide the key/value heads Hkv={kv_heads}"
            )

    problem = validate(
        "ring_attention",
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
        extra_fields={"head_chunks": (head_chunks if isinstance(head_chunks, int) else 0,)},
    )
    chunks = head_chunks if isinstance(head_chunks, int) else problem.kv_heads  # "auto"
    cfg = _Config(problem, backend, chunks)
    out, lse = _RingAttention.apply(to_4d(q), to_4d(k), to_4d(v), cfg)
    rank = problem.input_rank
    return (from_4d(out, rank), from_4d(lse, rank)) if return_lse else from_4d(out, rank)
