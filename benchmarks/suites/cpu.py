"""The compiled CPU kernel: qkv's `backend="cpu"` against torch SDPA, compiled FlexAttention and
qkv's pure-PyTorch `tiled`, every figure a ratio against an anchor measured in the same run.

- Implementations: `cpu` = `qkv.attention(q, k, v, backend="cpu", ...)`; `sdpa` =
  `F.scaled_dot_product_attention` (its fused CPU kernel; `is_causal=True` for causal, the dense
  bool mask `M.to_dense(N, N)` for a pattern, `enable_gqa=True` for decoding); `tiled` = qkv's
  pure-PyTorch backend; `flex` = `torch.compile(flex_attention, dynamic=False)` with a block
  mask (64-wide blocks) of an equivalent `mask_mod`, forward only, compiled afresh for each case
  in the warm-up round (shown apart, not in the figures); `auto` = `qkv.attention` with the
  default backend.
- Dense and causal: B=1, H=8, D=64, fp32 and bf16 (inputs drawn in that dtype), forward and
  forward + backward. GFLOP/s by FlashAttention's count (forward `4·B·H·N²·D`, halved for
  causal; ×3.5 for forward + backward), with its share of the fp32 matmul ceiling.
- Patterns (the definitions of the `sparse` suite, `benchmarks/suites/sparse.py`): sliding
  window 256, Longformer, BigBird, 8 documents, fp32, and the sliding window in bf16, same
  shapes. **kept-tile GFLOP/s** = the count over every kept 64×64 tile,
  `4·B·H·(kept tiles·64·64)·D` (×3.5), the work the kernel multiplies, with its share of the
  fp32 matmul ceiling in brackets.
- Decoding: one query (Nq=1) against a KV cache, H=32, Hkv=8, D=128, fp32. `copy` =
  `dst.copy_(src)` of a 256 MiB fp32 tensor, timed in the same rounds; its bandwidth counts
  bytes read + written (as STREAM does). **K/V read % of copy** = (K and V bytes / time of the
  call) / (copy bandwidth), taken within each round and the median over rounds.
- Small sizes: dense, N = Nq = Nk, fp32 and bf16: `cpu`, `sdpa` and `auto`, which below a size
  leaves plain requests to SDPA (the cpu/sdpa crossover: `qkv.dispatch.CROSSOVERS`, decided
  by `CpuBackend.crossover`); the table names the backend `auto` picks for each pass
  (`qkv.dispatch`); times in µs.
- Memory: `cpu` forward + backward, each in a fresh process (the runner's probe). **beyond the
  caller's tensors** = the peak beyond the inputs minus what the call hands back to the caller
  (the output and dq, dk, dv: 4 × the size of q).
- Under load: the forward of `cpu`, of `cpu` with its thread placement off (`QKV_CPU_PIN=0`:
  threads not held one per CPU, docs/cpu.md) and of SDPA, alone and with one competing
  CPU-bound process (`python -c 'while True: pass'`, stopped with SIGSTOP for the calls alone
  and resumed with SIGCONT, then 0.3 s to settle, for the loaded ones); within each round every
  implementation runs alone and loaded (the runner's interleaving, no quiet gate),
  **slowdown** = loaded / alone time within a round, the median over rounds.
- bf16 matmul: 15 short samples of torch's bf16 matmul at the start and the end of the run
  (`machine.matmul_spread`), how steady the unit the amx path's products share was.
- The core's own limits: at the start and the end of the run, one thread's rate on each unit
  the kernel multiplies on, in a register-resident loop (`torch.ops.qkv_cpu.peak_gflops`, the
  kernel's `peak.cpp`): float32 FMA (`fma_f32`), bfloat16 dot products (`dp_bf16`, VDPBF16PS,
  where the CPU has AVX512-BF16) and bfloat16 AMX tile products (`amx_bf16`, where the CPU has
  AMX), 5 samples of 0.2 s each; the best sample × the run's threads is the limit (0: not on
  this CPU). The kernel's forward, backward and forward + backward rates in the dense, causal
  and sliding-window cases (kept tiles) are given as a share of the limit of the unit their
  path runs on: float32 on `fma_f32`; bfloat16 on `amx_bf16` (amx path), `dp_bf16`
  (avx512bf16 path), else `fma_f32`. The backward is not timed alone: its time is forward +
  backward's median minus the forward's, its count 2.5× the forward's.
- `cpu avx512bf16` = `cpu` with `QKV_CPU_ISA=avx512bf16` (bfloat16 products on the dot-product
  instruction), in the dense and pattern cases, where the CPU has that path and `auto` takes
  another: the figures the targets of that path read.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import qkv

from .. import machine
from .. import report as rp
from ..probe import bind_call, short_error
from ..results import Results, median_or_none, paired_ratio
from ..runner import interleave
from ..suite import FWD, FWD_BWD, PASSES, Group, Impl, Memory, Probe, Stage, Suite, Target
from . import _attention as A
from . import sparse

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TILE = sparse.TILE
DECODE_HEADS, DECODE_KV_HEADS, DECODE_D = 32, 8, 128
COPY_BYTES = 256 * 2**20  # the bandwidth anchor: a copy of 256 MiB (read it, write it)
MILLION = 1_048_576
SPREAD_SIZE = 1024  # the bf16 matmul sampled at the start and the end of the run
SETTLE_S = 0.3  # after resuming the competing process, before a loaded call
PIN_ENV = "QKV_CPU_PIN"  # "0": the kernel leaves its threads where Linux puts them
UNPINNED = "cpu, QKV_CPU_PIN=0"


# --------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Dense:
    pattern: str  # "dense" or "causal"
    dtype: str
    n: int

    @property
    def causal(self) -> bool:
        return self.pattern == "causal"


@dataclasses.dataclass(frozen=True)
class Pattern(sparse.Case):
    """A pattern of the sparse suite (`pattern`, `n`) in a dtype."""

    dtype: str = "fp32"


@dataclasses.dataclass(frozen=True)
class Decode:
    nq: int
    nk: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def kv_bytes(self) -> int:
        return 2 * self.kv_heads * self.nk * self.head_dim * 4  # K and V, fp32


@dataclasses.dataclass(frozen=True)
class Small:
    dtype: str
    n: int


@dataclasses.dataclass(frozen=True)
class Settings:
    dense_n: int
    sparse_n: int
    patterns: tuple[tuple[str, str], ...]  # (pattern, dtype) at sparse_n
    slow_on: (
        tuple[tuple[str, str], ...] | None
    )  # (pattern, dtype) where Flex, tiled run (None: all)
    decode_nk: int
    small_ns: tuple[int, ...]
    repeats: int  # timed rounds at most (dense, patterns, load)
    small_repeats: int  # timed rounds of the small sizes and decoding
    memory: tuple[tuple[str, int, str], ...]  # (pattern, N, dtype): forward + backward probes
    load_n: tuple[int, int]  # (dense N, sliding window N) of the load test
    budget_s: float  # no timed case starts after this


PATTERN_CASES = (
    *((p, "fp32") for p in ("sliding", "longformer", "bigbird", "document")),
    ("sliding", "bf16"),
)
FULL = Settings(
    dense_n=4096,
    sparse_n=16384,
    patterns=PATTERN_CASES,
    slow_on=None,
    decode_nk=32768,
    small_ns=(64, 128, 256, 512, 1024),
    repeats=5,
    small_repeats=15,
    memory=(("longformer", 65536, "fp32"), ("sliding", MILLION, "bf16")),
    load_n=(4096, 16384),
    budget_s=15 * 60.0,  # then memory and load (≈ 4 min)
)
QUICK = Settings(
    dense_n=512,
    sparse_n=2048,
    patterns=PATTERN_CASES,
    slow_on=(("sliding", "fp32"),),
    decode_nk=4096,
    small_ns=(64, 256),
    repeats=2,
    small_repeats=3,
    memory=(("longformer", 4096, "fp32"), ("sliding", 8192, "bf16")),
    load_n=(512, 2048),
    budget_s=5 * 60.0,
)


# --------------------------------------------------------------------------- implementations


def cpu_call(**kwargs: Any) -> Callable:
    return lambda q, k, v: qkv.attention(q, k, v, backend="cpu", **kwargs)


DP_PATH = "avx512bf16"  # the path of bfloat16 dot products (tiles_dpbf16.h)
DP_IMPL = f"cpu {DP_PATH}"


def _kernel_paths() -> tuple[bool, str | None]:
    """(whether the CPU has DP_PATH, the path `auto` runs), or (False, None) without a kernel."""
    from qkv.kernels import cpu

    try:
        ops = cpu.load()
    except Exception:  # no kernel: the `cpu` rows say why
        return False, None
    return bool(ops.isa_supported(DP_PATH)), str(ops.best_isa())


def dp_belongs(_: Any) -> bool:
    """The forced dot-product path runs where the CPU has it and `cpu` runs another path."""
    has, best = _kernel_paths()
    return has and best != DP_PATH


def on_path(call: Callable, path: str) -> Callable:
    """`call` with QKV_CPU_ISA=path for its duration (the kernel reads it at every call)."""

    def run(*args: Any) -> Any:
        old = os.environ.get("QKV_CPU_ISA")
        os.environ["QKV_CPU_ISA"] = path
        try:
            return call(*args)
        finally:
            if old is None:
                os.environ.pop("QKV_CPU_ISA", None)
            else:
                os.environ["QKV_CPU_ISA"] = old

    return run


def dp_impl(base: Impl) -> Impl:
    return dataclasses.replace(
        base, name=DP_IMPL, make=lambda c: on_path(base.make(c), DP_PATH), when=dp_belongs
    )


def dense_impl(name: str, backend: str) -> Impl:
    return Impl(
        name, lambda c: lambda q, k, v: qkv.attention(q, k, v, backend=backend, causal=c.causal)
    )


def compare(reference: str) -> Callable[[Any, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The largest |difference| of each forward output from `reference`'s, in fp32."""

    def check(case: Any, outputs: dict[str, Any]) -> dict[str, dict[str, Any]]:
        ref = outputs.get(reference)
        if ref is None:
            return {}
        return {
            name: {"max_abs_diff": float((out.float() - ref.float()).abs().max())}
            for name, out in outputs.items()
            if name != reference and isinstance(out, torch.Tensor)
        }

    return check


