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

from .dropout import keep_mask, keep_scale
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


# Nq×Nk tensors the formula holds at once: S, S_scaled, exp(S_scaled − m), A and a temporary.
SCORE_COPIES = 5


def available_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can take on `device` (Linux MemAvailable on the CPU, the free
    memory of a CUDA device), or None where that is unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def check_fits(plan: AttentionPlan, device: torch.device) -> None:
    """Raise MemoryError, before allocating, when the formula's Nq×Nk matrices cannot fit."""
    elt = torch.empty((), dtype=plan.compute_dtype).element_size()
    need = plan.batch * plan.heads * plan.q_len * plan.kv_len * elt * SCORE_COPIES
    free = available_bytes(device)
    if free is not None and need > free:
        shape = (plan.batch, plan.heads, plan.q_len, plan.kv_len)
        raise MemoryError(
            f"the reference formula builds the full (B, H, Nq, Nk) = {shape} score matrix "
            f"{SCORE_COPIES} times over: about {need / 2**30:.1f} GiB, and {device} has "
            f"{free / 2**30:.1f} GiB available. Use backend='tiled' or 'auto' (O(N) memory)"
        )


def compute(plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Steps:
    """The formula on canonical 4-D tensors; returns 4-D `Steps`. Differentiable by autograd."""
    check_fits(plan, q.device)
    B, H, Hkv, G = plan.batch, plan.heads, plan.kv_heads, plan.groups
    Nq, Nk = plan.q_len, plan.kv_len
    cdt = plan.compute_dtype
    # Grouped heads as a broadcast, never a copy: query head h reads kv head h // G.
    q5 = q.to(cdt).reshape(B, Hkv, G, Nq, plan.head_dim)  # (B, Hkv, G, Nq, D)
    k5 = k.to(cdt).unsqueeze(2)  # (B, Hkv, 1, Nk, D)
    v5 = v.to(cdt).unsqueeze(2)  # (B, Hkv, 1, Nk, Dv)

    S = (q5 @ k5.transpose(-1, -2)).reshape(B, H, Nq, Nk)  # (B, H, Nq, Nk)
    S_scaled = S * plan.scale
    if plan.pairs.bias is not None:  # a −inf excludes the pair, whatever its score (even NaN)
        bias = plan.pairs.bias.to(cdt)
        S_scaled = torch.where(torch.isneginf(bias), -torch.inf, S_scaled + bias)
    if plan.score_mod is not None:
        b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
        h = torch.arange(H, device=q.device).view(1, H, 1, 1)
        pos = torch.arange(Nq, device=q.device).view(Nq, 1) + plan.pairs.causal_offset
        S_scaled = plan.score_mod(S_scaled, b, h, pos, torch.arange(Nk, device=q.device))
    allowed = plan.pairs.dense(q.device)
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
        bh = torch.arange(B * H, device=q.device).reshape(B, H, 1, 1)
        rows = torch.arange(Nq, device=q.device).unsqueeze(1)
        cols = torch.arange(Nk, device=q.device)
        keep = keep_mask(plan.dropout_seed, plan.dropout_p, bh, rows, cols)
        A_dropped = torch.where(keep, A * keep_scale(plan.dropout_p), 0.0)

    v_finite = all_finite(v)
    out = weighted_values(A_dropped.reshape(B, Hkv, G, Nq, Nk), v5, v_finite)
    out = out.reshape(B, H, Nq, plan.v_dim).to(plan.dtype)
    return Steps(S=S, S_scaled=S_scaled, A=A, A_dropped=A_dropped, out=out, lse=lse)


def steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
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
    mask: torch.Tensor | None = None,
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
