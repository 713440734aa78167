"""`tiled` backend: FlashAttention-2 written in PyTorch (the steps are in `steps.py`), exact
with O(N) extra memory, forward and backward, for every mask kind, score modifier and dropout.

Blocks chosen per batch element and kv head (`qkv.sparse.select_blocks`) run one (batch
element, kv head) at a time, each over its own kept tiles (`steps.kv_parts`), dropout and score
modifiers included.

Structured masks on the CPU can run their forward, when no gradient will be taken, on torch's
fused C++ flash kernel fed strip by strip (`fused.py`).

It also computes received attention, the column sums of A (`received.py`), for every request.
"""

from __future__ import annotations

import torch

from ...numerics import once_differentiable
from ...plan import AttentionPlan
from ..base import Backend, Result
from . import received as received_op
from .fused import FusedStrips
from .steps import (
    BLOCK_K,
    BLOCK_Q,
    MAX_COLS,
    MAX_ROWS,
    RowStats,
    Tiling,
    backward_loop,
    backward_parts,
    forward_loop,
    forward_parts,
)

# A tiling whose products are narrower than the default's folds a row's keys in more online-
# softmax steps, each a rounding of the float32 accumulator: past NARROW_STEPS of them the
# error outgrows FlashAttention's rule (2× the reference's error; 1-key products on identical
# keys miss it from a few hundred keys on). Such a tiling refuses those float32 requests.
NARROW_STEPS = 64

# Fused strips for packed segments (a Mask with `segments`: document, varlen), such as the whole
# images of a vision encoder, thousands of patches each: strips of up to 2048 rows bring each
# segment to the fused kernel in a few large calls, about as fast as one SDPA call per segment,
# where 64-row strips pay a per-strip cost thousands of times. A strip's window is its segment's
# keys (two segments' where it straddles a boundary), so none runs alone (`wide`) and the
# additive mask of one stays O(2048 · N), never N².
SEGMENT_STRIPS = FusedStrips(rows=2048, wide=1 << 20)

_NO_FUNC = (
    "torch.func transforms (grad, vmap, jacrev, ...) over a score modifier on the tiled backend "
    "are not supported (its backward reuses buffers a transform cannot write into); use "
    "torch.autograd.grad, or backend='reference'"
)


class _ScoreModAttention(torch.autograd.Function):
    """The tiled loop with a score modifier, whose parameters get gradients too: `apply(q, k,
    v, plan, tiling, *params)`, one kv group at a time where the plan's blocks are chosen per
    kv head (`steps.forward_parts`)."""

    @staticmethod
    def forward(q, k, v, plan, tiling, *params):
        out, lse, stats = forward_parts(plan, tiling, q, k, v, forward_loop)
        return out, lse, stats.hi, stats.l

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, plan, tiling, *params = inputs
        _, _, hi, l = output
        ctx.save_for_backward(q, k, v, hi, l, *params)
        ctx.job = (plan, tiling)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(hi, l)

    @staticmethod
    def vmap(info, in_dims, *args):
        raise NotImplementedError(_NO_FUNC)

    @staticmethod
    def backward(ctx, dout, dlse, _dhi, _dl):
        q, k, v, hi, l, *params = ctx.saved_tensors
        stats = RowStats(hi, None, l)
        try:
            with torch.no_grad():
                plan, tiling = ctx.job
                dq, dk, dv, dparams = backward_parts(
                    plan, tiling, q, k, v, stats, dout, dlse, backward_loop
                )
        except NotImplementedError as e:  # torch.func.grad hands the backward its wrappers
            if "TensorWrapper" in str(e):
                raise NotImplementedError(_NO_FUNC) from e
            raise
        grads = once_differentiable("tiled", (dq, dk, dv, *dparams), (q, k, v, *params))
        return *grads[:3], None, None, *grads[3:]