DENSE = Group(
    name="dense",
    cases=lambda s: [Dense(p, dt, s.dense_n) for dt in DTYPES for p in ("dense", "causal")],
    inputs=lambda c, backward: A.inputs(c.n, backward, dtype=DTYPES[c.dtype]),
    impls=(
        dense_impl("cpu", "cpu"),
        dp_impl(dense_impl("cpu", "cpu")),
        Impl(
            "sdpa",
            lambda c: lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=c.causal),
        ),
        dense_impl("tiled", "tiled"),
    ),
    anchors=("sdpa", "tiled"),
    repeats=lambda s, c: s.repeats,
    round_budget_s=10.0,
    rates={"gflops": lambda c, pass_, _: A.flops(c.n, pass_, 0.5 if c.causal else 1.0)},
    check=compare("sdpa"),
)


def slow_skip(c: Pattern, r: Results) -> str | None:
    """`--quick` compiles Flex and runs `tiled` (slow, and very slow on a busy machine: many small
    parallel regions) on the sliding window fp32 only."""
    only = r.settings.get("slow_on")
    if only is not None and [c.pattern, c.dtype] not in [list(x) for x in only]:
        return "skipped (`--quick` runs Flex and `tiled` on the sliding window fp32 only)"
    return None


def tiled_impl() -> Impl:
    return dataclasses.replace(sparse.qkv_impl("tiled", "tiled"), skip=slow_skip)


def dp_window(c: Pattern) -> bool:
    return c.pattern == "sliding" and c.dtype == "bf16" and dp_belongs(c)


def pattern_cases(s: Settings) -> list[Pattern]:
    return [Pattern(p, s.sparse_n, dt) for p, dt in s.patterns]


PATTERN_GROUP = Group(
    name="patterns",
    cases=pattern_cases,
    inputs=lambda c, backward: A.inputs(c.n, backward, dtype=DTYPES[c.dtype]),
    impls=(
        sparse.qkv_impl("cpu", "cpu"),
        dataclasses.replace(dp_impl(sparse.qkv_impl("cpu", "cpu")), when=dp_window),
        Impl("sdpa", sparse.sdpa),
        Impl("flex", sparse.flex, skip=slow_skip, passes=(FWD,)),
        tiled_impl(),
    ),
    anchors=("sdpa", "flex", "tiled"),
    repeats=lambda s, c: s.repeats,
    round_budget_s=10.0,
    rates={
        "eff": lambda c, pass_, fig: A.flops(c.n, pass_, fig["density"]),
        "kept": lambda c, pass_, fig: A.flops(1, pass_) * TILE * TILE * fig["kept_tiles"],
    },
    check=compare("sdpa"),
    describe=lambda c: sparse.sparsity(c.p.mask(c.n), c.n),
    warm=lambda c: Pattern(c.pattern, 512, c.dtype),
)


