"""`tiled` backend: FlashAttention-2 written in PyTorch, exact with O(N) extra memory.

Forward, for one tile of queries Q_i at a time, over key/value tiles K_j, V_j::

    S   = Q_i K_jᵀ · scale · log2(e)            one (block_q × block_k) tile of scores
    m'  = max(m, rowmax(S))                      running row max
    P   = 2^(S − m')                             unnormalised probabilities of this tile
    l   = l · 2^(m − m') + rowsum(P)             running softmax denominator
    acc = acc · 2^(m − m') + P V_j               rescaled accumulator
    out = acc / l,  lse = (m + log2 l) · ln 2    at the end of the row of tiles

Only one tile of scores exists at a time, so memory is O(N·d + block_q·block_k) per head. The
backward recomputes P from the saved lse instead of storing A (FlashAttention-2, Algorithm 2)::

    P  = exp(S − lse),  dV_j += Pᵀ dO_i,  dP = dO_i V_jᵀ,  dS = P ∘ (dP − D_i),
    dQ_i += dS K_j · scale,  dK_j += dSᵀ Q_i · scale,   with D_i = rowsum(dO_i ∘ O_i)

Work runs on all (batch, head) pairs of a tile at once as batched matrix products; grouped
query heads share their key/value tile without copying it (the group is folded into the rows).
Tiles that the causal mask empties are never computed; tiles it leaves whole skip the mask.
Base-2 exponentials are used because `exp2` is about three times faster than `exp` on the CPU.
"""

from __future__ import annotations

import math

import torch

from ..dropout import keep_mask, keep_scale
from ..numerics import causal_allowed, weighted_values
from ..plan import AttentionPlan
from .base import Result

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)

BLOCK_Q = 256  # query rows per tile (per head)
BLOCK_K = 256  # keys per tile


def _heads5(t: torch.Tensor | None, plan: AttentionPlan) -> torch.Tensor | None:
    """View a 4-D mask/bias `(B|1, H|1, Nq|1, Nk|1)` as `(B|1, Hkv|1, G|1, Nq|1, Nk|1)`."""
    if t is None:
        return None
    b, h, nq, nk = t.shape
    if h == 1:
        return t.reshape(b, 1, 1, nq, nk)
    return t.reshape(b, plan.kv_heads, plan.groups, nq, nk)


