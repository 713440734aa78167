"""The seed formula, step by step: the oracle every backend is judged against.

    S        = Q Kᵀ                      (B, H, Nq, Nk)
    S_scaled = S · scale (+ float mask), then score_mod; disallowed pairs set to −inf
    A        = softmax(S_scaled) by rows (disallowed entries exactly 0; a row with nothing
               allowed is all 0)
    out      = A V                       (B, H, Nq, Dv)

Nothing here is clever: the whole N×N matrix is built, which costs O(N²) memory. Run it in
float64 and it is the golden reference of the test suite.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from . import limits
from .dropout import keep_mask, keep_scale
from .masks import Mask
from .numerics import all_finite, weighted_values
from .plan import AttentionPlan, from_4d, make_plan, to_4d
from .scores import ScoreMod


@dataclass(frozen=True)
class Steps:
    """Every intermediate of the formula, in the caller's layout (`(N, ·)`, `(H, N, ·)` or
    `(B, H, N, ·)`). Scores and weights are in the compute dtype (fp32, or fp64 for fp64
    inputs); `out` is in the input dtype."""

    S: torch.Tensor  # Q Kᵀ, (…, Nq, Nk)
    S_scaled: torch.Tensor  # score_mod(S · scale + float mask); −inf where not allowed
    A: torch.Tensor  # row softmax of S_scaled; rows sum to 1, or to 0 when fully masked
    A_dropped: torch.Tensor  # A after dropout (kept weights scaled by 1/(1−p)); A when p = 0
    out: torch.Tensor  # A_dropped V, (…, Nq, Dv)
    lse: torch.Tensor  # log Σ_j exp(S_scaled[i, j]); −inf for a fully masked row, (…, Nq)


# Nq×Nk tensors the formula holds at once: S, S_scaled, exp(S_scaled − m), A and a temporary
# (`steps`, and any call autograd records: each intermediate is kept or saved for the backward).
SCORE_COPIES = 5
# The same without a gradient, where only the output, lse and weights are wanted (`lean`): one
# score matrix worked on in place, and a temporary (a score modifier's result, the weights kept
# beside their dropped copy, the dense mask).
LEAN_COPIES = 2
DROPOUT_CHUNK = 1 << 22  # score elements whose dropout mask is drawn at once (int64 temporaries)


def available_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can take on `device` (`qkv.limits`: the process's cgroup limit,
    RLIMIT_AS or MemAvailable on the CPU; the free memory of a CUDA device), or None."""
    return limits.available_bytes(device)


def check_fits(plan: AttentionPlan, device: torch.device, copies: int = SCORE_COPIES) -> None:
    """Raise `qkv.limits.MemoryRefusal` (a MemoryError), before allocating, when the formula's
    Nq×Nk matrices cannot fit in what this process may still allocate."""
    elt = torch.empty((), dtype=plan.compute_dtype).element_size()
    need = plan.batch * plan.heads * plan.q_len * plan.kv_len * elt * copies
    shape = (plan.batch, plan.heads, plan.q_len, plan.kv_len)
    limits.check(
        need,
        device,
        f"the reference formula builds the full (B, H, Nq, Nk) = {shape} score matrix "
        f"{copies} times over",
        "Use backend='tiled' or 'auto' (O(N) memory), or a shorter sequence",
    )


