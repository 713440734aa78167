"""`cpu` backend: qkv's compiled block-sparse FlashAttention-2 for the CPU (C++, `kernels/cpu/`).

The same algorithm as `tiled` (which stays the readable reference of it), compiled: the forward
walks the kept `block_q × 64` tiles of the block layout (`qkv.layout`, re-encoded with the
PARTIAL tiles' bits by `cpu/tile_encoding.py`) row by row and saves
each row's max m and denominator l; the backward walks them column by column and recomputes the
probabilities from (m, l). EMPTY tiles are never computed, FULL tiles run with no mask
arithmetic, PARTIAL tiles are masked by their bits. Grouped kv heads are read once per group;
ALiBi and softcap run inside the tiles; dropout uses `qkv.dropout`'s counter-based hash, so it
drops exactly what the reference backend drops. Products accumulate in float (≤ 64 terms per
tile) and across tiles in double, which makes the kernel more accurate than the float32
reference; the forward and the backward compute every score with the same instructions.

Threads: torch's intra-op pool (`torch.set_num_threads` holds), one parallel region per call,
items pulled from a shared counter, so a busy core slows a call by its share only. Rows of tiles
(forward) and chunks of key columns (backward) are cut finely enough to keep every thread busy
even for B·H = 1; a few long rows (decoding: Nq ≤ 16 against a long KV cache) are split across
threads and merged by their log-sum-exp.

Masked-out keys are kept out of every row without the caller's `finite_inputs` promise, with no
host sync: in PARTIAL tiles the mask selects −inf in place of the score (a NaN score of a
masked key is replaced, never added to), keys past Nk are never loaded, and P·V runs a
zero-skipping product for a V tile that holds NaN/inf (checked in the kernel while it reads the
tile), so 0·NaN never reaches a row; the backward zeroes non-finite K/V entries of the tiles it
packs. Fully masked rows give output 0, lse −inf and zero gradients.

What it refuses (`why_not`), each with its reason: float64 (it computes in float32; tiled runs
float64), returned weights, float masks (additive bias), score modifiers other than ALiBi and
softcap (relative_bias has a learnable table; a Python modifier cannot be compiled), tensors not
on the CPU, and a kernel that could not be built (no compiler: see `qkv build`).
"""

from __future__ import annotations

import os

import torch

from ...plan import AttentionPlan
from ..base import Backend, Result
from . import crossover
from .build import KernelUnavailable, load
from .isa import ENV as ISA_ENV
from .isa import choose as choose_isa

# fp16/bf16/fp32 inputs; everything accumulates in float32/float64 inside
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# Query rows per tile, measured by pairs of calls (docs/cpu.md, Measurements behind the code):
# 256 rows against 128 were faster in the dense and causal forward and in the dense forward +
# backward, slower in the causal backward; a mask's 64 rows against 128 were faster in the
# sliding window's forward + backward. Under GQA the backward's tiles of 128 rows ran forward +
# backward well ahead of the 16 the forward's rule gives them.
def default_block_q(groups: int, masked: bool, causal: bool = False, backward: bool = False) -> int:
    """Query rows per tile: 64 with a mask (finer skipping); without one 256 (dense and causal:
    each packed key tile serves more rows), except the causal backward's 128 (it computes its
    diagonal tiles whole); in the forward fewer when G query heads share a kv head (an item's
    rows are the tile's rows of all G heads), but at least 16. The backward's products take one
    head's rows at a time, so its tiles keep their rows whatever G."""
    rows = 64 if masked else 128 if causal and backward else 256
    bq = rows
    while not backward and bq > 16 and bq * groups > rows:
        bq //= 2
    return bq


def _mods(plan: AttentionPlan) -> tuple[tuple[torch.Tensor | None, float, bool] | None, str | None]:
    """`((slopes, softcap, alibi_after_softcap), None)` for the kernel, or `(None, reason)`."""
    mod = plan.score_mod
    if mod is None:
        return (None, 0.0, False), None
    if mod.parts is None:
        return None, (
            f"score_mod {mod!r} is Python code the compiled kernel cannot run (it runs alibi and "
            "softcap from qkv.scores; tiled runs any modifier)"
        )
    slopes, cap, after = None, 0.0, False
    for part in mod.parts:
        if part[0] == "alibi" and slopes is None:
            slopes, after = part[1], cap != 0.0
        elif part[0] == "softcap" and cap == 0.0:
            cap = float(part[1])
        elif part[0] == "rel":
            return None, "relative_bias has a learnable table the compiled kernel does not train"
        else:
            return None, f"the compiled kernel runs at most one {part[0]} modifier"
    return (slopes, cap, after), None


def kernel_status() -> tuple[str | None, str | None]:
    """`(isa, None)`: the compiled kernel is loaded (built on first use) and runs that
    instruction-set path; `(None, reason)` when it cannot run. torch.compile calls it while
    tracing and keeps the answer as a constant of the graph (`QKV_CPU_ISA` is read then).
    A path that runs is remembered per value of `QKV_CPU_ISA` (asked on every call)."""
    wanted = os.environ.get(ISA_ENV, "")
    found = _RUNS.get(wanted)
    if found is not None:
        return found
    try:
        ops = load()
    except KernelUnavailable as err:
        return None, f"the compiled CPU kernel is unavailable: {err} (see `qkv build`)"
    status = choose_isa(ops)
    if status[0] is not None:
        _RUNS[wanted] = status
    return status


