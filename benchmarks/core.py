"""Core attention benchmark: qkv's `tiled` and `auto` against the naive formula and torch SDPA.

What it measures, all in one run on one machine (fp32, B=1, H=8, D=64, CPU):

- for N in {1024, 2048, 4096, 8192}, dense and causal, and each implementation
  (`tiled`, `auto`, `naive`, `sdpa`): the median time of the forward (under `torch.no_grad`) and
  of forward + backward, after one warm-up; the rate in GFLOP/s by FlashAttention's count
  (forward `4·B·H·N²·D`, halved for causal; backward 2.5× forward); the speed relative to torch
  SDPA measured in the same run (`time_sdpa / time_impl`, the headline figure); and the peak
  memory of each computation, measured in a separate process as its peak RSS minus what it held
  once the inputs were built;
- the ceiling: torch's fp32 matmul rate (2048 × 2048 @ 2048 × 2048), measured in the same run;
- a long-sequence memory check: `tiled` and `sdpa` forward + backward at N = 32768, each in its
  own process (the score matrix alone would be 8·32768²·4 B = 34 GB, so `naive` is not run);
- the targets of docs/benchmarks.md, each with PASS/FAIL.

Run it from the repository root:

    python benchmarks/core.py --out docs/benchmarks.md   # full run, writes .md and .json
    python benchmarks/core.py --quick                    # smoke test (N = 512, 1024), prints

Progress goes to stderr, one line per measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
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

IMPLS = ("tiled", "auto", "naive", "sdpa")
MODES = ("dense", "causal")
ANCHOR = "sdpa"
LONG_N = 32768
LONG_IMPLS = ("tiled", "sdpa")
LONG_TARGET_MIB = 1024.0
LONG_TIMEOUT_S = 1200
# Address-space cap of each memory probe: an implementation that would materialise an N² matrix
# at N = 32768 fails with an allocation error instead of pushing a shared machine into the OOM
# killer. Generous enough for `naive` forward + backward at N = 8192.
PROBE_ADDRESS_LIMIT = 16 * 2**30
SECTION = "core"

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


# --------------------------------------------------------------------------- implementations


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> torch.Tensor:
    """The textbook formula, written plainly: softmax(Q Kᵀ · scale, masked) V."""
    scale = q.shape[-1] ** -0.5
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        n_q, n_k = s.shape[-2:]
        allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril(n_k - n_q)
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def qkv_attention(backend: str) -> Attention:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        return qkv.attention(q, k, v, causal=causal, backend=backend)

    return run


IMPLEMENTATIONS: dict[str, Attention] = {
    "tiled": qkv_attention("tiled"),
    "auto": qkv_attention("auto"),
    "naive": naive_attention,
    "sdpa": sdpa_attention,
}


# --------------------------------------------------------------------------- measurement helpers


def forward_flops(n: int, causal: bool) -> float:
    """FlashAttention's count: 4·B·H·N²·D for the forward, halved when causal."""
    flops = 4.0 * BATCH * HEADS * n * n * HEAD_DIM
    return flops / 2 if causal else flops


def total_flops(n: int, causal: bool, backward: bool) -> float:
    """Forward, or forward + backward (backward = 2.5× forward)."""
    return forward_flops(n, causal) * (3.5 if backward else 1.0)


def time_interleaved(
    n: int, causal: bool, backward: bool, repeats: int, label: str
) -> dict[str, list[float]]:
    """Seconds per call of every implementation: forward (no grad) or forward + backward.

    The implementations take turns (one warm-up call each, then round after round), so a burst
    of load from another process on a shared machine hits all of them alike and their ratios
    stay meaningful.
    """
    q, k, v, grad = make_inputs(n, requires_grad=backward)

    def clear_grads() -> None:
        q.grad = k.grad = v.grad = None

    runners = {
        impl: functools.partial(run_once, fn, q, k, v, grad, causal, backward)
        for impl, fn in IMPLEMENTATIONS.items()
    }
    return interleave(runners, repeats, label, before_each=clear_grads)


# --------------------------------------------------------------------------- memory probes


@dataclasses.dataclass
class Probe:
    """One memory measurement, run in its own process."""

    impl: str
    n: int
    causal: bool
    backward: bool
    threads: int


