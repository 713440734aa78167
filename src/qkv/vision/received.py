"""Attention received by each key, without the attention weights; and FastV-style pruning.

FastV (Chen et al. 2024) drops, after layer K, the image tokens that receive the least attention:
the column sums of A = softmax(Q Kᵀ · scale). Getting them from a model usually means
`output_attentions=True`, i.e. eager attention and an N×N matrix per head. Here the column sums
are computed a band of query rows at a time::

    for each band of rows i:   P = softmax(S_band)  (or exp(S_band − lse) with a given lse)
                               received += Σ_i P[i, :]

The band holds whole rows (all the keys a row may see), so its softmax is final and one pass
over the scores suffices; every head of a batch element runs in the same few large operations
(one batched product, one softmax in place, one sum per band). Memory is one band of scores
(`BAND_BYTES`, 32 MiB) plus the `(B, H, Nk)` result, whatever N is. Given the
lse that `qkv.attention(..., return_lse=True)` returned, a band's weights are `exp(S − lse)`
and the normalisation is skipped.
"""

from __future__ import annotations

import math

import torch

from ..layout import EMPTY, allowed, causal_hidden, layout_for
from ..masks import Mask
from ..plan import AttentionPlan, from_4d, make_plan, to_4d

BAND_BYTES = 32 * 2**20  # scores of one band of query rows (all heads of a batch element)
TILE = 64  # key tile of the mask layout that bounds a band's keys


def received_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    mask: torch.Tensor | Mask | None = None,
    causal: bool = False,
    scale: float | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """The total attention each key receives: the column sums of A, `Σ_i A[b, h, i, j]`.

    Args:
        q: `(B, H, Nq, D)`, `(H, Nq, D)` or `(Nq, D)`; k: `(B, Hkv, Nk, D)` in the same layout
            (grouped heads: query head h reads key head `h // (H // Hkv)`).
        mask, causal, scale: as in `qkv.attention` (bool or float tensor mask, a
            `qkv.masks.Mask`, bottom-right causal, default scale 1/√D).
        lse: the `(B, H, Nq)` lse that `qkv.attention(q, k, v, ..., return_lse=True)` returned
            for the same problem; when given, A = exp(S − lse) and no normalisation is done.

    Returns:
        `(B, H, Nk)` (or `(H, Nk)`, `(Nk,)` for the smaller layouts), float32 (float64 for
        float64 inputs), not differentiable. Rows that may attend nowhere contribute 0. Each
        row's weights sum to 1, so the result sums to the number of rows that attend somewhere.

    Memory beyond the inputs: the scores of one band of rows of all heads (`BAND_BYTES`) and
    the result: O(N) for a fixed band.
    """
    # Validate exactly as qkv.attention does (k stands in for v: the shapes it checks agree).
    plan = make_plan(q, k, k, mask=mask, causal=causal, scale=scale)
    q4, k4 = to_4d(q), to_4d(k)
    B, H, Nq, Nk = plan.batch, plan.heads, plan.q_len, plan.kv_len
    cdt = plan.compute_dtype
    lse4 = None
    if lse is not None:
        want = (B, H, Nq)
        if not isinstance(lse, torch.Tensor) or tuple(to_4d(lse.unsqueeze(-1)).shape[:3]) != want:
            got = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__
            raise ValueError(f"lse must have shape (B, H, Nq)={want}, got {got}")
        lse4 = to_4d(lse.unsqueeze(-1))[..., 0].to(cdt)
        lse4 = torch.where(torch.isneginf(lse4), math.inf, lse4)  # a row with no key: weights 0
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
                qb = q4[b].to(cdt).reshape(plan.kv_heads, G * Nq, -1)
                kt = k4[b].to(cdt).transpose(-1, -2)  # (Hkv, D, Nk)
                for r0, r1, c0, c1 in spans:
                    p = _band(plan, qb, kt, lse4, b, r0, r1, c0, c1, buf)  # (H, n, w)
                    total[b, :, c0:c1] += p.sum(1)
    return from_4d(total.to(cdt).unsqueeze(2), plan.input_rank)[..., 0, :]


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
    lse4: torch.Tensor | None,
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
    empty_rows = (
        plan.pairs.bias is not None or plan.pairs.mask is not None or plan.pairs.rule is not None
    )
    if plan.pairs.causal and not empty_rows:
        # Only keys past the band's first row can be hidden: mask that triangle, not the band.
        d0, hidden, empty_rows = causal_hidden(r0, r1, c0, c1, plan.q_len, plan.kv_len, s.device)
        if hidden is not None:
            s[..., d0 - c0 :].masked_fill_(hidden, -math.inf)
    else:
        ok = _allowed(plan, b, r0, r1, c0, c1, s.device)
        if ok is not None:
            s.masked_fill_(~ok, -math.inf)
    if lse4 is not None:
        return s.sub_(lse4[b, :, r0:r1, None]).exp_()
    torch.softmax(s, dim=-1, out=s)  # in place: one band of memory
    if empty_rows:
        s.nan_to_num_(nan=0.0)  # a row with nothing allowed: softmax of all −inf
    return s


