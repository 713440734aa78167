"""The tiled backend as two `torch.library` custom ops, `qkv::tiled_forward` and
`qkv::tiled_backward`, with fake (meta) implementations and vmap rules; `TiledAttention` ties
them together for autograd and torch.func.grad.

`torch.compile` sees each op as one opaque node with known output shapes, so it traces a model
through qkv attention without a graph break, and never looks at the Python loop inside (whose
tile schedule is plain Python ints). Every op takes `(q, k, v, *op_plan, ...)`: the problem as
the plan's `qkv.plan.OpPlan` (tensors, numbers and `qkv.cache.handle`s, so a compiled graph
specialises on a Mask), read back inside by `OpPlan.plan`, then what is its own: the backward's
saved rows, and the backend's tiling and fused-strips settings as lists of numbers.

Blocks chosen per batch element and kv head (`qkv.masks.ChosenBlocks`, from
`qkv.sparse.select_blocks`) run inside the ops one (batch element, kv head) at a time
(`steps.kv_parts`): each group's G query heads and its kv head, as views, over that group's own
kept tiles (not the union over every head), written into whole preallocated results; the
backward likewise. So autograd, torch.compile and vmap see the same two ops and save only the
whole out; dropout draws `qkv.dropout`'s mask exactly, from the whole problem's (b, h).
"""

from __future__ import annotations

import torch

from ...numerics import once_differentiable
from ...plan import AttentionPlan, OpPlan
from . import fused as fused_mod
from .fused import FusedStrips
from .steps import (
    RowStats,
    TileProblem,
    Tiling,
    backward_loop,
    backward_parts,
    forward_loop,
    kv_parts,
)

_FIELDS = len(OpPlan._fields)  # the op plan's arguments, after (q, k, v)


def _settings(tiling: list[int], fused: list[float]) -> tuple[Tiling, FusedStrips | None]:
    if not fused:
        return Tiling(*tiling), None
    rows, waste, wide, budget, mask_cache = fused
    return Tiling(*tiling), FusedStrips(int(rows), waste, int(wide), int(budget), int(mask_cache))


def fused_reason(cfg: FusedStrips | None, plan: AttentionPlan, q, k, v) -> str | None:
    """None when the forward takes the fused-strips path, else why it runs the loop."""
    if cfg is None:
        return "fused=False"
    if plan.wants_grad:
        return (
            "gradients: the loop's forward keeps what its backward needs (each row's max and "
            "softmax denominator); the fused op's float32 lse put float32 gradients beyond "
            "the error bound"
        )
    return fused_mod.reason(plan, q, k, v)


