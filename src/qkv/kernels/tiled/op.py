"""The tiled backend as two `torch.library` custom ops, `qkv::tiled_forward` and
`qkv::tiled_backward`, with fake (meta) implementations and vmap rules; `TiledAttention` ties
them together for autograd and torch.func.grad.

`torch.compile` sees each op as one opaque node with known output shapes, so it traces a model
through qkv attention without a graph break, and never looks at the Python loop inside (whose
tile schedule is plain Python ints). Everything an op needs travels as tensors and numbers:
the backend's tiling and fused-strips settings as lists of numbers, the structured `Mask` and
a held `BlockLayout` as small integer handles (`qkv.cache.handle`), so a compiled graph
specialises on them (a new Mask object means a new graph, as a new `BlockMask` does for
FlexAttention).

Blocks chosen per batch element and kv head (`qkv.masks.ChosenBlocks`, from
`qkv.sparse.select_blocks`) run inside the ops one (batch element, kv head) at a time
(`steps.kv_parts`): each group's G query heads and its kv head, as views, over that group's own
kept tiles (not the union over every head), written into whole preallocated results; the
backward likewise. So autograd, torch.compile and vmap see the same two ops and save only the
whole out; dropout draws `qkv.dropout`'s mask exactly, from the whole problem's (b, h).
"""

from __future__ import annotations

import torch

from ...cache import handle, lookup
from ...numerics import once_differentiable
from ...pairs import OpPairs, Pairs
from ...plan import AttentionPlan
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


def _plan(q, k, v, mask, bias, seed, scale, causal, dropout_p, finite, want_grad, rule, held):
    """The plan of an op call, rebuilt from its arguments (validated once by `make_plan`)."""
    B, H, Nq, D = q.shape
    return AttentionPlan(
        batch=B,
        heads=H,
        kv_heads=k.shape[1],
        q_len=Nq,
        kv_len=k.shape[2],
        head_dim=D,
        v_dim=v.shape[-1],
        scale=scale,
        pairs=Pairs.from_op(Nq, k.shape[2], OpPairs(mask, bias, causal, rule, held)),
        score_mod=None,
        dropout_p=dropout_p,
        dropout_seed=seed,
        finite_inputs=finite,
        return_lse=True,
        return_weights=False,
        wants_grad=want_grad,
        input_rank=4,
        dtype=q.dtype,
        device=q.device,
    )


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
    plan = _plan(q, k, v, mask, bias, seed, scale, causal, dropout_p, finite, want_grad, rule, held)
    parts = kv_parts(plan)
    if parts is None:
        out, lse, hi, l = _forward(plan, tiles, cfg, q, k, v, None)
        return out.contiguous(), lse, hi, l
    B, H, Nq = plan.batch, plan.heads, plan.q_len
    results = (
        q.new_empty(B, H, Nq, plan.v_dim),
        *(q.new_empty(B, H, Nq, dtype=_stat_dtype(q)) for _ in range(3)),
    )
    for p in parts:
        got = _forward(p.plan, tiles, cfg, p.rows(q), p.kv(k), p.kv(v), p.origin)
        for whole, part in zip(results, got, strict=True):
            whole[p.b, p.heads] = part[0]
    return results


def _forward(plan: AttentionPlan, tiles: Tiling, cfg: FusedStrips | None, q, k, v, origin):
    """`forward_impl`'s results for one problem (a whole plan or a `Part`'s)."""
    if fused_reason(cfg, plan, q, k, v) is None:  # no gradient: torch's fused op, in strips
        sched = fused_mod.schedule(plan, tiles.block_q, tiles.block_k, cfg)
        out, lse = fused_mod.forward(plan, sched, q, k, v)
        stats = RowStats.from_lse(lse, plan.compute_dtype)
        return out, lse, stats.hi, torch.ones_like(stats.hi)
    out, lse, stats = forward_loop(TileProblem(plan, q, tiles, origin), q, k, v)
    return out, lse, stats.hi, stats.l


tiled_forward = torch.library.custom_op("qkv::tiled_forward", forward_impl, mutates_args=())


