"""The steps of FlashAttention-2 in PyTorch, shared by the `tiled` backend and the distributed
ring: a problem cut into the tiles of its layout (`TileProblem`), one online-softmax step over a
run of kept key tiles (`fold_run`), the forward loop (`forward_loop`) and the backward
(`backward_loop`, from the forward's `RowStats`).

Forward, for one strip of query rows Q_i at a time, over runs of key/value tiles K_j, V_j::

    S   = Q_i K_jᵀ · scale                      (+ bias, score modifier, mask on PARTIAL tiles)
    m'  = max(m, rowmax(S))                      running row max
    P   = exp(S − m')                            unnormalised probabilities of the run
    l   = l · exp(m − m') + rowsum(P)            running softmax denominator
    acc = acc · exp(m − m') + P V_j              rescaled accumulator
    out = acc / l,  lse = m + log l              at the end of the strip

Only one run of scores exists at a time, so memory is O(N·d + run) per head. The backward
recomputes P instead of storing A (FlashAttention-2, Algorithm 2)::

    P = exp(S − m) / l,  D_i = Σ_j P_ij dP_ij / Σ_j P_ij,  dP = dO_i V_jᵀ,
    dS = P ∘ (dP − D_i),  dQ_i += dS K_j · scale,  dK_j += dSᵀ Q_i · scale,  dV_j += Pᵀ dO_i

Work runs on all (batch, head) pairs of a run at once as batched matrix products; grouped query
heads share their key/value tile without copying it (the group is folded into the rows). Which
tiles run, and which need the mask, is the layout's (`qkv.layout`); kept tiles are grouped into
runs so that each product spans many tiles.

A problem whose kept tiles differ per (batch element, kv head) — blocks chosen per kv head,
`qkv.pairs.Pairs.kv_groups` — is run one such group at a time (`kv_parts`, `forward_parts`,
`backward_parts`): a `Part` is a problem of its own (batch 1, its G query heads, one kv head)
over its own kept tiles, whose dropout counter and modifier indices stay the whole problem's.

Scores are rounded exactly as the reference rounds them (`(Q Kᵀ)·scale`); the forward's
exponentials are `exp2((S − m)·log2 e)`, faster than `exp` on the CPU, with the conversion
applied to the difference S − m, small where P matters.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import overload

import torch

from ...dropout import keep_mask, keep_scale
from ...layout import BlockLayout, Strip, layout_for
from ...numerics import guarded_pv, two_float
from ...plan import AttentionPlan

LOG2E = 1.0 / math.log(2.0)

BLOCK_Q = 64  # query rows per tile of the layout (per head)
BLOCK_K = 64  # keys per tile of the layout
MAX_ROWS = 256  # most query rows one matrix product spans
MAX_COLS = 768  # most keys one matrix product spans


def _heads5(t: torch.Tensor | None, plan: AttentionPlan) -> torch.Tensor | None:
    """View a 4-D bias `(B|1, H|1, Nq|1, Nk|1)` as `(B|1, Hkv|1, G|1, Nq|1, Nk|1)`."""
    if t is None:
        return None
    b, h, nq, nk = t.shape
    if h == 1:
        return t.reshape(b, 1, 1, nq, nk)
    return t.reshape(b, plan.kv_heads, plan.groups, nq, nk)


def _tile(t: torch.Tensor, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
    """Cut rows i0:i1 and columns j0:j1 out of a broadcastable bias (size-1 dims kept)."""
    rows = slice(i0, i1) if t.shape[-2] > 1 else slice(None)
    cols = slice(j0, j1) if t.shape[-1] > 1 else slice(None)
    return t[..., rows, cols]


@dataclass(frozen=True)
class Tiling:
    """How a problem is cut: `block_q × block_k` tiles (the unit the layout skips), products of
    at most `max_rows` query rows and `max_cols` keys (consecutive kept tiles merged)."""

    block_q: int = BLOCK_Q
    block_k: int = BLOCK_K
    max_rows: int = MAX_ROWS
    max_cols: int = MAX_COLS


class TileProblem:
    """One attention problem as the forward and backward loops see it: the plan, its layout
    for the tiling, and the index tensors its masks and modifiers are evaluated on (those of
    the whole problem when this is one `Part` of it: `origin`)."""

    def __init__(
        self,
        plan: AttentionPlan,
        q: torch.Tensor,
        tiling: Tiling,
        origin: tuple[int, int, int] | None = None,
    ):
        self.plan = plan
        self.tiling = tiling
        self.cdt = plan.compute_dtype
        self.device = q.device
        self.bias5 = _heads5(plan.pairs.bias, plan)
        # `origin` (b0, h0, H): this problem is batch elements b0 … and query heads h0 … of a
        # problem of H heads (a `Part`); the indices below are the whole problem's.
        b0, h0, heads = origin if origin is not None else (0, 0, plan.heads)
        b = torch.arange(b0, b0 + plan.batch, device=q.device)
        h = torch.arange(h0, h0 + plan.heads, device=q.device)
        # b * H + h with h = hkv * G + g, laid out as the 5-D score tile (dropout's counter).
        self.bh5 = (b.view(-1, 1) * heads + h).reshape(plan.batch, plan.kv_heads, plan.groups, 1, 1)
        # b (B, 1, 1, 1, 1) and h (1, Hkv, G, 1, 1), broadcast like the reference's, so that a
        # bias gathered by head is not repeated over the batch.
        self.b5 = b.view(plan.batch, 1, 1, 1, 1)
        self.h5 = h.view(1, plan.kv_heads, plan.groups, 1, 1)

    def values(self, v: torch.Tensor, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """V's keys j0:j1 for rows i0:i1, with 0 in place of the keys a float bias excludes
        (−inf) from every one of those rows: a bias never empties a tile, so without this a
        NaN/inf there would reach the rows through 0 · NaN. Decided on the device from the
        bias (an input), never from v's values. A key excluded from only some rows of the
        strip is not replaced (nor guarded)."""
        vt = v[:, :, j0:j1]
        if self.bias5 is None or self.plan.dropout_p > 0:
            return vt
        out = torch.isneginf(_tile(self.bias5, i0, i1, j0, j1)).all(3).all(2)  # (B|1, Hkv|1, w|1)
        return vt.masked_fill(out.unsqueeze(-1), 0.0)

    @functools.cached_property
    def layout(self) -> BlockLayout:
        """The plan's layout for this tiling (built or taken from qkv's cache on first use)."""
        return layout_for(self.plan.pairs, self.tiling.block_q, self.tiling.block_k)

    def forward_strips(self) -> list[Strip]:
        """Strips of query rows with their runs of keys (the forward's and backward's order)."""
        return self.layout.strips(self.tiling.max_rows, self.tiling.max_cols)

    def scores(
        self,
        s: torch.Tensor,
        i0: int,
        i1: int,
        j0: int,
        j1: int,
        partial: list[tuple[int, int, int, int]],
        track: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Turn scaled scores `s (B, Hkv, G*n, w)` (rows i0:i1, keys j0:j1) into what
        the softmax sees, in place: add the bias, apply the score modifier, then mask only the
        `partial` rectangles (absolute row0, row1, col0, col1).

        Returns the 5-D view `(B, Hkv, G, n, w)` and, when `track` and a modifier is set, its
        input x (a leaf) and output y for the backward's `autograd.grad`. The modifier runs in
        float64 (forward and backward alike): a learnable table's gradient sums dS over every
        pair of a run, which float32 does not sum within the error rule."""
        p = self.plan
        s5 = s.view(p.batch, p.kv_heads, p.groups, i1 - i0, j1 - j0)
        if self.bias5 is not None:  # a −inf excludes the pair, whatever its score (even NaN)
            bias = _tile(self.bias5, i0, i1, j0, j1)
            s5.add_(bias.to(self.cdt)).masked_fill_(torch.isneginf(bias), -torch.inf)
        graph = None
        if p.score_mod is not None:
            x = s5.to(torch.float64, copy=True)  # Q Kᵀ · scale + bias
            rows = torch.arange(i0, i1, device=self.device).unsqueeze(1) + p.pairs.causal_offset
            cols = torch.arange(j0, j1, device=self.device)
            with torch.set_grad_enabled(track):
                x.requires_grad_(track)
                y = p.score_mod(x, self.b5, self.h5, rows, cols)
            s5.copy_(y.detach())
            graph = (x, y) if track else None
        for r0, r1, c0, c1 in partial:
            allowed = self.allowed(r0, r1, c0, c1)
            if allowed is not None:
                s5[..., r0 - i0 : r1 - i0, c0 - j0 : c1 - j0].masked_fill_(~allowed, -torch.inf)
        return s5, graph

    def allowed(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor | None:
        """Which pairs of rows i0:i1 and keys j0:j1 may attend (broadcastable to 5-D)."""
        rows = torch.arange(i0, i1, device=self.device).unsqueeze(1)
        cols = torch.arange(j0, j1, device=self.device)
        return self.plan.pairs.allowed(self.b5, self.h5, rows, cols)

    def keep(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """Dropout keep-mask of a tile, `(B, Hkv, G, n, w)` bool."""
        rows = torch.arange(i0, i1, device=self.device).unsqueeze(1)
        cols = torch.arange(j0, j1, device=self.device)
        seed = self.plan.dropout_seed
        assert seed is not None  # a plan with dropout has its seed
        return keep_mask(seed, self.plan.dropout_p, self.bh5, rows, cols)


def fold_run(
    T: TileProblem,
    q_t: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i0: int,
    i1: int,
    run,
    m: torch.Tensor | None,
    l: torch.Tensor | None,
    acc: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of the online softmax: fold the run of kept key tiles `run` into the running
    max `m`, denominator `l` and numerator `acc` of query rows i0:i1 (`q_t (B, Hkv, G·n, D)`);
    `m = l = acc = None` means nothing yet. Returns the new `(m, l, acc)`; `l` and `acc` are
    updated in place when given. The distributed ring folds the blocks arriving from other
    ranks with the same step."""
    plan = T.plan
    j0, j1 = run.start, run.stop
    s = (q_t @ k[:, :, j0:j1].transpose(-1, -2)).mul_(plan.scale)  # (B, Hkv, G*n, w)
    s5, _ = T.scores(s, i0, i1, j0, j1, [(i0, i1, a, b) for a, b in run.partial])
    m_run = s.amax(dim=-1, keepdim=True)
    m_new = m_run if m is None else torch.maximum(m, m_run)
    m_use = m_new.clamp(min=torch.finfo(s.dtype).min)  # a row masked so far: exp(−inf) = 0
    s.sub_(m_use).mul_(LOG2E).exp2_()  # s is now P, the unnormalised probabilities of the run
    l_run = s.sum(dim=-1, keepdim=True)
    if plan.dropout_p > 0:
        s5.mul_(T.keep(i0, i1, j0, j1)).mul_(keep_scale(plan.dropout_p))
    # A NaN/inf in a masked (or dropped) value must not reach a row: the columns of partial
    # tiles (all of them under dropout) are guarded; in full tiles every row sees every key.
    guarded = None if plan.dropout_p > 0 else tuple((a - j0, b - j0) for a, b in run.partial)
    pv = guarded_pv(s, T.values(v, i0, i1, j0, j1), guarded)
    if m is None:
        return m_new, l_run, pv
    assert l is not None and acc is not None  # they come with m
    alpha = torch.exp(m - m_use)  # (B, Hkv, G*n, 1) rescales what came before
    return m_new, l.mul_(alpha).add_(l_run), acc.mul_(alpha).add_(pv)


@dataclass(frozen=True)
class RowStats:
    """What the backward needs of the forward's softmax, per query row `(B, H, Nq)`:
    P = exp(S − hi − lo) / l. The loop's forward gives its running max (hi, in the compute
    dtype) and denominator l, so that P is normalised exactly as its output was (and as the
    reference normalises: a one-key row gets P = 1/l = 1); a caller with only an lse (the
    distributed ring) gives it as a two-float (hi, lo) and no l."""

    hi: torch.Tensor  # +inf for a row that sees nothing (P = 0)
    lo: torch.Tensor | None
    l: torch.Tensor | None  # None: 1

    @staticmethod
    def from_lse(lse: torch.Tensor, dtype: torch.dtype) -> RowStats:
        hi, lo = two_float(lse.double(), dtype)
        return RowStats(torch.where(torch.isneginf(hi), torch.inf, hi), lo, None)


def forward_loop(
    T: TileProblem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, RowStats]:
    """`(out (B, H, Nq, Dv), lse (B, H, Nq), RowStats)`: lse (float32, or float64 for float64
    inputs) is m + log l, formed in float64."""
    plan = T.plan
    B, Hkv, G, Nq = plan.batch, plan.kv_heads, plan.groups, plan.q_len
    D, Dv = plan.head_dim, plan.v_dim
    cdt = T.cdt
    lse_dtype = torch.float64 if cdt == torch.float64 else torch.float32
    qs = q.to(cdt).reshape(B, Hkv, G, Nq, D)  # (B, Hkv, G, Nq, D)
    kc, vc = k.to(cdt), v.to(cdt)  # (B, Hkv, Nk, D), (B, Hkv, Nk, Dv); no copy for fp32/64
    # Rows that no strip covers (every tile empty) keep output 0 and lse −inf.
    out = torch.zeros(B, Hkv, G, Nq, Dv, dtype=plan.dtype, device=q.device)
    lse = torch.full((B, Hkv, G, Nq), -torch.inf, dtype=lse_dtype, device=q.device)
    row_max = torch.full((B, Hkv, G, Nq), torch.inf, dtype=cdt, device=q.device)
    row_sum = torch.ones((B, Hkv, G, Nq), dtype=cdt, device=q.device)
    for strip in T.forward_strips():
        i0, i1 = strip.start, strip.stop
        n = i1 - i0
        q_t = qs[:, :, :, i0:i1].reshape(B, Hkv, G * n, D)  # (B, Hkv, G*n, D)
        m = l = acc = None
        for run in strip.runs:
            m, l, acc = fold_run(T, q_t, kc, vc, i0, i1, run, m, l, acc)
        assert m is not None and l is not None and acc is not None  # a strip has runs
        empty = l == 0
        l_safe = torch.where(empty, 1.0, l)
        out[:, :, :, i0:i1] = (acc / l_safe).view(B, Hkv, G, n, Dv)
        row_max[:, :, :, i0:i1] = torch.where(empty, torch.inf, m).view(B, Hkv, G, n)
        row_sum[:, :, :, i0:i1] = l_safe.view(B, Hkv, G, n)
        row_lse = torch.where(empty, -torch.inf, m.double() + torch.log(l_safe.double()))
        lse[:, :, :, i0:i1] = row_lse.view(B, Hkv, G, n)
    shape = (B, plan.heads, Nq)
    stats = RowStats(row_max.view(shape), None, row_sum.view(shape))
    return out.view(B, plan.heads, Nq, Dv), lse.view(shape), stats


STRIP_KEEP = 2**24  # P and dP elements a strip of the backward keeps between its two phases
WIDE = torch.float64  # the backward's sums: D_i, dQ of a strip, the modifiers' parameters


@dataclass(frozen=True)
class _RowStrip:
    """A strip of query rows in the backward, as its runs need it."""

    i0: int  # first query row
    i1: int  # one past the last
    q_t: torch.Tensor  # (B, Hkv, G·n, D)
    do_t: torch.Tensor  # (B, Hkv, G·n, Dv)
    hi: torch.Tensor  # (B, Hkv, G·n, 1): the RowStats of these rows
    lo: torch.Tensor | None
    l: torch.Tensor | None


def backward_loop(
    T: TileProblem,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stats: RowStats,
    dout: torch.Tensor | None,
    dlse: torch.Tensor | None,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """FlashAttention-2's backward, over strips of query rows (as the forward) in two phases:
    recompute P and dP for the strip's kept keys and take D_i = Σ_j P_ij dP_ij from them,
    then form dS = P ∘ (dP − D_i) and accumulate dQ, dK, dV. P = exp(S − hi − lo) / l from
    the forward's `RowStats`.

    Precision, for float32 inputs (every product runs in float32):
    - D_i = Σ_j P_ij dP_ij / Σ_j P_ij, summed from the very P and dP that dS uses (exact
      products, in float64), not taken as rowsum(dO ∘ O): then dS sums to exactly 0 over a
      row (−dlse_i with an lse term) and the roundings of dP and of P's normaliser cancel, as
      they do in the reference's softmax backward. A row whose softmax is nearly one key's
      loses everything else to that cancellation, and its gradients would be off by whole
      roundings of dP;
    - P is normalised as the forward normalised its output (its max and l, not a rounded
      lse), and D_i is subtracted as a two-float (hi + lo);
    - P is `exp(S − max)`, not the forward's faster `exp2((S − max)·log2 e)`: rounding the
      argument x·log2 e costs P a relative error of |x|·eps, which the small weights of a
      peaked row carry straight into its gradient;
    - the dK/dV products of grouped query heads are one product per head, summed, not one dot
      product G times as long;
    - the strips and runs are the forward's, so every score is recomputed bit for bit (matrix
      products of other shapes round differently): the row's largest weight is exactly 1/l,
      1 for a row that sees one key, as the reference has it.
    `delta (B, H, Nq)` (the distributed ring, whose rows' keys are spread over ranks): D_i
    given, float64. A strip keeps its P and dP between the phases (up to STRIP_KEEP elements;
    beyond, it recomputes them)."""
    bw = _Backward(T, q, k, v, stats, dout, dlse, delta)
    for strip, size in zip(bw.strips, bw.per_strip, strict=True):
        rs = bw.row_strip(strip)
        kept, d_row = bw.row_terms(rs, strip, keep_all=bw.keeps(size))
        bw.gradients(rs, strip, kept, two_float(d_row, bw.cdt))
    return bw.finish(q, k, v)


class _Backward:
    """`backward_loop`'s state and phases: the inputs as the products read them, the
    gradients being summed, and buffers reused from strip to strip (allocating them anew hands
    glibc fresh mappings, and every fresh page costs a fault)."""

    def __init__(self, T, q, k, v, stats: RowStats, dout, dlse, delta) -> None:
        plan = self.plan = T.plan
        self.T = T
        B, Hkv, G, Nq, Nk = plan.batch, plan.kv_heads, plan.groups, plan.q_len, plan.kv_len
        D, Dv = plan.head_dim, plan.v_dim
        self.shape = (B, Hkv, G, Nq, D, Dv)
        cdt = self.cdt = T.cdt
        self.delta = delta
        self.qs = q.to(cdt).reshape(B, Hkv, G, Nq, D)
        # Garbage in masked-out keys/values must not turn 0-weight gradients into NaN: the
        # backward reads them with NaN/inf zeroed (a copy; it never reads values to decide).
        self.kc = torch.nan_to_num(k.to(cdt), nan=0.0, posinf=0.0, neginf=0.0)
        self.vc = torch.nan_to_num(v.to(cdt), nan=0.0, posinf=0.0, neginf=0.0)
        if dout is None:
            self.do5 = torch.zeros(B, Hkv, G, Nq, Dv, dtype=cdt, device=q.device)
        else:
            self.do5 = dout.to(cdt).reshape(B, Hkv, G, Nq, Dv)
        self.hi5 = stats.hi.reshape(B, Hkv, G, Nq)
        self.lo5 = None if stats.lo is None else stats.lo.reshape(B, Hkv, G, Nq)
        self.l5 = None if stats.l is None else stats.l.reshape(B, Hkv, G, Nq)
        self.dl5 = None if dlse is None else dlse.to(WIDE).reshape(B, Hkv, G, Nq)
        self.dq = torch.empty(B, Hkv, G, Nq, D, dtype=cdt, device=q.device)
        self.dk = torch.zeros(B, Hkv, Nk, D, dtype=cdt, device=q.device)
        self.dv = torch.zeros(B, Hkv, Nk, Dv, dtype=cdt, device=q.device)
        self.ks = keep_scale(plan.dropout_p)
        self.params = plan.score_mod.params if plan.score_mod is not None else ()
        self.dparams = [torch.zeros_like(t, dtype=WIDE) for t in self.params]
        self.strips = T.forward_strips()
        self.covered = torch.zeros(Nq, dtype=torch.bool)
        self._buffers(q.device)

    def _buffers(self, device) -> None:
        B, Hkv, G, _, D, Dv = self.shape
        strips, cdt = self.strips, self.cdt
        self.per_strip = [
            G * (st.stop - st.start) * sum(r.stop - r.start for r in st.runs) for st in strips
        ]
        # the largest P a strip keeps between its phases (strips beyond STRIP_KEEP recompute it)
        keep_max = max((n for n in self.per_strip if B * Hkv * n <= STRIP_KEEP), default=0)
        run_max = max(
            (G * (st.stop - st.start) * (r.stop - r.start) for st in strips for r in st.runs),
            default=0,
        )
        ws = max(keep_max, run_max)
        self.p_buf, self.dp_buf = (torch.empty(B * Hkv * ws, dtype=cdt, device=device)
                                   for _ in "pd")  # fmt: skip
        o_max = max((G * max(st.stop - st.start, r.stop - r.start) for st in strips
                     for r in st.runs), default=0)  # fmt: skip
        self.o_buf = torch.empty(B * Hkv * o_max * max(D, Dv), dtype=cdt, device=device)
        n_w = 0 if self.delta is not None else 2 * B * Hkv * run_max
        self.w_buf = torch.empty(n_w, dtype=WIDE)

    def keeps(self, size: int) -> bool:
        """Whether a strip of `size` P elements per (b, kv head) keeps P and dP between its
        phases."""
        B, Hkv = self.shape[:2]
        return B * Hkv * size <= STRIP_KEEP

    def row_sums(self, p: torch.Tensor, dp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ_j p_ij, Σ_j p_ij dp_ij), `(…, 1)` each, the products exact, summed in float64."""
        a = self.w_buf[: p.numel()].view(p.shape).copy_(p)
        b = self.w_buf[p.numel() : 2 * p.numel()].view(p.shape).copy_(dp)
        return a.sum(-1, keepdim=True), a.mul_(b).sum(-1, keepdim=True)

    def product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        shape = (*a.shape[:-1], b.shape[-1])
        return torch.matmul(a, b, out=self.o_buf[: math.prod(shape)].view(shape))

    def key_side(self, a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
        """`aᵀ b` for a `(B, Hkv, G·n, w)`, b `(B, Hkv, G·n, X)` → `(B, Hkv, w, X)`: one
        product per query head of the group, then summed over the group (as the reference's
        broadcast does), not one dot product G·n long."""
        B, Hkv, G = self.shape[:3]
        if G == 1:
            return self.product(a.transpose(-1, -2), b)
        a5 = a.view(B, Hkv, G, n, a.shape[-1]).transpose(-1, -2)
        return self.product(a5, b.view(B, Hkv, G, n, b.shape[-1])).sum(2)

    def probs(self, rs: _RowStrip, run, at: int):
        """(P, dP of the dropped weights, the dropout keep-mask or None, the score modifier's
        graph or None) of one run of a strip's rows, into the buffers at offset `at`."""
        plan, T = self.plan, self.T
        i0, i1, j0, j1 = rs.i0, rs.i1, run.start, run.stop
        shape = (*self.shape[:2], rs.q_t.shape[2], j1 - j0)
        size = math.prod(shape)
        s = torch.matmul(
            rs.q_t, self.kc[:, :, j0:j1].transpose(-1, -2),
            out=self.p_buf[at : at + size].view(shape),
        ).mul_(plan.scale)  # fmt: skip
        _, graph = T.scores(s, i0, i1, j0, j1, [(i0, i1, a, b) for a, b in run.partial], True)
        p = s.sub_(rs.hi)
        if rs.lo is not None:
            p.sub_(rs.lo)
        p.exp_()  # not exp2(x·log2 e): its argument's rounding grows with |x| (see docstring)
        if rs.l is not None:
            p.div_(rs.l)
        dp = torch.matmul(
            rs.do_t, self.vc[:, :, j0:j1].transpose(-1, -2),
            out=self.dp_buf[at : at + size].view(shape),
        )  # fmt: skip
        keep = None
        if plan.dropout_p > 0:
            keep = T.keep(i0, i1, j0, j1).reshape(shape)
            dp.mul_(keep).mul_(self.ks)
        return p, dp, keep, graph

    def row_strip(self, strip) -> _RowStrip:
        B, Hkv, G, _, D, Dv = self.shape
        i0, i1 = strip.start, strip.stop
        n = i1 - i0
        self.covered[i0:i1] = True
        rows = (B, Hkv, G * n, 1)

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:, :, :, i0:i1].reshape(rows)

        q_t = self.qs[:, :, :, i0:i1].reshape(B, Hkv, G * n, D)
        do_t = self.do5[:, :, :, i0:i1].reshape(B, Hkv, G * n, Dv)
        hi = cut(self.hi5)
        assert hi is not None
        return _RowStrip(i0, i1, q_t, do_t, hi, cut(self.lo5), cut(self.l5))

    def row_terms(self, rs: _RowStrip, strip, keep_all: bool) -> tuple[list, torch.Tensor]:
        """Phase 1: `(the runs' P and dP where the strip keeps them, D_i)`, D_i = Σ_j P_ij dP_ij
        (− dlse_i) from the P and dP phase 2 uses, or the given `delta`'s rows."""
        B, Hkv, G, Nq = self.shape[:4]
        i0, i1 = rs.i0, rs.i1
        rows = (B, Hkv, G * (i1 - i0), 1)
        kept: list = []
        if self.delta is not None:
            d = self.delta.reshape(B, Hkv, G, Nq)[:, :, :, i0:i1].reshape(rows).to(WIDE)
            return kept, d
        p_sum = torch.zeros(rows, dtype=WIDE, device=rs.q_t.device)
        d_row = torch.zeros(rows, dtype=WIDE, device=rs.q_t.device)
        at = 0
        for run in strip.runs:
            p, dp, keep, graph = self.probs(rs, run, at if keep_all else 0)
            sp, spd = self.row_sums(p, dp)
            p_sum += sp
            d_row += spd
            if keep_all:
                kept.append((p, dp, keep, graph))
                at += p.numel()
        # Σ_j P_ij is 1 up to rounding (of l, of P): dividing by it makes Σ_j dS_ij exactly
        # −dlse_i·Σ_j P_ij, so dP − D_i never carries 1 − Σ_j P_ij, which is all a peaked
        # row's gradient is made of.
        d_row /= torch.where(p_sum > 0, p_sum, 1.0)
        if self.dl5 is not None:
            d_row -= self.dl5[:, :, :, i0:i1].reshape(rows)
        return kept, d_row

    def gradients(self, rs: _RowStrip, strip, kept: list, d: tuple) -> None:
        """Phase 2: dS = P ∘ (dP − D_i) (D_i as a two-float `d`), and the three gradients."""
        B, Hkv, G, _, D, _ = self.shape
        n = rs.i1 - rs.i0
        d_hi, d_lo = d
        dq_t = torch.zeros(B, Hkv, G * n, D, dtype=WIDE, device=rs.q_t.device)
        for r, run in enumerate(strip.runs):
            j0, j1 = run.start, run.stop
            p, dp, keep, graph = kept[r] if kept else self.probs(rs, run, 0)
            k_t = self.kc[:, :, j0:j1]
            pd = p if keep is None else p * keep * self.ks
            self.dv[:, :, j0:j1].add_(self.key_side(pd, rs.do_t, n))
            ds = dp.sub_(d_hi).sub_(d_lo).mul_(p)
            if graph is not None:  # back through the score modifier, into its parameters too
                x, y = graph
                grads = torch.autograd.grad(
                    y, (x, *self.params), ds.view(y.shape).to(y.dtype), allow_unused=True
                )
                ds = ds.copy_(grads[0].view(ds.shape))
                for acc_g, g in zip(self.dparams, grads[1:], strict=True):
                    if g is not None:
                        acc_g.add_(g)
            dq_t.add_(self.product(ds, k_t))
            self.dk[:, :, j0:j1].add_(self.key_side(ds, rs.q_t, n))
        self.dq[:, :, :, rs.i0 : rs.i1] = dq_t.view(B, Hkv, G, n, D)

    def finish(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
        plan = self.plan
        D = self.shape[4]
        self.dq[:, :, :, ~self.covered] = 0  # rows with no kept tile
        # in place: no second O(N·d) copy
        dq = self.dq.mul_(plan.scale).reshape(plan.batch, plan.heads, plan.q_len, D)
        dk = self.dk.mul_(plan.scale)
        dparams = [g.to(t.dtype) for g, t in zip(self.dparams, self.params, strict=True)]
        return dq.to(q.dtype), dk.to(k.dtype), self.dv.to(v.dtype), dparams


# ------------------------------------------------------------------ one kv group at a time


@dataclass(frozen=True)
class Part:
    """Batch element `b` and kv head `g` of a problem whose kept tiles differ from one
    (b, kv head) to the next (blocks chosen per kv head, `qkv.pairs.Pairs.kv_groups`), as a
    problem of its own: `plan` has batch 1, the G query heads `heads` of the group, one kv head
    and the group's `Pairs`, so its layout holds that group's kept tiles alone. Its indices
    (dropout's b·H + h, a modifier's b and h) stay the whole problem's (`origin`)."""

    plan: AttentionPlan
    b: int  # batch element
    g: int  # kv head
    heads: slice  # its query heads
    whole_heads: int  # H of the whole problem

    @property
    def origin(self) -> tuple[int, int, int]:
        """`TileProblem`'s origin: (b, first query head, H)."""
        return self.b, self.heads.start, self.whole_heads

    @overload
    def rows(self, t: torch.Tensor) -> torch.Tensor: ...
    @overload
    def rows(self, t: None) -> None: ...
    @overload
    def rows(self, t: torch.Tensor | None) -> torch.Tensor | None: ...
    def rows(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """The part's `(1, G, …)` view of a `(B, H, …)` tensor (None stays None)."""
        return None if t is None else t[self.b : self.b + 1, self.heads]

    def kv(self, t: torch.Tensor) -> torch.Tensor:
        """The part's `(1, 1, …)` view of a `(B, Hkv, …)` tensor."""
        return t[self.b : self.b + 1, self.g : self.g + 1]

    def problem(self, q: torch.Tensor, tiling: Tiling) -> TileProblem:
        """The part's `TileProblem` (q: the part's rows)."""
        return TileProblem(self.plan, q, tiling, self.origin)


def kv_parts(plan: AttentionPlan) -> list[Part] | None:
    """The plan one (batch element, kv head) at a time, b-major, when its pairs are blocks
    chosen per kv head (`Pairs.kv_groups`, which maps a choice made for fewer kv heads or a
    smaller batch); None when one layout serves every head."""
    found = plan.pairs.kv_groups(plan.batch, plan.kv_heads)
    if found is None:
        return None
    G = plan.groups
    return [
        Part(
            replace(plan, batch=1, heads=G, kv_heads=1, pairs=pairs),
            b,
            g,
            slice(g * G, (g + 1) * G),
            plan.heads,
        )
        for b, g, pairs in found
    ]


def forward_parts(
    plan: AttentionPlan,
    tiling: Tiling,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    loop: Callable[..., tuple] = forward_loop,
) -> tuple[torch.Tensor, torch.Tensor, RowStats]:
    """`forward_loop` (or `loop`, its caller's name for it) over a plan, one `Part` at a time
    where `kv_parts` splits it (each over its own kept tiles, written into the whole results),
    else at once."""
    parts = kv_parts(plan)
    if parts is None:
        return loop(TileProblem(plan, q, tiling), q, k, v)
    B, H, Nq = plan.batch, plan.heads, plan.q_len
    out = q.new_empty(B, H, Nq, plan.v_dim)
    lse = q.new_empty(B, H, Nq, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    hi, l = (q.new_empty(B, H, Nq, dtype=plan.compute_dtype) for _ in "hl")
    for p in parts:
        qp = p.rows(q)
        o, s, stats = loop(p.problem(qp, tiling), qp, p.kv(k), p.kv(v))
        for whole, part in ((out, o), (lse, s), (hi, stats.hi), (l, stats.l)):
            whole[p.b, p.heads] = part[0]
    return out, lse, RowStats(hi, None, l)


def backward_parts(
    plan: AttentionPlan,
    tiling: Tiling,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stats: RowStats,
    dout: torch.Tensor | None,
    dlse: torch.Tensor | None,
    loop: Callable[..., tuple] = backward_loop,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """`backward_loop` (or `loop`) of `forward_parts`'s result: one `Part` at a time where
    `kv_parts` splits the plan (a modifier's parameter gradients summed over the parts), else
    at once."""
    parts = kv_parts(plan)
    if parts is None:
        return loop(TileProblem(plan, q, tiling), q, k, v, stats, dout, dlse)
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    params = plan.score_mod.params if plan.score_mod is not None else ()
    dparams = [torch.zeros_like(t, dtype=torch.float64) for t in params]  # summed in float64
    for p in parts:
        qp = p.rows(q)
        rows = RowStats(p.rows(stats.hi), p.rows(stats.lo), p.rows(stats.l))
        gq, gk, gv, gp = loop(
            p.problem(qp, tiling), qp, p.kv(k), p.kv(v), rows, p.rows(dout), p.rows(dlse)
        )
        dq[p.b, p.heads], dk[p.b, p.g], dv[p.b, p.g] = gq[0], gk[0, 0], gv[0, 0]
        for acc, g in zip(dparams, gp, strict=True):
            acc.add_(g)
    return dq, dk, dv, [g.to(t.dtype) for g, t in zip(dparams, params, strict=True)]
