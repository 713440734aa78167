"""Sparse attention benchmark: qkv's block-sparse `tiled` kernel on structured masks, against torch
SDPA with the equivalent dense bool mask and against compiled FlexAttention.

What it measures, all in one run on one machine (fp32, B=1, H=8, D=64, CPU):

- five patterns: sliding window `masks.sliding_window(256)`; Longformer (that window
  `| masks.global_tokens(range(16))`); BigBird `masks.bigbird(window=1, n_global=1, n_random=2,
  block=64, seed=0)`; 8 equal documents `masks.document([N // 8] * 8)`; causal (`causal=True`);
- for N in {4096, 8192, 16384, 32768, 65536} and each implementation: `qkv` =
  `qkv.attention(q, k, v, mask=M)` (backend "auto", which runs the block-sparse tiled kernel for
  a Mask; for causal it dispatches to SDPA, so `tiled` is also run explicitly there); `sdpa` =
  `F.scaled_dot_product_attention` with `attn_mask=M.to_dense(N, N)` (`is_causal=True` for
  causal), up to N = 16384; `flex` = `torch.compile(flex_attention)` with a block mask built
  from an equivalent `mask_mod`, forward only, its first call (the compilation) timed apart;
- the median time of the forward (under `torch.no_grad`) and of forward + backward (fixed
  random upstream gradient), after a warm-up, the implementations taking turns round after
  round; the speed relative to SDPA and to Flex (`time_other / time_qkv`); the effective rate
  (FlashAttention's count × the mask's density) and the rate on kept 64×64 tiles, as a fraction
  of torch's fp32 matmul rate measured in the same run;
- peak memory of Longformer and sliding-window forward + backward at N = 65536, each in its own
  process, beyond what the inputs hold;
- the targets, each with PASS/FAIL and the measured figure.

Run it from the repository root:

    python benchmarks/sparse.py --out docs/benchmarks.md   # full run (≈ 25 min); writes its
                                                           # section and docs/benchmarks-sparse.json
    python benchmarks/sparse.py --quick                    # smoke test (N = 2048, 4096), prints

Progress goes to stderr, one line per measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F

import qkv
from _harness import (
    BATCH,
    DTYPE,
    HEAD_DIM,
    HEADS,
    MATMUL_REPEATS,
    MATMUL_SIZE,
    ProbeResult,
    cpu_busy_fraction,
    cpu_pressure_total_s,
    fmt,
    interleave,
    limit_address_space,
    machine_info,
    make_inputs,
    matmul_gflops,
    measure_in_process,
    peak_rss_mib,
    print_probe_result,
    progress,
    reset_peak_rss,
    write_section,
)
from qkv import masks
from qkv.kernels.tiled import BLOCK_K, BLOCK_Q

TILE = BLOCK_Q  # the tiled kernel's 64×64 tile: the unit it skips or computes
WINDOW = 256
N_GLOBAL = 16
N_DOCS = 8
BIGBIRD = {"window": 1, "n_global": 1, "n_random": 2, "block": TILE, "seed": 0}
FLEX_BLOCK = TILE  # Flex's default is 128; 64 matches qkv's tile (same skipping granularity)
SDPA_MAX_N = 16384  # above this the dense bool mask (N² bytes) and N² time are not worth it
MAX_CALL_S = 60.0  # skip an implementation whose single forward is predicted to exceed this
GROUP_BUDGET_S = 8.0  # timed seconds per implementation and group: fixes its repeat count
CHECK_N = 2048  # mask_mods and tile densities are checked against Mask.to_dense at this N
LONG_N = 65536
LONG_PATTERNS = ("longformer", "sliding")
LONG_TARGET_MIB = 1024.0
LONG_TIMEOUT_S = 600
PROBE_ADDRESS_LIMIT = 16 * 2**30
# Before every timed round, wait (a bounded time) until other processes leave the CPUs alone:
# with one thread per core, qkv's many small parallel regions stall far more than one big SDPA
# call when another process takes a core, so contention would not hit the implementations alike.
QUIET_BUSY = 0.15  # fraction of all CPUs busy while this process sleeps for QUIET_SAMPLE_S
QUIET_SAMPLE_S = 0.2
QUIET_MAX_WAIT_S = 30.0  # per round
QUIET_MAX_TOTAL_S = 300.0  # per run; after that, rounds start without waiting
CONTENDED = 0.25
CAUSAL_DROP = (
    "causal is the slowest comparison (half of the N² work, where the other patterns keep "
    "≤ 13%): at N=65536 one forward + backward of `qkv` (= SDPA) or `tiled` alone takes minutes, "
    "beyond the ≈ 25 min budget of the run"
)  # median pressure above which a figure is flagged
SECTION = "sparse"

Call = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------- patterns


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A sparsity pattern: the qkv Mask (or `causal=True`) and an equivalent Flex mask_mod."""

    name: str
    title: str
    code: str  # how qkv is called, shown in the report
    causal: bool  # run with causal=True and no mask object
    make_mask: Callable[[int], masks.Mask]  # for causal: masks.causal(), for tiles and density
    make_mask_mod: Callable[[int, masks.Mask], MaskMod]


def sliding_mask_mod(n: int, mask: masks.Mask) -> MaskMod:
    def mask_mod(b, h, q, kv):
        return (q - kv).abs() <= WINDOW

    return mask_mod


def longformer_mask_mod(n: int, mask: masks.Mask) -> MaskMod:
    def mask_mod(b, h, q, kv):
        return ((q - kv).abs() <= WINDOW) | (q < N_GLOBAL) | (kv < N_GLOBAL)

    return mask_mod


def bigbird_mask_mod(n: int, mask: masks.Mask) -> MaskMod:
    """BigBird is block-granular with block = tile, so its tile layout is its block table."""
    table = (mask.blocks(n, n, TILE, TILE).kind[0, 0] != masks.EMPTY).contiguous()

    def mask_mod(b, h, q, kv):
        return table[q // TILE, kv // TILE]

    return mask_mod


def document_mask_mod(n: int, mask: masks.Mask) -> MaskMod:
    lengths = torch.tensor(document_lengths(n))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)

    def mask_mod(b, h, q, kv):
        return doc[q] == doc[kv]

    return mask_mod


