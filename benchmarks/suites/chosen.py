"""Content-selected blocks (`qkv.sparse.select_blocks`, MoBA / Quest style) through `auto`:
prefill forward and forward + backward against the dense causal kernel, decoding against the
full-cache step, memory at a million tokens.

- Shapes: B=1, H=8, D=64, CPU; block 64, top-16 key blocks + the local one (`local=1`), causal.
- Prefill implementations (fp32, Nq = Nk = N): `chosen` = `qkv.attention(q, k, v,
  mask=select_blocks(q, k, block=64, topk=16))`, the choice made inside every timed call (what a
  model pays per layer); `dense causal` = `qkv.attention(q, k, v, causal=True)`, the compiled
  kernel over every causal tile (the anchor); `window` = the causal sliding window of the same
  budget, `masks.sliding_window(17·64 − 1, 0)` (each query reads as many keys as `chosen`);
  `choice` = `select_blocks` plus the kept-tile lists of every (b, kv head) that the kernel
  reads (`forward_layout`: every group's tile lists), forward pass only: its time over
  `chosen`'s is the share of the call spent choosing.
- Decoding: one step of Nq = 1, 4 or 16 query rows over a 65,536-token cache (fp32).
  `chosen step` = `select_blocks(q, k, pooled_k=...)` + `qkv.attention(q, k, v, mask=...)`, with
  the blocks' pooled keys kept by the cache as tokens arrive (`KVCache(pool_block=64)`:
  `pooled_keys()` is in the timed call; the blocks' sums and means are updated when a token is
  appended, outside it); `full step` = `qkv.attention(q, k, v, causal=True)` over the whole
  cache (the anchor). Before every step (untimed) 64 MB are streamed through the caches, as a
  layer's step in a model follows the other layers' work: each step starts with cold caches and
  awake CPUs, whichever ran before it (the quiet gate's sleep, the other step).
- `choice`'s column "×dense causal" is its time against the anchor's, not a speed-up of
  attention; the share it matters for is in the targets.
- Memory: `chosen` forward + backward at N = 2²⁰ in bfloat16, in a fresh process capped at 22
  GiB of address space; the caller's tensors are q, k, v, the upstream gradient (the inputs) and
  out, dq, dk, dv (as large again): the figure beyond them is the peak beyond inputs minus the
  inputs' size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

import qkv
from qkv import masks
from qkv.kernels.cpu.op import forward_layout
from qkv.nn import KVCache
from qkv.sparse import select_blocks

from .. import report as rp
from ..results import Results
from ..suite import FWD, FWD_BWD, PASSES, Group, Impl, Memory, Probe, Suite, Target
from . import _attention as A

BLOCK, TOPK, LOCAL = 64, 16, 1
BUDGET = (TOPK + LOCAL) * BLOCK  # keys a query reads
CACHE_N = 65536
MILLION = 2**20


@dataclasses.dataclass(frozen=True)
class Case:
    n: int
    dtype: str = "fp32"


@dataclasses.dataclass(frozen=True)
class Step:
    nq: int
    cache: int


@dataclasses.dataclass(frozen=True)
class Settings:
    sizes: tuple[int, ...]
    steps: tuple[int, ...]
    cache: int
    repeats: int
    long_check: bool


FULL = Settings((16384, 65536), (1, 4, 16), CACHE_N, 3, True)
QUICK = Settings((4096,), (1, 16), 8192, 2, False)


def choose(q: torch.Tensor, k: torch.Tensor, **kwargs) -> masks.Mask:
    return select_blocks(q, k, block=BLOCK, topk=TOPK, local=LOCAL, **kwargs)


def chosen(c: Case):
    return lambda q, k, v: qkv.attention(q, k, v, mask=choose(q, k))


def dense(c: Case):
    return lambda q, k, v: qkv.attention(q, k, v, causal=True)


def window(c: Case):
    mask = masks.sliding_window(BUDGET - 1, 0)
    return lambda q, k, v: qkv.attention(q, k, v, mask=mask)


def choice(c: Case):
    """The choice and the tile lists the kernel reads (block_q 64: the kernel's, with a mask)."""

    def run(q, k, v):
        pairs = qkv.plan.make_plan(q, k, v, mask=choose(q, k)).pairs
        return forward_layout(pairs, q.shape[0], k.shape[1], 64)

    return run


def inputs(c: Case, backward: bool):
    dtype = torch.bfloat16 if c.dtype == "bf16" else torch.float32
    return A.inputs(c.n, backward, dtype=dtype)


PREFILL = Group(
    name="prefill",
    cases=lambda s: [Case(n) for n in s.sizes],
    inputs=inputs,
    impls=(
        Impl("chosen", chosen),
        Impl("dense causal", dense),
        Impl("window", window),
        Impl("choice", choice, passes=(FWD,)),
    ),
    anchors=("dense causal",),
    repeats=lambda s, c: s.repeats if c.n < 65536 else 1,
    round_budget_s=60.0,
    warm=lambda c: Case(1024, c.dtype),
)


def step_inputs(c: Step, backward: bool):
    gen = torch.Generator().manual_seed(0)
    shape = (A.BATCH, A.HEADS, c.cache, A.HEAD_DIM)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(A.BATCH, A.HEADS, c.nq, A.HEAD_DIM, generator=gen)
    cache = KVCache(A.BATCH, c.cache, A.HEADS, A.HEAD_DIM, pool_block=BLOCK)
    cache.update(k, v)
    return (q, cache), None


def chosen_step(c: Step):
    def run(q, cache):
        k, v = cache.keys[:, :, : cache.length], cache.values[:, :, : cache.length]
        return qkv.attention(q, k, v, mask=choose(q, k, pooled_k=cache.pooled_keys()))

    return run


def full_step(c: Step):
    def run(q, cache):
        k, v = cache.keys[:, :, : cache.length], cache.values[:, :, : cache.length]
        return qkv.attention(q, k, v, causal=True)

    return run


_OTHER_LAYERS: list[torch.Tensor] = []  # 64 MB, made on first use


def other_layers() -> None:
    """The other layers' work a decoding step follows: 64 MB (twice the last-level cache of the
    machines this runs on) read and written by torch's threads."""
    if not _OTHER_LAYERS:
        _OTHER_LAYERS.append(torch.zeros(16 * 2**20))
    _OTHER_LAYERS[0].add_(1.0)


DECODE = Group(
    name="decode",
    cases=lambda s: [Step(nq, s.cache) for nq in s.steps],
    inputs=step_inputs,
    impls=(Impl("chosen step", chosen_step), Impl("full step", full_step)),
    passes=(FWD,),
    anchors=("full step",),
    repeats=lambda s, c: 9,
    before_call=other_layers,
)


def probes(s: Settings) -> list[Probe]:
    return (
        [Probe("prefill", Case(MILLION, "bf16"), "chosen", FWD_BWD, 1800)] if s.long_check else []
    )


def ratio(group: str, case: object, impl: str, pass_: str, anchor: str) -> Callable:
    return lambda r: r.ratio(group, case, impl, pass_, anchor)


def choice_share(n: int) -> Callable[[Results], float | None]:
    def get(r: Results) -> float | None:
        part, whole = (r.median("prefill", Case(n), i, FWD) for i in ("choice", "chosen"))
        return part / whole if part and whole else None

    return get


def beyond_callers(r: Results) -> float | None:
    m = r.memory_of("prefill", Case(MILLION, "bf16"), "chosen", FWD_BWD)
    if m is None or m.peak_mib is None or m.inputs_mib is None:
        return None
    return m.peak_mib - m.inputs_mib  # out, dq, dk, dv are as large as q, k, v and the grad


def prefill_table() -> rp.Table:
    return rp.Table(
        (
            rp.field("n", "N"),
            rp.impl_column(),
            rp.time_column(FWD, "fwd ms (n)", counts=True),
            rp.ratio_column(FWD, "dense causal", "fwd ×dense causal"),
            rp.time_column(FWD_BWD, "fwd+bwd ms (n)", counts=True),
            rp.ratio_column(FWD_BWD, "dense causal", "fwd+bwd ×dense causal"),
            rp.pressure_column(PASSES, "CPU pressure fwd / fwd+bwd"),
        ),
        lambda r: rp.rows(r, "prefill"),
        "Prefill (fp32, causal)",
    )


DECODE_TABLE = rp.Table(
    (
        rp.field("nq", "Nq"),
        rp.field("cache", "cache"),
        rp.impl_column(),
        rp.time_column(FWD, "step ms (n)", counts=True, spec=".2f"),
        rp.ratio_column(FWD, "full step", "×full step"),
    ),
    lambda r: rp.rows(r, "decode"),
    "Decoding (fp32)",
)

LONG_TABLE = rp.Table(
    (
        rp.Column("N", lambda m: str(m.case.n)),
        rp.Column("dtype", lambda m: m.case.dtype),
        *rp.MEMORY_COLUMNS,
    ),
    rp.memory_rows("prefill"),
    f"Memory at N = {MILLION:,}",
    lambda r: (
        "`chosen` forward + backward, bfloat16, in its own process, run once; inputs = q, k, v "
        "and the upstream grad; the peak includes out, dq, dk, dv (as large as the inputs)."
        if r.memory
        else "Skipped (`--quick`)."
    ),
)


SUITE = Suite(
    name="chosen",
    title="Content-selected blocks",
    settings={"full": FULL, "quick": QUICK},
    steps=(PREFILL, DECODE, Memory(probes, address_limit=22 * 2**30)),
    targets=(
        *(
            Target(
                f"N={CACHE_N}, {pass_}: chosen blocks ×dense causal kernel",
                ratio("prefill", Case(CACHE_N), "chosen", pass_, "dense causal"),
                20.0,
            )
            for pass_ in PASSES
        ),
        Target(
            f"N={CACHE_N}, fwd: choice + tile lists, share of the call",
            choice_share(CACHE_N),
            0.15,
            at_least=False,
            unit="%",
        ),
        Target(
            f"N={MILLION}, bf16 fwd+bwd: peak MiB beyond the caller's tensors",
            beyond_callers,
            1024.0,
            at_least=False,
            unit=" MiB",
            digits=0,
        ),
        *(
            Target(
                f"decoding, Nq={nq}, {CACHE_N}-token cache: chosen step ×full step",
                ratio("decode", Step(nq, CACHE_N), "chosen step", FWD, "full step"),
                10.0,
            )
            for nq in FULL.steps
        ),
    ),
    report=(prefill_table(), DECODE_TABLE, LONG_TABLE),
    doc=__doc__,
    budget_s=lambda s: None,
)
