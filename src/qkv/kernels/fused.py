"""Fused strips: the tiled backend's fast path for structured masks on the CPU.

The tiled kernel (tiled.py) does the softmax arithmetic of every tile as separate eager PyTorch
passes; for a sliding window that arithmetic, not the matrix products, is most of the time.
Torch ships a fused C++ CPU flash-attention kernel that takes an additive mask and returns the
log-sum-exp::

    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=, scale=)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, False, attn_mask=, scale=)

It accepts grouped kv heads (query head h reads kv head h // G), arbitrary strides, fp32, fp64,
bf16 and fp16 (scores and softmax in fp32 for the low precisions), and its lse is in natural
units (float32, or float64 for float64 inputs), as ours. What it cannot do is skip anything: it
runs every key of its `k`. So this module hands it only the keys each group of queries keeps:

1. **Layout.** `schedule.tile_kinds` classifies the `block_q × block_k` tiles of the backend
   (from the Mask's tile bounds and the causal flag; never an N×N matrix).
2. **Strips.** Rows of tiles are merged into strips of at most `rows` query rows (128 by
   default; measured best for a 256 window on 2 cores: 64 pays more calls, 256 more waste) while
   the union of their kept key tiles stays within `waste` times what they keep alone
   (`schedule.strips`). A strip's *window* is the concatenation of its kept key ranges: one
   contiguous range for a band, several for Longformer's global columns + band or BigBird.
3. **Groups.** Strips with the same row count whose window widths round up to the same bucket
   (widths rounded up by at most 1/8) form a group. A group is cut into batches whose gathered
   tensors stay within `budget` bytes; each batch is ONE call of the fused op, batched over its
   strips: q rows and the window's k/v rows are gathered with `index_select` (the copy also
   folds batch into heads: `(strips, B·H, rows, D)` against `(strips, B·Hkv, width, D)`), and
   the additive mask `(strips, 1|H, rows, width)` is built by evaluating the rule on the window
   only (O(N · width), never N²). Padded columns of a narrower window are masked out. A batch
   whose tiles are all FULL and unpadded passes no mask at all.
4. **Wide strips** (window wider than `wide` keys: the rows of a global token, a dense prefix)
   run alone; a contiguous window is passed as a view of k/v (no copy). The backward cuts every
   window into pieces of at most `wide` keys: with the forward's lse, each piece's dK/dV and
   share of dQ are exact on their own, which bounds the backward's temporaries.

Semantics fixed up around the op: a row with no allowed key gets out 0 (the op gives 0), lse
−inf (the op gives 0) and zero gradients (the op gives 0 when handed lse 0 for that row, which
is what the backward passes). Masks that depend on the batch element (padding, key_mask) or on
the head when B > 1 run one batch element at a time, so the mask is never repeated B times.

Accuracy: in fp32 the op's backward is less accurate than the error-ratio rule of DESIGN.md §3
allows (dQ up to ~4× the fp32 reference's error on small masked problems, where the PyTorch loop
stays within 2×); with fp64 arithmetic it is within 1.5-2×. So by default (`exact_backward`) the
backward of fp32 inputs gathers each batch in fp64 and runs the op there (the gather copies
anyway; the products cost about twice as much). bf16/fp16 run the op in their own dtype (it
accumulates in fp32), which passes the rule.

Backward: `_FusedStrips` (an autograd Function) saves q, k, v, out and lse only (O(N·d)),
re-gathers each batch, calls the fused backward op on it and scatters dQ with `index_add_` and
dK/dV with `index_add_` (windows overlap). The op has no lse gradient; when the caller
differentiates lse (ring attention merges blocks by lse), the backward of that call runs the
tiled kernel's backward instead, which is exact and consistent with this forward.

What stays on the tiled kernel (see `reason`): dropout (ours is a counter-based hash the op
cannot reproduce), score modifiers, returned weights, dense bool or float masks, Dv ≠ D (the op
needs equal head sizes), non-finite k/v (the op's `P @ V` would turn 0 · NaN in a masked-out
value into NaN), devices other than the CPU, and plans without a structured Mask (dense and
causal attention go to SDPA already).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..masks import EMPTY
from ..numerics import all_finite, causal_allowed
from ..plan import AttentionPlan
from .schedule import strips, tile_kinds

_OPS = torch.ops.aten
_FWD_NAME = "_scaled_dot_product_flash_attention_for_cpu"
_BWD_NAME = "_scaled_dot_product_flash_attention_for_cpu_backward"


def _op_available() -> bool:
    return hasattr(_OPS, _FWD_NAME) and hasattr(_OPS, _BWD_NAME)


def fused_forward_op(q, k, v, mask, scale):
    """The fused op's forward (a module-level name, so tests can count the calls)."""
    return getattr(_OPS, _FWD_NAME)(q, k, v, attn_mask=mask, scale=scale)