def decode_inputs(c: Decode, backward: bool):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, c.heads, c.nq, c.head_dim, generator=gen)
    k, v = (torch.randn(1, c.kv_heads, c.nk, c.head_dim, generator=gen) for _ in range(2))
    return (q, k, v), None


def copy_impl(c: Decode) -> Callable:
    """The bandwidth anchor: one copy of COPY_BYTES, the attention inputs ignored."""
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    return lambda q, k, v: dst.copy_(src)


DECODE = Group(
    name="decode",
    cases=lambda s: [Decode(1, s.decode_nk, DECODE_HEADS, DECODE_KV_HEADS, DECODE_D)],
    inputs=decode_inputs,
    impls=(
        Impl("cpu", lambda c: cpu_call(), passes=(FWD,)),
        Impl(
            "sdpa",
            lambda c: lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            passes=(FWD,),
        ),
        Impl("copy", copy_impl, passes=(FWD,)),
    ),
    passes=(FWD,),
    anchors=("sdpa", "copy"),
    repeats=lambda s, c: s.small_repeats,
    check=lambda c, outs: compare("sdpa")(c, {k: v for k, v in outs.items() if k != "copy"}),
)


def auto_picks(c: Small) -> dict[str, Any]:
    """The backend `auto` dispatches the case to, without and with gradients (`qkv.dispatch`)."""
    picks = {}
    for pass_ in PASSES:
        x = torch.empty(A.BATCH, A.HEADS, c.n, A.HEAD_DIM, dtype=DTYPES[c.dtype])
        x.requires_grad_(pass_ == FWD_BWD)
        picks[f"auto {pass_}"] = qkv.dispatch(x, x, x).backend.name
    return picks


SMALL = Group(
    name="small",
    cases=lambda s: [Small(dt, n) for dt in DTYPES for n in s.small_ns],
    inputs=lambda c, backward: A.inputs(c.n, backward, dtype=DTYPES[c.dtype]),
    impls=(
        Impl("cpu", lambda c: cpu_call()),
        Impl("sdpa", lambda c: F.scaled_dot_product_attention),
        Impl("auto", lambda c: lambda q, k, v: qkv.attention(q, k, v)),
    ),
    anchors=("sdpa",),
    repeats=lambda s, c: s.small_repeats,
    describe=auto_picks,
)


def probes(s: Settings) -> list[Probe]:
    return [Probe("patterns", Pattern(p, n, dt), "cpu", FWD_BWD, 1800.0) for p, n, dt in s.memory]


# --------------------------------------------------------------------------- under load


class Competitor:
    """One CPU-bound process, stopped (SIGSTOP) or running (SIGCONT) between calls."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(SETTLE_S)
        self.stop()

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        time.sleep(0.05)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        time.sleep(SETTLE_S)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def unpinned(call: Callable) -> Callable:
    """`call` with the kernel's thread placement off (`QKV_CPU_PIN=0`, read at every call)."""

    def run(*args: Any) -> Any:
        before = os.environ.get(PIN_ENV)
        os.environ[PIN_ENV] = "0"
        try:
            return call(*args)
        finally:
            if before is None:
                del os.environ[PIN_ENV]
            else:
                os.environ[PIN_ENV] = before

    return run


def load_cases(s: Settings) -> list[tuple[str, Any, dict[str, Callable]]]:
    dense_n, window_n = s.load_n
    window = Pattern("sliding", window_n)
    dense_cpu, window_cpu = cpu_call(), cpu_call(**window.kwargs())
    return [
        (
            "dense fp32",
            Dense("dense", "fp32", dense_n),
            {
                "cpu": dense_cpu,
                UNPINNED: unpinned(dense_cpu),
                "sdpa": F.scaled_dot_product_attention,
            },
        ),
        (
            "sliding window fp32",
            window,
            {"cpu": window_cpu, UNPINNED: unpinned(window_cpu), "sdpa": sparse.sdpa(window)},
        ),
    ]


def under_load(s: Settings, _: Results) -> list[dict[str, Any]]:
    """The forward of each implementation alone and loaded, taking turns in every round."""
    out = []
    for label, case, calls in load_cases(s):
        args, _ = A.inputs(case.n, False)
        competitor = Competitor()
        try:
            bound = {}
            for impl, call in calls.items():
                run, _ = bind_call(call, args, None)
                bound[f"{impl} alone"] = (run, competitor.stop)
                bound[f"{impl} loaded"] = (run, competitor.resume)
            series = interleave(
                bound, s.repeats, round_budget_s=10.0, label=f"[load] {label} N={case.n}"
            )
        finally:
            competitor.close()
        row: dict[str, Any] = {"case": label, "n": case.n, "impls": {}}
        for impl in calls:
            alone, loaded = series[f"{impl} alone"], series[f"{impl} loaded"]
            slow = paired_ratio([loaded.times_s], alone.times_s)  # min(loaded) / alone per round
            row["impls"][impl] = {
                "alone_s": median_or_none(alone.times_s),
                "loaded_s": median_or_none(loaded.times_s),
                "alone_pressure": median_or_none(alone.pressure),
                "loaded_pressure": median_or_none(loaded.pressure),
                "slowdown": slow,
                "error": alone.error or loaded.error,
            }
        out.append(row)
    return out


def tile_spread(_: Settings, __: Results) -> dict[str, Any]:
    """Short samples of torch's bf16 matmul (the tile unit where the CPU has AMX), GFLOP/s."""
    return {"size": SPREAD_SIZE, "gflops": machine.matmul_spread(torch.bfloat16, SPREAD_SIZE)}


PEAK_SAMPLES, PEAK_SAMPLE_S = 5, 0.2
UNITS = {  # the kinds of `torch.ops.qkv_cpu.peak_gflops`: the units the kernel's products run on
    "fma_f32": "float32 FMA",
    "dp_bf16": "bfloat16 dot products, VDPBF16PS",
    "amx_bf16": "bfloat16 AMX tiles",
}


def peak_sample(kind: str) -> float:
    """One thread's register-resident rate of `kind`'s unit, GFLOP/s, in one sample (0.0: not on
    this CPU, or a kernel built before it knew `kind`)."""
    try:
        return float(torch.ops.qkv_cpu.peak_gflops(kind, PEAK_SAMPLE_S))
    except RuntimeError:  # "peak_gflops takes …": an older kernel, the suite still runs
        return 0.0