class TiledBackend(Backend):
    """Our FlashAttention-2 in PyTorch.

    `block_q × block_k` is the tile of the layout (the unit that can be skipped); a matrix
    product spans at most `max_rows` query rows (or, in the backward, keys) and `max_cols` keys
    (or queries) when consecutive kept tiles are merged.

    `fused`: for a structured `qkv.masks.Mask` on the CPU, run the forward's kept tiles through
    torch's fused C++ flash kernel, batched over strips of queries (`fused.py`); the gradient
    is this kernel's own backward, which needs the loop's forward: the fused path runs when
    no gradient will be taken (see `fused_reason`). `True` (the default) sizes the strips from
    the problem (`strips_for`: `SEGMENT_STRIPS` for packed segments, else `FusedStrips()`); a
    `FusedStrips` with its knobs sets them; `False` turns the path off. Plans the fused op
    cannot compute exactly (dropout, score modifiers, tensor masks, …) run the loop either
    way."""

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
        self.fused = fused or None  # True: sized from each problem (`strips_for`)

    def __repr__(self) -> str:
        extra = ""
        if self.fused is None:
            extra = ", fused=False"
        elif self.fused is not True:
            extra = f", fused={self.fused!r}"
        return (
            f"TiledBackend({self.block_q}, {self.block_k}, max_rows={self.max_rows}, "
            f"max_cols={self.max_cols}{extra})"
        )

    def fused_reason(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> str | None:
        """None when `forward` takes the fused-strips path, else why it runs the loop."""
        from . import (
            op as tiled_op,  # registers the custom ops at first use: import qkv stays light
        )

        return tiled_op.fused_reason(self.strips_for(plan), plan, q, k, v)

    def strips_for(self, plan: AttentionPlan) -> FusedStrips | None:
        """The fused-strips settings for a plan: the backend's own where it was given some
        (None: `fused=False`), else sized from the problem (`SEGMENT_STRIPS` for a mask of
        packed segments, else the defaults)."""
        if self.fused is not True:
            return self.fused
        rule = plan.pairs.rule
        if rule is not None and rule.segments(plan.q_len, plan.kv_len) is not None:
            return SEGMENT_STRIPS
        return FusedStrips()

    def why_not(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> str | None:
        if plan.return_weights:
            return "tiled never materialises the attention weights (use backend='reference')"
        if (
            plan.pairs.bias is not None
            and plan.pairs.bias.requires_grad
            and torch.is_grad_enabled()
        ):
            return "tiled does not differentiate a float mask (it requires grad)"
        return self._too_narrow(plan)

    def _too_narrow(self, plan: AttentionPlan) -> str | None:
        """Why this tiling's products are too narrow for a float32 request (see NARROW_STEPS)."""
        bk = self.block_k
        width = max(bk, (self.max_cols // bk) * bk)  # keys one product spans (layout._strips)
        steps = -(-plan.kv_len // width)
        if plan.dtype != torch.float32 or width >= MAX_COLS or steps <= NARROW_STEPS:
            return None
        return (
            f"this tiling's products span {width} keys (block_k={bk}, max_cols={self.max_cols}), "
            f"so a row folds its {plan.kv_len} keys in {steps} float32 online-softmax steps, "
            f"more than the {NARROW_STEPS} within which the error stays within 2x the "
            f"reference's; use max_cols >= {-(-plan.kv_len // NARROW_STEPS)} (the default is "
            f"{MAX_COLS}), the default tiling (backend='tiled') or float64 inputs"
        )

    def forward(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> Result:
        if plan.score_mod is None:  # the custom op: torch.compile traces through it
            from . import (
                op as tiled_op,  # registered at first use (also when that is under tracing)
            )

            out, lse = tiled_op.attention(plan, self.tiling, self.strips_for(plan), q, k, v)
            return out, lse, None
        # A score modifier is Python code with learnable tensors: an autograd Function.
        params = plan.score_mod.params
        out, lse, _, _ = _ScoreModAttention.apply(q, k, v, plan, self.tiling, *params)
        return out, lse, None

    def why_not_received(self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor) -> str | None:
        """Received attention runs for every valid plan (any device, dtype and mask)."""
        return None

    def received(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor | None
    ) -> torch.Tensor:
        """The column sums of A, a band of query rows at a time (`received.py`)."""
        return received_op.received(plan, q, k, lse)