def _tile(t: torch.Tensor, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
    """Cut rows i0:i1 and columns j0:j1 out of a broadcastable mask (size-1 dims kept)."""
    rows = slice(i0, i1) if t.shape[-2] > 1 else slice(None)
    cols = slice(j0, j1) if t.shape[-1] > 1 else slice(None)
    return t[..., rows, cols]


class _Tiles:
    """Per-call state shared by the forward and backward loops."""

    def __init__(self, plan: AttentionPlan, q: torch.Tensor, block_q: int, block_k: int):
        self.plan = plan
        self.bq, self.bk = block_q, block_k
        self.cdt = plan.compute_dtype
        self.device = q.device
        self.mask5 = _heads5(plan.mask, plan)
        self.bias5 = _heads5(plan.bias, plan)
        if plan.dropout_p > 0:
            # b * H + h with h = hkv * G + g, laid out as the 5-D score tile.
            self.bh5 = torch.arange(plan.batch * plan.heads, device=q.device).reshape(
                plan.batch, plan.kv_heads, plan.groups, 1, 1
            )

    def kv_end(self, i1: int) -> int:
        """Keys past this index are invisible to every query row < i1."""
        if not self.plan.causal:
            return self.plan.kv_len
        return max(0, min(self.plan.kv_len, i1 + self.plan.causal_offset))

    def q_start(self, j0: int) -> int:
        """First query-tile start whose rows can see key j0."""
        if not self.plan.causal:
            return 0
        first_row = max(0, j0 - self.plan.causal_offset)
        return (first_row // self.bq) * self.bq

    def scores(self, s: torch.Tensor, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """Apply bias and masks in place to a score tile `s (B, Hkv, G*n, w)` in log2 units.

        Returns the 5-D view `(B, Hkv, G, n, w)`."""
        p = self.plan
        s5 = s.view(p.batch, p.kv_heads, p.groups, i1 - i0, j1 - j0)
        if self.bias5 is not None:
            s5.add_(_tile(self.bias5, i0, i1, j0, j1).to(self.cdt), alpha=LOG2E)
        allowed = None
        if p.causal and j1 - 1 > i0 + p.causal_offset:  # tile crosses the diagonal
            rows = torch.arange(i0, i1, device=self.device).unsqueeze(1)
            cols = torch.arange(j0, j1, device=self.device)
            allowed = causal_allowed(rows, cols, p.causal_offset)
        if self.mask5 is not None:
            m = _tile(self.mask5, i0, i1, j0, j1)
            allowed = m if allowed is None else allowed & m
        if allowed is not None:
            s5.masked_fill_(~allowed, -torch.inf)
        return s5

    def keep(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """Dropout keep-mask of a tile, `(B, Hkv, G, n, w)` bool."""
        rows = torch.arange(i0, i1, device=self.device).unsqueeze(1)
        cols = torch.arange(j0, j1, device=self.device)
        return keep_mask(self.plan.dropout_seed, self.plan.dropout_p, self.bh5, rows, cols)


def _forward(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bq: int, bk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    B, Hkv, G, Nq = plan.batch, plan.kv_heads, plan.groups, plan.q_len
    D, Dv = plan.head_dim, plan.v_dim
    T = _Tiles(plan, q, bq, bk)
    cdt = T.cdt
    lse_dtype = torch.float64 if cdt == torch.float64 else torch.float32
    qs = (q.to(cdt) * (plan.scale * LOG2E)).reshape(B, Hkv, G, Nq, D)  # (B, Hkv, G, Nq, D)
    kc, vc = k.to(cdt), v.to(cdt)  # (B, Hkv, Nk, D), (B, Hkv, Nk, Dv); no copy for fp32/64
    v_finite = bool(torch.isfinite(vc).all())
    out = torch.empty(B, Hkv, G, Nq, Dv, dtype=plan.dtype, device=q.device)
    lse = torch.empty(B, Hkv, G, Nq, dtype=lse_dtype, device=q.device)
    ks = keep_scale(plan.dropout_p)

    for i0 in range(0, Nq, bq):
        i1 = min(i0 + bq, Nq)
        n = i1 - i0
        q_t = qs[:, :, :, i0:i1].reshape(B, Hkv, G * n, D)  # (B, Hkv, G*n, D)
        m = torch.full((B, Hkv, G * n, 1), -torch.inf, dtype=cdt, device=q.device)
        l = torch.zeros(B, Hkv, G * n, 1, dtype=cdt, device=q.device)
        acc = torch.zeros(B, Hkv, G * n, Dv, dtype=cdt, device=q.device)
        kv_end = T.kv_end(i1)
        for j0 in range(0, kv_end, bk):
            j1 = min(j0 + bk, kv_end)
            s = q_t @ kc[:, :, j0:j1].transpose(-1, -2)  # (B, Hkv, G*n, w) in log2 units
            s5 = T.scores(s, i0, i1, j0, j1)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            m_use = torch.where(torch.isneginf(m_new), 0.0, m_new)  # masked row: 2^−inf = 0
            alpha = torch.exp2(m - m_use)  # (B, Hkv, G*n, 1) rescales what came before
            s.sub_(m_use).exp2_()  # s is now P, the tile's unnormalised probabilities
            l.mul_(alpha).add_(s.sum(dim=-1, keepdim=True))
            if plan.dropout_p > 0:
                s5.mul_(T.keep(i0, i1, j0, j1)).mul_(ks)
            acc.mul_(alpha).add_(weighted_values(s, vc[:, :, j0:j1], v_finite))
            m = m_new
        empty = l == 0
        o = acc / torch.where(empty, 1.0, l)
        out[:, :, :, i0:i1] = o.view(B, Hkv, G, n, Dv)
        row_lse = torch.where(empty, -torch.inf, m * LN2 + torch.log(torch.where(empty, 1.0, l)))
        lse[:, :, :, i0:i1] = row_lse.view(B, Hkv, G, n)
    return out.view(B, plan.heads, Nq, Dv), lse.view(B, plan.heads, Nq)


def _backward(
    plan: AttentionPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor | None,
    dlse: torch.Tensor | None,
    bq: int,
    bk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, Hkv, G, Nq, Nk = plan.batch, plan.kv_heads, plan.groups, plan.q_len, plan.kv_len
    D, Dv = plan.head_dim, plan.v_dim
    T = _Tiles(plan, q, bq, bk)
    cdt = T.cdt
    qs = (q.to(cdt) * (plan.scale * LOG2E)).reshape(B, Hkv, G, Nq, D)
    kc, vc = k.to(cdt), v.to(cdt)
    # Garbage in masked-out keys/values must not turn 0-weight gradients into NaN.
    if not bool(torch.isfinite(kc).all()):
        kc = torch.nan_to_num(kc, nan=0.0, posinf=0.0, neginf=0.0)
    if not bool(torch.isfinite(vc).all()):
        vc = torch.nan_to_num(vc, nan=0.0, posinf=0.0, neginf=0.0)
    if dout is None:
        do5 = torch.zeros(B, Hkv, G, Nq, Dv, dtype=cdt, device=q.device)
    else:
        do5 = dout.to(cdt).reshape(B, Hkv, G, Nq, Dv)
    # D_i = rowsum(dO ∘ O) − dlse_i  (the lse term: ∂lse_i/∂S_ij = P_ij)
    Di = (do5 * out.to(cdt).reshape(B, Hkv, G, Nq, Dv)).sum(-1)  # (B, Hkv, G, Nq)
    if dlse is not None:
        Di = Di - dlse.to(cdt).reshape(B, Hkv, G, Nq)
    lse2 = (lse.to(cdt) * LOG2E).reshape(B, Hkv, G, Nq)
    lse2 = torch.where(torch.isneginf(lse2), torch.inf, lse2)  # fully masked row: P = 0
    dq = torch.zeros(B, Hkv, G, Nq, D, dtype=cdt, device=q.device)
    dk = torch.zeros(B, Hkv, Nk, D, dtype=cdt, device=q.device)
    dv = torch.zeros(B, Hkv, Nk, Dv, dtype=cdt, device=q.device)
    ks = keep_scale(plan.dropout_p)

    for j0 in range(0, Nk, bk):
        j1 = min(j0 + bk, Nk)
        k_t, v_t = kc[:, :, j0:j1], vc[:, :, j0:j1]  # (B, Hkv, w, D), (B, Hkv, w, Dv)
        dk_t, dv_t = dk[:, :, j0:j1], dv[:, :, j0:j1]
        for i0 in range(T.q_start(j0), Nq, bq):
            i1 = min(i0 + bq, Nq)
            n = i1 - i0
            q_t = qs[:, :, :, i0:i1].reshape(B, Hkv, G * n, D)
            do_t = do5[:, :, :, i0:i1].reshape(B, Hkv, G * n, Dv)
            s = q_t @ k_t.transpose(-1, -2)  # (B, Hkv, G*n, w)
            T.scores(s, i0, i1, j0, j1)
            p = s.sub_(lse2[:, :, :, i0:i1].reshape(B, Hkv, G * n, 1)).exp2_()  # P, exact
            dp = do_t @ v_t.transpose(-1, -2)  # dP of the (dropped) weights
            if plan.dropout_p > 0:
                keep = T.keep(i0, i1, j0, j1).reshape(B, Hkv, G * n, j1 - j0)
                dv_t.add_((p * keep * ks).transpose(-1, -2) @ do_t)
                dp.mul_(keep).mul_(ks)
            else:
                dv_t.add_(p.transpose(-1, -2) @ do_t)
            ds = dp.sub_(Di[:, :, :, i0:i1].reshape(B, Hkv, G * n, 1)).mul_(p)  # dS, natural
            dq[:, :, :, i0:i1].add_((ds @ k_t).view(B, Hkv, G, n, D))
            dk_t.add_(ds.transpose(-1, -2) @ q_t)
    dq = (dq * plan.scale).reshape(B, plan.heads, Nq, D)
    dk = dk * (1.0 / LOG2E)  # q_t carried scale · log2(e); dK needs scale only
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, bq, bk):  # type: ignore[override]
        out, lse = _forward(plan, q, k, v, bq, bk)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.bq, ctx.bk = plan, bq, bk
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.plan, q, k, v, out, lse, dout, dlse, ctx.bq, ctx.bk)
        return dq, dk, dv, None, None, None


class TiledBackend:
    """Our FlashAttention-2 in PyTorch. `block_q`/`block_k` set the tile (rows × keys)."""

    name = "tiled"

    def __init__(self, block_q: int = BLOCK_Q, block_k: int = BLOCK_K):
        for arg, value in (("block_q", block_q), ("block_k", block_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        self.block_q, self.block_k = block_q, block_k

    def __repr__(self) -> str:
        return f"TiledBackend(block_q={self.block_q}, block_k={self.block_k})"

    def why_not(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> str | None:
        if plan.return_weights:
            return "tiled never materialises the attention weights (use backend='reference')"
        if plan.bias is not None and plan.bias.requires_grad and torch.is_grad_enabled():
            return "tiled does not differentiate a float mask (it requires grad)"
        return None

    def forward(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> Result:
        out, lse = _TiledAttention.apply(q, k, v, plan, self.block_q, self.block_k)
        return out, lse, None