def core_peaks(_: Settings, __: Results) -> dict[str, Any]:
    """The samples of every unit's one-thread rate, GFLOP/s, and the run's threads."""
    return {
        "threads": torch.get_num_threads(),
        **{k: [peak_sample(k) for _ in range(PEAK_SAMPLES)] for k in UNITS},
    }


# --------------------------------------------------------------------------- the suite's hooks


def requires() -> str | None:
    try:
        from qkv.kernels import cpu
    except ImportError:
        return "needs qkv's compiled CPU kernel (`qkv.kernels.cpu`), which this checkout lacks"
    try:
        cpu.load()
    except Exception as error:  # KernelUnavailable, or anything a broken build raises
        return f"needs qkv's compiled CPU kernel, unavailable here: {short_error(error)}"
    return None


def prepare(_: Settings) -> None:
    sparse.prepare(sparse.QUICK)  # the mask_mods and tile densities against the Masks


def facts(_: Settings) -> dict[str, Any]:
    from qkv.kernels import cpu

    try:
        isa, why = cpu.isa.choose(cpu.load())
    except Exception as error:  # the kernel's API is young: a missing fact must not stop the run
        isa, why = None, f"unknown ({short_error(error)})"
    return {"software": {"qkv CPU kernel path": isa or why}}


def method(r: Results) -> list[str]:
    s = r.settings
    memory = "; ".join(f"{sparse.PATTERNS[p].title} N={n} {dt}" for p, n, dt in s["memory"])
    return [
        f"- Sizes of this run: dense and causal N={s['dense_n']}; patterns N={s['sparse_n']}; "
        f"decoding Nk={s['decode_nk']}; small N in {{{', '.join(map(str, s['small_ns']))}}}; "
        f"memory: {memory}; under load: dense N={s['load_n'][0]}, sliding window "
        f"N={s['load_n'][1]}. The targets are evaluated at these sizes.",
        f"- Timed rounds: at most {s['repeats']} (dense, patterns, load; as many as fit in "
        f"{DENSE.round_budget_s:.0f} s by the warm-up call, at least one, shown as `(n)`), "
        f"{s['small_repeats']} (small sizes, decoding); runtime budget "
        f"{s['budget_s'] / 60:.0f} min for the timed cases.",
    ]


# --------------------------------------------------------------------------- report


def diff_column() -> rp.Column:
    return rp.Column(
        "max \\|Δ\\| vs SDPA",
        lambda r: "—" if (d := r.extra("max_abs_diff")) is None else f"{d:.1e}",
    )


DENSE_TABLE = rp.Table(
    (
        rp.field("pattern", align="l"),
        rp.field("dtype", align="l"),
        rp.field("n", "N"),
        rp.impl_column(),
        rp.time_column(FWD, "fwd ms (n)", counts=True),
        rp.ratio_column(FWD, "sdpa", "fwd ×SDPA"),
        rp.ratio_column(FWD, "tiled", "fwd ×tiled"),
        rp.rate_column(FWD, "gflops", "fwd GFLOP/s (% matmul)", share="also"),
        rp.time_column(FWD_BWD, "fwd+bwd ms (n)", counts=True),
        rp.ratio_column(FWD_BWD, "sdpa", "fwd+bwd ×SDPA"),
        rp.ratio_column(FWD_BWD, "tiled", "fwd+bwd ×tiled"),
        rp.rate_column(FWD_BWD, "gflops", "fwd+bwd GFLOP/s (% matmul)", share="also"),
        diff_column(),
        rp.pressure_column(PASSES, "CPU pressure fwd / fwd+bwd"),
    ),
    lambda r: rp.rows(r, "dense"),
    "Dense and causal",
)


def kept(r: rp.Row) -> str:
    k, total = r.extra("kept_tiles"), r.extra("total_tiles")
    return "—" if k is None else f"{k} / {total} ({100 * k / total:.1f}%)"


def flex_compile_s(r: rp.Row) -> str:
    t = r.timing(FWD, "flex")
    return rp.fmt(t.warmup_s if t else None, ".1f")


SHAPES_TABLE = rp.Table(
    (
        rp.Column("pattern", lambda r: r.case.p.title, "l"),
        rp.field("dtype", align="l"),
        rp.field("n", "N"),
        rp.Column("density", lambda r: rp.fmt(r.extra("density"), ".4f")),
        rp.Column("kept 64×64 tiles", kept),
        rp.Column("Flex block mask s", lambda r: rp.fmt(r.extra("block_mask_s", "flex"), ".1f")),
        rp.Column("Flex compile s", flex_compile_s),
        rp.Column("note", lambda r: r.note or "", "l"),
    ),
    lambda r: rp.case_rows(r, "patterns"),
    "Patterns",
    lambda r: (
        "Patterns as in the `sparse` suite: "
        + "; ".join(f"{p.title}: `{p.code}`" for p in sparse.PATTERNS.values() if not p.causal)
        + "."
    ),
)


def kept_column(pass_: str) -> rp.Column:
    inner = rp.rate_column(pass_, "kept", f"{pass_} kept-tile GFLOP/s (% matmul)", share="also")
    return rp.Column(inner.header, lambda r: inner.cell(r) if r.impl in ("cpu", "tiled") else "—")


PATTERN_TABLE = rp.Table(
    (
        rp.Column("pattern", lambda r: r.case.p.title, "l"),
        rp.field("dtype", align="l"),
        rp.impl_column(),
        rp.time_column(FWD, "fwd ms (n)", counts=True),
        rp.ratio_column(FWD, "sdpa", "fwd ×SDPA"),
        rp.ratio_column(FWD, "flex", "fwd ×Flex"),
        rp.ratio_column(FWD, "tiled", "fwd ×tiled"),
        kept_column(FWD),
        rp.time_column(FWD_BWD, "fwd+bwd ms (n)", counts=True),
        rp.ratio_column(FWD_BWD, "sdpa", "fwd+bwd ×SDPA"),
        rp.ratio_column(FWD_BWD, "tiled", "fwd+bwd ×tiled"),
        kept_column(FWD_BWD),
        diff_column(),
        rp.pressure_column(PASSES, "CPU pressure fwd / fwd+bwd"),
    ),
    lambda r: rp.rows(r, "patterns"),
)


def moved_bytes(r: rp.Row) -> float:
    """Bytes a call moves: K and V read, or the copy's read + written."""
    return 2 * COPY_BYTES if r.impl == "copy" else r.case.kv_bytes