@tiled_forward.register_fake
def _(q, k, v, mask, bias, seed, *args):
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
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor,
    scale: float,
    causal: bool,
    dropout_p: float,
    finite: bool,
    rule: int,
    held: int,
    tiling: list[int],
    fused: list[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(dq, dk, dv)` of `tiled_forward`'s out and lse."""
    plan = _plan(q, k, v, mask, bias, seed, scale, causal, dropout_p, finite, True, rule, held)
    stats = RowStats(row_max, None, row_sum)
    tiles = _settings(tiling, fused)[0]
    dq, dk, dv, _ = backward_parts(plan, tiles, q, k, v, stats, dout, dlse, backward_loop)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


tiled_backward = torch.library.custom_op("qkv::tiled_backward", backward_impl, mutates_args=())


@tiled_backward.register_fake
def _(q, k, v, mask, bias, seed, row_max, row_sum, dout, dlse, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class TiledAttention(torch.autograd.Function):
    """Autograd (and torch.func) around the two ops: `apply(q, k, v, mask, bias, seed, scale,
    causal, dropout_p, finite, want_grad, rule, held, tiling, fused)` → `(out, lse)`."""

    generate_vmap_rule = True  # the ops' own vmap rules fold the mapped dim into the batch

    @staticmethod
    def forward(q, k, v, mask, bias, seed, *args):  # type: ignore[override]
        return tiled_forward(q, k, v, mask, bias, seed, *args)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        q, k, v, mask, bias, seed, scale, causal, dropout_p, finite, _, rule, held, *cfg = inputs
        _, _, row_max, row_sum = output
        ctx.save_for_backward(q, k, v, mask, bias, seed, row_max, row_sum)
        ctx.args = (scale, causal, dropout_p, finite, rule, held, *cfg)
        ctx.not_differentiable = len(inputs) - 3  # all but q, k, v
        if not torch.compiler.is_compiling():  # eager: the Mask lives until the backward
            ctx.alive = (lookup(rule), lookup(held))
        ctx.mark_non_differentiable(row_max, row_sum)

    @staticmethod
    def backward(ctx, dout, dlse, _drow_max, _drow_sum):  # type: ignore[override]
        q, k, v, mask, bias, seed, row_max, row_sum = ctx.saved_tensors
        with torch.no_grad():
            if dout is None:
                dout = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
            if dlse is None:
                dlse = torch.zeros_like(row_max)
            stats = (row_max, row_sum)
            grads = tiled_backward(q, k, v, mask, bias, seed, *stats, dout, dlse, *ctx.args)
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


@tiled_forward.register_vmap
def _(info, in_dims, q, k, v, mask, bias, seed, *rest):
    if in_dims[5] is not None:
        raise NotImplementedError("qkv: vmap over a batch of dropout seeds is not supported")
    size, batch = info.batch_size, _batch_of(q, in_dims[0])
    tensors = (q, k, v, mask, bias)
    folded = [_fold(x, d, size, batch) for x, d in zip(tensors, in_dims[:5], strict=True)]
    outs = tiled_forward(*folded, seed, *rest)
    return tuple(_unfold(o, size) for o in outs), (0, 0, 0, 0)


@tiled_backward.register_vmap
def _(info, in_dims, q, k, v, mask, bias, seed, row_max, row_sum, dout, dlse, *rest):
    if in_dims[5] is not None:
        raise NotImplementedError("qkv: vmap over a batch of dropout seeds is not supported")
    size, batch = info.batch_size, _batch_of(q, in_dims[0])
    tensors = (q, k, v, mask, bias)
    folded = [_fold(x, d, size, batch) for x, d in zip(tensors, in_dims[:5], strict=True)]
    stats = [
        _fold(x, d, size, batch)
        for x, d in zip((row_max, row_sum, dout, dlse), in_dims[6:10], strict=True)
    ]
    outs = tiled_backward(*folded, seed, *stats, *rest)
    return tuple(_unfold(o, size) for o in outs), (0, 0, 0)


def attention(
    plan: AttentionPlan, tiling: Tiling, cfg: FusedStrips | None, q, k, v
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, lse)` of a plan without a score modifier, through the custom op."""
    seed = plan.dropout_seed
    if seed is not None and not isinstance(seed, torch.Tensor):
        seed = torch.tensor(seed, dtype=torch.int64, device=q.device)
    # Without a gradient, the op alone (Function.apply binds its arguments on every call).
    call = TiledAttention.apply if plan.wants_grad else tiled_forward
    out, lse, _, _ = call(
        q,
        k,
        v,
        plan.pairs.mask,
        plan.pairs.bias,
        seed,
        plan.scale,
        plan.pairs.causal,
        plan.dropout_p,
        plan.finite_inputs,
        plan.wants_grad,
        handle(plan.pairs.rule),
        handle(plan.pairs.layout),
        [tiling.block_q, tiling.block_k, tiling.max_rows, tiling.max_cols],
        [] if cfg is None else [cfg.rows, cfg.waste, cfg.wide, cfg.budget, cfg.mask_cache],
    )
    return out, lse
