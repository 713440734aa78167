"""Benchmark of qkv's compiled CPU kernel (`backend="cpu"`), every figure a ratio against an
anchor measured in the same run on the same machine.

What it measures (B=1, H=8, D=64 unless said otherwise):

- dense and causal, N=4096, fp32 and bf16: forward and forward + backward of `cpu` against torch
  SDPA (`F.scaled_dot_product_attention`, its own fused kernel) and qkv's pure-PyTorch `tiled`;
- sparse, N=16384 (the patterns of benchmarks/sparse.py: sliding window 256, Longformer, BigBird,
  8 documents), fp32, and the sliding window in bf16: `cpu` against SDPA with the dense bool
  mask, compiled FlexAttention (forward; block mask of an equivalent mask_mod, 64-wide blocks)
  and `tiled`; the rate on kept 64×64 tiles as a fraction of torch's fp32 matmul rate;
- decoding, Nq=1 against a KV cache of 32768, H=32, Hkv=8, D=128, fp32: `cpu` against SDPA
  (`enable_gqa`), and the K/V bytes read per second against a large tensor copy;
- small sizes (N = 64 … 1024), where `auto` hands SDPA what it can run (`CpuBackend.auto_skip`);
- memory, each in its own process: Longformer N=65536 fp32 and the sliding window at
  N=1,048,576 in bf16, forward + backward (peak RSS beyond the caller's tensors, and the time);
- load: dense N=4096 and the sliding window N=16384 forward, alone and with one competing
  CPU-bound process, for `cpu` and SDPA (how much each slows down);
- the targets of the kernel's issue, each with PASS/FAIL and the figure.

Timing: the implementations take turns round after round (`_harness.interleave`); before each
round a quiet gate waits (within a budget) while other processes keep the CPUs busy, and the CPU
pressure during every call (Linux PSI) is recorded; the median is reported. Forward under
`torch.no_grad()`; forward + backward as `out.backward(grad)` with a fixed random `grad`.

    python benchmarks/cpu.py --out docs/benchmarks.md   # full run; writes the "cpu" section
                                                        # and docs/benchmarks-cpu.json
    python benchmarks/cpu.py --quick                    # small sizes, prints the section

Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qkv
from _harness import (
    ProbeResult,
    cpu_pressure_total_s,
    interleave,
    limit_address_space,
    machine_info,
    matmul_gflops,
    measure_in_process,
    peak_rss_mib,
    print_probe_result,
    progress,
    reset_peak_rss,
    write_section,
)
from qkv.kernels import cpu as cpu_kernel
from sparse import FLEX_BLOCK, PATTERN_BY_NAME, QuietGate, Runner, check_mask_mod, sparsity

SECTION = "cpu"
B, H, D = 1, 8, 64
SPARSE = ("sliding", "longformer", "bigbird", "document")
DECODE = {"H": 32, "Hkv": 8, "D": 128, "Nk": 32768}
COPY_FLOATS = 64 * 2**20  # the bandwidth anchor: a copy of 256 MiB
MILLION = 1_048_576
PROBE_LIMIT = 20 * 2**30
CONTENDED = 0.25  # median pressure above which a figure is flagged †


@dataclasses.dataclass(frozen=True)
class Settings:
    dense_n: int
    sparse_n: int
    decode_nk: int
    small_ns: tuple[int, ...]
    repeats: int  # timed rounds (the slow SDPA-with-dense-mask calls run one)
    long_ns: tuple[int, int]  # (Longformer fp32, sliding window bf16) in the memory probes
    load: bool


FULL = Settings(4096, 16384, DECODE["Nk"], (64, 128, 256, 512, 1024), 5, (65536, MILLION), True)
QUICK = Settings(1024, 2048, 4096, (64, 256), 2, (4096, 16384), False)


# --------------------------------------------------------------------------- measurements


@dataclasses.dataclass
class Row:
    """One implementation on one case and step."""

    case: str  # e.g. "dense fp32", "sliding fp32", "decode"
    n: int
    impl: str  # cpu, sdpa, flex, tiled
    step: str  # fwd, fwd+bwd
    times_ms: list[float] = dataclasses.field(default_factory=list)
    pressure: float | None = None  # median CPU pressure during its calls
    error: str | None = None
    work: float | None = None  # FLOPs by FlashAttention's count (kept tiles for masks), or bytes
    ms: float | None = None
    vs_sdpa: float | None = None  # time_sdpa / time
    vs_flex: float | None = None


def inputs(n: int, dtype: torch.dtype, grad: bool, h=H, hkv=H, d=D, nq=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, nq or n, d, generator=g).to(dtype)
    k = torch.randn(B, hkv, n, d, generator=g).to(dtype)
    v = torch.randn(B, hkv, n, d, generator=g).to(dtype)
    dout = torch.randn(B, h, nq or n, d, generator=g).to(dtype)
    for t in (q, k, v):
        t.requires_grad_(grad)
    return q, k, v, dout


def step_runner(call: Callable, tensors, backward: bool) -> Callable[[], None]:
    q, k, v, dout = tensors

    def run() -> None:
        if backward:
            for t in (q, k, v):
                t.grad = None
            call(q, k, v).backward(dout)
        else:
            with torch.no_grad():
                call(q, k, v)

    return run


def measure(group: list[Row], calls: dict[str, Callable], tensors, repeats, gate) -> None:
    """Time the rows of one (case, step) in turns; fill times, pressure and errors."""
    runners = {
        row.impl: Runner(step_runner(calls[row.impl], tensors, row.step == "fwd+bwd"))
        for row in group
    }
    label = f"[{group[0].case} N={group[0].n} {group[0].step}]"

    def counts(warm):  # one round for calls slower than 5 s (SDPA with an N² mask)
        return {name: (1 if t > 5.0 else repeats) for name, t in warm.items()}

    times = interleave(runners, counts, label, before_round=gate)
    for row in group:
        r = runners[row.impl]
        row.error = r.error
        if r.error is None:
            row.times_ms = [1e3 * t for t in times[row.impl]]
            row.ms = statistics.median(row.times_ms)
            row.pressure = statistics.median(r.pressure) if r.pressure else None


def qkv_call(backend, **kw):
    return lambda q, k, v: qkv.attention(q, k, v, backend=backend, **kw)


def sdpa_call(**kw):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw)


def flex_call(pattern, mask, n):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    block_mask = torch.compile(create_block_mask)(
        pattern.make_mask_mod(n, mask), None, None, n, n, device="cpu", BLOCK_SIZE=FLEX_BLOCK
    )
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask)


def dense_rows(s: Settings, gate) -> list[Row]:
    rows = []
    n = s.dense_n
    for dtype in (torch.float32, torch.bfloat16):
        dt = str(dtype).split(".")[1].replace("float32", "fp32").replace("bfloat16", "bf16")
        for causal in (False, True):
            case = f"{'causal' if causal else 'dense'} {dt}"
            calls = {
                "cpu": qkv_call("cpu", causal=causal),
                "sdpa": sdpa_call(is_causal=causal),
                "tiled": qkv_call("tiled", causal=causal),
            }
            flops = 4.0 * B * H * n * n * D / (2 if causal else 1)
            for step in ("fwd", "fwd+bwd"):
                group = [Row(case, n, impl, step) for impl in calls]
                measure(group, calls, inputs(n, dtype, step != "fwd"), s.repeats, gate)
                for row in group:
                    row.work = flops * (3.5 if step != "fwd" else 1.0)
                rows += group
    return rows


def sparse_rows(s: Settings, gate) -> tuple[list[Row], dict[str, dict]]:
    rows, shapes = [], {}
    n = s.sparse_n
    for name, dtype in [(p, torch.float32) for p in SPARSE] + [("sliding", torch.bfloat16)]:
        pattern = PATTERN_BY_NAME[name]
        mask = pattern.make_mask(n)
        dt = "fp32" if dtype == torch.float32 else "bf16"
        case = f"{name} {dt}"
        sp = sparsity(mask, n)
        shapes[case] = dataclasses.asdict(sp)
        dense = mask.to_dense(n, n)
        calls = {
            "cpu": qkv_call("cpu", mask=mask),
            "sdpa": sdpa_call(attn_mask=dense),
            "tiled": qkv_call("tiled", mask=mask),
        }
        try:
            calls["flex"] = flex_call(pattern, mask, n)
        except Exception as err:  # a compiler failure is a result
            progress(f"[flex] {case}: {err!r}"[:300])
        kept = 4.0 * B * H * sp.kept_tiles * 64 * 64 * D
        for step in ("fwd", "fwd+bwd"):
            impls = [i for i in calls if not (i == "flex" and step != "fwd")]
            group = [Row(case, n, impl, step) for impl in impls]
            measure(group, calls, inputs(n, dtype, step != "fwd"), s.repeats, gate)
            for row in group:
                row.work = kept * (3.5 if step != "fwd" else 1.0)
            rows += group
    return rows, shapes


def decode_rows(s: Settings, gate) -> tuple[list[Row], float]:
    nk = s.decode_nk
    tensors = inputs(
        nk, torch.float32, False, h=DECODE["H"], hkv=DECODE["Hkv"], d=DECODE["D"], nq=1
    )
    calls = {"cpu": qkv_call("cpu"), "sdpa": sdpa_call(enable_gqa=True)}
    group = [Row("decode", nk, impl, "fwd") for impl in calls]
    measure(group, calls, tensors, 3 * s.repeats, gate)
    kv_bytes = 2 * DECODE["Hkv"] * nk * DECODE["D"] * 4
    for row in group:
        row.work = kv_bytes
    src = torch.randn(COPY_FLOATS)
    dst = torch.empty_like(src)
    copy = {"copy": Runner(lambda: dst.copy_(src))}
    t = statistics.median(interleave(copy, 3 * s.repeats, "[copy]", before_round=gate)["copy"])
    return group, 2 * COPY_FLOATS * 4 / t  # bytes read + written per second (STREAM's count)


def small_rows(s: Settings, gate) -> list[Row]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        dt = "fp32" if dtype == torch.float32 else "bf16"
        for n in s.small_ns:
            calls = {"cpu": qkv_call("cpu"), "sdpa": sdpa_call()}
            for step in ("fwd", "fwd+bwd"):
                group = [Row(f"small {dt}", n, impl, step) for impl in calls]
                measure(group, calls, inputs(n, dtype, step != "fwd"), 3 * s.repeats, gate)
                rows += group
    return rows


def derive(rows: list[Row]) -> None:
    by = {(r.case, r.n, r.step, r.impl): r for r in rows}
    for r in rows:
        sd, fx = by.get((r.case, r.n, r.step, "sdpa")), by.get((r.case, r.n, r.step, "flex"))
        if r.ms is not None and sd is not None and sd.ms is not None:
            r.vs_sdpa = sd.ms / r.ms
        if r.ms is not None and fx is not None and fx.ms is not None:
            r.vs_flex = fx.ms / r.ms


# --------------------------------------------------------------------------- load


_BUSY = "while True: pass"


def load_rows(s: Settings, gate) -> list[dict]:
    """Forward of cpu and SDPA alone, then with one competing CPU-bound process."""
    out = []
    mask = PATTERN_BY_NAME["sliding"].make_mask(s.sparse_n)
    cases = [
        ("dense fp32", s.dense_n, {"cpu": qkv_call("cpu"), "sdpa": sdpa_call()}),
        (
            "sliding fp32",
            s.sparse_n,
            {
                "cpu": qkv_call("cpu", mask=mask),
                "sdpa": sdpa_call(attn_mask=mask.to_dense(s.sparse_n, s.sparse_n)),
            },
        ),
    ]
    for case, n, calls in cases:
        tensors = inputs(n, torch.float32, False)
        result = {"case": case, "n": n}
        for phase in ("alone", "loaded"):
            busy = subprocess.Popen([sys.executable, "-c", _BUSY]) if phase == "loaded" else None
            try:
                time.sleep(0.5 if busy else 0.0)
                group = [Row(case, n, impl, "fwd") for impl in calls]
                measure(group, calls, tensors, s.repeats, gate if busy is None else None)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
            for row in group:
                result[f"{row.impl}_{phase}_ms"] = row.ms
                result[f"{row.impl}_{phase}_pressure"] = row.pressure
        for impl in calls:
            a, b = result.get(f"{impl}_alone_ms"), result.get(f"{impl}_loaded_ms")
            result[f"{impl}_slowdown"] = b / a if a and b else None
        out.append(result)
    return out


# --------------------------------------------------------------------------- memory probes


@dataclasses.dataclass(frozen=True)
class Probe:
    pattern: str
    n: int
    dtype: str
    threads: int


def probe_main(spec: str) -> None:
    """In its own process: q, k, v and the upstream gradient built, a tiny warm-up, then one
    forward + backward; prints peak RSS beyond the baseline and what the caller's tensors
    (inputs, output, gradients) hold."""
    limit_address_space(PROBE_LIMIT)
    p = Probe(**json.loads(spec))
    torch.set_num_threads(p.threads)
    dtype = getattr(torch, p.dtype)
    mask = PATTERN_BY_NAME[p.pattern].make_mask(p.n)
    wq, wk, wv, wd = inputs(512, dtype, True)
    qkv.attention(
        wq, wk, wv, mask=PATTERN_BY_NAME[p.pattern].make_mask(512), backend="cpu"
    ).backward(wd)
    del wq, wk, wv, wd
    q, k, v, dout = inputs(p.n, dtype, True)
    in_mib = sum(t.numel() * t.element_size() for t in (q, k, v, dout)) / 2**20
    baseline = reset_peak_rss()
    start = time.perf_counter()
    qkv.attention(q, k, v, mask=mask, backend="cpu").backward(dout)
    wall = time.perf_counter() - start
    # what the call hands back: the output (freed by now but counted at its peak) and dq, dk, dv
    print_probe_result(
        ProbeResult(peak_mib=peak_rss_mib() - baseline, inputs_mib=in_mib, wall_s=wall)
    )


def memory_checks(s: Settings) -> list[dict]:
    out = []
    for pattern, n, dtype in (
        ("longformer", s.long_ns[0], "float32"),
        ("sliding", s.long_ns[1], "bfloat16"),
    ):
        progress(f"[memory] {pattern} {dtype} N={n} fwd+bwd in its own process...")
        probe = Probe(pattern, n, dtype, torch.get_num_threads())
        r = measure_in_process(Path(__file__), dataclasses.asdict(probe), 1800)
        elem = 4 if dtype == "float32" else 2
        returned_mib = 4 * B * H * n * D * elem / 2**20  # out, dq, dk, dv
        beyond = None if r.peak_mib is None else r.peak_mib - returned_mib
        out.append(
            {
                "pattern": pattern,
                "n": n,
                "dtype": dtype,
                **dataclasses.asdict(r),
                "returned_mib": returned_mib,
                "beyond_callers_mib": beyond,
            }
        )
    return out


# --------------------------------------------------------------------------- targets


def targets(rows: list[Row], decode_bw: float, mems: list[dict], loads: list[dict], ceiling: float):
    by = {(r.case, r.step, r.impl): r for r in rows}

    def get(case, step, impl, field):
        r = by.get((case, step, impl))
        return None if r is None else getattr(r, field)

    def rate(case, step):
        r = by.get((case, step, "cpu"))
        return None if r is None or r.ms is None else r.work / (r.ms / 1e3) / 1e9 / ceiling

    out = []

    def add(name, value, threshold, unit="×"):
        ok = None if value is None else value >= threshold
        out.append(
            {
                "target": name,
                "threshold": f"≥ {threshold:g}{unit}",
                "measured": value,
                "unit": unit,
                "pass": ok,
            }
        )

    for dt in ("fp32", "bf16"):
        for case in ("dense", "causal"):
            for step in ("fwd", "fwd+bwd"):
                add(f"{case} {dt} {step} ×SDPA", get(f"{case} {dt}", step, "cpu", "vs_sdpa"), 1.0)
    add(
        "sliding window fp32 fwd ×SDPA (dense mask)",
        get("sliding fp32", "fwd", "cpu", "vs_sdpa"),
        40,
    )
    add("sliding window fp32 fwd ×Flex (compiled)", get("sliding fp32", "fwd", "cpu", "vs_flex"), 2)
    add(
        "sliding window fp32 fwd+bwd ×SDPA (dense mask)",
        get("sliding fp32", "fwd+bwd", "cpu", "vs_sdpa"),
        30,
    )
    fr, fbr = rate("sliding fp32", "fwd"), rate("sliding fp32", "fwd+bwd")
    add(
        "sliding window fwd: kept-tile rate / fp32 matmul",
        None if fr is None else 100 * fr,
        70,
        "%",
    )
    add(
        "sliding window fwd+bwd: kept-tile rate / fp32 matmul",
        None if fbr is None else 100 * fbr,
        60,
        "%",
    )
    add("decode ×SDPA", get("decode", "fwd", "cpu", "vs_sdpa"), 1.5)
    dec = by.get(("decode", "fwd", "cpu"))
    bw = None if dec is None or dec.ms is None else 100 * (dec.work / (dec.ms / 1e3)) / decode_bw
    add("decode: K/V read / copy bandwidth", bw, 50, "%")
    for m in mems:
        value = m["beyond_callers_mib"]
        out.append(
            {
                "target": f"{m['pattern']} {m['dtype']} N={m['n']} fwd+bwd: MiB beyond the "
                "caller's tensors",
                "threshold": "≤ 1024 MiB",
                "measured": value,
                "unit": " MiB",
                "pass": None if value is None else value <= 1024,
            }
        )
    for ld in loads:
        a, b = ld.get("cpu_slowdown"), ld.get("sdpa_slowdown")
        out.append(
            {
                "target": f"{ld['case']} fwd under one competing process: slowdown of cpu "
                "vs SDPA's",
                "threshold": "cpu ≤ SDPA",
                "measured": a,
                "unit": "×",
                "pass": None if a is None or b is None else a <= b,
            }
        )
    return out


# --------------------------------------------------------------------------- the report


def _ms(r: Row) -> str:
    if r.error:
        return "failed"
    if r.ms is None:
        return "—"
    dag = "†" if r.pressure is not None and r.pressure > CONTENDED else ""
    return f"{r.ms:.1f}{dag} ({len(r.times_ms)})"


def _x(v) -> str:
    return "—" if v is None else f"{v:.2f}"


def table(rows: list[Row], ceiling: float, kept: bool) -> list[str]:
    unit = "kept-tile GFLOP/s (% matmul)" if kept else "GFLOP/s (% matmul)"
    lines = [
        f"| case | N | step | impl | ms (n) | ×SDPA | ×Flex | {unit} | CPU pressure |",
        "|:---|---:|:---|:---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rate = "—"
        if r.ms is not None and r.work is not None and r.impl in ("cpu", "tiled"):
            g = r.work / (r.ms / 1e3) / 1e9
            rate = f"{g:.0f} ({100 * g / ceiling:.0f}%)"
        p = "—" if r.pressure is None else f"{100 * r.pressure:.0f}%"
        lines.append(
            f"| {r.case} | {r.n} | {r.step} | {r.impl} | {_ms(r)} | {_x(r.vs_sdpa)} | "
            f"{_x(r.vs_flex)} | {rate} | {p} |"
        )
    return lines


def render(report: dict, rows: list[Row]) -> str:
    m = report["machine"]
    ceil = report["ceiling"]["gflops"]
    pressure = report["cpu_pressure_run"]
    lines = [
        "## Compiled CPU kernel (`benchmarks/cpu.py`)",
        "",
        "Generated by `benchmarks/cpu.py`; regenerate it, never edit the numbers by hand.",
        "",
        f"- **Date:** {m['date_utc']}",
        f"- **Machine:** {m['uname']}; CPU {m['cpu_model']}; nproc {m['nproc']}; torch CPU "
        f"capability {m['cpu_capability']}; kernel ISA path `{report['isa']}`",
        f"- **Software:** torch {m['torch']}, `torch.get_num_threads()` = {m['torch_threads']}, "
        f"Python {m['python']}",
        f"- **Command:** `{report['command']}` (total runtime {report['runtime_s'] / 60:.1f} min)",
        f"- **Load:** 1-minute load average {report['load'][0]:.2f} at the start, "
        f"{report['load'][1]:.2f} at the end; CPU pressure over the run (Linux PSI: share of the "
        f"time some task waited for a CPU) "
        f"{'—' if pressure is None else f'{100 * pressure:.0f}%'}; the quiet gate waited "
        f"{report['quiet_gate']['waited_s']:.0f} s before {report['quiet_gate']['rounds_waited']} "
        "rounds. † marks a time whose calls ran under > 25% median pressure.",
        "",
        "### Method",
        "",
        '- `cpu` = `qkv.attention(..., backend="cpu")`; `sdpa` = '
        "`F.scaled_dot_product_attention` (with the dense bool mask `M.to_dense(N, N)` for the "
        "sparse patterns, `is_causal` for causal, `enable_gqa` for decoding); `flex` = "
        "`torch.compile(flex_attention)` with a block mask (64-wide) of an equivalent mask_mod, "
        "forward only, compilation excluded; `tiled` = qkv's pure-PyTorch backend.",
        "- Median of the timed rounds after a warm-up, implementations in turns; forward under "
        "`torch.no_grad()`, forward + backward with a fixed upstream gradient. ×SDPA = "
        "time_sdpa / time (> 1: faster than SDPA), ×Flex likewise.",
        "- GFLOP/s by FlashAttention's count (forward 4·B·H·N²·D, halved for causal; ×3.5 for "
        "forward + backward); for masks over every kept 64×64 tile (the work the kernel "
        "multiplies); % matmul = that rate over torch's fp32 matmul rate measured in the same "
        f"run: {report['ceiling']['before_gflops']:.1f} before and "
        f"{report['ceiling']['after_gflops']:.1f} GFLOP/s after the timings (the higher, "
        f"**{ceil:.1f}**, is used).",
        "- Decoding: K/V bytes read per second against a copy of a 256 MiB tensor "
        f"({report['copy_gbs']:.1f} GB/s, counting bytes read + written, as STREAM does).",
        "- Memory: one forward + backward in its own process after a tiny warm-up; peak RSS "
        "(VmHWM, reset through /proc/self/clear_refs) minus the RSS before the call, minus what "
        "the call returns (out, dq, dk, dv): what the kernel adds beyond the caller's tensors.",
        "- Load: the forward alone, then with one `python -c 'while True: pass'` process "
        "competing for the 2 CPUs (no quiet gate); slowdown = loaded / alone time.",
        "",
        "### Dense and causal",
        "",
        *table([r for r in rows if r.case.split()[0] in ("dense", "causal")], ceil, False),
        "",
        "### Sparse patterns",
        "",
        *[
            f"- `{c}`: kept 64×64 tiles {s['kept_tiles']} / {s['total_tiles']}, density "
            f"{s['density']:.4f}"
            for c, s in report["sparse_shapes"].items()
        ],
        "",
        *table([r for r in rows if r.case.split()[0] in SPARSE], ceil, True),
        "",
        "### Decoding (Nq=1, Nk={nk}, H=32, Hkv=8, D=128, fp32)".format(nk=report["decode_nk"]),
        "",
        "| impl | ms (n) | ×SDPA | K/V GB/s | % of copy bandwidth |",
        "|:---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.case == "decode" and r.ms is not None:
            gbs = r.work / (r.ms / 1e3) / 1e9
            lines.append(
                f"| {r.impl} | {_ms(r)} | {_x(r.vs_sdpa)} | {gbs:.1f} | "
                f"{100 * gbs / report['copy_gbs']:.0f}% |"
            )
    lines += [
        "",
        "### Small sizes (dense, where `auto` leaves SDPA what it can run)",
        "",
        "| case | N | step | cpu ms | sdpa ms | ×SDPA |",
        "|:---|---:|:---|---:|---:|---:|",
    ]
    small = {(r.case, r.n, r.step, r.impl): r for r in rows if r.case.startswith("small")}
    for (case, n, step, impl), r in small.items():
        if impl == "cpu":
            sd = small.get((case, n, step, "sdpa"))
            lines.append(
                f"| {case.split()[1]} | {n} | {step} | {_ms(r)} | "
                f"{_ms(sd) if sd else '—'} | {_x(r.vs_sdpa)} |"
            )
    lines += [
        "",
        "### Memory (forward + backward, own process)",
        "",
        "| pattern | dtype | N | wall s | inputs MiB | peak MiB beyond inputs | of which "
        "returned (out, dq, dk, dv) | beyond the caller's tensors |",
        "|:---|:---|---:|---:|---:|---:|---:|---:|",
    ]
    for mm in report["memory"]:
        f = lambda x, spec=".1f": "—" if x is None else format(x, spec)  # noqa: E731
        lines.append(
            f"| {mm['pattern']} | {mm['dtype']} | {mm['n']} | {f(mm['wall_s'])} | "
            f"{f(mm['inputs_mib'], '.0f')} | {f(mm['peak_mib'])} | "
            f"{f(mm['returned_mib'], '.0f')} | {f(mm['beyond_callers_mib'])} |"
            + (f" {mm['error']}" if mm.get("error") else "")
        )
    if report["load_test"]:
        lines += [
            "",
            "### Under load (forward; one competing CPU-bound process)",
            "",
            "| case | N | cpu alone ms | cpu loaded ms | cpu slowdown | sdpa alone ms | "
            "sdpa loaded ms | sdpa slowdown |",
            "|:---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        keys = ("cpu_alone_ms", "cpu_loaded_ms", "cpu_slowdown", "sdpa_alone_ms",
                "sdpa_loaded_ms", "sdpa_slowdown")  # fmt: skip
        for ld in report["load_test"]:
            cells = " | ".join(_x(ld.get(key)) for key in keys)
            lines.append(f"| {ld['case']} | {ld['n']} | {cells} |")
    lines += [
        "",
        "### Targets",
        "",
        "| target | threshold | measured | result |",
        "|:---|:---|---:|:---|",
    ]
    for t in report["targets"]:
        v = "—" if t["measured"] is None else f"{t['measured']:.2f}{t['unit'].strip()}"
        res = "—" if t["pass"] is None else ("PASS" if t["pass"] else "**FAIL**")
        lines.append(f"| {t['target']} | {t['threshold']} | {v} | {res} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the section into this document")
    ap.add_argument("--quick", action="store_true", help="small sizes; prints the section")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        probe_main(args.probe)
        return
    s = QUICK if args.quick else FULL
    started, load0, psi0 = time.perf_counter(), os.getloadavg()[0], cpu_pressure_total_s()
    command = shlex.join(["python", *sys.argv])
    ops = cpu_kernel.load()
    isa = cpu_kernel.isa.choose(ops)[0]
    for name in SPARSE:
        check_mask_mod(PATTERN_BY_NAME[name], 2048)
    progress(f"{command}: torch {torch.__version__}, {torch.get_num_threads()} threads, ISA {isa}")
    gate = QuietGate()
    before = matmul_gflops()
    rows = dense_rows(s, gate)
    sparse, shapes = sparse_rows(s, gate)
    dec, copy_bw = decode_rows(s, gate)
    rows += sparse + dec + small_rows(s, gate)
    after = matmul_gflops()
    ceiling = max(before, after)
    derive(rows)
    loads = load_rows(s, gate) if s.load else []
    mems = memory_checks(s)
    runtime = time.perf_counter() - started
    psi1 = cpu_pressure_total_s()
    report = {
        "machine": machine_info(),
        "command": command,
        "isa": isa,
        "settings": dataclasses.asdict(s),
        "ceiling": {"before_gflops": before, "after_gflops": after, "gflops": ceiling},
        "copy_gbs": copy_bw / 1e9,
        "decode_nk": s.decode_nk,
        "sparse_shapes": shapes,
        "results": [dataclasses.asdict(r) for r in rows],
        "memory": mems,
        "load_test": loads,
        "targets": targets(rows, copy_bw, mems, loads, ceiling),
        "runtime_s": runtime,
        "load": [load0, os.getloadavg()[0]],
        "cpu_pressure_run": None if psi0 is None or psi1 is None else (psi1 - psi0) / runtime,
        "quiet_gate": dataclasses.asdict(gate),
    }
    markdown = render(report, rows)
    print(markdown)
    if args.out is not None:
        write_section(args.out, SECTION, markdown)
        js = args.out.with_name(f"{args.out.stem}-{SECTION}.json")
        js.write_text(json.dumps(report, indent=2) + "\n")
        progress(f"wrote section '{SECTION}' of {args.out} and {js}")


if __name__ == "__main__":
    main()