def kv_share(row: rp.Row) -> float | None:
    """(K/V bytes / call time) / (copy bytes / copy time), paired within rounds."""
    ratio = row.ratio(FWD, "copy")
    if ratio is None or row.impl == "copy":
        return None
    return row.case.kv_bytes / (2 * COPY_BYTES) * ratio["median"]


DECODE_TABLE = rp.Table(
    (
        rp.field("nq", "Nq"),
        rp.field("nk", "Nk"),
        rp.impl_column(),
        rp.time_column(FWD, "ms (n)", counts=True, spec=".2f"),
        rp.Column(
            "×SDPA",
            lambda r: (
                "—"
                if r.impl == "copy"
                else rp.fmt((r.ratio(FWD, "sdpa") or {}).get("median"), ".2f")
            ),
        ),
        rp.Column(
            "GB/s",
            lambda r: rp.fmt(
                None if (t := r.median(FWD)) is None else moved_bytes(r) / t / 1e9, ".1f"
            ),
        ),
        rp.Column(
            "K/V read % of copy",
            lambda r: rp.fmt(None if (v := kv_share(r)) is None else 100 * v, ".0f"),
        ),
        diff_column(),
    ),
    lambda r: rp.rows(r, "decode"),
    lambda r: f"Decoding (H={DECODE_HEADS}, Hkv={DECODE_KV_HEADS}, D={DECODE_D}, fp32)",
    lambda r: (
        "GB/s: K and V bytes read per second for `cpu` and `sdpa` (K and V: "
        + ", ".join(f"{c.kv_bytes / 2**20:.0f} MiB" for c in r.case_objects("decode"))
        + f"); bytes read + written per second for `copy` (2 × {COPY_BYTES // 2**20} MiB)."
    ),
)


def auto_pick(r: rp.Row) -> str:
    """The backends `auto` dispatches the case to (`qkv.dispatch`), on its row."""
    case = rp.Row(r.results, r.group, r.case)
    picked = [case.extra(f"auto {pass_}") for pass_ in PASSES]
    if r.impl != "auto":
        return ""
    return "—" if None in picked else " / ".join(f"`{p}`" for p in picked)


SMALL_TABLE = rp.Table(
    (
        rp.field("dtype", align="l"),
        rp.field("n", "N"),
        rp.Column("`auto` picks fwd / fwd+bwd", auto_pick, "l"),
        rp.impl_column(),
        rp.time_column(FWD, "fwd µs (n)", counts=True, scale=1e6, spec=".0f"),
        rp.ratio_column(FWD, "sdpa", "fwd ×SDPA"),
        rp.time_column(FWD_BWD, "fwd+bwd µs (n)", counts=True, scale=1e6, spec=".0f"),
        rp.ratio_column(FWD_BWD, "sdpa", "fwd+bwd ×SDPA"),
    ),
    lambda r: rp.rows(r, "small"),
    "Small sizes (dense)",
)


def returned_mib(m: rp.MemoryRow) -> float:
    """What the call hands back: the output and dq, dk, dv, each the size of q."""
    return 4 * A.BATCH * A.HEADS * m.case.n * A.HEAD_DIM * DTYPES[m.case.dtype].itemsize / 2**20


def beyond_callers(m: rp.MemoryRow) -> float | None:
    peak = m.result.peak_mib
    return None if peak is None else peak - returned_mib(m)


MEMORY_TABLE = rp.Table(
    (
        rp.Column("pattern", lambda m: m.case.p.title, "l"),
        rp.Column("dtype", lambda m: m.case.dtype, "l"),
        rp.Column("N", lambda m: str(m.case.n)),
        rp.Column("inputs MiB", lambda m: rp.fmt(m.result.inputs_mib, ".0f")),
        rp.Column("peak MiB beyond inputs", lambda m: rp.fmt(m.result.peak_mib, ".1f")),
        rp.Column("of which returned (out, dq, dk, dv)", lambda m: f"{returned_mib(m):.0f}"),
        rp.Column("MiB beyond the caller's tensors", lambda m: rp.fmt(beyond_callers(m), ".1f")),
        rp.Column("wall s", lambda m: rp.fmt(m.result.wall_s, ".1f")),
        rp.Column("note", lambda m: m.result.error or "", "l"),
    ),
    rp.memory_rows("patterns"),
    "Memory (forward + backward, `cpu`, each in a fresh process)",
    lambda r: (
        "Inputs = q, k, v and the upstream grad; each process is capped at "
        f"{MEMORY.address_limit / 2**30:.0f} GiB of address space; wall s = the one call."
    ),
)


def spread_block(r: Results) -> list[str]:
    runs = [(when, r.stages.get(f"bf16 {when}")) for when in ("start", "end")]
    lines = ["### bf16 matmul: how steady the tile unit was", ""]
    if not any(run for _, run in runs):
        return [*lines, "Not run (dry run)." if r.dry_run else "Not run.", ""]
    size, samples = next((run["size"], len(run["gflops"])) for _, run in runs if run)
    lines += [
        f"torch's bf16 matmul (`{size}×{size} @ {size}×{size}`, oneDNN's kernels: on the AMX tile "
        f"unit where the CPU has one), {samples} samples of about 50 ms at the start and at the "
        "end of the run, GFLOP/s. On the amx path the kernel's float32 scores and dP and all its "
        "bfloat16 products run on that unit: a wide spread here (a unit shared with another "
        "tenant of the host, say) moves the amx path's figures with it, while the fp32 ceiling "
        "above (vector units) may stay put.",
        "",
        "| when | min | median | max | max ÷ min |",
        "|:---|---:|---:|---:|---:|",
    ]
    for when, run in runs:
        if not run:
            lines.append(f"| {when} | — | — | — | — |")
            continue
        g = sorted(run["gflops"])
        lines.append(
            f"| {when} | {g[0]:.0f} | {median_or_none(g):.0f} | {g[-1]:.0f} | {g[-1] / g[0]:.2f} |"
        )
    return [*lines, ""]


def peak_limits(r: Results) -> dict[str, float | None] | None:
    """The run's limits by unit, GFLOP/s: the best one-thread sample of each probe × the run's
    threads (0: not on this CPU; None: the run did not sample it)."""
    runs = [run for run in (r.stages.get("peaks start"), r.stages.get("peaks end")) if run]
    if not runs:
        return None
    threads = runs[0]["threads"]
    samples = {k: [x for run in runs for x in run.get(k, ())] for k in UNITS}
    return {k: threads * max(xs) if xs else None for k, xs in samples.items()}