def run_probe(probe: Probe) -> ProbeResult:
    """Body of the probe process: build inputs, warm up tiny, record the baseline, run once."""
    torch.set_num_threads(probe.threads)
    fn = IMPLEMENTATIONS[probe.impl]
    q, k, v, grad = make_inputs(probe.n, requires_grad=probe.backward)
    inputs_mib = sum(t.numel() * t.element_size() for t in (q, k, v, grad)) / 2**20
    # Lazy library set-up (kernels, thread pools, autograd engine) is not the attention's memory.
    wq, wk, wv, wgrad = make_inputs(256, requires_grad=probe.backward)
    run_once(fn, wq, wk, wv, wgrad, probe.causal, probe.backward)
    del wq, wk, wv, wgrad
    baseline = reset_peak_rss()
    start = time.perf_counter()
    run_once(fn, q, k, v, grad, probe.causal, probe.backward)
    wall = time.perf_counter() - start
    return ProbeResult(peak_mib=peak_rss_mib() - baseline, inputs_mib=inputs_mib, wall_s=wall)


def run_once(
    fn: Attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    causal: bool,
    backward: bool,
) -> None:
    if backward:
        fn(q, k, v, causal).backward(grad)
    else:
        with torch.no_grad():
            fn(q, k, v, causal)


def measure_memory(probe: Probe, timeout_s: float = LONG_TIMEOUT_S) -> ProbeResult:
    """Run `probe` in a fresh Python process (so peak RSS is its own) and return its result."""
    return measure_in_process(Path(__file__), vars(probe), timeout_s)


def probe_main(spec: str) -> None:
    """Entry point of a probe process: print its ProbeResult as one JSON line."""
    limit_address_space(PROBE_ADDRESS_LIMIT)
    print_probe_result(run_probe(Probe(**json.loads(spec))))


# --------------------------------------------------------------------------- the benchmark


@dataclasses.dataclass
class Row:
    """All figures of one (mode, N, implementation)."""

    mode: str
    n: int
    impl: str
    fwd_times_ms: list[float]
    fwdbwd_times_ms: list[float]
    fwd_ms: float = 0.0
    fwdbwd_ms: float = 0.0
    fwd_gflops: float = 0.0
    fwdbwd_gflops: float = 0.0
    fwd_ceiling_frac: float = 0.0
    fwdbwd_ceiling_frac: float = 0.0
    fwd_vs_sdpa: float = 0.0
    fwdbwd_vs_sdpa: float = 0.0
    fwd_peak_mib: float | None = None
    fwdbwd_peak_mib: float | None = None
    fwd_peak_error: str | None = None
    fwdbwd_peak_error: str | None = None


@dataclasses.dataclass
class LongCheck:
    impl: str
    n: int
    result: ProbeResult


@dataclasses.dataclass
class Target:
    name: str
    threshold: str
    measured: float | None
    passed: bool | None  # None: not measured in this run


@dataclasses.dataclass
class Settings:
    sizes: tuple[int, ...]
    repeats: dict[int, int]
    long_check: bool


FULL = Settings(sizes=(1024, 2048, 4096, 8192), repeats={4096: 3, 8192: 3}, long_check=True)
QUICK = Settings(sizes=(512, 1024), repeats={}, long_check=False)
DEFAULT_REPEATS = {"full": 5, "quick": 3}


def measure_times(settings: Settings, default_repeats: int) -> list[Row]:
    rows = []
    groups = len(settings.sizes) * len(MODES) * 2
    step = 0
    for n in settings.sizes:
        repeats = settings.repeats.get(n, default_repeats)
        for mode in MODES:
            causal = mode == "causal"
            times = {}
            for backward in (False, True):
                step += 1
                kind = "fwd+bwd" if backward else "fwd"
                label = f"[time {step:2d}/{groups}] {mode:6s} N={n:5d} {kind:7s}"
                times[backward] = time_interleaved(n, causal, backward, repeats, label)
                for impl, t in times[backward].items():
                    ms = statistics.median(t) * 1e3
                    rate = total_flops(n, causal, backward) / ms / 1e6
                    progress(
                        f"{label} {impl:5s} {ms:9.1f} ms  {rate:6.1f} GFLOP/s (median of {repeats})"
                    )
            for impl in IMPLS:
                fwd = [t * 1e3 for t in times[False][impl]]
                fwdbwd = [t * 1e3 for t in times[True][impl]]
                rows.append(Row(mode, n, impl, fwd, fwdbwd))
    return rows


def measure_peaks(rows: list[Row], threads: int) -> None:
    for step, row in enumerate(rows, start=1):
        for backward in (False, True):
            probe = Probe(row.impl, row.n, row.mode == "causal", backward, threads)
            result = measure_memory(probe)
            kind = "fwd+bwd" if backward else "fwd"
            prefix = "fwdbwd" if backward else "fwd"
            setattr(row, f"{prefix}_peak_mib", result.peak_mib)
            setattr(row, f"{prefix}_peak_error", result.error)
            shown = f"{result.peak_mib:8.1f} MiB" if result.error is None else result.error
            progress(
                f"[mem  {step:3d}/{len(rows)}] {row.mode:6s} N={row.n:5d} {row.impl:5s} "
                f"{kind:7s} {shown}"
            )