def causal_mask_mod(n: int, mask: masks.Mask) -> MaskMod:
    def mask_mod(b, h, q, kv):
        return q >= kv

    return mask_mod


def document_lengths(n: int) -> list[int]:
    return [n // N_DOCS] * N_DOCS


PATTERNS = (
    Pattern(
        "sliding",
        "Sliding window",
        f"mask=masks.sliding_window({WINDOW})",
        False,
        lambda n: masks.sliding_window(WINDOW),
        sliding_mask_mod,
    ),
    Pattern(
        "longformer",
        "Longformer",
        f"mask=masks.sliding_window({WINDOW}) | masks.global_tokens(range({N_GLOBAL}))",
        False,
        lambda n: masks.sliding_window(WINDOW) | masks.global_tokens(list(range(N_GLOBAL))),
        longformer_mask_mod,
    ),
    Pattern(
        "bigbird",
        "BigBird",
        "mask=masks.bigbird(" + ", ".join(f"{k}={v}" for k, v in BIGBIRD.items()) + ")",
        False,
        lambda n: masks.bigbird(**BIGBIRD),
        bigbird_mask_mod,
    ),
    Pattern(
        "document",
        "Documents",
        f"mask=masks.document([N // {N_DOCS}] * {N_DOCS})",
        False,
        lambda n: masks.document(document_lengths(n)),
        document_mask_mod,
    ),
    Pattern("causal", "Causal", "causal=True", True, lambda n: masks.causal(), causal_mask_mod),
)
PATTERN_BY_NAME = {p.name: p for p in PATTERNS}


def check_mask_mod(pattern: Pattern, n: int) -> None:
    """The Flex mask_mod and the qkv Mask allow exactly the same pairs at size n."""
    mask = pattern.make_mask(n)
    zero = torch.zeros((), dtype=torch.long)
    rows, cols = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    flex_dense = pattern.make_mask_mod(n, mask)(zero, zero, rows, cols)
    if not torch.equal(flex_dense.expand(n, n), mask.to_dense(n, n)):
        raise AssertionError(f"{pattern.name}: mask_mod differs from the qkv Mask at N={n}")


# --------------------------------------------------------------------------- sparsity


@dataclasses.dataclass
class Sparsity:
    """How much of the N×N score matrix a pattern keeps."""

    density: float  # fraction of allowed (query, key) pairs
    kept_tiles: int  # non-empty 64×64 tiles (what the tiled kernel computes)
    total_tiles: int


def sparsity(mask: masks.Mask, n: int) -> Sparsity:
    """Exact density from the tile layout: full tiles count whole, partial tiles are evaluated
    element-wise (O(kept tiles) work instead of Mask.density's O(N²))."""
    kind = mask.blocks(n, n, TILE, TILE).kind[0, 0]
    full = int((kind == masks.FULL).sum())
    allowed = full * TILE * TILE
    partial = (kind == masks.PARTIAL).nonzero()
    offsets = torch.arange(TILE)
    zero = torch.zeros(1, dtype=torch.long)
    for chunk in partial.split(1024):
        rows = (chunk[:, 0:1] * TILE + offsets).unsqueeze(2)  # (P, T, 1)
        cols = (chunk[:, 1:2] * TILE + offsets).unsqueeze(1)  # (P, 1, T)
        allowed += int(mask.evaluate(zero, zero, rows, cols, n, n).sum())
    kept = int((kind != masks.EMPTY).sum())
    return Sparsity(density=allowed / (n * n), kept_tiles=kept, total_tiles=kind.numel())


def effective_flops(n: int, density: float, backward: bool) -> float:
    """FlashAttention's count of the allowed pairs: 4·B·H·N²·D·density, ×3.5 for fwd+bwd."""
    return 4.0 * BATCH * HEADS * n * n * HEAD_DIM * density * (3.5 if backward else 1.0)


def kept_tile_flops(kept_tiles: int, backward: bool) -> float:
    """The same count over every kept 64×64 tile: what the tiled kernel multiplies."""
    return 4.0 * BATCH * HEADS * kept_tiles * TILE * TILE * HEAD_DIM * (3.5 if backward else 1.0)


# --------------------------------------------------------------------------- implementations


def qkv_call(pattern: Pattern, mask: masks.Mask, backend: str) -> Call:
    kwargs = {"causal": True} if pattern.causal else {"mask": mask}

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return qkv.attention(q, k, v, backend=backend, **kwargs)

    return run


def sdpa_call(pattern: Pattern, dense: torch.Tensor | None) -> Call:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if pattern.causal:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

    return run


@dataclasses.dataclass
class FlexSetup:
    call: Call | None = None
    block_mask_s: float | None = None  # building the BlockMask (compiled create_block_mask)
    compile_s: float | None = None  # the first call: Dynamo + Inductor + the C++ compiler
    error: str | None = None


def short_error(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:200]


def flex_setup(pattern: Pattern, mask: masks.Mask, n: int, q, k, v) -> FlexSetup:
    """Build the block mask and compile flex_attention for this shape (a fresh compilation:
    Dynamo's caches are reset first), timing both; errors are recorded, not raised."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    setup = FlexSetup()
    try:
        torch._dynamo.reset()
        mask_mod = pattern.make_mask_mod(n, mask)
        start = time.perf_counter()
        block_mask = torch.compile(create_block_mask)(
            mask_mod, None, None, n, n, device="cpu", BLOCK_SIZE=FLEX_BLOCK
        )
        setup.block_mask_s = time.perf_counter() - start
        flex = torch.compile(flex_attention, dynamic=False)

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return flex(q, k, v, block_mask=block_mask)

        start = time.perf_counter()
        with torch.no_grad():
            run(q, k, v)
        setup.compile_s = time.perf_counter() - start
        setup.call = run
    except Exception as error:  # a compiler or runtime failure is a result, not a crash
        setup.error = short_error(error)
    return setup


class Runner:
    """One implementation's call in a timing group. Records the CPU pressure during each call
    (Linux PSI: the fraction of the call during which some task waited for a CPU); after an
    error it records the message and does nothing more."""

    def __init__(self, run: Callable[[], object]):
        self.run = run
        self.error: str | None = None
        self.pressure: list[float] = []

    def __call__(self) -> None:
        if self.error is not None:
            return
        before, start = cpu_pressure_total_s(), time.perf_counter()
        try:
            self.run()
        except Exception as error:
            self.error = short_error(error)
            return
        elapsed, after = time.perf_counter() - start, cpu_pressure_total_s()
        if before is not None and after is not None:
            self.pressure.append((after - before) / elapsed)


def run_once(
    call: Call,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    backward: bool,
) -> None:
    if backward:
        call(q, k, v).backward(grad)
    else:
        with torch.no_grad():
            call(q, k, v)


# --------------------------------------------------------------------------- quiet rounds


@dataclasses.dataclass
class QuietGate:
    """Waits before each timed round until other processes leave the CPUs alone, within a time
    budget."""

    waited_s: float = 0.0
    rounds_waited: int = 0

    def __call__(self) -> None:
        start = time.perf_counter()
        waited = False
        while self.waited_s + (time.perf_counter() - start) < QUIET_MAX_TOTAL_S:
            busy = cpu_busy_fraction(QUIET_SAMPLE_S)
            if busy is None or busy <= QUIET_BUSY:
                break
            if time.perf_counter() - start > QUIET_MAX_WAIT_S:
                break
            waited = True
            time.sleep(1.0)
        if waited:
            self.waited_s += time.perf_counter() - start
            self.rounds_waited += 1
            progress(
                f"[quiet] waited {time.perf_counter() - start:.0f} s for other processes "
                f"({self.waited_s:.0f} s of {QUIET_MAX_TOTAL_S:.0f} s so far)"
            )


# --------------------------------------------------------------------------- the benchmark


@dataclasses.dataclass
class Row:
    """All figures of one (pattern, N, implementation)."""

    pattern: str
    n: int
    impl: str
    fwd_times_ms: list[float] = dataclasses.field(default_factory=list)
    fwdbwd_times_ms: list[float] = dataclasses.field(default_factory=list)
    fwd_pressure: float | None = None  # median CPU pressure during the timed calls
    fwdbwd_pressure: float | None = None
    fwd_note: str | None = None  # why there is no figure: skipped (reason) or the error
    fwdbwd_note: str | None = None
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    fwd_vs_sdpa: float | None = None
    fwdbwd_vs_sdpa: float | None = None
    fwd_vs_flex: float | None = None
    fwd_eff_gflops: float | None = None
    fwdbwd_eff_gflops: float | None = None
    fwd_kept_gflops: float | None = None
    fwdbwd_kept_gflops: float | None = None
    fwd_kept_frac: float | None = None  # kept-tile rate / matmul rate
    fwdbwd_kept_frac: float | None = None


@dataclasses.dataclass
class Shape:
    """Per (pattern, N): sparsity, and what building and compiling Flex cost."""

    pattern: str
    n: int
    density: float
    kept_tiles: int
    total_tiles: int
    flex_block_mask_s: float | None = None
    flex_compile_s: float | None = None
    flex_error: str | None = None
    dropped: str | None = None  # the whole (pattern, N) was not run, and why


@dataclasses.dataclass
class Settings:
    sizes: tuple[int, ...]
    max_repeats: dict[int, int]  # by N; fewer at large N
    long_check: bool
    fresh_compile_cache: bool  # Flex compile times with an empty Inductor cache
    flex_sizes: tuple[int, ...] | None  # the N at which Flex runs (None: all)
    dropped: dict[tuple[str, int], str]  # (pattern, N) not run, with the reason
    runtime_budget_s: float  # no new (pattern, N) starts after this


FULL = Settings(
    sizes=(4096, 8192, 16384, 32768, 65536),
    max_repeats={4096: 5, 8192: 5, 16384: 3, 32768: 3, 65536: 2},
    long_check=True,
    fresh_compile_cache=True,
    flex_sizes=None,
    dropped={("causal", 65536): CAUSAL_DROP},
    runtime_budget_s=25 * 60.0,
)
QUICK = Settings(
    sizes=(2048, 4096),
    max_repeats={},
    long_check=False,
    fresh_compile_cache=False,
    flex_sizes=(2048,),
    dropped={},
    runtime_budget_s=10 * 60.0,
)


def impls_for(pattern: Pattern) -> tuple[str, ...]:
    return ("qkv", "tiled", "sdpa", "flex") if pattern.causal else ("qkv", "sdpa", "flex")


def repeats_rule(max_repeats: int) -> Callable[[Mapping[str, float]], dict[str, int]]:
    """Each implementation gets as many timed calls as fit in GROUP_BUDGET_S by its warm-up
    call, at least 1 and at most `max_repeats`."""

    def rule(warm: Mapping[str, float]) -> dict[str, int]:
        return {
            impl: max(1, min(max_repeats, int(GROUP_BUDGET_S / max(t, 1e-9))))
            for impl, t in warm.items()
        }

    return rule


class Bench:
    """The timing phase: state shared across (pattern, N) groups."""

    def __init__(self, settings: Settings, gate: QuietGate, started: float):
        self.settings = settings
        self.gate = gate
        self.started = started
        self.rows: list[Row] = []
        self.shapes: list[Shape] = []
        self.last_fwd_s: dict[tuple[str, str], tuple[int, float]] = {}  # (pattern, impl)

    def skip_reason(self, pattern: Pattern, impl: str, n: int) -> str | None:
        """Why `impl` is not run at this shape, or None."""
        flex_sizes = self.settings.flex_sizes
        if impl == "flex" and flex_sizes is not None and n not in flex_sizes:
            return "skipped (`--quick` compiles Flex at the smallest N only)"
        if impl == "sdpa" and n > SDPA_MAX_N:
            mask_note = (
                "" if pattern.causal else f"; the dense bool mask alone is {n * n / 2**30:.0f} GiB"
            )
            return f"skipped (N > {SDPA_MAX_N}: SDPA pays N² time{mask_note})"
        last = self.last_fwd_s.get((pattern.name, impl))
        if last is not None and impl in ("sdpa", "flex"):
            n0, t0 = last
            predicted = t0 * (n / n0) ** (2 if impl == "sdpa" else 1)
            if predicted > MAX_CALL_S:
                return f"skipped (one forward predicted at {predicted:.0f} s > {MAX_CALL_S:.0f} s)"
        return None

    def measure(self, pattern: Pattern, n: int, step: str) -> None:
        mask = pattern.make_mask(n)
        sp = sparsity(mask, n)
        shape = Shape(pattern.name, n, sp.density, sp.kept_tiles, sp.total_tiles)
        self.shapes.append(shape)
        impls = impls_for(pattern)
        rows = {impl: Row(pattern.name, n, impl) for impl in impls}
        self.rows += rows.values()
        reason = self.settings.dropped.get((pattern.name, n))
        if reason is None and time.perf_counter() - self.started > self.settings.runtime_budget_s:
            reason = f"runtime budget of {self.settings.runtime_budget_s / 60:.0f} min reached"
        if reason is not None:
            shape.dropped = reason
            for row in rows.values():
                row.fwd_note = row.fwdbwd_note = f"not run ({reason.split(':')[0]})"
            progress(f"{step} {pattern.name} N={n}: not run ({reason})")
            return
        progress(
            f"{step} {pattern.name} N={n}: density {sp.density:.4f}, "
            f"{sp.kept_tiles}/{sp.total_tiles} tiles kept"
        )
        skips = {impl: self.skip_reason(pattern, impl, n) for impl in impls}
        dense = None
        if skips["sdpa"] is None and not pattern.causal:
            dense = mask.to_dense(n, n)
        calls: dict[str, Call] = {
            "qkv": qkv_call(pattern, mask, "auto"),
            "tiled": qkv_call(pattern, mask, "tiled"),
            "sdpa": sdpa_call(pattern, dense),
        }
        for backward in (False, True):
            kind = "fwd+bwd" if backward else "fwd"
            q, k, v, grad = make_inputs(n, requires_grad=backward)
            if not backward and skips["flex"] is None:
                setup = flex_setup(pattern, mask, n, q, k, v)
                shape.flex_block_mask_s, shape.flex_compile_s = setup.block_mask_s, setup.compile_s
                shape.flex_error = setup.error
                if setup.call is not None:
                    calls["flex"] = setup.call
                    progress(
                        f"{step} {pattern.name} N={n} flex: block mask {setup.block_mask_s:.1f} s, "
                        f"compile (first call) {setup.compile_s:.1f} s"
                    )
                else:
                    skips["flex"] = f"failed: {setup.error}"
                    progress(f"{step} {pattern.name} N={n} flex failed: {setup.error}")
            active = {
                impl: Runner(functools.partial(run_once, calls[impl], q, k, v, grad, backward))
                for impl in impls
                if skips[impl] is None and not (backward and impl == "flex")
            }

            def clear_grads(q=q, k=k, v=v) -> None:
                q.grad = k.grad = v.grad = None

            label = f"{step} {pattern.name:10s} N={n:5d} {kind:7s}"
            max_repeats = self.settings.max_repeats.get(n, 1)
            times = interleave(
                active, repeats_rule(max_repeats), label, clear_grads, before_round=self.gate
            )
            prefix = "fwdbwd" if backward else "fwd"
            for impl, row in rows.items():
                runner = active.get(impl)
                if runner is None:
                    note = "forward only" if impl == "flex" and backward else skips[impl]
                    setattr(row, f"{prefix}_note", note)
                    continue
                if runner.error is not None:
                    setattr(row, f"{prefix}_note", f"failed: {runner.error}")
                    progress(f"{label} {impl} failed: {runner.error}")
                    continue
                ms = [t * 1e3 for t in times[impl]]
                setattr(row, f"{prefix}_times_ms", ms)
                if runner.pressure[1:]:
                    setattr(row, f"{prefix}_pressure", statistics.median(runner.pressure[1:]))
                median = statistics.median(ms)
                rate = effective_flops(n, sp.density, backward) / median / 1e6
                progress(
                    f"{label} {impl:5s} {median:9.1f} ms  {rate:6.1f} effective GFLOP/s "
                    f"(median of {len(ms)})"
                )
                if not backward:
                    self.last_fwd_s[(pattern.name, impl)] = (n, median / 1e3)
            del q, k, v, grad, active, times
        calls.clear()
        del dense


def group_order(settings: Settings) -> list[tuple[int, Pattern]]:
    """(N, pattern) by N, except that the slowest comparison (causal, above SDPA_MAX_N) runs
    last, so that the runtime budget drops it before anything else."""
    order = [(n, p) for n in settings.sizes for p in PATTERNS]
    last = [(n, p) for n, p in order if p.causal and n > SDPA_MAX_N]
    return [g for g in order if g not in last] + last


def measure_times(settings: Settings, gate: QuietGate, started: float) -> Bench:
    bench = Bench(settings, gate, started)
    order = group_order(settings)
    for i, (n, pattern) in enumerate(order, start=1):
        bench.measure(pattern, n, f"[time {i:2d}/{len(order)}]")
    return bench


def derive(rows: list[Row], shapes: list[Shape], ceiling: float) -> None:
    """Medians, rates, fractions of the matmul rate, and ratios against SDPA and Flex."""
    by_shape = {(s.pattern, s.n): s for s in shapes}
    for row in rows:
        shape = by_shape[(row.pattern, row.n)]
        for prefix, backward in (("fwd", False), ("fwdbwd", True)):
            times = getattr(row, f"{prefix}_times_ms")
            if not times:
                continue
            ms = statistics.median(times)
            setattr(row, f"{prefix}_ms", ms)
            eff = effective_flops(row.n, shape.density, backward) / ms / 1e6
            setattr(row, f"{prefix}_eff_gflops", eff)
            if row.impl in ("qkv", "tiled"):
                kept = kept_tile_flops(shape.kept_tiles, backward) / ms / 1e6
                setattr(row, f"{prefix}_kept_gflops", kept)
                setattr(row, f"{prefix}_kept_frac", kept / ceiling)
    by_key = {(r.pattern, r.n, r.impl): r for r in rows}
    for row in rows:
        for prefix in ("fwd", "fwdbwd"):
            ms = getattr(row, f"{prefix}_ms")
            anchors = (
                (("sdpa", prefix), ("flex", prefix)) if prefix == "fwd" else (("sdpa", prefix),)
            )
            for anchor, p in anchors:
                other = by_key.get((row.pattern, row.n, anchor))
                other_ms = getattr(other, f"{p}_ms") if other else None
                if ms is not None and other_ms is not None:
                    setattr(row, f"{prefix}_vs_{anchor}", other_ms / ms)


# --------------------------------------------------------------------------- memory probes


@dataclasses.dataclass
class Probe:
    """One memory measurement of `qkv.attention`, run in its own process."""

    pattern: str
    n: int
    backward: bool
    threads: int


@dataclasses.dataclass
class LongCheck:
    pattern: str
    n: int
    result: ProbeResult


def run_probe(probe: Probe) -> ProbeResult:
    """Body of the probe process: build inputs, warm up tiny, record the baseline, run once."""
    torch.set_num_threads(probe.threads)
    pattern = PATTERN_BY_NAME[probe.pattern]
    q, k, v, grad = make_inputs(probe.n, requires_grad=probe.backward)
    inputs_mib = sum(t.numel() * t.element_size() for t in (q, k, v, grad)) / 2**20
    # Lazy library set-up (kernels, thread pools, autograd engine) is not the attention's memory.
    warm_n = 512
    wq, wk, wv, wgrad = make_inputs(warm_n, requires_grad=probe.backward)
    warm_call = qkv_call(pattern, pattern.make_mask(warm_n), "auto")
    run_once(warm_call, wq, wk, wv, wgrad, probe.backward)
    del wq, wk, wv, wgrad
    call = qkv_call(pattern, pattern.make_mask(probe.n), "auto")
    baseline = reset_peak_rss()
    start = time.perf_counter()
    run_once(call, q, k, v, grad, probe.backward)
    wall = time.perf_counter() - start
    return ProbeResult(peak_mib=peak_rss_mib() - baseline, inputs_mib=inputs_mib, wall_s=wall)


def probe_main(spec: str) -> None:
    """Entry point of a probe process: print its ProbeResult as one JSON line."""
    limit_address_space(PROBE_ADDRESS_LIMIT)
    print_probe_result(run_probe(Probe(**json.loads(spec))))


def long_checks(threads: int) -> list[LongCheck]:
    checks = []
    for name in LONG_PATTERNS:
        progress(f"[long] {name} qkv fwd+bwd N={LONG_N} in its own process...")
        probe = Probe(name, LONG_N, True, threads)
        result = measure_in_process(Path(__file__), vars(probe), LONG_TIMEOUT_S)
        shown = (
            f"peak {result.peak_mib:.1f} MiB beyond inputs, {result.wall_s:.1f} s"
            if result.error is None
            else result.error
        )
        progress(f"[long] {name} qkv fwd+bwd N={LONG_N}: {shown}")
        checks.append(LongCheck(name, LONG_N, result))
    return checks


# --------------------------------------------------------------------------- targets


@dataclasses.dataclass
class Target:
    name: str
    threshold: str
    measured: float | None
    passed: bool | None  # None: not measured in this run
    unit: str = "×"


def evaluate_targets(rows: list[Row], longs: list[LongCheck]) -> list[Target]:
    by_key = {(r.pattern, r.n, r.impl): r for r in rows}

    def value(pattern: str, n: int, impl: str, field: str) -> float | None:
        row = by_key.get((pattern, n, impl))
        return getattr(row, field) if row else None

    def target(name: str, measured: float | None, threshold: float, at_least: bool, unit: str):
        sign = "≥" if at_least else "≤"
        shown = f"{100 * threshold:.0f}%" if unit == "%" else f"{threshold:g}{unit}"
        passed = None
        if measured is not None:
            passed = measured >= threshold if at_least else measured <= threshold
        return Target(name, f"{sign} {shown}", measured, passed, unit)

    targets = [
        target(
            "sliding window, N=16384, fwd: speed ×SDPA with the dense bool mask",
            value("sliding", 16384, "qkv", "fwd_vs_sdpa"),
            30.0,
            True,
            "×",
        ),
        target(
            "sliding window, N=16384, fwd: speed ×compiled FlexAttention (compile excluded)",
            value("sliding", 16384, "qkv", "fwd_vs_flex"),
            1.5,
            True,
            "×",
        ),
    ]
    for prefix, label in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd")):
        t32, t16 = (value("sliding", n, "qkv", f"{prefix}_ms") for n in (32768, 16384))
        ratio = t32 / t16 if t32 is not None and t16 is not None else None
        targets.append(
            target(f"sliding window, {label}: time(N=32768) / time(N=16384)", ratio, 2.3, False, "")
        )
    long = next((c.result for c in longs if c.pattern == "longformer"), None)
    targets.append(
        target(
            f"Longformer, fwd+bwd, N={LONG_N}: peak MiB beyond inputs",
            long.peak_mib if long else None,
            LONG_TARGET_MIB,
            False,
            " MiB",
        )
    )
    for prefix, label in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd")):
        targets.append(
            target(
                f"sliding window, N=16384, {label}: kept-tile rate as % of fp32 matmul",
                value("sliding", 16384, "qkv", f"{prefix}_kept_frac"),
                0.5,
                True,
                "%",
            )
        )
    return targets


# --------------------------------------------------------------------------- report


def dispatch_choices() -> dict[str, str]:
    """Which backend `auto` picks for each pattern (at N=4096)."""
    n = 4096
    q = torch.empty(BATCH, HEADS, n, HEAD_DIM, dtype=DTYPE)
    choices = {}
    for p in PATTERNS:
        kwargs = {"causal": True} if p.causal else {"mask": p.make_mask(n)}
        choices[p.name] = qkv.dispatch(q, q, q, **kwargs).backend.name
    return choices


def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def ratio_cell(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def kept_cell(rate: float | None, frac: float | None) -> str:
    return "—" if rate is None else f"{rate:.1f} ({100 * frac:.0f}%)"


def time_cell(
    ms: float | None, note: str | None, times: list[float], pressure: float | None
) -> str:
    if ms is None:  # the reason is listed under "Not run"
        return note.split(" (")[0].split(":")[0] if note else "—"
    flag = " †" if pressure is not None and pressure > CONTENDED else ""
    return f"{ms:.1f} ({len(times)}){flag}"


def shape_table(shapes: list[Shape], pattern: str) -> list[str]:
    lines = [
        "| N | density | kept 64×64 tiles | Flex block mask s | Flex compile s | note |",
        "|---:|---:|---:|---:|---:|:---|",
    ]
    for s in (s for s in shapes if s.pattern == pattern):
        note = ""
        if s.dropped:
            note = f"not run: {s.dropped}"
        elif s.flex_error:
            note = f"Flex: {s.flex_error}"
        lines.append(
            f"| {s.n} | {s.density:.4f} | {s.kept_tiles} / {s.total_tiles} "
            f"({100 * s.kept_tiles / s.total_tiles:.1f}%) | {fmt(s.flex_block_mask_s, '.1f')} "
            f"| {fmt(s.flex_compile_s, '.1f')} | {note} |"
        )
    return lines


def results_table(rows: list[Row], pattern: str) -> list[str]:
    lines = [
        "| N | impl | fwd ms (n) | fwd ×SDPA | fwd ×Flex | fwd eff GFLOP/s "
        "| fwd kept-tile GFLOP/s (% matmul) | fwd+bwd ms (n) | fwd+bwd ×SDPA "
        "| fwd+bwd eff GFLOP/s | fwd+bwd kept-tile GFLOP/s (% matmul) "
        "| CPU pressure fwd / fwd+bwd |",
        "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in (r for r in rows if r.pattern == pattern):
        lines.append(
            f"| {r.n} | {r.impl} "
            f"| {time_cell(r.fwd_ms, r.fwd_note, r.fwd_times_ms, r.fwd_pressure)} "
            f"| {ratio_cell(r.fwd_vs_sdpa)} | {ratio_cell(r.fwd_vs_flex)} "
            f"| {fmt(r.fwd_eff_gflops, '.1f')} | {kept_cell(r.fwd_kept_gflops, r.fwd_kept_frac)} "
            f"| {time_cell(r.fwdbwd_ms, r.fwdbwd_note, r.fwdbwd_times_ms, r.fwdbwd_pressure)} "
            f"| {ratio_cell(r.fwdbwd_vs_sdpa)} | {fmt(r.fwdbwd_eff_gflops, '.1f')} "
            f"| {kept_cell(r.fwdbwd_kept_gflops, r.fwdbwd_kept_frac)} "
            f"| {pct(r.fwd_pressure)} / {pct(r.fwdbwd_pressure)} |"
        )
    return lines


def long_table(longs: list[LongCheck]) -> list[str]:
    lines = [
        "| pattern | N | inputs MiB | peak MiB beyond inputs | wall s | note |",
        "|:---|---:|---:|---:|---:|:---|",
    ]
    for c in longs:
        r = c.result
        lines.append(
            f"| {PATTERN_BY_NAME[c.pattern].title} | {c.n} | {fmt(r.inputs_mib, '.0f')} "
            f"| {fmt(r.peak_mib, '.1f')} | {fmt(r.wall_s, '.1f')} | {r.error or ''} |"
        )
    return lines


def targets_table(targets: list[Target]) -> list[str]:
    lines = ["| target | threshold | measured | result |", "|:---|:---|---:|:---|"]
    for t in targets:
        if t.measured is None:
            shown = "—"
        elif t.unit == "%":
            shown = f"{100 * t.measured:.0f}%"
        elif t.unit == " MiB":
            shown = f"{t.measured:.1f} MiB"
        else:
            shown = f"{t.measured:.2f}{t.unit}"
        result = {True: "PASS", False: "**FAIL**", None: "not measured"}[t.passed]
        lines.append(f"| {t.name} | {t.threshold} | {shown} | {result} |")
    return lines


def not_run_lines(rows: list[Row], shapes: list[Shape]) -> list[str]:
    lines = []
    for s in shapes:
        if s.dropped:
            lines.append(f"- {PATTERN_BY_NAME[s.pattern].title}, N={s.n}: {s.dropped}.")
    skipped: dict[str, list[str]] = {}
    for r in rows:
        for note, kind in ((r.fwd_note, "fwd"), (r.fwdbwd_note, "fwd+bwd")):
            if note and (note.startswith("skipped") or note.startswith("failed")):
                where = f"{PATTERN_BY_NAME[r.pattern].title} N={r.n} {kind}"
                skipped.setdefault(f"`{r.impl}` {note}", []).append(where)
    for note, where in skipped.items():
        lines.append(f"- {note}: {', '.join(where)}.")
    lines.append(
        "- Flex forward + backward is not run (forward only, as specified); Flex compile time is "
        "reported apart from its steady-state time."
    )
    return lines


def render(report: dict[str, object], bench: Bench, longs: list[LongCheck]) -> str:
    info = report["machine"]
    ceiling = report["ceiling"]
    settings = report["settings"]
    load = report["load_average_1min"]
    pressure = report["cpu_pressure"]
    gate = report["quiet_gate"]
    choices = report["auto_dispatch"]
    repeats = ", ".join(f"{r} at N={n}" for n, r in settings["max_repeats_by_n"].items())
    cache = (
        "an empty Inductor cache (a fresh `TORCHINDUCTOR_CACHE_DIR` for the run), so the first "
        "shape compiles everything and later ones reuse what Inductor and the C++ compiler "
        "already built in this run"
        if settings["fresh_compile_cache"]
        else "Inductor's on-disk cache as it was (`--quick`), so compile times may be cache hits"
    )
    lines = [
        "## Sparse attention (`benchmarks/sparse.py`)",
        "",
        "Generated by `benchmarks/sparse.py`; regenerate it, never edit the numbers by hand.",
        "",
        f"- **Date:** {info['date_utc']}",
        f"- **Machine:** {info['uname']}; CPU {info['cpu_model']}; nproc {info['nproc']}; "
        f"CPU capability {info['cpu_capability']}",
        f"- **Software:** torch {info['torch']}, `torch.get_num_threads()` = "
        f"{info['torch_threads']}, Python {info['python']}",
        f"- **Command:** `{report['command']}` (total runtime {report['runtime_s'] / 60:.1f} min)",
        f"- **Load:** 1-minute load average {load['start']:.2f} at the start, {load['end']:.2f} "
        f"at the end, on {info['nproc']} CPUs; CPU pressure (the share of the run's wall time "
        f"during which some task waited for a CPU, Linux PSI) {pct(pressure['run_fraction'])}; "
        f"the quiet gate waited {gate['waited_s']:.0f} s before {gate['rounds_waited']} rounds",
        f"- **Shapes:** fp32, B={BATCH}, H={HEADS}, D={HEAD_DIM}, Nq = Nk = N, CPU, one run",
        "",
        "### Method",
        "",
        "- Patterns (`from qkv import masks`): "
        + "; ".join(f"{p.title}: `{p.code}`" for p in PATTERNS)
        + ". `auto` dispatches to "
        + ", ".join(f"`{choices[p.name]}` for {p.title.lower()}" for p in PATTERNS)
        + " (checked with `qkv.dispatch`).",
        "- Implementations: `qkv` = `qkv.attention(q, k, v, <pattern>)` with backend `auto`; "
        '`tiled` = the same with `backend="tiled"` (causal only, where `auto` is SDPA); `sdpa` '
        "= `F.scaled_dot_product_attention(q, k, v, attn_mask=M.to_dense(N, N))` "
        "(`is_causal=True` for causal); `flex` = `torch.compile(flex_attention, dynamic=False)` "
        "with a block mask from `torch.compile(create_block_mask)` of an equivalent `mask_mod` "
        f"(BLOCK_SIZE={FLEX_BLOCK}, qkv's tile; Flex's default is 128), forward only. Each "
        "`mask_mod` is checked equal to `Mask.to_dense` at "
        f"N={report['check_n']} (BigBird's indexes the Mask's own 64×64 tile table, which is "
        "exactly its block table). Before each (pattern, N) Dynamo's caches are reset, so Flex's "
        f"first call is a compilation: it is timed apart ('Flex compile s'), with {cache}.",
        f"- Time: median of the timed calls after one warm-up call; each implementation gets as "
        f"many timed calls as fit in {GROUP_BUDGET_S:.0f} s by its warm-up call, at least 1 and "
        f"at most {repeats}; the count is shown as `(n)`. Forward under `torch.no_grad()`, "
        "forward + backward as `out.backward(grad)` with a fixed random `grad`, gradients "
        "cleared between calls. For each (pattern, N, fwd | fwd+bwd) the implementations take "
        "turns, round after round. The (pattern, N) groups run by N, except causal above "
        f"N={SDPA_MAX_N} (the slowest comparison), which runs last; no group starts once the "
        "run has used its time budget "
        f"({fmt(settings['runtime_budget_s'] / 60, '.0f')} min): see 'Not run'.",
        "- Quiet gate: on this 2-CPU machine, shared with other work, a second process taking a "
        "CPU slows `qkv` (hundreds of small parallel regions per call, each waiting for both "
        "threads) by up to ~20×, but one big SDPA or Flex call only ~2×: contention does not hit "
        "them alike, and interleaving alone cannot cancel it. So before each timed round the "
        f"script sleeps {QUIET_SAMPLE_S} s, reads how busy the CPUs were meanwhile "
        "(`/proc/stat`: other processes' use), and waits (≤ "
        f"{QUIET_MAX_WAIT_S:.0f} s per round, ≤ {QUIET_MAX_TOTAL_S:.0f} s per run) while more "
        f"than {100 * QUIET_BUSY:.0f}% of the CPUs' time was busy. Other processes can still "
        "start during a round, so the CPU pressure (Linux PSI: the share of the call during "
        "which some task waited for a CPU) is recorded during every timed call; its median per "
        f"implementation is reported, and † marks a time whose median is above "
        f"{100 * CONTENDED:.0f}% (measured under contention: read it with care).",
        "- **×SDPA** = `time_sdpa / time_impl`, **×Flex** = `time_flex / time_impl` (steady "
        "state, compile excluded), both measured in the same run (> 1: faster than the other).",
        "- **eff GFLOP/s** = FlashAttention's count of the allowed pairs, `4·B·H·N²·D·density` "
        "(×3.5 for forward + backward), divided by the time. **kept-tile GFLOP/s** = the same "
        "count over every non-empty 64×64 tile, `4·B·H·(kept tiles·64·64)·D` (×3.5), i.e. the "
        "work the tiled kernel really multiplies, and in brackets its fraction of torch's fp32 "
        "matmul rate in the same run (below). Shown for `qkv` and `tiled` only. Densities are "
        "exact (full tiles counted whole, partial tiles evaluated element-wise).",
        "- Memory: `qkv` forward + backward at N=65536 in its own Python process, as in "
        "`core.py`: after building q, k, v and the upstream grad and a warm-up call at N=512, "
        "the peak-RSS mark is reset (`/proc/self/clear_refs`) and the figure is the peak RSS "
        "(VmHWM) during the measured call minus the RSS before it. It includes what the call "
        "returns (the output and dq, dk, dv: 128 MiB each at N=65536).",
        "",
        "### Ceiling: torch fp32 matmul",
        "",
        f"`{MATMUL_SIZE}×{MATMUL_SIZE} @ {MATMUL_SIZE}×{MATMUL_SIZE}`, median of "
        f"{MATMUL_REPEATS} after a warm-up, measured before and after the attention timings: "
        f"{ceiling['before_gflops']:.1f} and {ceiling['after_gflops']:.1f} GFLOP/s. "
        f"The ceiling used is the higher, **{ceiling['gflops']:.1f} GFLOP/s**.",
        "",
    ]
    for p in PATTERNS:
        lines += [
            f"### {p.title} (`{p.code}`)",
            "",
            *shape_table(bench.shapes, p.name),
            "",
            *results_table(bench.rows, p.name),
            "",
        ]
    lines += [f"### Memory at N={LONG_N}", ""]
    if longs:
        lines += [
            f"`qkv` forward + backward, B={BATCH}, H={HEADS}, D={HEAD_DIM}, fp32, each in its "
            "own process, run once; inputs = q, k, v and the upstream grad. The process is "
            f"capped at {PROBE_ADDRESS_LIMIT / 2**30:.0f} GiB of address space.",
            "",
            *long_table(longs),
            "",
        ]
    else:
        lines += ["Skipped (`--quick`).", ""]
    lines += ["### Not run", "", *not_run_lines(bench.rows, bench.shapes), ""]
    targets = [Target(**t) for t in report["targets"]]
    lines += ["### Targets", "", *targets_table(targets), ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="N in {2048, 4096}, 1 repeat")
    parser.add_argument(
        "--out", type=Path, help="write this script's section of this Markdown file, JSON beside"
    )
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # internal: one memory probe
    return parser.parse_args(argv)


def json_path(out: Path) -> Path:
    """docs/benchmarks.md → docs/benchmarks-sparse.json (core.py owns docs/benchmarks.json)."""
    return out.with_name(f"{out.stem}-{SECTION}.json")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.probe:
        probe_main(args.probe)
        return
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    pressure_start = cpu_pressure_total_s()
    settings = QUICK if args.quick else FULL
    cache_dir = None
    if settings.fresh_compile_cache:
        cache_dir = tempfile.mkdtemp(prefix="sparse-bench-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    threads = torch.get_num_threads()
    command = shlex.join(["python", *sys.argv])
    progress(f"{command}: torch {torch.__version__}, {threads} threads")

    check_n = CHECK_N
    for pattern in PATTERNS:
        check_mask_mod(pattern, check_n)
        mask = pattern.make_mask(check_n)
        exact = mask.density(check_n, check_n)
        if abs(sparsity(mask, check_n).density - exact) > 1e-12:
            raise AssertionError(f"{pattern.name}: tile density differs from Mask.density")
    progress(f"[check] mask_mods and tile densities equal the qkv Masks at N={check_n}")

    gate = QuietGate()
    ceiling_before = matmul_gflops()
    progress(f"[ceiling] fp32 matmul {ceiling_before:.1f} GFLOP/s")
    bench = measure_times(settings, gate, started)
    ceiling_after = matmul_gflops()
    progress(f"[ceiling] fp32 matmul {ceiling_after:.1f} GFLOP/s (after)")
    ceiling = max(ceiling_before, ceiling_after)
    derive(bench.rows, bench.shapes, ceiling)
    longs = long_checks(threads) if settings.long_check else []
    targets = evaluate_targets(bench.rows, longs)
    if cache_dir is not None:
        shutil.rmtree(cache_dir, ignore_errors=True)

    runtime = time.perf_counter() - started
    pressure_end = cpu_pressure_total_s()
    run_pressure = (
        (pressure_end - pressure_start) / runtime
        if pressure_start is not None and pressure_end is not None
        else None
    )
    report: dict[str, object] = {
        "machine": machine_info(),
        "command": command,
        "settings": {
            "dtype": "float32",
            "batch": BATCH,
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "tile": [BLOCK_Q, BLOCK_K],
            "flex_block_size": FLEX_BLOCK,
            "sizes": list(settings.sizes),
            "max_repeats_by_n": {n: settings.max_repeats.get(n, 1) for n in settings.sizes},
            "group_budget_s": GROUP_BUDGET_S,
            "runtime_budget_s": settings.runtime_budget_s,
            "fresh_compile_cache": settings.fresh_compile_cache,
            "dropped": [
                {"pattern": p, "n": n, "reason": r} for (p, n), r in settings.dropped.items()
            ],
        },
        "check_n": check_n,
        "auto_dispatch": dispatch_choices(),
        "ceiling": {
            "shape": [MATMUL_SIZE, MATMUL_SIZE, MATMUL_SIZE],
            "before_gflops": ceiling_before,
            "after_gflops": ceiling_after,
            "gflops": ceiling,
        },
        "shapes": [dataclasses.asdict(s) for s in bench.shapes],
        "results": [dataclasses.asdict(r) for r in bench.rows],
        "long_sequence": [dataclasses.asdict(c) for c in longs],
        "targets": [dataclasses.asdict(t) for t in targets],
        "runtime_s": runtime,
        "load_average_1min": {"start": load_start, "end": os.getloadavg()[0]},
        "cpu_pressure": {"run_fraction": run_pressure},
        "quiet_gate": dataclasses.asdict(gate),
    }
    markdown = render(report, bench, longs)
    if args.out is None:
        print(markdown)
    else:
        write_section(args.out, SECTION, markdown)
        json_path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        progress(f"wrote section '{SECTION}' of {args.out} and {json_path(args.out)}")
    progress(f"total runtime {report['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