BWD = "bwd"  # not timed alone: forward + backward minus forward
BWD_FLOPS = 2.5  # FlashAttention's count: the backward is 2.5× the forward
PATHS = ("amx", DP_PATH, "avx512", "avx2", "portable")
BF16_UNITS = {"amx": "amx_bf16", DP_PATH: "dp_bf16"}  # the other paths widen to float32 FMAs


def cpu_path(r: Results) -> str | None:
    """The path `cpu` ran in this run (the run's facts), None where unknown."""
    path = (r.facts.get("software") or {}).get("qkv CPU kernel path")
    return path if path in PATHS else None


def unit_of(row: rp.Row) -> str | None:
    """The unit the row's products run on, a kind of `UNITS`: float32 on the FMAs; bfloat16 on
    the tiles (amx path), the dot-product instruction (avx512bf16), else widened to FMAs."""
    if row.case.dtype == "fp32":
        return "fma_f32"
    path = DP_PATH if row.impl == DP_IMPL else cpu_path(row.results)
    return None if path is None else BF16_UNITS.get(path, "fma_f32")


def pass_rates(row: rp.Row, kind: str) -> dict[str, float | None]:
    """GFLOP/s of the forward, the backward and forward + backward. The backward's time is the
    forward + backward median minus the forward's, its count `BWD_FLOPS` × the forward's."""
    fwd, t_fwd, t_both = row.rate(FWD, kind), row.median(FWD), row.median(FWD_BWD)
    bwd = None
    if fwd and t_fwd and t_both and t_both > t_fwd:
        bwd = BWD_FLOPS * fwd * t_fwd / (t_both - t_fwd)
    return {FWD: fwd, BWD: bwd, FWD_BWD: row.rate(FWD_BWD, kind)}


def limit_rows(r: Results) -> list[tuple[str, rp.Row, str]]:
    """(label, row, rate kind) of the rows the limits block reads: dense and causal (N =
    dense_n), the sliding window (its kept tiles), for `cpu` and the dot-product path."""
    s = r.settings
    rows = []
    for impl in ("cpu", DP_IMPL):
        for dt in DTYPES:
            for p in ("dense", "causal"):
                case = Dense(p, dt, s["dense_n"])
                rows.append(
                    (f"{p} {dt}, N={s['dense_n']}", rp.Row(r, "dense", case, impl), "gflops")
                )
            if ["sliding", dt] in [list(x) for x in s["patterns"]]:
                case = Pattern("sliding", s["sparse_n"], dt)
                label = f"sliding window {dt}, N={s['sparse_n']}"
                rows.append((label, rp.Row(r, "patterns", case, impl), "kept"))
    return [row for row in rows if row[1].timing(FWD) is not None]


def share_cell(rate: float | None, limit: float | None) -> str:
    """`GFLOP/s (% of the limit)`; "—" without a rate, `(—)` without a limit."""
    if rate is None:
        return "—"
    return f"{rate:.0f} ({100 * rate / limit:.0f}%)" if limit else f"{rate:.0f} (—)"


def limit_text(limit: float | None) -> str:
    """A limit as the block names it: GFLOP/s, "not on this CPU" (0) or not sampled (None)."""
    if limit is None:
        return "not sampled in this run"
    return f"**{limit:.0f} GFLOP/s**" if limit else "not on this CPU"


def limits_intro(limits: dict[str, float | None], threads: int, path: str | None) -> list[str]:
    """The paragraphs before the table: the limits measured, and how the rates are read."""
    shown = ", ".join(f"`{k}` ({what}) {limit_text(limits[k])}" for k, what in UNITS.items())
    ran = f"`cpu` ran the {path} path." if path else "The path `cpu` ran is not recorded."
    return [
        f"Limits of this run ({threads} threads, the best of the one-thread samples at the start "
        f"and the end × {threads}): {shown}. {ran}",
        "",
        "Each rate is a share of the limit of the unit its path multiplies on: float32 against "
        "`fma_f32`; bfloat16 against `amx_bf16` on the amx path, `dp_bf16` on the avx512bf16 "
        f"path (`{DP_IMPL}`, or `cpu` where it runs that path), `fma_f32` on the others (they "
        "widen bfloat16 to float32). On the amx path the float32 scores run on the tiles too "
        "(three bfloat16 parts), so a float32 share there is not of the only unit at work. FLOPs "
        "by FlashAttention's count (dense and causal: `4·B·H·N²·D`, halved for causal; the "
        f"sliding window: its kept 64×64 tiles), the backward {BWD_FLOPS}× the forward, forward "
        f"+ backward {1 + BWD_FLOPS}×. The backward is not timed alone: its time is the row's "
        "forward + backward median minus its forward median.",
        "",
    ]


def limits_block(r: Results) -> list[str]:
    lines = ["### Against the core's own limits", ""]
    limits = peak_limits(r)
    if not limits:
        return [*lines, "Not run (dry run)." if r.dry_run else "Not run.", ""]
    threads = (r.stages.get("peaks start") or r.stages.get("peaks end"))["threads"]
    lines += [
        *limits_intro(limits, threads, cpu_path(r)),
        "| case | impl | unit | fwd GFLOP/s (% of the unit's limit) | bwd GFLOP/s (%) "
        "| fwd+bwd GFLOP/s (%) |",
        "|:---|:---|:---|---:|---:|---:|",
    ]
    for label, row, kind in limit_rows(r):
        unit = unit_of(row)
        limit = limits[unit] if unit else None
        rates = pass_rates(row, kind)
        cells = " | ".join(share_cell(rates[p], limit) for p in (FWD, BWD, FWD_BWD))
        lines.append(f"| {label} | {row.impl} | {f'`{unit}`' if unit else '—'} | {cells} |")
    return [*lines, ""]


def load_block(r: Results) -> list[str]:
    rows = r.stages.get("load")
    lines = ["### Under load (forward, one competing CPU-bound process)", ""]
    if not rows:
        return [*lines, "Not run (dry run)." if r.dry_run else "Not run.", ""]
    lines += [
        "| case | N | impl | alone ms | loaded ms | slowdown (range) "
        "| CPU pressure alone / loaded | note |",
        "|:---|---:|:---|---:|---:|---:|---:|:---|",
    ]
    for row in rows:
        for impl, f in row["impls"].items():
            slow = f["slowdown"]
            shown = (
                "—" if not slow else f"{slow['median']:.2f} ({slow['lo']:.2f} – {slow['hi']:.2f})"
            )
            pressure = " / ".join(
                rp.fmt(None if p is None else 100 * p, ".0f") + ("%" if p is not None else "")
                for p in (f["alone_pressure"], f["loaded_pressure"])
            )
            ms = [
                rp.fmt(None if f[k] is None else 1e3 * f[k], ".1f") for k in ("alone_s", "loaded_s")
            ]
            lines.append(
                f"| {row['case']} | {row['n']} | {impl} | {ms[0]} | {ms[1]} | {shown} | "
                f"{pressure} | {f['error'] or ''} |"
            )
    return [*lines, ""]


