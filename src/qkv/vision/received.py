"""Attention received by each key, without the attention weights; and FastV-style pruning.

FastV (Chen et al. 2024) drops, after layer K, the image tokens that receive the least attention:
the column sums of A = softmax(Q Kᵀ · scale). Getting them from a model usually means
`output_attentions=True`, i.e. eager attention and an N×N matrix per head. `received_attention`
computes them without the matrix: it validates the request, makes the plan and asks dispatch
(`qkv.dispatch(q, k, ..., op="received")` shows the choice), whose backend computes the column
sums a band of query rows at a time (the tiled backend's `qkv.kernels.tiled.received`)::

    for each band of rows i:   P = softmax(S_band)  (or exp(S_band − lse) with a given lse)
                               received += Σ_i P[i, :]

The band holds whole rows (all the keys a row may see), so its softmax is final and one pass
over the scores suffices. Memory is one band of scores (`BAND_BYTES` of that module, 32 MiB)
plus the `(B, H, Nk)` result, whatever N is. Given the lse that
`qkv.attention(..., return_lse=True)` returned, a band's weights are `exp(S − lse)` and the
normalisation is skipped.
"""

from __future__ import annotations

import math

import torch

from ..dispatch import choose_received
from ..masks import Mask
from ..plan import from_4d, make_plan, to_4d


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

    Memory beyond the inputs: the scores of one band of rows of all heads
    (`qkv.kernels.tiled.received.BAND_BYTES`) and the result: O(N) for a fixed band.
    """
    # Validate exactly as qkv.attention does (k stands in for v: the shapes it checks agree).
    plan = make_plan(q, k, k, mask=mask, causal=causal, scale=scale)
    lse4 = None
    if lse is not None:
        want = (plan.batch, plan.heads, plan.q_len)
        if not isinstance(lse, torch.Tensor) or tuple(to_4d(lse.unsqueeze(-1)).shape[:3]) != want:
            got = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__
            raise ValueError(f"lse must have shape (B, H, Nq)={want}, got {got}")
        lse4 = to_4d(lse.unsqueeze(-1))[..., 0]
    q4, k4 = to_4d(q), to_4d(k)
    total = choose_received(plan, q4, k4).backend.received(plan, q4, k4, lse4)  # (B, H, Nk)
    return from_4d(total.unsqueeze(2), plan.input_rank)[..., 0, :]


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
