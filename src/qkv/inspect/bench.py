"""The cost curve: time and peak memory of attention against N, measured on this machine.

Four ways to compute the same attention (B=1, D=64, fp32):

- `naive`: the formula as written (`backend="reference"`), N×N scores held in memory;
- `sdpa`: torch's `scaled_dot_product_attention` (its fused CPU kernel);
- `tiled`: qkv's FlashAttention-2 kernel, O(N) memory;
- `window`: the tiled kernel on a sliding window (`qkv.masks.sliding_window(w)`), whose
  empty tiles are never computed: cost ∝ N·w instead of N².

Time is the best of a few runs after a warm-up. Peak memory is the rise of this process's
resident set (VmHWM, reset before each call through /proc/self/clear_refs; Linux only, else
None) above what it held before the call, with glibc's allocator told to return large
blocks to the system at once, so that freed tensors do not hide the next peak.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import masks
from ..functional import attention
from .text import ljust, rjust

METHODS = ("naive", "sdpa", "tiled", "window")
PASSES = ("forward", "forward+backward")


@dataclass(frozen=True)
class Sizes:
    """What one `qkv bench` run measures."""

    ns: tuple[int, ...]
    heads: int
    window: int  # the sliding window's reach on each side
    repeats: int
    dim: int = 64


QUICK = Sizes(ns=(512, 1024, 2048, 4096), heads=4, window=128, repeats=2)
FULL = Sizes(ns=(1024, 2048, 4096, 8192, 16384), heads=8, window=256, repeats=3)


# --------------------------------------------------------------------------- memory


def _status_mib(field: str) -> float | None:
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # reported in kB
    return None


def reset_peak_rss() -> float | None:
    """Reset this process's peak-RSS mark to its current RSS; return that RSS in MiB.

    `getrusage(...).ru_maxrss` cannot be reset and, in a child process, starts at the parent's
    high-water mark; writing 5 to /proc/self/clear_refs resets VmHWM (Linux ≥ 4.0). None
    where this is not available."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_mib("VmRSS")


def peak_rss_mib() -> float | None:
    """Peak resident memory of this process since the last `reset_peak_rss`, in MiB."""
    return _status_mib("VmHWM")


def release_freed_memory() -> None:
    """Give memory that is freed but still resident back to the system, now and later.

    glibc keeps freed heap chunks resident and serves later tensors from them, which would hide
    those tensors from the RSS peak; `malloc_trim(0)` releases the free pages, and a fixed 128
    KiB mmap threshold makes later large blocks return to the system when freed (by default
    glibc raises the threshold after a large free). A no-op where glibc is not the allocator."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        libc.malloc_trim(0)


def available_mib() -> float | None:
    """MiB this process may still allocate (`qkv.limits`: cgroup, RLIMIT_AS, MemAvailable)."""
    from ..limits import available_bytes

    free = available_bytes("cpu")
    return None if free is None else free / 2**20


# --------------------------------------------------------------------------- methods


def estimate_mib(method: str, pas: str, n: int, heads: int, dim: int) -> float:
    """A generous estimate of the memory a call needs beyond its inputs (to skip what won't fit)."""
    vectors = 8 * heads * n * dim * 4  # q, k, v, out, grads: O(N·D)
    if method != "naive":
        return vectors / 2**20
    squares = (3 if pas == "forward" else 6) * heads * n * n * 4  # S, S/√d, A (+ their grads)
    return (vectors + squares) / 2**20


def _runner(method: str, pas: str, q, k, v, window: int) -> Callable[[], object]:
    if method == "naive":

        def fwd():
            return attention(q, k, v, backend="reference")
    elif method == "sdpa":

        def fwd():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    elif method == "tiled":

        def fwd():
            return attention(q, k, v, backend="tiled")
    elif method == "window":
        band = masks.sliding_window(window)

        def fwd():
            return attention(q, k, v, mask=band, backend="tiled")
    else:
        raise ValueError(f"method {method!r} is unknown; expected one of {', '.join(METHODS)}")
    if pas == "forward":

        def run():
            with torch.no_grad():
                return fwd()

        return run
    if pas != "forward+backward":
        raise ValueError(f"pass {pas!r} is unknown; expected one of {', '.join(PASSES)}")
    grad = torch.randn_like(q)

    def run_backward():
        q.grad = k.grad = v.grad = None
        fwd().backward(grad)

    return run_backward


def measure(
    sizes: Sizes = QUICK,
    methods: Sequence[str] = METHODS,
    passes: Sequence[str] = PASSES,
    *,
    progress: bool | Callable[[Iterable], Iterable] = True,
    seed: int = 0,
) -> list[dict]:
    """Time and peak memory of each method at each N; returns one record per (method, pass, N):
    `{"method", "pass", "n", "time_s", "peak_mib", "note"}` (time and memory None when skipped,
    with the reason in `note`)."""
    return list(iter_measure(sizes, methods, passes, progress=progress, seed=seed))


def iter_measure(
    sizes: Sizes = QUICK,
    methods: Sequence[str] = METHODS,
    passes: Sequence[str] = PASSES,
    *,
    progress: bool | Callable[[Iterable], Iterable] = True,
    seed: int = 0,
) -> Iterator[dict]:
    """`measure` one record at a time, each yielded as soon as it is measured, so that a caller
    interrupted (Ctrl-C) still holds every finished record."""
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"method {m!r} is unknown; expected one of {', '.join(METHODS)}")
    plan = [(n, m, p) for n in sizes.ns for p in passes for m in methods]
    steps = _progress(plan, progress)
    free = available_mib()
    try:
        for n, method, pas in steps:
            yield _measure_one(sizes, method, pas, n, free, seed)
    finally:
        close = getattr(steps, "close", None)
        if close is not None:  # the progress bar gives its line back, also after Ctrl-C
            close()