# --------------------------------------------------------------------------- targets


class SizedTarget(Target):
    """A target whose name names the run's sizes: `{dense_n}`, `{sparse_n}`… from the settings."""

    def evaluate(self, results: Any) -> dict[str, Any]:
        out = super().evaluate(results)
        settings = results.settings
        out["name"] = self.name.format(
            **settings,
            long_n=settings["memory"][0][1],
            million_n=settings["memory"][1][1],
            dense_load_n=settings["load_n"][0],
            window_load_n=settings["load_n"][1],
        )
        return out


def dense_ratio(pattern: str, dtype: str, pass_: str) -> Callable[[Results], float | None]:
    return lambda r: r.ratio(
        "dense", Dense(pattern, dtype, r.settings["dense_n"]), "cpu", pass_, "sdpa"
    )


def window_row(r: Results, impl: str = "cpu", dtype: str = "fp32") -> rp.Row:
    return rp.Row(r, "patterns", Pattern("sliding", r.settings["sparse_n"], dtype), impl)


def window_ratio(pass_: str, anchor: str) -> Callable[[Results], float | None]:
    return lambda r: (window_row(r).ratio(pass_, anchor) or {}).get("median")


def window_share(pass_: str) -> Callable[[Results], float | None]:
    def get(r: Results) -> float | None:
        rate = window_row(r).rate(pass_, "kept")
        return rate / r.ceiling["gflops"] if rate and r.ceiling else None

    return get


def decode_row(r: Results, impl: str = "cpu") -> rp.Row:
    s = r.settings
    return rp.Row(
        r, "decode", Decode(1, s["decode_nk"], DECODE_HEADS, DECODE_KV_HEADS, DECODE_D), impl
    )


def dp_impl_of(r: Results) -> str:
    """The rows of the dot-product path: `cpu` where auto runs it, else the forced rows."""
    return (
        "cpu" if (r.facts.get("software") or {}).get("qkv CPU kernel path") == DP_PATH else DP_IMPL
    )


def dp_ratio(pattern: str, pass_: str, anchor: str) -> Callable[[Results], float | None]:
    """The dot-product path in bf16 against an anchor (`own fp32`: the same impl in fp32)."""

    def get(r: Results) -> float | None:
        n, impl = r.settings["dense_n"], dp_impl_of(r)
        if anchor != "own fp32":
            return r.ratio("dense", Dense(pattern, "bf16", n), impl, pass_, anchor)
        t16, t32 = (
            r.median("dense", Dense(pattern, dt, n), impl, pass_) for dt in ("bf16", "fp32")
        )
        return t32 / t16 if t16 and t32 else None

    return get


def dp_window_flex(r: Results) -> float | None:
    return (window_row(r, dp_impl_of(r), "bf16").ratio(FWD, "flex") or {}).get("median")


def dp_peak_share(r: Results) -> float | None:
    limits = peak_limits(r)
    row = rp.Row(r, "dense", Dense("dense", "bf16", r.settings["dense_n"]), dp_impl_of(r))
    rate = row.rate(FWD, "gflops")
    return rate / limits["dp_bf16"] if rate and limits and limits["dp_bf16"] else None


def memory_beyond(index: int) -> Callable[[Results], float | None]:
    def get(r: Results) -> float | None:
        p, n, dt = r.settings["memory"][index]
        case = Pattern(p, n, dt)
        m = r.memory_of("patterns", case, "cpu", FWD_BWD)
        return None if m is None else beyond_callers(rp.MemoryRow(case, "cpu", m))

    return get


def load_margin(index: int) -> Callable[[Results], float | None]:
    """cpu's slowdown / SDPA's (≤ 1: qkv slows down no more than SDPA)."""

    def get(r: Results) -> float | None:
        rows = r.stages.get("load") or []
        if index >= len(rows):
            return None
        cpu, sdpa = (rows[index]["impls"][i]["slowdown"] for i in ("cpu", "sdpa"))
        return cpu["median"] / sdpa["median"] if cpu and sdpa else None

    return get


DP_TARGETS = (  # issue 40, for CPUs with AVX512-BF16 and no AMX: read on the avx512bf16 path
    SizedTarget(
        "avx512bf16 path: dense bf16, N={dense_n}, fwd ×its own fp32 time",
        dp_ratio("dense", FWD, "own fp32"),
        1.8,
    ),
    *(
        SizedTarget(
            f"avx512bf16 path: {p} bf16, N={{dense_n}}, fwd ×SDPA", dp_ratio(p, FWD, "sdpa"), 2.0
        )
        for p in ("dense", "causal")
    ),
    *(
        SizedTarget(
            f"avx512bf16 path: {p} bf16, N={{dense_n}}, fwd+bwd ×SDPA",
            dp_ratio(p, FWD_BWD, "sdpa"),
            1.6,
        )
        for p in ("dense", "causal")
    ),
    SizedTarget(
        "avx512bf16 path: sliding window bf16, N={sparse_n}, fwd ×compiled FlexAttention",
        dp_window_flex,
        3.0,
    ),
    SizedTarget(
        "avx512bf16 path: dense bf16, N={dense_n}, fwd rate as % of the bf16 dot-product limit",
        dp_peak_share,
        0.50,
        unit="%",
    ),
)

