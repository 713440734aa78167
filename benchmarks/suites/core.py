"""Core: qkv's `tiled` and `auto` against the naive formula and torch SDPA, dense and causal.

- Shapes: fp32, B=1, H=8, D=64, Nq = Nk = N, CPU.
- Implementations: `tiled` = `qkv.attention(..., backend="tiled")`; `auto` =
  `qkv.attention(..., backend="auto")`; `naive` = the formula written plainly in torch
  (`softmax(q @ kᵀ · scale, masked_fill −inf) @ v`); `sdpa` =
  `torch.nn.functional.scaled_dot_product_attention` called directly (`is_causal` for causal).
- GFLOP/s by FlashAttention's count: forward `4·B·H·N²·D`, halved for causal; backward 2.5×
  forward, so forward + backward is 3.5× forward. **% ceil** = the rate as a share of the
  matmul ceiling.
- Peak memory of every call in a fresh process; and `tiled` and `sdpa` forward + backward at
  N = 32768, where the score matrix alone would be 8·32768²·4 B = 34 GB (so `naive` is not run).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import qkv

from .. import report as rp
from ..results import Results
from ..suite import FWD, FWD_BWD, PASSES, Group, Impl, Memory, Probe, Suite, Target
from . import _attention as A

MODES = ("dense", "causal")
LONG_N = 32768


@dataclasses.dataclass(frozen=True)
class Case:
    mode: str  # "dense" or "causal"
    n: int

    @property
    def causal(self) -> bool:
        return self.mode == "causal"


@dataclasses.dataclass(frozen=True)
class Settings:
    sizes: tuple[int, ...]
    repeats: dict[int, int]  # timed rounds by N, where not `default_repeats`
    default_repeats: int
    long_check: bool


FULL = Settings((1024, 2048, 4096, 8192), {4096: 3, 8192: 3}, 5, long_check=True)
QUICK = Settings((512, 1024), {}, 3, long_check=False)


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The textbook formula, written plainly: softmax(Q Kᵀ · scale, masked) V."""
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        n_q, n_k = s.shape[-2:]
        allowed = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def sdpa(c: Case):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=c.causal)


def backend(name: str) -> Impl:
    def make(c: Case):
        return lambda q, k, v: qkv.attention(q, k, v, causal=c.causal, backend=name)

    return Impl(name, make)


GROUP = Group(
    name="core",
    cases=lambda s: [Case(mode, n) for n in s.sizes for mode in MODES],
    inputs=lambda c, backward: A.inputs(c.n, backward),
    impls=(
        backend("tiled"),
        backend("auto"),
        Impl("naive", lambda c: lambda q, k, v: naive(q, k, v, c.causal)),
        Impl("sdpa", sdpa),
    ),
    anchors=("sdpa",),
    repeats=lambda s, c: s.repeats.get(c.n, s.default_repeats),
    rates={"gflops": lambda c, pass_, _: A.flops(c.n, pass_, 0.5 if c.causal else 1.0)},
    warm=lambda c: Case(c.mode, 256),
)


def probes(s: Settings) -> list[Probe]:
    timed = [
        Probe("core", c, i.name, p) for c in GROUP.cases(s) for i in GROUP.impls for p in PASSES
    ]
    long = [Probe("core", Case("dense", LONG_N), impl, FWD_BWD) for impl in ("tiled", "sdpa")]
    return timed + (long if s.long_check else [])


def facts(_: Settings) -> dict[str, object]:
    q = torch.empty(A.BATCH, A.HEADS, 1024, A.HEAD_DIM)
    return {m: qkv.dispatch(q, q, q, causal=m == "causal").backend.name for m in MODES}


def method(r: Results) -> list[str]:
    s = r.settings
    rounds = {int(n): v for n, v in s["repeats"].items()}
    shown = ", ".join(f"{rounds.get(n, s['default_repeats'])} at N={n}" for n in s["sizes"])
    return [
        f"- N in {{{', '.join(map(str, s['sizes']))}}}; timed rounds: {shown}. `auto` dispatches "
        f"to `{r.facts.get('dense')}` for dense and `{r.facts.get('causal')}` for causal at "
        "these shapes (`qkv.dispatch`)."
    ]


def sdpa_target(impl: str, pass_: str, mode: str, threshold: float) -> Target:
    return Target(
        f"`{impl}` {pass_}, {mode}, N=4096: speed ×SDPA",
        lambda r: r.ratio("core", Case(mode, 4096), impl, pass_, "sdpa"),
        threshold,
    )


def long_peak(r: Results) -> float | None:
    m = r.memory_of("core", Case("dense", LONG_N), "tiled", FWD_BWD)
    return m.peak_mib if m else None


def table(mode: str) -> rp.Table:
    columns = [rp.field("n", "N"), rp.impl_column()]
    for p in PASSES:
        columns += [
            rp.time_column(p, f"{p} ms"),
            rp.rate_column(p, "gflops", f"{p} GFLOP/s"),
            rp.rate_column(p, "gflops", f"{p} % ceil", share="only"),
            rp.ratio_column(p, "sdpa", f"{p} ×SDPA"),
        ]
    columns += [rp.peak_column(p, f"{p} peak MiB") for p in PASSES]
    return rp.Table(
        tuple(columns), lambda r: rp.rows(r, "core", lambda c: c.mode == mode), mode.title()
    )


LONG_TABLE = rp.Table(
    (rp.Column("impl", lambda m: m.impl, "l"), rp.field("n", "N"), *rp.MEMORY_COLUMNS),
    rp.memory_rows("core", lambda c: c.n == LONG_N),
    f"Long sequence: memory at N={LONG_N}",
    lambda r: (
        "Forward + backward, dense, run once each; inputs = q, k, v and the upstream grad."
        if any(m.case["n"] == LONG_N for m in r.memory)
        else "Skipped (`--quick`)."
    ),
)

SUITE = Suite(
    name="core",
    title="Core: dense and causal attention",
    settings={"full": FULL, "quick": QUICK},
    steps=(GROUP, Memory(probes)),
    targets=(
        *(sdpa_target("auto", FWD, mode, 0.95) for mode in MODES),
        *(sdpa_target("tiled", FWD, mode, 0.6) for mode in MODES),
        *(sdpa_target("tiled", FWD_BWD, mode, 0.5) for mode in MODES),
        Target(
            f"`tiled` fwd+bwd, dense, N={LONG_N}: peak MiB beyond inputs",
            long_peak,
            1024.0,
            at_least=False,
            unit=" MiB",
            digits=1,
        ),
    ),
    report=(table("dense"), table("causal"), LONG_TABLE),
    doc=__doc__,
    method=method,
    ceiling=True,
    facts=facts,
)