def _allowed(
    plan: AttentionPlan, b: int, r0: int, r1: int, c0: int, c1: int, device: torch.device
) -> torch.Tensor | None:
    """Which pairs of rows r0:r1 and keys c0:c1 may attend, broadcastable to `(H, n, w)`."""
    rows = torch.arange(r0, r1, device=device).unsqueeze(1)
    cols = torch.arange(c0, c1, device=device)
    ok = allowed(0, 0, rows, cols, q_len=plan.q_len, kv_len=plan.kv_len, causal=plan.pairs.causal)
    if plan.pairs.mask is not None:
        m = _cut(plan.pairs.mask, b, r0, r1, c0, c1)
        ok = m if ok is None else ok & m
    if plan.pairs.rule is not None:
        rule = plan.pairs.rule
        bi = torch.tensor([b if rule.batch else 0], device=device).view(1, 1, 1)
        hi = torch.arange(plan.heads if rule.heads else 1, device=device).view(-1, 1, 1)
        m = rule.evaluate(bi, hi, rows, cols, plan.q_len, plan.kv_len)
        ok = m if ok is None else ok & m
    return ok


def _cut(t: torch.Tensor, b: int, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
    """Batch b, rows r0:r1, keys c0:c1 of a 4-D broadcastable mask or bias: `(H|1, n|1, w|1)`."""
    t = t[b if t.shape[0] > 1 else 0]
    rows = slice(r0, r1) if t.shape[1] > 1 else slice(None)
    cols = slice(c0, c1) if t.shape[2] > 1 else slice(None)
    return t[:, rows, cols]


def prune(
    x: torch.Tensor,
    scores: torch.Tensor,
    keep: int | float,
    *,
    candidates: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FastV-style pruning: keep the `keep` highest-scoring tokens of `x (B, N, C)`.

    Args:
        scores: `(B, N)`, e.g. `received_attention(...)` averaged over heads.
        keep: how many candidate tokens survive (an int), or which fraction of them (a float in
            (0, 1], rounded down, at least 1).
        candidates: bool `(B, N)`, the tokens that may be dropped (the image tokens; the same
            count in every row); the others are always kept. Default: all tokens.

    Returns:
        `(x_kept (B, M, C), index (B, M))`: the kept tokens in their original order and their
        positions in x (to gather position ids, masks, …).
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must have shape (B, N, C), got {got}")
    B, N, C = x.shape
    if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (B, N):
        got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"scores must have shape (B, N)=({B}, {N}), got {got}")
    if candidates is None:
        candidates = torch.ones(B, N, dtype=torch.bool, device=x.device)
    elif (
        not isinstance(candidates, torch.Tensor)
        or candidates.dtype != torch.bool
        or tuple(candidates.shape) != (B, N)
    ):
        raise ValueError(
            f"candidates must be a bool tensor of shape ({B}, {N}), got {candidates!r}"
        )
    counts = candidates.sum(1)
    if B and bool((counts != counts[0]).any()):
        raise ValueError(
            f"every row must have the same number of candidates, got {counts.tolist()}"
        )
    n_cand = int(counts[0]) if B else 0
    if isinstance(keep, bool) or not isinstance(keep, (int, float)):
        raise TypeError(f"keep must be an int count or a float fraction, got {keep!r}")
    if isinstance(keep, float):
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"keep as a fraction must be in (0, 1], got {keep}")
        keep = max(1, int(n_cand * keep)) if n_cand else 0
    if not 0 <= keep <= n_cand:
        raise ValueError(f"keep={keep} must be in [0, {n_cand}] (the candidate tokens)")
    # Non-candidates rank above every candidate; among candidates the scores decide.
    rank = torch.where(candidates, scores.to(torch.float64), math.inf)
    n_keep = N - n_cand + keep
    index = rank.topk(n_keep, dim=1).indices.sort(dim=1).values  # (B, M), original order
    return x.gather(1, index[..., None].expand(-1, -1, C)), index
