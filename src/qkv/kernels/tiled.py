"""`tiled` backend: FlashAttention-2 written in PyTorch (the steps are in `steps.py`), exact
with O(N) extra memory, forward and backward, for every mask kind, score modifier and dropout.

Structured masks on the CPU can run their forward, when no gradient will be taken, on torch's
fused C++ flash kernel fed strip by strip (`fused.py`).
"""

from __future__ import annotations

import torch

from ..numerics import no_double_backward
from ..plan import AttentionPlan
from . import fused as fused_mod
from .base import Result
from .fused import FusedStrips
from .steps import (
    BLOCK_K,
    BLOCK_Q,
    MAX_COLS,
    MAX_ROWS,
    RowStats,
    TileProblem,
    Tiling,
    backward_loop,
    forward_loop,
)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tiles, sched, *params):  # type: ignore[override]
        if sched is not None:
            out, lse = fused_mod.forward(tiles.plan, sched, q, k, v)
            stats = RowStats.from_lse(lse, tiles.cdt)
        else:
            out, lse, stats = forward_loop(tiles, q, k, v)
        ctx.save_for_backward(q, k, v, stats.hi, stats.lo, stats.l)
        ctx.tiles = tiles
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # type: ignore[override]
        no_double_backward("tiled")
        q, k, v, hi, lo, l = ctx.saved_tensors
        dq, dk, dv, dparams = backward_loop(ctx.tiles, q, k, v, RowStats(hi, lo, l), dout, dlse)
        return dq, dk, dv, None, None, *dparams


class TiledBackend:
    """Our FlashAttention-2 in PyTorch.

    `block_q × block_k` is the tile of the layout (the unit that can be skipped); a matrix
    product spans at most `max_rows` query rows (or, in the backward, keys) and `max_cols` keys
    (or queries) when consecutive kept tiles are merged.

    `fused`: for a structured `qkv.masks.Mask` on the CPU, run the forward's kept tiles through
    torch's fused C++ flash kernel, batched over strips of queries (`fused.py`); the gradient
    is this kernel's own backward, which needs the loop's forward: the fused path runs when
    no gradient will be taken (see `fused_reason`). `True` (the default) or a `FusedStrips` with its
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
        self.tiling = Tiling(block_q, block_k, max_rows, max_cols)
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
        if plan.wants_grad:
            return (
                "gradients: the loop's forward keeps what its backward needs (each row's max and "
                "softmax denominator); the fused op's float32 lse put float32 gradients beyond "
                "the error bound"
            )
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
        tiles = TileProblem(plan, q, self.tiling)
        out, lse = _TiledAttention.apply(q, k, v, tiles, sched, *params)
        return out, lse, None