TARGETS = (
    *(
        SizedTarget(
            f"{pattern} {dtype}, N={{dense_n}}, {pass_}: `cpu` ×SDPA",
            dense_ratio(pattern, dtype, pass_),
            1.0,
        )
        for dtype in DTYPES
        for pattern in ("dense", "causal")
        for pass_ in PASSES
    ),
    SizedTarget(
        "sliding window fp32, N={sparse_n}, fwd: `cpu` ×SDPA with the dense bool mask",
        window_ratio(FWD, "sdpa"),
        40.0,
    ),
    SizedTarget(
        "sliding window fp32, N={sparse_n}, fwd: `cpu` ×compiled FlexAttention",
        window_ratio(FWD, "flex"),
        2.0,
    ),
    SizedTarget(
        "sliding window fp32, N={sparse_n}, fwd+bwd: `cpu` ×SDPA with the dense bool mask",
        window_ratio(FWD_BWD, "sdpa"),
        30.0,
    ),
    SizedTarget(
        "sliding window fp32, N={sparse_n}, fwd: kept-tile rate as % of fp32 matmul",
        window_share(FWD),
        0.70,
        unit="%",
    ),
    SizedTarget(
        "sliding window fp32, N={sparse_n}, fwd+bwd: kept-tile rate as % of fp32 matmul",
        window_share(FWD_BWD),
        0.60,
        unit="%",
    ),
    SizedTarget(
        "decoding, Nk={decode_nk}: `cpu` ×SDPA (enable_gqa)",
        lambda r: (decode_row(r).ratio(FWD, "sdpa") or {}).get("median"),
        1.5,
    ),
    SizedTarget(
        "decoding, Nk={decode_nk}: `cpu` K/V read as % of copy bandwidth",
        lambda r: kv_share(decode_row(r)),
        0.50,
        unit="%",
    ),
    SizedTarget(
        "Longformer fp32, N={long_n}, fwd+bwd: MiB beyond the caller's tensors",
        memory_beyond(0),
        1024.0,
        at_least=False,
        unit=" MiB",
        digits=1,
    ),
    SizedTarget(
        "sliding window bf16, N={million_n}, fwd+bwd: MiB beyond the caller's tensors "
        "(time in the memory table)",
        memory_beyond(1),
        1024.0,
        at_least=False,
        unit=" MiB",
        digits=1,
    ),
    SizedTarget(
        "dense fp32, N={dense_load_n}, fwd under load: `cpu` slowdown ÷ SDPA's",
        load_margin(0),
        1.0,
        at_least=False,
    ),
    SizedTarget(
        "sliding window fp32, N={window_load_n}, fwd under load: `cpu` slowdown ÷ SDPA's",
        load_margin(1),
        1.0,
        at_least=False,
    ),
)


def on_paths(paths: tuple[str, ...], get: Callable[[Results], float | None]):
    """`get`, read only where `cpu` ran one of `paths` (the targets of one kind of CPU); None
    (not measured) elsewhere."""
    return lambda r: get(r) if cpu_path(r) in paths else None


def unit_share(case: Callable[[Results], tuple[rp.Row, str]], pass_: str):
    """The row's `pass_` rate as a share of the limit of the unit its path runs on (the limits
    block's figure); `case` gives the row and its rate kind."""

    def get(r: Results) -> float | None:
        row, kind = case(r)
        limits, unit = peak_limits(r), unit_of(row)
        limit = limits.get(unit) if limits and unit else None
        rate = pass_rates(row, kind)[pass_]
        return rate / limit if rate and limit else None

    return get


def dense_case(pattern: str, dtype: str, impl: Callable[[Results], str] = lambda r: "cpu"):
    return lambda r: (
        rp.Row(r, "dense", Dense(pattern, dtype, r.settings["dense_n"]), impl(r)),
        "gflops",
    )


def window_case(dtype: str):
    return lambda r: (window_row(r, "cpu", dtype), "kept")


NO_AMX = ("avx512bf16", "avx512", "avx2", "portable")
RATE_TARGETS = (  # issue 50: the kernel at the hardware's rate
    *(
        SizedTarget(
            f"avx512bf16 path: {p} bf16, N={{dense_n}}, fwd+bwd rate as % of the bf16 "
            "dot-product limit",
            unit_share(dense_case(p, "bf16", dp_impl_of), FWD_BWD),
            0.60,
            unit="%",
        )
        for p in ("dense", "causal")
    ),
    *(
        SizedTarget(
            f"without AMX: {p} fp32, N={{dense_n}}, fwd+bwd: `cpu` ×SDPA",
            on_paths(NO_AMX, dense_ratio(p, "fp32", FWD_BWD)),
            1.25,
        )
        for p in ("dense", "causal")
    ),
    SizedTarget(
        "without AMX: dense fp32, N={dense_n}, fwd rate as % of the FMA limit",
        on_paths(NO_AMX, unit_share(dense_case("dense", "fp32"), FWD)),
        0.80,
        unit="%",
    ),
    *(
        SizedTarget(
            f"amx path: {p} bf16, N={{dense_n}}, {pass_}: `cpu` ×SDPA",
            on_paths(("amx",), dense_ratio(p, "bf16", pass_)),
            least,
        )
        for pass_, least in ((FWD, 2.0), (FWD_BWD, 1.6))
        for p in ("dense", "causal")
    ),
    SizedTarget(
        "amx path: dense bf16, N={dense_n}, fwd rate as % of the AMX tile limit",
        on_paths(("amx",), unit_share(dense_case("dense", "bf16"), FWD)),
        0.40,
        unit="%",
    ),
    *(
        SizedTarget(
            f"amx path: {p} fp32, N={{dense_n}}, fwd+bwd: `cpu` ×SDPA",
            on_paths(("amx",), dense_ratio(p, "fp32", FWD_BWD)),
            1.1,
        )
        for p in ("dense", "causal")
    ),
    *(
        SizedTarget(
            f"sliding window {dt}, N={{sparse_n}}, fwd+bwd: kept-tile rate as % of its unit's "
            "limit",
            unit_share(window_case(dt), FWD_BWD),
            0.60,
            unit="%",
        )
        for dt in DTYPES
    ),
)

TARGETS = (*TARGETS, *DP_TARGETS, *RATE_TARGETS)

MEMORY = Memory(probes, address_limit=20 * 2**30)

SUITE = Suite(
    name="cpu",
    title="Compiled CPU kernel",
    settings={"full": FULL, "quick": QUICK},
    steps=(
        Stage("bf16 start", tile_spread),
        Stage("peaks start", core_peaks),
        DENSE,
        PATTERN_GROUP,
        DECODE,
        SMALL,
        MEMORY,
        Stage("load", under_load),
        Stage("bf16 end", tile_spread),
        Stage("peaks end", core_peaks),
    ),
    targets=TARGETS,
    report=(
        spread_block,
        DENSE_TABLE,
        SHAPES_TABLE,
        PATTERN_TABLE,
        DECODE_TABLE,
        SMALL_TABLE,
        MEMORY_TABLE,
        load_block,
        limits_block,
    ),
    doc=__doc__,
    method=method,
    ceiling=True,
    budget_s=lambda s: s.budget_s,
    requires=requires,
    prepare=prepare,
    facts=facts,
)