_RUNS: dict[str, tuple[str | None, str | None]] = {}  # QKV_CPU_ISA's value -> (path, None)


# What `torch.compiler.assume_constant_result(kernel_status)` does, without importing
# torch._dynamo at `import qkv` (as `qkv.cache.handle` does).
kernel_status._dynamo_marked_constant = True  # type: ignore[attr-defined]  # dynamo's marker


class CpuBackend(Backend):
    """qkv's compiled CPU kernel (module docstring). `block_q`: query rows per tile, forward and
    backward (default `default_block_q`); a tile is always 64 keys wide."""

    name = "cpu"

    def __init__(self, block_q: int | None = None):
        if block_q is not None and (
            isinstance(block_q, bool) or not isinstance(block_q, int) or block_q < 1
        ):
            raise ValueError(f"block_q must be a positive int or None, got {block_q!r}")
        self.block_q = block_q

    def __repr__(self) -> str:
        return "CpuBackend()" if self.block_q is None else f"CpuBackend(block_q={self.block_q})"

    def why_not(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> str | None:
        if plan.device.type != "cpu":
            return f"tensors are on {plan.device}; the cpu backend runs on CPU tensors"
        if plan.dtype not in DTYPES:
            return (
                f"the compiled CPU kernel computes float32 (from fp32/bf16/fp16 inputs), "
                f"not {plan.dtype}; tiled runs it"
            )
        if plan.return_weights:
            return "the cpu backend never materialises the attention weights (use 'reference')"
        if plan.pairs.bias is not None:
            return "a float mask (additive bias) is not read by the compiled kernel; tiled takes it"
        _, why = _mods(plan)
        if why is not None:
            return why
        if plan.dropout_p > 0 and plan.pairs.kv_groups(plan.batch, plan.kv_heads) is not None:
            return (
                "dropout over blocks chosen per kv head: the kernel runs one head group at a "
                "time and would draw another mask than qkv.dropout's (tiled runs it)"
            )
        return kernel_status()[1]

    def crossover(self, rival: str, plan: AttentionPlan) -> tuple[str, str] | None:
        """`(winner, why)` between this kernel and torch SDPA from this machine's table
        (`cpu.crossover`); None against any other backend (nothing measured)."""
        isa = kernel_status()[0] if rival == "sdpa" else None
        return None if isa is None else crossover.decide(plan, isa)

    def crossover_basis(self, rival: str) -> str | None:
        """Which crossover table decides between this kernel and SDPA (calibrated / default)."""
        isa = kernel_status()[0] if rival == "sdpa" else None
        return None if isa is None else crossover.basis(isa)

    def dispatch_state(self) -> tuple:
        """The forced instruction-set path (`QKV_CPU_ISA`) and the generation of the crossover
        tables (`cpu.crossover.clear()` starts a new one)."""
        return os.environ.get(ISA_ENV, ""), crossover.generation()

    def forward(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> Result:
        from . import op as cpu_op
        from .tile_encoding import BLOCK_K

        isa, why = kernel_status()
        if why is None:
            mods, why = _mods(plan)
        if why is not None:
            raise NotImplementedError(f"backend='cpu' cannot run this request: {why}")
        assert isa is not None and mods is not None  # no reason: both were found
        slopes, softcap, alibi_after = mods
        masked = plan.pairs.mask is not None or plan.pairs.rule is not None
        bq = self.block_q or default_block_q(plan.groups, masked, plan.pairs.causal)
        bq_bwd = self.block_q or default_block_q(
            plan.groups, masked, plan.pairs.causal, backward=True
        )
        held = plan.pairs.layout
        if self.block_q is None and held is not None and held.block_k == BLOCK_K:
            bq = bq_bwd = held.block_q  # the caller's layout is read as it is, not rebuilt
        f32_slopes = None if slopes is None else slopes.to(torch.float32)
        settings = cpu_op.CpuSettings(
            slopes=f32_slopes, softcap=softcap, alibi_after=alibi_after, block_q=bq,
            precise_scores=cpu_op.precise_scores(), isa=isa,
        )  # fmt: skip
        args = (q, k, v, *plan.op_plan(), *settings)
        # Without a gradient, the op alone (Function.apply binds its arguments on every call),
        # and outside torch.compile its function itself (the dispatcher's cost per call is a
        # visible share of a decoding step: docs/cpu.md, Measurements behind the code).
        if plan.wants_grad:
            out, lse, _, _ = cpu_op.CpuAttention.apply(*args, bq_bwd)
        elif torch.compiler.is_compiling():
            out, lse, _, _ = cpu_op.cpu_forward(*args)
        else:
            out, lse, _, _ = cpu_op.forward_impl(*args)
        return out, lse, None
