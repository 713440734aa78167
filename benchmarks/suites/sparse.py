"""Sparse attention: qkv's block-sparse `tiled` kernel on structured masks, against torch SDPA
with the equivalent dense bool mask and against compiled FlexAttention.

- Shapes: fp32, B=1, H=8, D=64, Nq = Nk = N, CPU.
- Implementations: `qkv` = `qkv.attention(q, k, v, <pattern>)` with backend `auto`; `tiled` =
  the same with `backend="tiled"` (causal only); `sdpa` =
  `F.scaled_dot_product_attention(q, k, v, attn_mask=M.to_dense(N, N))` (`is_causal=True` for
  causal), up to N=16384; `flex` = `torch.compile(flex_attention, dynamic=False)` with a block
  mask from `torch.compile(create_block_mask)` of an equivalent `mask_mod` (BLOCK_SIZE=64, qkv's
  tile; Flex's default is 128), forward only. Each `mask_mod` is checked equal to
  `Mask.to_dense` at N=2048. Before each case Dynamo's caches are reset, so Flex's first call
  (the warm-up round) is a compilation, shown apart as 'Flex compile s'.
- Cases run by N, causal above N=16384 (the slowest comparison) last, and none starts once the
  run has used its budget. SDPA and Flex are skipped where one forward is predicted (from the
  last N measured) above 60 s.
- **eff GFLOP/s** = FlashAttention's count of the allowed pairs, `4·B·H·N²·D·density` (×3.5 for
  forward + backward) over the time. **kept-tile GFLOP/s** = the same count over every kept
  64×64 tile, `4·B·H·(kept tiles·64·64)·D` (×3.5): the work the tiled kernel really multiplies,
  with its share of the matmul ceiling in brackets (`qkv` and `tiled` only). Densities are
  exact (full tiles counted whole, partial tiles evaluated element-wise).
- Memory: `qkv` forward + backward at N=65536 (Longformer, sliding window), each in a fresh
  process; the figure includes the output and dq, dk, dv (128 MiB each).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import qkv
from qkv import masks
from qkv.kernels.tiled.backend import BLOCK_Q

from .. import report as rp
from ..results import Results
from ..suite import FWD, FWD_BWD, PASSES, Group, Impl, Memory, Prepared, Probe, Suite, Target
from . import _attention as A

TILE = BLOCK_Q  # the tiled kernel's 64×64 tile: the unit it skips or computes
WINDOW, N_GLOBAL, N_DOCS = 256, 16, 8
BIGBIRD = {"window": 1, "n_global": 1, "n_random": 2, "block": TILE, "seed": 0}
FLEX_BLOCK = TILE  # Flex's default is 128; 64 matches qkv's tile (the same skipping granularity)
SDPA_MAX_N = 16384  # above this the dense bool mask (N² bytes) and N² time are not worth it
MAX_CALL_S = 60.0  # skip SDPA or Flex where one forward is predicted to take longer
CHECK_N = 2048  # the mask_mods and tile densities are checked against the Masks at this N
LONG_N = 65536
CAUSAL_DROP = (
    "causal is the slowest comparison (half of the N² work, where the other patterns keep "
    "≤ 13%): at N=65536 one forward + backward of `qkv` (= SDPA) or `tiled` alone takes minutes, "
    "beyond the ≈ 25 min budget of the run"
)

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A sparsity pattern: the qkv Mask (`masks.causal()` for `causal=True`), how qkv is called
    (shown in the report) and an equivalent Flex mask_mod."""

    title: str
    code: str
    mask: Callable[[int], masks.Mask]
    mask_mod: Callable[[int, masks.Mask], MaskMod]

    @property
    def causal(self) -> bool:
        return self.code == "causal=True"