def _measure_one(sizes: Sizes, method: str, pas: str, n: int, free: float | None, seed: int):
    need = estimate_mib(method, pas, n, sizes.heads, sizes.dim)
    rec = {"method": method, "pass": pas, "n": n, "time_s": None, "peak_mib": None, "note": ""}
    if free is not None and need > 0.5 * free:
        rec["note"] = f"skipped: needs about {need:,.0f} MiB, {free:,.0f} MiB available"
        return rec
    g = torch.Generator().manual_seed(seed)
    shape = (1, sizes.heads, n, sizes.dim)
    grad = pas != "forward"
    q, k, v = (torch.randn(shape, generator=g).requires_grad_(grad) for _ in range(3))
    run = _runner(method, pas, q, k, v, sizes.window)
    run()  # warm-up
    times = []
    for _ in range(sizes.repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    release_freed_memory()
    base = reset_peak_rss()
    run()
    peak = peak_rss_mib()
    rec["time_s"] = min(times)
    rec["peak_mib"] = None if base is None or peak is None else max(peak - base, 0.0)
    return rec


def _progress(plan: list, progress: bool | Callable[[Iterable], Iterable]) -> Iterable:
    if callable(progress):
        return progress(plan)
    if not progress:
        return plan
    try:
        from tqdm import tqdm
    except ImportError:
        return _plain_progress(plan)
    return tqdm(plan, desc="qkv bench", unit="run", file=sys.stderr, leave=False)


def _plain_progress(plan: list) -> Iterator:
    try:
        for i, item in enumerate(plan, 1):
            n, method, pas = item
            line = f"\r[{i}/{len(plan)}] N={n} {method} {pas}   "
            print(line, end="", file=sys.stderr, flush=True)
            yield item
    finally:
        print(file=sys.stderr)


# --------------------------------------------------------------------------- analysis


def slopes(records: Sequence[dict], metric: str = "time_s", last: int = 3) -> dict[str, float]:
    """Least-squares slope of log(metric) against log(N) over each method's `last` largest
    measured sizes: ≈ 2 for dense attention, ≈ 1 for a fixed window (NaN with < 2 points)."""
    out: dict[str, float] = {}
    for method in dict.fromkeys(r["method"] for r in records):
        pts = sorted((r["n"], r[metric]) for r in records if r["method"] == method and r[metric])
        pts = pts[-last:]
        if len(pts) < 2:
            out[method] = math.nan
            continue
        xs = [math.log(n) for n, _ in pts]
        ys = [math.log(y) for _, y in pts]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        out[method] = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mx) ** 2 for x in xs
        )
    return out