def fused_backward_op(dout, q, k, v, out, lse, mask, scale):
    """The fused op's backward."""
    return getattr(_OPS, _BWD_NAME)(
        dout, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale
    )


@dataclass(frozen=True)
class FusedStrips:
    """Settings of the fused-strips path (`TiledBackend(fused=FusedStrips(...))`)."""

    rows: int = 128  # most query rows per strip
    waste: float = 1.25  # merge rows of tiles while the union of kept tiles grows ≤ 25%
    wide: int = 4096  # a window wider than this runs alone (forward) / in pieces (backward)
    budget: int = 64 * 2**20  # bytes of gathered tensors (and mask) per batched call
    exact_backward: bool = True  # fp32 inputs: run the backward op in fp64 (see the docstring)

    def __post_init__(self):
        for name in ("rows", "wide", "budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not self.waste >= 1.0:
            raise ValueError(f"waste must be ≥ 1, got {self.waste!r}")


def reason(plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when the fused path computes this plan exactly, else why the tiled loop runs."""
    if plan.mask_rule is None:
        return "no structured qkv.masks.Mask"
    if q.device.type != "cpu":
        return "the fused op runs on the CPU only"
    if not _op_available():
        return f"this torch has no aten.{_FWD_NAME}"
    if plan.dropout_p > 0:
        return "dropout (qkv's counter-based mask) is applied by the tiled loop"
    if plan.score_mod is not None:
        return "score modifiers are applied by the tiled loop"
    if plan.return_weights:
        return "weights are not returned by the fused op"
    if plan.mask is not None or plan.bias is not None:
        return "a tensor mask is applied by the tiled loop"
    if plan.head_dim != plan.v_dim:
        return "the fused op needs Dv == D"
    if plan.q_len == 0 or plan.kv_len == 0 or plan.head_dim == 0:
        return "empty problem"
    if not (all_finite(k) and all_finite(v)):
        return "non-finite keys/values (the fused op would let 0·NaN through)"
    return None


# ---------------------------------------------------------------------------------- schedule


@dataclass
class _Batch:
    """Strips run as one call: same row count, windows padded to one width."""

    rows: torch.Tensor | slice  # query rows: (n·R,) indices, or one slice when n == 1
    r0: torch.Tensor  # (n,) first row of each strip
    n_rows: int  # R
    cols: torch.Tensor | slice  # keys: (n·W,) indices, or one slice (a contiguous window)
    col_pos: torch.Tensor  # (n, W) key positions (clamped), for the mask
    col_ok: torch.Tensor | None  # (n, W) bool: a real column of the window (None: all real)
    width: int  # W
    full: bool  # every kept tile FULL and no padding: no mask needed


def _bucket(w: int, step: int) -> int:
    """Round a width up by at most 1/8 (and to a multiple of `step`)."""
    g = max(step, 1 << max(0, w.bit_length() - 4))
    return -(-w // g) * g


class _Schedule:
    """Strips of a plan, grouped into batched calls (built once; reused by the backward)."""

    def __init__(self, plan: AttentionPlan, block_q: int, block_k: int, cfg: FusedStrips):
        self.plan, self.cfg = plan, cfg
        nq, nk = plan.q_len, plan.kv_len
        kinds = tile_kinds(plan, block_q, block_k)
        self.kept_fraction = float((kinds != EMPTY).float().mean()) if kinds.numel() else 0.0
        groups: dict[tuple, list] = {}
        singles = []
        for s in strips(kinds, block_q, block_k, nq, nk, max(cfg.rows, block_q), nk, cfg.waste):
            ranges = [(r.start, r.stop) for r in s.runs]
            merged: list[tuple[int, int]] = []
            for a, b in ranges:  # runs are cut at max_cols = Nk: only gaps separate them
                if merged and merged[-1][1] == a:
                    merged[-1] = (merged[-1][0], b)
                else:
                    merged.append((a, b))
            width = sum(b - a for a, b in merged)
            full = all(not r.partial for r in s.runs)
            item = (s.start, s.stop, merged, width, full)
            if width > cfg.wide:
                singles.append(item)
            else:
                key = (s.stop - s.start, _bucket(width, 16))
                groups.setdefault(key, []).append(item)
        self.batches: list[_Batch] = []
        for (n_rows, width), items in groups.items():
            per = max(1, cfg.budget // self._strip_bytes(n_rows, width))
            for i in range(0, len(items), per):
                self.batches.append(self._batch(items[i : i + per], n_rows, width))
        for item in singles:
            self.batches.append(self._batch([item], item[1] - item[0], item[3]))

    def _strip_bytes(self, n_rows: int, width: int) -> int:
        p = self.plan
        elt = torch.empty((), dtype=p.dtype).element_size()
        bh, bhkv = p.batch * p.heads, p.batch * p.kv_heads
        mask_heads = p.heads if p.mask_rule is not None and p.mask_rule.heads else 1
        # backward: q, dout, out, dq (rows) + k, v, dk, dv (window) + mask and its bool
        tensors = 4 * n_rows * bh * p.head_dim + 4 * width * bhkv * p.head_dim
        return elt * tensors + (elt + 1) * n_rows * width * mask_heads

    def _batch(self, items, n_rows: int, width: int) -> _Batch:
        r0 = torch.tensor([it[0] for it in items], dtype=torch.long)
        if len(items) == 1:
            rows: torch.Tensor | slice = slice(items[0][0], items[0][1])
        else:
            rows = (r0.view(-1, 1) + torch.arange(n_rows)).reshape(-1)
        pos, ok = [], []
        padded = False
        for _, _, ranges, w, _ in items:
            idx = torch.cat([torch.arange(a, b) for a, b in ranges])
            good = torch.ones(width, dtype=torch.bool)
            if w < width:
                padded = True
                idx = torch.cat([idx, idx.new_full((width - w,), idx[-1].item())])
                good[w:] = False
            pos.append(idx)
            ok.append(good)
        col_pos = torch.stack(pos)
        contiguous = len(items) == 1 and len(items[0][2]) == 1 and not padded
        cols: torch.Tensor | slice = (
            slice(items[0][2][0][0], items[0][2][0][1]) if contiguous else col_pos.reshape(-1)
        )
        return _Batch(
            rows=rows,
            r0=r0,
            n_rows=n_rows,
            cols=cols,
            col_pos=col_pos,
            col_ok=torch.stack(ok) if padded else None,
            width=width,
            full=all(it[4] for it in items) and not padded,
        )


# ------------------------------------------------------------------------------ the pieces


def _take(t: torch.Tensor, sel: torch.Tensor | slice) -> torch.Tensor:
    """Rows `sel` of a `(N, X, D)` tensor: a view for a slice, a gathered copy otherwise."""
    return t[sel] if isinstance(sel, slice) else t.index_select(0, sel)


def _to_op(t: torch.Tensor, n: int) -> torch.Tensor:
    """`(n·R, X, D)` → the op's `(n, X, R, D)` view (its own favoured memory layout)."""
    return t.view(n, t.shape[0] // n, t.shape[1], t.shape[2]).transpose(1, 2)


def _from_op(t: torch.Tensor) -> torch.Tensor:
    """The op's `(n, X, R, D)` result → `(n·R, X, D)` (a view for the op's layout)."""
    n, x, r, d = t.shape
    return t.transpose(1, 2).reshape(n * r, x, d)


def _allowed(
    plan: AttentionPlan, batch: _Batch, b: int | None, c0: int = 0, c1: int | None = None
) -> torch.Tensor:
    """bool `(n, 1|H, R, w)`: the rule (and causal flag) on the batch's window columns c0:c1."""
    rule = plan.mask_rule
    assert rule is not None
    col_pos = batch.col_pos[:, c0:c1]
    n, w = col_pos.shape
    rows = (batch.r0.view(-1, 1) + torch.arange(batch.n_rows)).view(n, 1, batch.n_rows, 1)
    cols = col_pos.view(n, 1, 1, w)
    bi = torch.zeros(1, 1, 1, 1, dtype=torch.long) + (b or 0)
    hi = torch.arange(plan.heads).view(1, -1, 1, 1) if rule.heads else torch.zeros(1, 1, 1, 1)
    allowed = rule.evaluate(bi, hi.long(), rows, cols, plan.q_len, plan.kv_len)
    if plan.causal:
        allowed = allowed & causal_allowed(rows, cols, plan.causal_offset)
    if batch.col_ok is not None:
        allowed = allowed & batch.col_ok[:, c0:c1].view(n, 1, 1, w)
    return allowed.expand(n, allowed.shape[1], batch.n_rows, w)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, -torch.inf)


def _slice_cols(batch: _Batch, c0: int, c1: int) -> torch.Tensor | slice:
    if isinstance(batch.cols, slice):
        return slice(batch.cols.start + c0, batch.cols.start + c1)
    return batch.col_pos[:, c0:c1].reshape(-1)


def _forward(plan: AttentionPlan, sched: _Schedule, q, k, v):
    B, H, Nq, Dv = plan.batch, plan.heads, plan.q_len, plan.v_dim
    lse_dtype = torch.float64 if plan.dtype == torch.float64 else torch.float32
    out = torch.zeros(B, H, Nq, Dv, dtype=plan.dtype)  # rows no strip covers stay 0
    lse = torch.full((B, H, Nq), -torch.inf, dtype=lse_dtype)
    for b in _batch_elements(plan):
        qt, kt, vt = (_rows(t, b) for t in (q, k, v))
        out_t, lse_t = _rows(out, b), _rows(lse.unsqueeze(-1), b)
        for batch in sched.batches:
            n = batch.r0.numel()
            mask = None
            empty = None
            if not batch.full:
                allowed = _allowed(plan, batch, b)
                mask = _additive(allowed, plan.dtype)
                empty = ~allowed.any(-1)  # (n, 1|H, R)
            o, lse_b = fused_forward_op(
                _to_op(_take(qt, batch.rows), n),
                _to_op(_take(kt, batch.cols), n),
                _to_op(_take(vt, batch.cols), n),
                mask,
                plan.scale,
            )
            if empty is not None:
                lse_b = lse_b.masked_fill(empty, -torch.inf)
            _put(out_t, batch.rows, _from_op(o))
            _put(lse_t, batch.rows, _from_op(lse_b.unsqueeze(-1)))
    return out, lse


def _backward(plan: AttentionPlan, sched: _Schedule, q, k, v, out, lse, dout):
    cfg = sched.cfg
    wide = cfg.exact_backward and plan.dtype == torch.float32
    bdt = torch.float64 if wide else plan.dtype  # the backward op's dtype
    ldt = torch.float64 if bdt == torch.float64 else torch.float32  # and of its lse

    def take(t, sel, n):
        return _to_op(_take(t, sel).to(bdt), n)

    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for b in _batch_elements(plan):
        qt, kt, vt, ot, dot = (_rows(t, b) for t in (q, k, v, out, dout))
        lt = _rows(torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1), b)  # op's lse: 0
        dqt, dkt, dvt = (_rows(t, b) for t in (dq, dk, dv))
        for batch in sched.batches:
            n = batch.r0.numel()
            q_b, o_b, do_b = (take(t, batch.rows, n) for t in (qt, ot, dot))
            l_b = _take(lt, batch.rows).to(ldt).view(n, -1, lt.shape[1]).transpose(1, 2)
            dq_b = None
            step = batch.width if n > 1 else cfg.wide  # pieces of a wide window
            for c0 in range(0, batch.width, step):
                c1 = min(batch.width, c0 + step)
                cols = _slice_cols(batch, c0, c1)
                mask = None
                if not batch.full:
                    mask = _additive(_allowed(plan, batch, b, c0, c1), bdt)
                g = fused_backward_op(
                    do_b,
                    q_b,
                    take(kt, cols, n),
                    take(vt, cols, n),
                    o_b,
                    l_b,
                    mask,
                    plan.scale,
                )
                dq_b = g[0] if dq_b is None else dq_b.add_(g[0])
                _add(dkt, cols, _from_op(g[1]).to(dkt.dtype))
                _add(dvt, cols, _from_op(g[2]).to(dvt.dtype))
            _add(dqt, batch.rows, _from_op(dq_b).to(dqt.dtype))
    return dq, dk, dv


def _batch_elements(plan: AttentionPlan) -> list[int | None]:
    """None: batch folded into heads. A rule that depends on the batch element (or on the head,
    with B > 1) runs one element at a time, so its mask is never repeated B times."""
    rule = plan.mask_rule
    assert rule is not None
    if rule.batch is not None or (rule.heads is not None and plan.batch > 1):
        return list(range(plan.batch))
    return [None]


def _rows(t: torch.Tensor, b: int | None) -> torch.Tensor:
    """`(B, X, N, D)` → `(N, B·X, D)` (folded) or `(N, X, D)` for batch element b."""
    B, X, N, D = t.shape
    if b is None:
        return t.reshape(B * X, N, D).transpose(0, 1)
    return t[b].transpose(0, 1)


def _put(dst: torch.Tensor, sel: torch.Tensor | slice, src: torch.Tensor) -> None:
    if isinstance(sel, slice):
        dst[sel] = src
    else:
        dst.index_copy_(0, sel, src)


def _add(dst: torch.Tensor, sel: torch.Tensor | slice, src: torch.Tensor) -> None:
    if isinstance(sel, slice):
        dst[sel] += src
    else:
        dst.index_add_(0, sel, src)


# ------------------------------------------------------------------------------- autograd


class _FusedStrips(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, sched, lse_backward):  # type: ignore[override]
        out, lse = _forward(plan, sched, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.sched, ctx.lse_backward = plan, sched, lse_backward
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        if dlse is not None and bool((dlse != 0).any()):
            dq, dk, dv = ctx.lse_backward(q, k, v, out, lse, dout, dlse)
        elif dout is None:
            return None, None, None, None, None, None
        else:
            dq, dk, dv = _backward(ctx.plan, ctx.sched, q, k, v, out, lse, dout)
        return dq, dk, dv, None, None, None


LseBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def attention(
    plan: AttentionPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_q: int,
    block_k: int,
    cfg: FusedStrips,
    lse_backward: LseBackward,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out (B, H, Nq, Dv), lse (B, H, Nq))` of a plan `reason` accepted, on the layout of
    `block_q × block_k` tiles. `lse_backward(q, k, v, out, lse, dout, dlse) -> (dq, dk, dv)`
    is the exact backward used when the caller differentiates lse."""
    sched = _Schedule(plan, block_q, block_k, cfg)
    return _FusedStrips.apply(q, k, v, plan, sched, lse_backward)
