"""Received attention in PyTorch operations: the column sums of A, one band of scores at a time.

The tiled backend's second operation (`TiledBackend.received`, reached through
`qkv.dispatch.choose_received`; `qkv.vision.received_attention` is its public face)::

    for each band of rows i:   P = softmax(S_band)  (or exp(S_band − lse) with a given lse)
                               received += Σ_i P[i, :]

A band holds whole rows (all the keys a row may see), so its softmax is final and one pass over
the scores suffices; every head of a batch element runs in the same few large operations (one
batched product, one softmax in place, one sum per band). Memory is one band of scores
(`BAND_BYTES`, 32 MiB) plus the `(B, H, Nk)` result, whatever N is. Which pairs a band may
attend comes from the plan's `Pairs` (`plan.pairs.band`), and which keys a band's rows may
reach at all from its block layout (`qkv.layout.layout_for`).
"""

from __future__ import annotations

import math

import torch

from ...layout import EMPTY, layout_for
from ...plan import AttentionPlan

BAND_BYTES = 32 * 2**20  # scores of one band of query rows (all heads of a batch element)
TILE = 64  # key tile of the mask layout that bounds a band's keys


def received(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor | None
) -> torch.Tensor:
    """`Σ_i A[b, h, i, j]`, `(B, H, Nk)` in the compute dtype, not differentiable, for canonical
    `q (B, H, Nq, D)`, `k (B, Hkv, Nk, D)` and, when given, the `(B, H, Nq)` lse of the same
    problem (then A = exp(S − lse), not normalised again). Rows that may attend nowhere add 0."""
    B, H, Nq, Nk = plan.batch, plan.heads, plan.q_len, plan.kv_len
    cdt = plan.compute_dtype
    if lse is not None:
        lse = lse.to(cdt)
        lse = torch.where(torch.isneginf(lse), math.inf, lse)  # a row with no key: weights 0
    # Bands add up in float64: (B, H, Nk) only, and many bands summed in fp32 lose digits.
    total = torch.zeros(B, H, Nk, dtype=torch.float64, device=q.device)
    spans = _band_spans(plan) if Nq > 0 and Nk > 0 else []
    if spans:
        G = plan.groups
        # one buffer for every band's scores, reused: fresh pages would fault on every band
        size = max(H * (r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in spans)
        buf = torch.empty(size, dtype=cdt, device=q.device)
        with torch.no_grad():
            for b in range(B):
                # (Hkv, G·Nq, D): the G query heads of a key head side by side, as rows
                qb = q[b].to(cdt).reshape(plan.kv_heads, G * Nq, -1)
                kt = k[b].to(cdt).transpose(-1, -2)  # (Hkv, D, Nk)
                for r0, r1, c0, c1 in spans:
                    p = _band(plan, qb, kt, lse, b, r0, r1, c0, c1, buf)  # (H, n, w)
                    total[b, :, c0:c1] += p.sum(1)
    return total.to(cdt)


def _band_spans(plan: AttentionPlan) -> list[tuple[int, int, int, int]]:
    """Bands of query rows `(r0, r1)` with the key range `(c0, c1)` their rows may see, each at
    most `BAND_BYTES` of scores: all keys (dense), or the kept tiles of a causal or structured
    mask (never an N×N matrix), in which case a band grows while its rows' key range stays
    within the budget (the first bands of a causal problem hold many short rows)."""
    Nq, Nk, H = plan.q_len, plan.kv_len, plan.heads
    rows = max(1, min(Nq, BAND_BYTES // (H * Nk * 4)))  # rows of full width that fit
    if plan.pairs.rule is None and not plan.pairs.causal:
        return [(r0, min(Nq, r0 + rows), 0, Nk) for r0 in range(0, Nq, rows)]
    unit = min(rows, TILE)  # the rows of one step, each with its kept key range
    kept = _kept_tiles(plan, unit)  # (steps, key tiles) bool
    spans: list[tuple[int, int, int, int]] = []
    for i in range(kept.shape[0]):
        tiles = kept[i].nonzero().view(-1)
        if tiles.numel() == 0:
            continue  # no row of this step may attend anywhere: it adds nothing
        r0, r1 = i * unit, min(Nq, (i + 1) * unit)
        c0, c1 = int(tiles[0]) * TILE, min(Nk, (int(tiles[-1]) + 1) * TILE)
        if spans:
            p0, p1, q0, q1 = spans[-1]
            lo, hi = min(q0, c0), max(q1, c1)
            if p1 == r0 and H * (r1 - p0) * (hi - lo) * 4 <= BAND_BYTES:
                spans[-1] = (p0, r1, lo, hi)
                continue
        spans.append((r0, r1, c0, c1))
    return spans


def _kept_tiles(plan: AttentionPlan, rows: int) -> torch.Tensor:
    """Which key tiles each band of `rows` query rows keeps: the plan's block layout (causal
    rule and structured mask, any batch element, any head) for `rows × TILE` tiles."""
    return layout_for(plan.pairs, rows, TILE).kind != EMPTY


def _band(
    plan: AttentionPlan,
    qb: torch.Tensor,
    kt: torch.Tensor,
    lse: torch.Tensor | None,
    b: int,
    r0: int,
    r1: int,
    c0: int,
    c1: int,
    buf: torch.Tensor,
) -> torch.Tensor:
    """The attention weights of rows r0:r1 on keys c0:c1 of every head of batch element b,
    `(H, r1 − r0, c1 − c0)`, computed in `buf`."""
    Hkv, G, Nq = plan.kv_heads, plan.groups, plan.q_len
    n, w = r1 - r0, c1 - c0
    # rows r0:r1 of every query head: (Hkv, G·n, D)
    q_band = qb.view(Hkv, G, Nq, -1)[:, :, r0:r1].reshape(Hkv, G * n, -1)
    s = buf[: plan.heads * n * w].view(Hkv, G * n, w)
    torch.baddbmm(s, q_band, kt[:, :, c0:c1], beta=0, alpha=plan.scale, out=s)  # scaled scores
    s = s.view(plan.heads, n, w)
    if plan.pairs.bias is not None:
        s.add_(_cut(plan.pairs.bias, b, r0, r1, c0, c1).to(s.dtype))
    band = plan.pairs.band(b, plan.heads, r0, r1, c0, c1, s.device)
    if band.hidden is not None:
        s[..., band.start - c0 :].masked_fill_(band.hidden, -math.inf)
    if lse is not None:
        return s.sub_(lse[b, :, r0:r1, None]).exp_()
    torch.softmax(s, dim=-1, out=s)  # in place: one band of memory
    if band.empty_rows:
        s.nan_to_num_(nan=0.0)  # a row with nothing allowed: softmax of all −inf
    return s


def _cut(t: torch.Tensor, b: int, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
    """Batch b, rows r0:r1, keys c0:c1 of a 4-D broadcastable bias: `(H|1, n|1, w|1)`."""
    t = t[b if t.shape[0] > 1 else 0]
    rows = slice(r0, r1) if t.shape[1] > 1 else slice(None)
    cols = slice(c0, c1) if t.shape[2] > 1 else slice(None)
    return t[:, rows, cols]
