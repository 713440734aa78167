"""The compiled CPU kernel as two `torch.library` custom ops, `qkv::cpu_forward` and
`qkv::cpu_backward`, with fake (meta) implementations; `CpuAttention` ties them together for
autograd.

The C++ ops (`torch.ops.qkv_cpu.forward` / `backward`, registered by `cpu/csrc/ops.cpp`) read
the kernel's block layout as tensors. Building that layout is Python (`qkv.layout` and qkv's
cache), so it happens inside these ops, never in a traced graph: `torch.compile` sees each op
as one opaque node with known output shapes and traces a model through the kernel without a
graph break. Every op takes `(q, k, v, *op_plan, ...)`, as the tiled ops do: the problem as the
plan's `qkv.plan.OpPlan` (tensors, numbers and `qkv.cache.handle`s, so a compiled graph
specialises on a Mask; the dropout seed a tensor read inside the op, no host read in the
graph), read back inside by `OpPlan.pairs`, then what is its own: the backward's saved results,
and the kernel's settings (`CpuSettings`).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from ...numerics import once_differentiable
from ...pairs import Pairs
from ...plan import OpPlan
from . import load
from .tile_encoding import CpuLayout, chosen_forward, chosen_layouts, joined, kernel_layout


class CpuSettings(NamedTuple):
    """The kernel's own arguments, after the `OpPlan`'s, in the ops' order: build them by name,
    read them by name."""

    slopes: torch.Tensor | None  # ALiBi's, float32, one per query head
    softcap: float  # 0: none
    alibi_after: bool  # ALiBi added after the softcap
    block_q: int  # query rows per tile
    precise_scores: bool  # see `precise_scores`
    isa: str  # the instruction-set path


_FIELDS = len(OpPlan._fields)  # the op plan's arguments, after (q, k, v)


def forward_layout(pairs: Pairs, batch: int, kv_heads: int, block_q: int) -> CpuLayout:
    """What the forward reads: the problem's one layout, or, for blocks chosen per (b, kv
    head) (`Pairs.kv_choice`), each group's own tile lists back to back (one call, each group
    over its own tiles)."""
    choice = pairs.kv_choice(batch, kv_heads)
    if choice is None:
        return kernel_layout(pairs, block_q)
    built = chosen_forward(pairs, choice, block_q)
    if built is not None:
        return built
    groups = pairs.kv_groups(batch, kv_heads)
    assert groups is not None  # there is a choice per group
    return joined([kernel_layout(one, block_q) for *_, one in groups])


def group_layouts(pairs: Pairs, batch: int, kv_heads: int, block_q: int) -> list[CpuLayout]:
    """The backward's tile lists of each (b, kv head) of blocks chosen per group
    (`Pairs.kv_groups` order): all at once from the block lists where they are whole tiles,
    else each group's own `kernel_layout`."""
    choice = pairs.kv_choice(batch, kv_heads)
    assert choice is not None  # called for a choice per group only
    built = chosen_layouts(pairs, choice, block_q)
    if built is not None:
        return built
    groups = pairs.kv_groups(batch, kv_heads)
    assert groups is not None  # there is a choice per group
    return [kernel_layout(one, block_q) for *_, one in groups]


