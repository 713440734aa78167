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
Which tiles run is decided by `schedule.py`: tiles that the causal flag, a structured
`qkv.masks.Mask` or a bool mask empty are never computed, tiles they leave whole skip the mask
arithmetic, and kept tiles are grouped into runs so that each matmul spans many tiles.
Base-2 exponentials are used because `exp2` is about three times faster than `exp` on the CPU:
scores are kept in log2 units (q is pre-scaled by scale · log2 e). With a score modifier, which
is written for natural units, the kernel stays in natural units and uses `exp` instead, which
avoids rounding the scores through two unit conversions.
"""

from __future__ import annotations

import functools
import math

import torch

from ..dropout import keep_mask, keep_scale
from ..numerics import all_finite, causal_allowed, weighted_values
from ..plan import AttentionPlan
from . import fused as fused_mod
from .base import Result
from .fused import FusedStrips
from .schedule import Strip, strips, tile_kinds

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)

BLOCK_Q = 64  # query rows per tile of the layout (per head)
BLOCK_K = 64  # keys per tile of the layout
MAX_ROWS = 256  # most query rows (backward: keys) one matrix product spans
MAX_COLS = 768  # most keys (backward: query rows) one matrix product spans


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


def kernel_units(scale: float, unit: float, dtype: torch.dtype) -> tuple[float, float]:
    """`(q_scale, lse_unit)`: q is multiplied by `q_scale = scale · unit` (a Python float, which
    the multiplication rounds to `dtype`), and an lse converts between natural units and the
    kernel's by `lse_unit = fl(scale · unit) / fl(scale)`, the factor that rounding really
    applied. The reference and torch's SDPA kernels scale the scores by fl(scale), so an lse
    one of them computed (the fused path's) matches this kernel's recomputed scores without a
    systematic error of one rounding of the constant (which broke the error-ratio rule)."""
    q_scale = scale * unit

    def rounded(x: float) -> float:
        return torch.tensor(x, dtype=dtype).item()

    return q_scale, rounded(q_scale) / rounded(scale)


class _Tiles:
    """Per-call state shared by the forward and backward loops. `sched`: the fused-strips
    schedule when the forward runs on torch's fused op (`fused.py`), None for the loop."""

    def __init__(
        self,
        plan: AttentionPlan,
        q: torch.Tensor,
        backend: TiledBackend,
        sched: fused_mod.Schedule | None = None,
    ):
        self.plan = plan
        self.backend = backend
        self.sched = sched
        self.cdt = plan.compute_dtype
        self.device = q.device
        self.mask5 = _heads5(plan.mask, plan)
        self.bias5 = _heads5(plan.bias, plan)
        # b * H + h with h = hkv * G + g, laid out as the 5-D score tile.
        self.bh5 = torch.arange(plan.batch * plan.heads, device=q.device).reshape(
            plan.batch, plan.kv_heads, plan.groups, 1, 1
        )
        rule = plan.mask_rule
        zero = torch.zeros(1, dtype=torch.long, device=q.device)
        if rule is not None:
            self.rule_b = self.bh5 // plan.heads if rule.batch else zero
            self.rule_h = self.bh5 % plan.heads if rule.heads else zero
        self.b5, self.h5 = self.bh5 // plan.heads, self.bh5 % plan.heads  # for score_mod
        # Units of the scores: log2 (fast exp2) unless a score modifier wants natural units.
        natural = plan.score_mod is not None
        self.unit = 1.0 if natural else LOG2E
        self.q_scale, self.lse_unit = kernel_units(plan.scale, self.unit, self.cdt)
        self.exp_ = torch.Tensor.exp_ if natural else torch.Tensor.exp2_
        self.exp = torch.exp if natural else torch.exp2

    @functools.cached_property
    def kinds(self) -> torch.Tensor:
        """The layout's tile kinds (computed when a loop first needs them)."""
        return tile_kinds(self.plan, self.backend.block_q, self.backend.block_k)

    def forward_strips(self) -> list[Strip]:
        """Rows of query tiles with their runs of keys."""
        b, p = self.backend, self.plan
        return strips(self.kinds, b.block_q, b.block_k, p.q_len, p.kv_len, b.max_rows, b.max_cols)

    def backward_strips(self) -> list[Strip]:
        """Columns of key tiles with their runs of queries."""
        b, p = self.backend, self.plan
        return strips(self.kinds.T, b.block_k, b.block_q, p.kv_len, p.q_len, b.max_rows, b.max_cols)

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
        """Turn raw scores `s (B, Hkv, G*n, w)` (log2 units, rows i0:i1, keys j0:j1) into what
        the softmax sees, in place: add the bias, apply the score modifier, then mask only the
        `partial` rectangles (absolute row0, row1, col0, col1).

        Returns the 5-D view `(B, Hkv, G, n, w)` and, when `track` and a modifier is set, its
        input x (a leaf, natural units) and output y for the backward's `autograd.grad`."""
        p = self.plan
        s5 = s.view(p.batch, p.kv_heads, p.groups, i1 - i0, j1 - j0)
        if self.bias5 is not None:
            s5.add_(_tile(self.bias5, i0, i1, j0, j1).to(self.cdt), alpha=self.unit)
        graph = None
        if p.score_mod is not None:
            x = s5.clone()  # natural units here: Q Kᵀ · scale + bias
            rows = torch.arange(i0, i1, device=self.device).unsqueeze(1) + p.causal_offset
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
        p = self.plan
        rows = torch.arange(i0, i1, device=self.device).unsqueeze(1)
        cols = torch.arange(j0, j1, device=self.device)
        allowed = None
        if p.causal:
            allowed = causal_allowed(rows, cols, p.causal_offset)
        if self.mask5 is not None:
            m = _tile(self.mask5, i0, i1, j0, j1)
            allowed = m if allowed is None else allowed & m
        if p.mask_rule is not None:
            m = p.mask_rule.evaluate(self.rule_b, self.rule_h, rows, cols, p.q_len, p.kv_len)
            allowed = m if allowed is None else allowed & m
        return allowed

    def keep(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """Dropout keep-mask of a tile, `(B, Hkv, G, n, w)` bool."""
        rows = torch.arange(i0, i1, device=self.device).unsqueeze(1)
        cols = torch.arange(j0, j1, device=self.device)
        return keep_mask(self.plan.dropout_seed, self.plan.dropout_p, self.bh5, rows, cols)


def fold_run(
    T: _Tiles,
    q_t: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i0: int,
    i1: int,
    run,
    m: torch.Tensor | None,
    l: torch.Tensor | None,
    acc: torch.Tensor | None,
    v_finite: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of the online softmax: fold the run of kept key tiles `run` into the running
    max `m`, denominator `l` and numerator `acc` of query rows i0:i1 (`q_t`, scaled into the
    kernel's units, `(B, Hkv, G·n, D)`); `m = l = acc = None` means nothing yet. Returns the new
    `(m, l, acc)`; `l` and `acc` are updated in place when given. The distributed ring folds
    the blocks arriving from other ranks with the same step."""
    plan = T.plan
    j0, j1 = run.start, run.stop
    s = (q_t @ k[:, :, j0:j1].transpose(-1, -2)).mul_(T.q_scale)  # (B, Hkv, G*n, w), kernel units
    s5, _ = T.scores(s, i0, i1, j0, j1, [(i0, i1, a, b) for a, b in run.partial])
    m_run = s.amax(dim=-1, keepdim=True)
    m_new = m_run if m is None else torch.maximum(m, m_run)
    m_use = m_new.clamp(min=torch.finfo(s.dtype).min)  # a row masked so far: 2^(−inf) = 0
    T.exp_(s.sub_(m_use))  # s is now P, the unnormalised probabilities of the run
    l_run = s.sum(dim=-1, keepdim=True)
    if plan.dropout_p > 0:
        s5.mul_(T.keep(i0, i1, j0, j1)).mul_(keep_scale(plan.dropout_p))
    pv = weighted_values(s, v[:, :, j0:j1], v_finite)
    if m is None:
        return m_new, l_run, pv
    alpha = T.exp(m - m_use)  # (B, Hkv, G*n, 1) rescales what came before
    return m_new, l.mul_(alpha).add_(l_run), acc.mul_(alpha).add_(pv)


def _forward(
    T: _Tiles, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    plan = T.plan
    B, Hkv, G, Nq = plan.batch, plan.kv_heads, plan.groups, plan.q_len
    D, Dv = plan.head_dim, plan.v_dim
    cdt = T.cdt
    lse_dtype = torch.float64 if cdt == torch.float64 else torch.float32
    qs = q.to(cdt).reshape(B, Hkv, G, Nq, D)  # (B, Hkv, G, Nq, D)
    kc, vc = k.to(cdt), v.to(cdt)  # (B, Hkv, Nk, D), (B, Hkv, Nk, Dv); no copy for fp32/64
    v_finite = all_finite(vc)
    # Rows that no strip covers (every tile empty) keep output 0 and lse −inf.
    out = torch.zeros(B, Hkv, G, Nq, Dv, dtype=plan.dtype, device=q.device)
    lse = torch.full((B, Hkv, G, Nq), -torch.inf, dtype=lse_dtype, device=q.device)
    for strip in T.forward_strips():
        i0, i1 = strip.start, strip.stop
        n = i1 - i0
        q_t = qs[:, :, :, i0:i1].reshape(B, Hkv, G * n, D)  # (B, Hkv, G*n, D)
        m = l = acc = None
        for run in strip.runs:
            m, l, acc = fold_run(T, q_t, kc, vc, i0, i1, run, m, l, acc, v_finite)
        empty = l == 0
        o = acc / torch.where(empty, 1.0, l)
        out[:, :, :, i0:i1] = o.view(B, Hkv, G, n, Dv)
        m_nat = m / T.lse_unit
        row_lse = torch.where(empty, -torch.inf, m_nat + torch.log(torch.where(empty, 1.0, l)))
        lse[:, :, :, i0:i1] = row_lse.view(B, Hkv, G, n)
    return out.view(B, plan.heads, Nq, Dv), lse.view(B, plan.heads, Nq)


def _backward(
    T: _Tiles,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor | None,
    dlse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    plan = T.plan
    B, Hkv, G, Nq, Nk = plan.batch, plan.kv_heads, plan.groups, plan.q_len, plan.kv_len
    D, Dv = plan.head_dim, plan.v_dim
    cdt = T.cdt
    qs = q.to(cdt).reshape(B, Hkv, G, Nq, D)
    kc, vc = k.to(cdt), v.to(cdt)
    # Garbage in masked-out keys/values must not turn 0-weight gradients into NaN.
    if not all_finite(kc):
        kc = torch.nan_to_num(kc, nan=0.0, posinf=0.0, neginf=0.0)
    if not all_finite(vc):
        vc = torch.nan_to_num(vc, nan=0.0, posinf=0.0, neginf=0.0)
    if dout is None:
        do5 = torch.zeros(B, Hkv, G, Nq, Dv, dtype=cdt, device=q.device)
    else:
        do5 = dout.to(cdt).reshape(B, Hkv, G, Nq, Dv)
    # D_i = rowsum(dO ∘ O) − dlse_i  (the lse term: ∂lse_i/∂S_ij = P_ij)
    Di = (do5 * out.to(cdt).reshape(B, Hkv, G, Nq, Dv)).sum(-1)  # (B, Hkv, G, Nq)
    if dlse is not None:
        Di = Di - dlse.to(cdt).reshape(B, Hkv, G, Nq)
    lse_w = (lse.double() * T.lse_unit).reshape(B, Hkv, G, Nq)
    lse2 = lse_w.to(cdt)
    lse_lo = torch.nan_to_num(lse_w - lse2.double(), nan=0.0).to(cdt)
    lse2 = torch.where(torch.isneginf(lse2), torch.inf, lse2)  # fully masked row: P = 0
    dq = torch.zeros(B, Hkv, G, Nq, D, dtype=cdt, device=q.device)
    dk = torch.zeros(B, Hkv, Nk, D, dtype=cdt, device=q.device)
    dv = torch.zeros(B, Hkv, Nk, Dv, dtype=cdt, device=q.device)
    ks = keep_scale(plan.dropout_p)
    params = plan.score_mod.params if plan.score_mod is not None else ()
    dparams = [torch.zeros_like(t) for t in params]

    strips = T.backward_strips()
    # Every run's products land in three buffers reused from run to run: allocating them per
    # run hands glibc a fresh mapping each time, and every fresh page costs a fault.
    s_max = max(
        (G * (r.stop - r.start) * (st.stop - st.start) for st in strips for r in st.runs), default=0
    )
    o_max = max(
        (max(G * (r.stop - r.start), st.stop - st.start) for st in strips for r in st.runs),
        default=0,
    )
    s_buf, dp_buf = (torch.empty(B * Hkv * s_max, dtype=cdt, device=q.device) for _ in "sd")
    o_buf = torch.empty(B * Hkv * o_max * max(D, Dv), dtype=cdt, device=q.device)

    def product(a: torch.Tensor, b: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        shape = (*a.shape[:-1], b.shape[-1])
        return torch.matmul(a, b, out=buf[: math.prod(shape)].view(shape))

    for strip in strips:
        j0, j1 = strip.start, strip.stop
        k_t, v_t = kc[:, :, j0:j1], vc[:, :, j0:j1]  # (B, Hkv, w, D), (B, Hkv, w, Dv)
        dk_t, dv_t = dk[:, :, j0:j1], dv[:, :, j0:j1]
        for run in strip.runs:
            i0, i1 = run.start, run.stop
            n = i1 - i0
            q_t = qs[:, :, :, i0:i1].reshape(B, Hkv, G * n, D)
            do_t = do5[:, :, :, i0:i1].reshape(B, Hkv, G * n, Dv)
            s = product(q_t, k_t.transpose(-1, -2), s_buf).mul_(T.q_scale)  # (B, Hkv, G*n, w)
            _, graph = T.scores(
                s, i0, i1, j0, j1, [(a, b, j0, j1) for a, b in run.partial], track=True
            )
            s.sub_(lse2[:, :, :, i0:i1].reshape(B, Hkv, G * n, 1))
            p = T.exp_(s.sub_(lse_lo[:, :, :, i0:i1].reshape(B, Hkv, G * n, 1)))  # P, exact
            dp = product(do_t, v_t.transpose(-1, -2), dp_buf)  # dP of the (dropped) weights
            if plan.dropout_p > 0:
                keep = T.keep(i0, i1, j0, j1).reshape(B, Hkv, G * n, j1 - j0)
                dv_t.add_(product((p * keep * ks).transpose(-1, -2), do_t, o_buf))
                dp.mul_(keep).mul_(ks)
            else:
                dv_t.add_(product(p.transpose(-1, -2), do_t, o_buf))
            ds = dp.sub_(Di[:, :, :, i0:i1].reshape(B, Hkv, G * n, 1)).mul_(p)  # dS, natural
            if graph is not None:  # back through the score modifier, into its parameters too
                x, y = graph
                grads = torch.autograd.grad(y, (x, *params), ds.view_as(y), allow_unused=True)
                ds = grads[0].reshape(ds.shape)
                for acc_g, g in zip(dparams, grads[1:], strict=True):
                    if g is not None:
                        acc_g.add_(g)
            dq[:, :, :, i0:i1].add_(product(ds, k_t, o_buf).view(B, Hkv, G, n, D))
            dk_t.add_(product(ds.transpose(-1, -2), q_t, o_buf))
    dq = dq.mul_(plan.scale).reshape(B, plan.heads, Nq, D)  # in place: no second O(N·d) copy
    dk = dk.mul_(plan.scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dparams


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tiles, *params):  # type: ignore[override]
        if tiles.sched is not None:
            out, lse = fused_mod.forward(tiles.plan, tiles.sched, q, k, v)
        else:
            out, lse = _forward(tiles, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.tiles = tiles
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, dparams = _backward(ctx.tiles, q, k, v, out, lse, dout, dlse)
        return dq, dk, dv, None, *dparams


class TiledBackend:
    """Our FlashAttention-2 in PyTorch.

    `block_q × block_k` is the tile of the layout (the unit that can be skipped); a matrix
    product spans at most `max_rows` query rows (or, in the backward, keys) and `max_cols` keys
    (or queries) when consecutive kept tiles are merged.

    `fused`: for a structured `qkv.masks.Mask` on the CPU, run the forward's kept tiles through
    torch's fused C++ flash kernel, batched over strips of queries (`fused.py`); the gradient
    is this kernel's own backward either way. `True` (the default) or a `FusedStrips` with its
    knobs turns it on, `False` off. Plans the fused op cannot compute exactly (dropout, score
    modifiers, tensor masks, …) run the loop either way."""

    name = "tiled"

    def __init__(
        self,
        block_q: int = BLOCK_Q,
        block_k: int = BLOCK_K,
        max_rows: int = MAX_ROWS,
        max_cols: int = MAX_COLS,
        fused: bool | FusedStrips = True,
    ):
        for arg, value in (
            ("block_q", block_q),
            ("block_k", block_k),
            ("max_rows", max_rows),
            ("max_cols", max_cols),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        self.block_q, self.block_k = block_q, block_k
        self.max_rows, self.max_cols = max_rows, max_cols
        if not isinstance(fused, (bool, FusedStrips)):
            raise TypeError(f"fused must be a bool or a FusedStrips, got {fused!r}")
        self.fused = FusedStrips() if fused is True else (fused or None)

    def __repr__(self) -> str:
        extra = ""
        if self.fused is None:
            extra = ", fused=False"
        elif self.fused != FusedStrips():
            extra = f", fused={self.fused!r}"
        return (
            f"TiledBackend({self.block_q}, {self.block_k}, max_rows={self.max_rows}, "
            f"max_cols={self.max_cols}{extra})"
        )

    def fused_reason(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> str | None:
        """None when `forward` takes the fused-strips path, else why it runs the loop."""
        if self.fused is None:
            return "fused=False"
        return fused_mod.reason(plan, q, k, v)

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
        sched = None
        if self.fused_reason(plan, q, k, v) is None:  # the forward on the fused op
            sched = fused_mod.schedule(plan, self.block_q, self.block_k, self.fused)
        params = plan.score_mod.params if plan.score_mod is not None else ()
        out, lse = _TiledAttention.apply(q, k, v, _Tiles(plan, q, self, sched), *params)
        return out, lse, None