def _mod_grid(plan: AttentionPlan, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A score modifier's index arguments over the whole score matrix: batch `(B, 1, 1, 1)`,
    head `(1, H, 1, 1)`, query position `(Nq, 1)` (bottom-right aligned) and key `(Nk,)`."""
    b = torch.arange(plan.batch, device=device).view(plan.batch, 1, 1, 1)
    h = torch.arange(plan.heads, device=device).view(1, plan.heads, 1, 1)
    pos = torch.arange(plan.q_len, device=device).view(plan.q_len, 1) + plan.pairs.causal_offset
    return b, h, pos, torch.arange(plan.kv_len, device=device)


def _grouped(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in the compute dtype, grouped heads as a broadcast, never a copy (query head h
    reads kv head h // G): (B, Hkv, G, Nq, D), (B, Hkv, 1, Nk, D), (B, Hkv, 1, Nk, Dv)."""
    cdt = plan.compute_dtype
    q5 = q.to(cdt).reshape(plan.batch, plan.kv_heads, plan.groups, plan.q_len, plan.head_dim)
    return q5, k.to(cdt).unsqueeze(2), v.to(cdt).unsqueeze(2)


def compute(plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Steps:
    """The formula on canonical 4-D tensors; returns 4-D `Steps`. Differentiable by autograd."""
    check_fits(plan, q.device)
    B, H, Nq, Nk = plan.batch, plan.heads, plan.q_len, plan.kv_len
    cdt = plan.compute_dtype
    q5, k5, v5 = _grouped(plan, q, k, v)

    S = (q5 @ k5.transpose(-1, -2)).reshape(B, H, Nq, Nk)  # (B, H, Nq, Nk)
    S_scaled = S * plan.scale
    if plan.pairs.bias is not None:  # a −inf excludes the pair, whatever its score (even NaN)
        bias = plan.pairs.bias.to(cdt)
        S_scaled = torch.where(torch.isneginf(bias), -torch.inf, S_scaled + bias)
    if plan.score_mod is not None:
        S_scaled = plan.score_mod(S_scaled, *_mod_grid(plan, q.device))
    # Nothing to mask in an empty problem (and a size-0 bool mask has no entry to index).
    allowed = plan.pairs.dense(q.device) if S_scaled.numel() else None
    if allowed is not None:
        S_scaled = torch.where(allowed, S_scaled, -torch.inf)

    m = (
        S_scaled.amax(dim=-1, keepdim=True)
        if Nk > 0
        else S_scaled.new_full((B, H, Nq, 1), -torch.inf)
    )
    m = torch.where(torch.isneginf(m), 0.0, m)  # a fully masked row: exp(−inf − 0) = 0
    e = torch.exp(S_scaled - m)
    den = e.sum(dim=-1, keepdim=True)
    empty = den == 0
    A = e / torch.where(empty, 1.0, den)
    lse = torch.where(empty, -torch.inf, torch.log(torch.where(empty, 1.0, den)) + m).squeeze(-1)
    if cdt != torch.float64:
        lse = lse.float()

    A_dropped = A
    if plan.dropout_p > 0:
        seed = plan.dropout_seed
        assert seed is not None  # make_plan draws one when dropout_p > 0
        bh = torch.arange(B * H, device=q.device).reshape(B, H, 1, 1)
        rows = torch.arange(Nq, device=q.device).unsqueeze(1)
        cols = torch.arange(Nk, device=q.device)
        keep = keep_mask(seed, plan.dropout_p, bh, rows, cols)
        A_dropped = torch.where(keep, A * keep_scale(plan.dropout_p), 0.0)

    v_finite = all_finite(v)
    out = weighted_values(A_dropped.reshape(*q5.shape[:4], Nk), v5, v_finite)
    out = out.reshape(B, H, Nq, plan.v_dim).to(plan.dtype)
    return Steps(S=S, S_scaled=S_scaled, A=A, A_dropped=A_dropped, out=out, lse=lse)


def forward(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`(out, lse, weights)` of the formula on canonical 4-D tensors (weights: A in the input
    dtype when `plan.return_weights`, else None), bit for bit those of `compute`. Where autograd
    records (a gradient will be taken) it is `compute`; otherwise the lean path: one score
    matrix, masked, exponentiated and normalised in place (LEAN_COPIES instead of
    SCORE_COPIES), the dropout mask drawn a band of rows at a time."""
    if _records_grad(plan, q, k, v):
        st = compute(plan, q, k, v)
        return st.out, st.lse, st.A.to(plan.dtype) if plan.return_weights else None
    return _lean(plan, q, k, v)


def _records_grad(plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    if not torch.is_grad_enabled():
        return False
    params = plan.score_mod.params if plan.score_mod is not None else ()
    return any(t is not None and t.requires_grad for t in (q, k, v, plan.pairs.bias, *params))


def _lean(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`forward` without autograd: `compute`'s operations, in its order, in place."""
    check_fits(plan, q.device, LEAN_COPIES)
    B, H, Nq, Nk = plan.batch, plan.heads, plan.q_len, plan.kv_len
    cdt = plan.compute_dtype
    q5, k5, v5 = _grouped(plan, q, k, v)

    s = (q5 @ k5.transpose(-1, -2)).reshape(B, H, Nq, Nk).mul_(plan.scale)  # (B, H, Nq, Nk)
    if plan.pairs.bias is not None:  # a −inf excludes the pair, whatever its score (even NaN)
        bias = plan.pairs.bias.to(cdt)
        s.add_(bias).masked_fill_(torch.isneginf(bias), -torch.inf)
    if plan.score_mod is not None:
        s = plan.score_mod(s, *_mod_grid(plan, q.device))
    allowed = plan.pairs.dense(q.device) if s.numel() else None
    if allowed is not None:
        s.masked_fill_(~allowed, -torch.inf)

    m = s.amax(dim=-1, keepdim=True) if Nk > 0 else s.new_full((B, H, Nq, 1), -torch.inf)
    m = torch.where(torch.isneginf(m), 0.0, m)  # a fully masked row: exp(−inf − 0) = 0
    e = s.sub_(m).exp_()
    den = e.sum(dim=-1, keepdim=True)
    empty = den == 0
    A = e.div_(torch.where(empty, 1.0, den))
    lse = torch.where(empty, -torch.inf, torch.log(torch.where(empty, 1.0, den)) + m).squeeze(-1)
    if cdt != torch.float64:
        lse = lse.float()
    weights = A.to(plan.dtype) if plan.return_weights else None

    A_dropped = A
    if plan.dropout_p > 0:
        if weights is not None and plan.dtype == cdt:
            A_dropped = A.clone()  # the weights are A itself
        seed = plan.dropout_seed
        assert seed is not None  # make_plan draws one when dropout_p > 0
        bh = torch.arange(B * H, device=q.device).reshape(B, H, 1, 1)
        rows = torch.arange(Nq, device=q.device).unsqueeze(1)
        cols = torch.arange(Nk, device=q.device)
        band = max(1, DROPOUT_CHUNK // max(1, B * H * Nk))
        for r0 in range(0, Nq, band):
            keep = keep_mask(seed, plan.dropout_p, bh, rows[r0 : r0 + band], cols)
            part = A_dropped[..., r0 : r0 + band, :]
            part.mul_(keep_scale(plan.dropout_p)).masked_fill_(~keep, 0.0)

    out = weighted_values(A_dropped.reshape(*q5.shape[:4], Nk), v5, all_finite(v))
    return out.reshape(B, H, Nq, plan.v_dim).to(plan.dtype), lse, weights


def steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | Mask | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    score_mod: ScoreMod | None = None,
) -> Steps:
    """Run the formula and return every intermediate (see `Steps`), in the caller's layout.

    Arguments and semantics are those of `qkv.attention`; `dropout_seed` fixes the dropout mask
    (otherwise drawn from torch's RNG).

    Example, the textbook's N=4, d=8, d_k=4::

        X = torch.randn(4, 8)
        Wq, Wk, Wv = (torch.randn(8, 4) for _ in range(3))
        st = qkv.reference.steps(X @ Wq, X @ Wk, X @ Wv)
        st.S.shape, st.A.sum(-1)     # (4, 4), all ones
    """
    plan = make_plan(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        score_mod=score_mod,
    )
    st = compute(plan, to_4d(q), to_4d(k), to_4d(v))
    return Steps(**{f.name: from_4d(getattr(st, f.name), plan.input_rank) for f in fields(st)})


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | Mask | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    score_mod: ScoreMod | None = None,
) -> torch.Tensor:
    """`steps(...).out`: the attention output computed by the plain formula."""
    return steps(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        score_mod=score_mod,
    ).out