def derive(rows: list[Row], ceiling: float) -> None:
    """Fill in medians, rates, fractions of the ceiling and ratios against SDPA."""
    for row in rows:
        causal = row.mode == "causal"
        row.fwd_ms = statistics.median(row.fwd_times_ms)
        row.fwdbwd_ms = statistics.median(row.fwdbwd_times_ms)
        row.fwd_gflops = total_flops(row.n, causal, False) / row.fwd_ms / 1e6
        row.fwdbwd_gflops = total_flops(row.n, causal, True) / row.fwdbwd_ms / 1e6
        row.fwd_ceiling_frac = row.fwd_gflops / ceiling
        row.fwdbwd_ceiling_frac = row.fwdbwd_gflops / ceiling
    anchors = {(r.mode, r.n): r for r in rows if r.impl == ANCHOR}
    for row in rows:
        anchor = anchors[(row.mode, row.n)]
        row.fwd_vs_sdpa = anchor.fwd_ms / row.fwd_ms
        row.fwdbwd_vs_sdpa = anchor.fwdbwd_ms / row.fwdbwd_ms


def long_checks(threads: int) -> list[LongCheck]:
    checks = []
    for impl in LONG_IMPLS:
        progress(f"[long] {impl} fwd+bwd N={LONG_N} (expect a few minutes)...")
        result = measure_memory(Probe(impl, LONG_N, False, True, threads))
        shown = (
            f"peak {result.peak_mib:.1f} MiB beyond inputs, {result.wall_s:.1f} s"
            if result.error is None
            else result.error
        )
        progress(f"[long] {impl} fwd+bwd N={LONG_N}: {shown}")
        checks.append(LongCheck(impl, LONG_N, result))
    return checks


def evaluate_targets(rows: list[Row], longs: list[LongCheck]) -> list[Target]:
    by_key = {(r.mode, r.n, r.impl): r for r in rows}
    targets = []
    ratio_targets = (
        ("auto", "fwd", 0.95),
        ("tiled", "fwd", 0.6),
        ("tiled", "fwdbwd", 0.5),
    )
    for impl, kind, threshold in ratio_targets:
        for mode in MODES:
            row = by_key.get((mode, 4096, impl))
            value = getattr(row, f"{kind}_vs_sdpa") if row else None
            label = "fwd+bwd" if kind == "fwdbwd" else "fwd"
            targets.append(
                Target(
                    name=f"`{impl}` {label}, {mode}, N=4096: speed ×SDPA",
                    threshold=f"≥ {threshold:.2f}×",
                    measured=value,
                    passed=None if value is None else value >= threshold,
                )
            )
    tiled_long = next((c.result for c in longs if c.impl == "tiled"), None)
    peak = tiled_long.peak_mib if tiled_long else None
    targets.append(
        Target(
            name=f"`tiled` fwd+bwd, dense, N={LONG_N}: peak MiB beyond inputs",
            threshold=f"≤ {LONG_TARGET_MIB:.0f} MiB",
            measured=peak,
            passed=None if peak is None else peak <= LONG_TARGET_MIB,
        )
    )
    return targets


# --------------------------------------------------------------------------- report


def dispatch_choices() -> dict[str, str]:
    """Which backend `auto` picks for this benchmark's shapes, per mode."""
    q = torch.empty(BATCH, HEADS, 1024, HEAD_DIM, dtype=DTYPE)
    return {mode: qkv.dispatch(q, q, q, causal=mode == "causal").backend.name for mode in MODES}