def _stat_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def forward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    seed: torch.Tensor | None,
    scale: float,
    causal: bool,
    dropout_p: float,
    finite: bool,
    want_grad: bool,
    rule: int,
    held: int,
    tiling: list[int],
    fused: list[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(out, lse, row max, row sum)`: the last two are what the backward needs. Blocks
    chosen per kv head run one (batch element, kv head) at a time, each over its own kept
    tiles (`steps.kv_parts`), into the whole results."""
    tiles, cfg = _settings(tiling, fused)
    op = OpPlan(mask, bias, seed, scale, causal, dropout_p, finite, want_grad, rule, held)
    plan = op.plan(q, k, v)
    parts = kv_parts(plan)
    if parts is None:
        out, lse, hi, l = _forward(plan, tiles, cfg, q, k, v, None)
        return out.contiguous(), lse, hi, l
    B, H, Nq = plan.batch, plan.heads, plan.q_len
    stat = _stat_dtype(q)
    results = (
        q.new_empty(B, H, Nq, plan.v_dim),
        q.new_empty(B, H, Nq, dtype=stat),
        q.new_empty(B, H, Nq, dtype=stat),
        q.new_empty(B, H, Nq, dtype=stat),
    )
    for p in parts:
        got = _forward(p.plan, tiles, cfg, p.rows(q), p.kv(k), p.kv(v), p.origin)
        for whole, part in zip(results, got, strict=True):
            whole[p.b, p.heads] = part[0]
    return results


def _forward(plan: AttentionPlan, tiles: Tiling, cfg: FusedStrips | None, q, k, v, origin):
    """`forward_impl`'s results for one problem (a whole plan or a `Part`'s)."""
    if fused_reason(cfg, plan, q, k, v) is None:  # no gradient: torch's fused op, in strips
        assert cfg is not None  # fused_reason refuses a backend without fused strips
        sched = fused_mod.schedule(plan, tiles.block_q, tiles.block_k, cfg)
        out, lse = fused_mod.forward(plan, sched, q, k, v)
        stats = RowStats.from_lse(lse, plan.compute_dtype)
        return out, lse, stats.hi, torch.ones_like(stats.hi)
    out, lse, stats = forward_loop(TileProblem(plan, q, tiles, origin), q, k, v)
    return out, lse, stats.hi, stats.l


tiled_forward = torch.library.custom_op("qkv::tiled_forward", forward_impl, mutates_args=())


@tiled_forward.register_fake
def _(q, k, v, *args):
    B, H, Nq, _ = q.shape
    rows = (B, H, Nq)
    cdt = _stat_dtype(q)
    return (
        q.new_empty(B, H, Nq, v.shape[-1]),
        q.new_empty(rows, dtype=cdt),
        q.new_empty(rows, dtype=cdt),
        q.new_empty(rows, dtype=cdt),
    )


def backward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    seed: torch.Tensor | None,
    scale: float,
    causal: bool,
    dropout_p: float,
    finite: bool,
    want_grad: bool,
    rule: int,
    held: int,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor,
    tiling: list[int],
    fused: list[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(dq, dk, dv)` of `tiled_forward`'s out and lse, for the forward's `OpPlan`."""
    op = OpPlan(mask, bias, seed, scale, causal, dropout_p, finite, want_grad, rule, held)
    plan = op.plan(q, k, v)
    stats = RowStats(row_max, None, row_sum)
    tiles = _settings(tiling, fused)[0]
    dq, dk, dv, _ = backward_parts(plan, tiles, q, k, v, stats, dout, dlse, backward_loop)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


tiled_backward = torch.library.custom_op("qkv::tiled_backward", backward_impl, mutates_args=())


@tiled_backward.register_fake
def _(q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class TiledAttention(torch.autograd.Function):
    """Autograd (and torch.func) around the two ops: `apply(q, k, v, *op_plan, tiling, fused)`
    → `(out, lse, row max, row sum)`."""

    generate_vmap_rule = True  # the ops' own vmap rules fold the mapped dim into the batch

    @staticmethod
    def forward(q, k, v, *args):
        return tiled_forward(q, k, v, *args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, *rest = inputs
        op = OpPlan(*rest[:_FIELDS])
        _, _, row_max, row_sum = output
        ctx.save_for_backward(q, k, v, op.mask, op.bias, op.seed, row_max, row_sum)
        ctx.op = op._replace(mask=None, bias=None, seed=None)  # its tensors are saved above
        ctx.cfg = rest[_FIELDS:]
        ctx.not_differentiable = len(inputs) - 3  # all but q, k, v
        if not torch.compiler.is_compiling():  # eager: the Mask lives until the backward
            ctx.alive = op.alive()
        ctx.mark_non_differentiable(row_max, row_sum)

    @staticmethod
    def backward(ctx, dout, dlse, _drow_max, _drow_sum):
        q, k, v, mask, bias, seed, row_max, row_sum = ctx.saved_tensors
        op = ctx.op._replace(mask=mask, bias=bias, seed=seed)
        with torch.no_grad():
            if dout is None:
                dout = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
            if dlse is None:
                dlse = torch.zeros_like(row_max)
            stats = (row_max, row_sum)
            grads = tiled_backward(q, k, v, *op, *stats, dout, dlse, *ctx.cfg)
        return *once_differentiable("tiled", grads, (q, k, v)), *([None] * ctx.not_differentiable)


# -- vmap: fold the mapped dimension into the batch ---------------------------------------------
def _fold(x: torch.Tensor | None, dim: int | None, size: int, batch: int) -> torch.Tensor | None:
    """`x` with its mapped dim (or a broadcast one) first, folded into dim 0: `(size·batch, …)`."""
    if x is None:
        return None
    x = x.unsqueeze(0) if dim is None else x.movedim(dim, 0)
    x = x.expand(size, batch, *x.shape[2:])
    return x.reshape(size * batch, *x.shape[2:])


def _unfold(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.reshape(size, x.shape[0] // size, *x.shape[1:])


def _batch_of(x: torch.Tensor, dim: int | None) -> int:
    return x.shape[0] if dim is None else x.movedim(dim, 0).shape[1]


def _fold_problem(info, in_dims, q, k, v, op: OpPlan) -> tuple[int, int, list, OpPlan]:
    """`(size, batch, [q, k, v] folded, op_plan with its mask and bias folded)`."""
    dims = dict(zip(OpPlan._fields, in_dims[3 : 3 + _FIELDS], strict=True))  # mapped dims
    if dims["seed"] is not None:
        raise NotImplementedError("qkv: vmap over a batch of dropout seeds is not supported")
    size, batch = info.batch_size, _batch_of(q, in_dims[0])
    qkv = [_fold(x, d, size, batch) for x, d in zip((q, k, v), in_dims[:3], strict=True)]
    mask, bias = (
        _fold(op.mask, dims["mask"], size, batch),
        _fold(op.bias, dims["bias"], size, batch),
    )
    return size, batch, qkv, op._replace(mask=mask, bias=bias)


@tiled_forward.register_vmap
def _(info, in_dims, q, k, v, *rest):
    op = OpPlan(*rest[:_FIELDS])
    size, _, qkv, op = _fold_problem(info, in_dims, q, k, v, op)
    outs = tiled_forward(*qkv, *op, *rest[_FIELDS:])
    return tuple(_unfold(o, size) for o in outs), (0, 0, 0, 0)


@tiled_backward.register_vmap
def _(info, in_dims, q, k, v, *rest):
    op = OpPlan(*rest[:_FIELDS])
    size, batch, qkv, op = _fold_problem(info, in_dims, q, k, v, op)
    stats_at = 3 + _FIELDS  # row_max, row_sum, dout, dlse
    stats = [
        _fold(x, d, size, batch)
        for x, d in zip(rest[_FIELDS : _FIELDS + 4], in_dims[stats_at : stats_at + 4], strict=True)
    ]
    outs = tiled_backward(*qkv, *op, *stats, *rest[_FIELDS + 4 :])
    return tuple(_unfold(o, size) for o in outs), (0, 0, 0)


def attention(
    plan: AttentionPlan, tiling: Tiling, cfg: FusedStrips | None, q, k, v
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, lse)` of a plan without a score modifier, through the custom op."""
    # Without a gradient, the op alone (Function.apply binds its arguments on every call).
    call = TiledAttention.apply if plan.wants_grad else tiled_forward
    out, lse, _, _ = call(
        q,
        k,
        v,
        *plan.op_plan(),
        [tiling.block_q, tiling.block_k, tiling.max_rows, tiling.max_cols],
        [] if cfg is None else [cfg.rows, cfg.waste, cfg.wide, cfg.budget, cfg.mask_cache],
    )
    return out, lse