def bigbird_mod(n: int, mask: masks.Mask) -> MaskMod:
    """BigBird is block-granular with block = tile, so its tile layout is its block table."""
    table = (mask.blocks(n, n, TILE, TILE).kind != masks.EMPTY).contiguous()
    return lambda b, h, q, kv: table[q // TILE, kv // TILE]


def document_mod(n: int, mask: masks.Mask) -> MaskMod:
    doc = torch.arange(N_DOCS).repeat_interleave(n // N_DOCS)
    return lambda b, h, q, kv: doc[q] == doc[kv]


def window_mod(n: int, mask: masks.Mask) -> MaskMod:
    return lambda b, h, q, kv: (q - kv).abs() <= WINDOW


def longformer_mod(n: int, mask: masks.Mask) -> MaskMod:
    return lambda b, h, q, kv: ((q - kv).abs() <= WINDOW) | (q < N_GLOBAL) | (kv < N_GLOBAL)


SLIDING = masks.sliding_window(WINDOW)
LONGFORMER = SLIDING | masks.global_tokens(list(range(N_GLOBAL)))
BIGBIRD_CODE = "mask=masks.bigbird(" + ", ".join(f"{k}={v}" for k, v in BIGBIRD.items()) + ")"
PATTERNS = {
    "sliding": Pattern(
        "Sliding window", f"mask=masks.sliding_window({WINDOW})", lambda n: SLIDING, window_mod
    ),
    "longformer": Pattern(
        "Longformer",
        f"mask=masks.sliding_window({WINDOW}) | masks.global_tokens(range({N_GLOBAL}))",
        lambda n: LONGFORMER,
        longformer_mod,
    ),
    "bigbird": Pattern("BigBird", BIGBIRD_CODE, lambda n: masks.bigbird(**BIGBIRD), bigbird_mod),
    "document": Pattern(
        "Documents",
        f"mask=masks.document([N // {N_DOCS}] * {N_DOCS})",
        lambda n: masks.document([n // N_DOCS] * N_DOCS),
        document_mod,
    ),
    "causal": Pattern(
        "Causal", "causal=True", lambda n: masks.causal(), lambda n, m: lambda b, h, q, kv: q >= kv
    ),
}


@dataclasses.dataclass(frozen=True)
class Case:
    pattern: str
    n: int

    @property
    def p(self) -> Pattern:
        return PATTERNS[self.pattern]

    def kwargs(self) -> dict[str, object]:
        return {"causal": True} if self.p.causal else {"mask": self.p.mask(self.n)}


@dataclasses.dataclass(frozen=True)
class Settings:
    sizes: tuple[int, ...]
    max_repeats: dict[int, int]  # timed rounds by N at most (1 where not given)
    long_check: bool
    fresh_compile_cache: bool  # Flex compile times with an empty Inductor cache
    flex_sizes: tuple[int, ...] | None  # the N at which Flex runs (None: all)
    dropped: tuple[tuple[str, int, str], ...]  # (pattern, N, why) listed but not run
    budget_s: float  # no case starts after this


FULL = Settings(
    (4096, 8192, 16384, 32768, 65536),
    {4096: 5, 8192: 5, 16384: 3, 32768: 3, 65536: 2},
    long_check=True,
    fresh_compile_cache=True,
    flex_sizes=None,
    dropped=(("causal", 65536, CAUSAL_DROP),),
    budget_s=25 * 60.0,
)
QUICK = Settings((2048, 4096), {}, False, False, (2048,), (), 10 * 60.0)


# --------------------------------------------------------------------------- sparsity


def sparsity(mask: masks.Mask, n: int) -> dict[str, float]:
    """Exact density from the kept tiles: full tiles count whole, partial tiles are evaluated
    element-wise (O(kept tiles) work instead of Mask.density's O(N²))."""
    layout = mask.blocks(n, n, TILE, TILE)
    allowed = int(layout.full.sum()) * TILE * TILE
    partial = ~layout.full
    offsets, zero = torch.arange(TILE), torch.zeros(1, dtype=torch.long)
    tiles = zip(
        layout.tile_rows()[partial].split(1024), layout.col[partial].split(1024), strict=True
    )
    for r, c in tiles:
        q = (r.view(-1, 1) * TILE + offsets).unsqueeze(2)  # (P, T, 1)
        k = (c.view(-1, 1) * TILE + offsets).unsqueeze(1)  # (P, 1, T)
        allowed += int(mask.evaluate(zero, zero, q, k, n, n).sum())
    nqb, nkb = layout.shape
    return {"density": allowed / (n * n), "kept_tiles": layout.nnz, "total_tiles": nqb * nkb}


def prepare(s: Settings) -> None:
    """Check every mask_mod and tile density against its Mask; give Flex an empty compile cache."""
    zero = torch.zeros((), dtype=torch.long)
    rows_, cols = torch.arange(CHECK_N).view(-1, 1), torch.arange(CHECK_N).view(1, -1)
    for name, p in PATTERNS.items():
        mask = p.mask(CHECK_N)
        flex = p.mask_mod(CHECK_N, mask)(zero, zero, rows_, cols).expand(CHECK_N, CHECK_N)
        if not torch.equal(flex, mask.to_dense(CHECK_N, CHECK_N)):
            raise AssertionError(f"{name}: the mask_mod differs from the qkv Mask at N={CHECK_N}")
        if abs(sparsity(mask, CHECK_N)["density"] - mask.density(CHECK_N, CHECK_N)) > 1e-12:
            raise AssertionError(f"{name}: the tile density differs from Mask.density")
    if s.fresh_compile_cache:
        cache = tempfile.mkdtemp(prefix="sparse-bench-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        atexit.register(shutil.rmtree, cache, True)


# --------------------------------------------------------------------------- implementations


def qkv_impl(name: str, backend: str, when: Callable[[Case], bool] = lambda c: True) -> Impl:
    def make(c: Case):
        kwargs = c.kwargs()
        return lambda q, k, v: qkv.attention(q, k, v, backend=backend, **kwargs)

    return Impl(name, make, when=when)


def sdpa(c: Case):
    dense = None if c.p.causal else c.p.mask(c.n).to_dense(c.n, c.n)
    return lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=dense, is_causal=c.p.causal
    )


def flex(c: Case) -> Prepared:
    """A fresh compilation (Dynamo's caches reset): the block mask is built and timed here, the
    kernel compiles on the first call (the warm-up round, timed apart)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    start = time.perf_counter()
    block_mask = torch.compile(create_block_mask)(
        c.p.mask_mod(c.n, c.p.mask(c.n)), None, None, c.n, c.n, device="cpu", BLOCK_SIZE=FLEX_BLOCK
    )
    built = time.perf_counter() - start
    compiled = torch.compile(flex_attention, dynamic=False)
    return Prepared(
        lambda q, k, v: compiled(q, k, v, block_mask=block_mask), {"block_mask_s": built}
    )


def predicted_skip(name: str, power: int) -> Callable[[Case, Results], str | None]:
    """Skip where one forward is predicted (from the last N measured, time ∝ N^power) to take
    longer than MAX_CALL_S."""

    def skip(c: Case, r: Results) -> str | None:
        earlier = [
            t
            for t in r.timings
            if t.impl == name and t.pass_ == FWD and t.case["pattern"] == c.pattern and t.median_s
        ]
        if not earlier:
            return None
        t = earlier[-1]
        predicted = t.median_s * (c.n / t.case["n"]) ** power
        if predicted > MAX_CALL_S:
            return f"skipped (one forward predicted at {predicted:.0f} s > {MAX_CALL_S:.0f} s)"
        return None

    return skip


def sdpa_skip(c: Case, r: Results) -> str | None:
    if c.n > SDPA_MAX_N:
        size = "" if c.p.causal else f"; the dense bool mask alone is {c.n**2 / 2**30:.0f} GiB"
        return f"skipped (N > {SDPA_MAX_N}: SDPA pays N² time{size})"
    return predicted_skip("sdpa", 2)(c, r)


def flex_skip(c: Case, r: Results) -> str | None:
    sizes = r.settings.get("flex_sizes")
    if sizes is not None and c.n not in sizes:
        return "skipped (`--quick` compiles Flex at the smallest N only)"
    return predicted_skip("flex", 1)(c, r)


def cases(s: Settings) -> list[Case]:
    """By N, except that causal above SDPA_MAX_N (the slowest comparison) runs last, so that
    the runtime budget drops it before anything else."""
    order = [Case(p, n) for n in s.sizes for p in PATTERNS]
    last = [c for c in order if c.p.causal and c.n > SDPA_MAX_N]
    return [c for c in order if c not in last] + last


GROUP = Group(
    name="sparse",
    cases=cases,
    inputs=lambda c, backward: A.inputs(c.n, backward),
    impls=(
        qkv_impl("qkv", "auto"),
        qkv_impl("tiled", "tiled", when=lambda c: c.p.causal),
        Impl("sdpa", sdpa, skip=sdpa_skip),
        Impl("flex", flex, skip=flex_skip, passes=(FWD,)),
    ),
    anchors=("sdpa", "flex"),
    repeats=lambda s, c: s.max_repeats.get(c.n, 1),
    round_budget_s=8.0,
    rates={
        "eff": lambda c, pass_, fig: A.flops(c.n, pass_, fig["density"]),
        "kept": lambda c, pass_, fig: A.flops(1, pass_) * TILE * TILE * fig["kept_tiles"],
    },
    describe=lambda c: sparsity(c.p.mask(c.n), c.n),
    warm=lambda c: Case(c.pattern, 512),
    drop=lambda s, c: next((why for p, n, why in s.dropped if (p, n) == (c.pattern, c.n)), None),
)


def probes(s: Settings) -> list[Probe]:
    long = [
        Probe("sparse", Case(p, LONG_N), "qkv", FWD_BWD, 600) for p in ("longformer", "sliding")
    ]
    return long if s.long_check else []


def facts(_: Settings) -> dict[str, object]:
    q = torch.empty(A.BATCH, A.HEADS, 4096, A.HEAD_DIM)
    choice = {
        name: qkv.dispatch(q, q, q, **Case(name, 4096).kwargs()).backend.name for name in PATTERNS
    }
    return choice


def method(r: Results) -> list[str]:
    s = r.settings
    cache = (
        "with an empty Inductor cache (a fresh `TORCHINDUCTOR_CACHE_DIR` for the run): the first "
        "shape compiles everything, later ones reuse what this run built"
        if s["fresh_compile_cache"]
        else "with Inductor's on-disk cache as it was (`--quick`): may be cache hits"
    )
    return [
        "- Patterns (`from qkv import masks`): "
        + "; ".join(f"{p.title}: `{p.code}`" for p in PATTERNS.values())
        + ". `auto` dispatches to "
        + ", ".join(f"`{r.facts.get(name)}` for {p.title.lower()}" for name, p in PATTERNS.items())
        + " (`qkv.dispatch`).",
        f"- N in {{{', '.join(map(str, s['sizes']))}}}; timed rounds: at most "
        + ", ".join(f"{v} at N={n}" for n, v in s["max_repeats"].items())
        + f", as many as fit in {GROUP.round_budget_s:.0f} s by the warm-up call (at least one, "
        f"shown as `(n)`); runtime budget {s['budget_s'] / 60:.0f} min. Flex compile times "
        f"{cache}.",
    ]


def shape_table(name: str) -> rp.Table:
    def note(r: rp.Row) -> str:
        if r.note:
            return r.note
        flex = r.timing(FWD, "flex")
        return f"Flex: {flex.note}" if flex and flex.note and flex.note.startswith("failed") else ""

    def kept(r: rp.Row) -> str:
        k, total = r.extra("kept_tiles"), r.extra("total_tiles")
        return "—" if k is None else f"{k} / {total} ({100 * k / total:.1f}%)"

    def compile_s(r: rp.Row) -> str:
        t = r.timing(FWD, "flex")
        return rp.fmt(t.warmup_s if t else None, ".1f")

    return rp.Table(
        (
            rp.field("n", "N"),
            rp.Column("density", lambda r: rp.fmt(r.extra("density"), ".4f")),
            rp.Column("kept 64×64 tiles", kept),
            rp.Column(
                "Flex block mask s", lambda r: rp.fmt(r.extra("block_mask_s", "flex"), ".1f")
            ),
            rp.Column("Flex compile s", compile_s),
            rp.Column("note", note, "l"),
        ),
        lambda r: rp.case_rows(r, "sparse", lambda c: c.pattern == name),
        f"{PATTERNS[name].title} (`{PATTERNS[name].code}`)",
    )


def kept_column(pass_: str) -> rp.Column:
    inner = rp.rate_column(pass_, "kept", f"{pass_} kept-tile GFLOP/s (% matmul)", share="also")
    return rp.Column(inner.header, lambda r: inner.cell(r) if r.impl in ("qkv", "tiled") else "—")


def results_table(name: str) -> rp.Table:
    return rp.Table(
        (
            rp.field("n", "N"),
            rp.impl_column(),
            rp.time_column(FWD, "fwd ms (n)", counts=True),
            rp.ratio_column(FWD, "sdpa", "fwd ×SDPA"),
            rp.ratio_column(FWD, "flex", "fwd ×Flex"),
            rp.rate_column(FWD, "eff", "fwd eff GFLOP/s"),
            kept_column(FWD),
            rp.time_column(FWD_BWD, "fwd+bwd ms (n)", counts=True),
            rp.ratio_column(FWD_BWD, "sdpa", "fwd+bwd ×SDPA"),
            rp.rate_column(FWD_BWD, "eff", "fwd+bwd eff GFLOP/s"),
            kept_column(FWD_BWD),
            rp.pressure_column(PASSES, "CPU pressure fwd / fwd+bwd"),
        ),
        lambda r: rp.rows(r, "sparse", lambda c: c.pattern == name),
    )


LONG_TABLE = rp.Table(
    (
        rp.Column("pattern", lambda m: m.case.p.title, "l"),
        rp.Column("N", lambda m: str(m.case.n)),
        *rp.MEMORY_COLUMNS,
    ),
    rp.memory_rows("sparse"),
    f"Memory at N={LONG_N}",
    lambda r: (
        f"`qkv` forward + backward, {A.SHAPE_TEXT}, each in its own process, run once; inputs = "
        "q, k, v and the upstream grad; the figure includes the output and dq, dk, dv (128 MiB "
        "each at N=65536). The process is capped at 16 GiB of address space."
        if r.memory
        else "Skipped (`--quick`)."
    ),
)


def value(pattern: str, n: int, impl: str, get: Callable[[rp.Row], float | None]) -> Callable:
    return lambda r: get(rp.Row(r, "sparse", Case(pattern, n), impl))


def ratio(pass_: str, anchor: str) -> Callable[[rp.Row], float | None]:
    return lambda row: (row.ratio(pass_, anchor) or {}).get("median")


def scaling(pass_: str) -> Callable[[Results], float | None]:
    def get(r: Results) -> float | None:
        big, small = (r.median("sparse", Case("sliding", n), "qkv", pass_) for n in (32768, 16384))
        return big / small if big is not None and small is not None else None

    return get


def kept_share(pass_: str) -> Callable[[rp.Row], float | None]:
    def get(row: rp.Row) -> float | None:
        rate = row.rate(pass_, "kept")
        return rate / row.results.ceiling["gflops"] if rate and row.results.ceiling else None

    return get


def long_peak(r: Results) -> float | None:
    m = r.memory_of("sparse", Case("longformer", LONG_N), "qkv", FWD_BWD)
    return m.peak_mib if m else None


SUITE = Suite(
    name="sparse",
    title="Sparse attention",
    settings={"full": FULL, "quick": QUICK},
    steps=(GROUP, Memory(probes)),
    targets=(
        Target(
            "sliding window, N=16384, fwd: speed ×SDPA with the dense bool mask",
            value("sliding", 16384, "qkv", ratio(FWD, "sdpa")),
            30.0,
        ),
        Target(
            "sliding window, N=16384, fwd: speed ×compiled FlexAttention (compile excluded)",
            value("sliding", 16384, "qkv", ratio(FWD, "flex")),
            1.5,
        ),
        *(
            Target(
                f"sliding window, {pass_}: time(N=32768) / time(N=16384)",
                scaling(pass_),
                2.3,
                at_least=False,
                unit="",
            )
            for pass_ in PASSES
        ),
        Target(
            f"Longformer, fwd+bwd, N={LONG_N}: peak MiB beyond inputs",
            long_peak,
            1024.0,
            at_least=False,
            unit=" MiB",
            digits=1,
        ),
        *(
            Target(
                f"sliding window, N=16384, {pass_}: kept-tile rate as % of fp32 matmul",
                value("sliding", 16384, "qkv", kept_share(pass_)),
                0.5,
                unit="%",
            )
            for pass_ in PASSES
        ),
    ),
    report=(
        *(t for name in PATTERNS for t in (shape_table(name), results_table(name))),
        LONG_TABLE,
    ),
    doc=__doc__,
    method=method,
    ceiling=True,
    budget_s=lambda s: s.budget_s,
    prepare=prepare,
    facts=facts,
)