def report(records: Sequence[dict], sizes: Sizes, complete: bool = True) -> dict[str, object]:
    """Everything a run measured, JSON-ready: the sizes, the machine, the records, the slopes;
    `complete` is False when the run was interrupted before its last record."""
    return {
        "complete": complete,
        "sizes": {**asdict(sizes), "batch": 1, "dtype": "float32"},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.machine(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "time_best_of": sizes.repeats,
        "records": list(records),
        "slopes": {  # None where fewer than two sizes were measured
            p: {m: None if math.isnan(x) else x for m, x in slopes(mine).items()}
            for p in dict.fromkeys(r["pass"] for r in records)
            for mine in [[r for r in records if r["pass"] == p]]
        },
    }


TABLE_TEXT = {
    "en": {
        "forward": "forward",
        "forward+backward": "forward+backward",
        "cell": "time    peak MiB",
        "skipped": "skipped",
        "slope": "slope (time)",
        "note": "{method} {pas} N={n}: {note}",
        "no_slope": "slope —: fewer than two sizes were measured",
    },
    "zh": {
        "forward": "前向",
        "forward+backward": "前向+反向",
        "cell": "时间    峰值 MiB",
        "skipped": "已跳过",
        "slope": "斜率（时间）",
        "note": "{method} {pas} N={n}：{note}",
        "no_slope": "斜率 —：测量过的长度不足两个",
    },
}
SKIPPED = re.compile(r"skipped: needs about ([\d,]+) MiB, ([\d,]+) MiB available")


def _note(r: dict, t: dict[str, str], lang: str) -> str:
    """A record's note line (the note is English in the JSON) in `lang`."""
    note = r["note"]
    m = SKIPPED.fullmatch(note)
    if lang == "zh" and m:
        note = f"已跳过：大约需要 {m[1]} MiB，可用 {m[2]} MiB"
    return t["note"].format(
        method=r["method"], pas=t.get(r["pass"], r["pass"]), n=r["n"], note=note
    )


def table(records: Sequence[dict], lang: str = "en") -> str:
    """A text table: one row per (pass, N), time and peak memory for each method, then slopes;
    its words in `lang` ("en" or "zh")."""
    if lang not in TABLE_TEXT:
        raise ValueError(f"lang must be one of {', '.join(TABLE_TEXT)}, got {lang!r}")
    t = TABLE_TEXT[lang]
    methods = list(dict.fromkeys(r["method"] for r in records))
    lines: list[str] = []
    unfitted = False
    for pas in dict.fromkeys(r["pass"] for r in records):
        mine = [r for r in records if r["pass"] == pas]
        head = ljust(t.get(pas, pas), 17) + "".join(f"{m:>21}" for m in methods)
        lines += [head, f"{'N':<17}" + "".join(rjust(t["cell"], 21) for _ in methods)]
        for n in dict.fromkeys(r["n"] for r in mine):
            lines.append(f"{n:<17}" + "".join(_cell(mine, n, m, t) for m in methods))
        fit = slopes(mine)
        fitted = [fit.get(m, math.nan) for m in methods]
        unfitted = unfitted or not all(math.isfinite(x) for x in fitted)
        shown = (f"{x:>21.2f}" if math.isfinite(x) else f"{'—':>21}" for x in fitted)
        lines += [ljust(t["slope"], 17) + "".join(shown), ""]
    notes = sorted({_note(r, t, lang) for r in records if r["note"]})
    if unfitted:
        notes.append(t["no_slope"])
    return "\n".join(lines + notes).rstrip()


def _cell(mine: Sequence[dict], n: int, method: str, t: dict[str, str]) -> str:
    """One method's time and peak memory at N, 21 columns wide."""
    r = next((x for x in mine if x["n"] == n and x["method"] == method), None)
    if r is None:  # not measured (the run was interrupted)
        return f"{'—':>21}"
    if r["time_s"] is None:
        return rjust(t["skipped"], 21)
    peak = "—" if r["peak_mib"] is None else f"{r['peak_mib']:,.0f}"
    return f"{_seconds(r['time_s']):>12}{peak:>9}"


def _seconds(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"