def results_table(rows: list[Row], mode: str) -> list[str]:
    lines = [
        "| N | impl | fwd ms | fwd GFLOP/s | fwd % ceil | fwd ×SDPA | fwd+bwd ms "
        "| fwd+bwd GFLOP/s | fwd+bwd % ceil | fwd+bwd ×SDPA | fwd peak MiB | fwd+bwd peak MiB |",
        "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in (r for r in rows if r.mode == mode):
        lines.append(
            f"| {r.n} | {r.impl} | {r.fwd_ms:.1f} | {r.fwd_gflops:.1f} "
            f"| {100 * r.fwd_ceiling_frac:.0f}% | {r.fwd_vs_sdpa:.2f} | {r.fwdbwd_ms:.1f} "
            f"| {r.fwdbwd_gflops:.1f} | {100 * r.fwdbwd_ceiling_frac:.0f}% "
            f"| {r.fwdbwd_vs_sdpa:.2f} | {fmt(r.fwd_peak_mib, '.1f', r.fwd_peak_error)} "
            f"| {fmt(r.fwdbwd_peak_mib, '.1f', r.fwdbwd_peak_error)} |"
        )
    return lines


def long_table(longs: list[LongCheck]) -> list[str]:
    lines = [
        "| impl | N | inputs MiB | peak MiB beyond inputs | wall s | note |",
        "|:---|---:|---:|---:|---:|:---|",
    ]
    for c in longs:
        r = c.result
        note = r.error or ""
        lines.append(
            f"| {c.impl} | {c.n} | {fmt(r.inputs_mib, '.0f')} | {fmt(r.peak_mib, '.1f')} "
            f"| {fmt(r.wall_s, '.1f')} | {note} |"
        )
    return lines


def targets_table(targets: list[Target]) -> list[str]:
    lines = ["| target | threshold | measured | result |", "|:---|:---|---:|:---|"]
    for t in targets:
        spec = ".1f" if "MiB" in t.threshold else ".2f"
        result = {True: "PASS", False: "**FAIL**", None: "not measured"}[t.passed]
        lines.append(f"| {t.name} | {t.threshold} | {fmt(t.measured, spec)} | {result} |")
    return lines


def render(report: dict[str, object], rows: list[Row], longs: list[LongCheck]) -> str:
    info = report["machine"]
    ceiling = report["ceiling"]
    settings = report["settings"]
    choices = report["auto_dispatch"]
    load = report["load_average_1min"]
    repeats = ", ".join(f"{r} at N={n}" for n, r in settings["repeats_by_n"].items())
    lines = [
        "## Core: dense and causal attention (`benchmarks/core.py`)",
        "",
        "Generated by `benchmarks/core.py`; regenerate it, never edit the numbers by hand.",
        "",
        f"- **Date:** {info['date_utc']}",
        f"- **Machine:** {info['uname']}; CPU {info['cpu_model']} "
        f"(`platform.processor()`: {platform.processor() or 'empty'}); nproc {info['nproc']}; "
        f"CPU capability {info['cpu_capability']}",
        f"- **Software:** torch {info['torch']}, `torch.get_num_threads()` = "
        f"{info['torch_threads']}, Python {info['python']}",
        f"- **Command:** `{report['command']}` (total runtime {report['runtime_s'] / 60:.1f} min)",
        f"- **Load:** 1-minute load average {load['start']:.2f} at the start, "
        f"{load['end']:.2f} at the end, on {info['nproc']} CPUs (above the thread count means "
        "other processes competed for the CPUs: absolute times suffer more than ratios)",
        f"- **Shapes:** fp32, B={BATCH}, H={HEADS}, D={HEAD_DIM}, Nq = Nk = N, CPU",
        "",
        "### Method",
        "",
        '- Implementations: `tiled` = `qkv.attention(..., backend="tiled")`; `auto` = '
        f'`qkv.attention(..., backend="auto")` (it dispatches to `{choices["dense"]}` for dense '
        f"and `{choices['causal']}` for causal at these shapes); `naive` = the formula written "
        "plainly in torch (`softmax(q @ kᵀ · scale, masked_fill −inf) @ v`); `sdpa` = "
        "`torch.nn.functional.scaled_dot_product_attention` called directly (`is_causal` for "
        "causal).",
        "- Time: median of several repeats after one warm-up call "
        f"({repeats}); forward under `torch.no_grad()`, forward + backward as "
        "`out.backward(grad)` with a fixed random `grad`, gradients cleared between calls. "
        "For each (N, mode, fwd | fwd+bwd) the four implementations take turns, round after "
        "round, so that load from other processes hits them alike.",
        "- GFLOP/s by FlashAttention's count: forward `4·B·H·N²·D`, halved for causal; "
        "backward 2.5× forward, so forward + backward is 3.5× forward.",
        "- **×SDPA** = `time_sdpa / time_impl`, with SDPA measured in the same run on the same "
        "shapes (> 1 means faster than SDPA). This ratio is the headline figure: the machine is "
        "shared and noisy, absolute times mean little.",
        "- **% ceil** = the rate as a fraction of the ceiling, torch's fp32 matmul rate on this "
        "machine in the same run (below).",
        "- Memory: each (impl, N, mode, fwd | fwd+bwd) runs once in its own Python process with "
        "the same thread count. After it has built the inputs (q, k, v and the "
        "upstream grad) and made a tiny warm-up call at N=256 (so that lazy library set-up is "
        "not counted), its resident set (VmRSS) is the baseline and its peak-RSS mark is reset "
        "(`/proc/self/clear_refs`); the figure is the peak RSS (VmHWM) during the one measured "
        "call minus that baseline. `getrusage().ru_maxrss` is not used: on Linux a child "
        "inherits its parent's high-water mark across exec, which hid every figure here. The "
        "figure includes what the call returns (the output, and for fwd+bwd the gradients "
        "dq, dk, dv: 2 MiB each per 1024 of N).",
        "",
        "### Ceiling: torch fp32 matmul",
        "",
        f"`{MATMUL_SIZE}×{MATMUL_SIZE} @ {MATMUL_SIZE}×{MATMUL_SIZE}`, median of "
        f"{MATMUL_REPEATS} after a warm-up, measured before and after the attention timings: "
        f"{ceiling['before_gflops']:.1f} and {ceiling['after_gflops']:.1f} GFLOP/s. "
        f"The ceiling used is the higher, **{ceiling['gflops']:.1f} GFLOP/s**.",
        "",
    ]
    for mode in MODES:
        lines += [f"### {mode.capitalize()}", "", *results_table(rows, mode), ""]
    lines += ["### Long sequence: memory at N=32768", ""]
    if longs:
        lines += [
            f"Forward + backward, dense, B={BATCH}, H={HEADS}, D={HEAD_DIM}, fp32, each in its "
            f"own process, run once. The score matrix alone would be "
            f"{HEADS}·{LONG_N}²·4 B = {HEADS * LONG_N**2 * 4 / 1e9:.0f} GB, so `naive` is not "
            "run. Inputs = q, k, v and the upstream grad. The probe process is capped at "
            f"{PROBE_ADDRESS_LIMIT / 2**30:.0f} GiB of address space, so an implementation "
            "that materialises the scores fails instead of exhausting the machine.",
            "",
            *long_table(longs),
            "",
        ]
    else:
        lines += ["Skipped (`--quick`).", ""]
    lines += ["### Targets", "", *targets_table(report_targets(report)), ""]
    return "\n".join(lines)


def report_targets(report: dict[str, object]) -> list[Target]:
    return [Target(**t) for t in report["targets"]]


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="N in {512, 1024}, fewer repeats")
    parser.add_argument(
        "--out", type=Path, help="write this script's section of this Markdown file, JSON beside"
    )
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # internal: one memory probe
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.probe:
        probe_main(args.probe)
        return
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    settings = QUICK if args.quick else FULL
    default_repeats = DEFAULT_REPEATS["quick" if args.quick else "full"]
    threads = torch.get_num_threads()
    command = shlex.join(["python", *sys.argv])
    progress(f"{command}: torch {torch.__version__}, {threads} threads")

    ceiling_before = matmul_gflops()
    progress(f"[ceiling] fp32 matmul {ceiling_before:.1f} GFLOP/s")
    rows = measure_times(settings, default_repeats)
    ceiling_after = matmul_gflops()
    progress(f"[ceiling] fp32 matmul {ceiling_after:.1f} GFLOP/s (after)")
    ceiling = max(ceiling_before, ceiling_after)
    derive(rows, ceiling)
    measure_peaks(rows, threads)
    longs = long_checks(threads) if settings.long_check else []
    targets = evaluate_targets(rows, longs)

    report: dict[str, object] = {
        "machine": machine_info(),
        "command": command,
        "settings": {
            "dtype": "float32",
            "batch": BATCH,
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "sizes": list(settings.sizes),
            "repeats_by_n": {n: settings.repeats.get(n, default_repeats) for n in settings.sizes},
        },
        "auto_dispatch": dispatch_choices(),
        "ceiling": {
            "shape": [MATMUL_SIZE, MATMUL_SIZE, MATMUL_SIZE],
            "before_gflops": ceiling_before,
            "after_gflops": ceiling_after,
            "gflops": ceiling,
        },
        "results": [dataclasses.asdict(r) for r in rows],
        "long_sequence": [dataclasses.asdict(c) for c in longs],
        "targets": [dataclasses.asdict(t) for t in targets],
    }
    report["runtime_s"] = time.perf_counter() - started
    report["load_average_1min"] = {"start": load_start, "end": os.getloadavg()[0]}
    markdown = render(report, rows, longs)
    if args.out is None:
        print(markdown)
    else:
        write_section(args.out, SECTION, markdown)
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        progress(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    progress(f"total runtime {report['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