def _group(q, k, v, slopes, b: int, g: int):
    """The tensors of batch element b, kv head g: its G query heads (views, no copy)."""
    heads = slice(g * (q.shape[1] // k.shape[1]), (g + 1) * (q.shape[1] // k.shape[1]))
    one = slice(b, b + 1)
    return (
        heads,
        q[one, heads],
        k[one, g : g + 1],
        v[one, g : g + 1],
        (None if slopes is None else slopes[heads]),
    )


@torch.compiler.assume_constant_result  # a compiled graph keeps the setting it was traced under
def precise_scores() -> bool:
    """Whether float32 scores are precise: float chains of 16 products summed in double, at
    torch's default float32 matmul precision, "highest". Under
    `torch.set_float32_matmul_precision("high")` (or "medium"), which lets torch's own float32
    matmuls round more, the scores are one float gemm like torch's kernels: a few percent
    faster, within the same error rule but with less margin under it (docs/cpu.md, "Accuracy")."""
    return torch.get_float32_matmul_precision() == "highest"


def _seed(seed: torch.Tensor | None) -> int:
    return 0 if seed is None else int(seed)


INTERRUPTED = "qkv_cpu: interrupted by SIGINT"  # csrc/interrupt.h's message


@contextlib.contextmanager
def _interruptible():
    """Ctrl-C during a kernel call: the kernel stops handing out items, hands SIGINT back to the
    process's handler (Python's raises KeyboardInterrupt at the next line of Python) and fails
    with INTERRUPTED; that failure is KeyboardInterrupt here, should the handler not raise."""
    try:
        yield
    except RuntimeError as e:
        if INTERRUPTED not in str(e):
            raise
        raise KeyboardInterrupt from None


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
    slopes: torch.Tensor | None,
    softcap: float,
    alibi_after: bool,
    block_q: int,
    precise_scores: bool,
    isa: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(out, lse, m, l)`: each row's max m (float32) and denominator l (float64) are what the
    backward needs. `precise_scores`: float32 scores in float chains summed in double (else one
    float sum)."""
    op = OpPlan(mask, bias, seed, scale, causal, dropout_p, finite, want_grad, rule, held)
    pairs = op.pairs(q.shape[2], k.shape[2])
    settings = (softcap, alibi_after, dropout_p, _seed(seed), precise_scores, isa)

    def run(L, q, k, v, slopes):
        with _interruptible():
            return load().forward(
                q, k, v, L.row_ptr, L.col_idx, L.code, L.bits, L.q_starts, L.k_starts,
                L.block_q, scale, slopes, *settings,
            )  # fmt: skip

    L = forward_layout(pairs, q.shape[0], k.shape[1], block_q)
    out, m, l, lse = run(L, q, k, v, slopes)
    return out, lse, m, l


cpu_forward = torch.library.custom_op("qkv::cpu_forward", forward_impl, mutates_args=())


@cpu_forward.register_fake
def _(q, k, v, *args):
    B, H, Nq, _ = q.shape
    return (
        q.new_empty(B, H, Nq, v.shape[-1]),
        q.new_empty(B, H, Nq, dtype=torch.float32),
        q.new_empty(B, H, Nq, dtype=torch.float32),
        q.new_empty(B, H, Nq, dtype=torch.float64),
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
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    out: torch.Tensor,
    m: torch.Tensor,
    l: torch.Tensor,
    slopes: torch.Tensor | None,
    softcap: float,
    alibi_after: bool,
    block_q: int,
    precise_scores: bool,
    isa: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(dq, dk, dv)` of `cpu_forward`'s out and lse, for the forward's `OpPlan`."""
    op = OpPlan(mask, bias, seed, scale, causal, dropout_p, finite, want_grad, rule, held)
    pairs = op.pairs(q.shape[2], k.shape[2])
    settings = (softcap, alibi_after, dropout_p, _seed(seed), precise_scores, isa)

    def run(L, dout, dlse, q, k, v, out, m, l, slopes):
        with _interruptible():
            return load().backward(
                dout, dlse, q, k, v, out, m, l, L.row_ptr, L.col_idx, L.code, L.col_ptr,
                L.row_idx, L.code_t, L.bits, L.q_starts, L.k_starts, L.block_q, scale, slopes,
                *settings,
            )  # fmt: skip

    groups = pairs.kv_groups(q.shape[0], k.shape[1])
    if groups is None:
        return run(kernel_layout(pairs, block_q), dout, dlse, q, k, v, out, m, l, slopes)
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    layouts = group_layouts(pairs, q.shape[0], k.shape[1], block_q)
    for (b, g, _), L in zip(groups, layouts, strict=True):
        heads, qg, kg, vg, sg = _group(q, k, v, slopes, b, g)
        rows = [None if t is None else t[b : b + 1, heads] for t in (dout, dlse, out, m, l)]
        gq, gk, gv = run(L, rows[0], rows[1], qg, kg, vg, rows[2], rows[3], rows[4], sg)
        dq[b, heads], dk[b, g], dv[b, g] = gq[0], gk[0, 0], gv[0, 0]
        del gq, gk, gv  # back to the kernel's kept results before the next group's call
    return dq, dk, dv


cpu_backward = torch.library.custom_op("qkv::cpu_backward", backward_impl, mutates_args=())


@cpu_backward.register_fake
def _(q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class CpuAttention(torch.autograd.Function):
    """Autograd around the two ops: `apply(q, k, v, *op_plan, *CpuSettings(...),
    backward_block_q)` → `(out, lse, m, l)`. The backward tiles the queries by
    `backward_block_q` rows: a score has the same bits whatever its tile, so the backward
    recomputes the forward's weights exactly."""

    @staticmethod
    def forward(q, k, v, *args):
        return cpu_forward(q, k, v, *args[:-1])

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, *rest, backward_block_q = inputs
        op, settings = OpPlan(*rest[:_FIELDS]), CpuSettings(*rest[_FIELDS:])
        out, _, m, l = output
        ctx.save_for_backward(q, k, v, out, m, l, op.mask, op.bias, op.seed, settings.slopes)
        ctx.op = op._replace(mask=None, bias=None, seed=None)  # its tensors are saved above
        ctx.settings = settings._replace(slopes=None, block_q=backward_block_q)
        ctx.not_differentiable = len(inputs) - 3  # all but q, k, v
        if not torch.compiler.is_compiling():  # eager: the Mask lives until the backward
            ctx.alive = op.alive()
        ctx.mark_non_differentiable(m, l)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout, dlse, _dm, _dl):
        q, k, v, out, m, l, mask, bias, seed, slopes = ctx.saved_tensors
        op = ctx.op._replace(mask=mask, bias=bias, seed=seed)
        settings = ctx.settings._replace(slopes=slopes)
        with torch.no_grad():
            if dout is None:
                dout = torch.zeros_like(out)
            grads = cpu_backward(q, k, v, *op, dout, dlse, out, m, l, *settings)
        return *once_differentiable("cpu", grads, (q, k, v)), *([None] * ctx.not_differentiable)
