"""What a figure depends on besides the code: the machine, how busy it is, and its matmul rate.

- `facts()`: CPU model (from `lscpu`), CPUs, torch and Python versions, threads, date and load,
  recorded with every result;
- `cpu_pressure_total_s()` (Linux PSI) and `cpu_busy_fraction()` (/proc/stat), the two readings
  of contention; `QuietGate` waits before a timed round while other processes keep the CPUs busy;
- `matmul_gflops()`: torch's fp32 matmul rate, the ceiling a CPU suite measures in the same run;
  `matmul_spread()`: many short samples of one matmul's rate, to show how steady a unit was.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

MATMUL_SIZE = 2048
MATMUL_REPEATS = 10


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- facts


def lscpu() -> dict[str, str]:
    """`lscpu`'s fields (empty where it is missing)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def cpu_model() -> str:
    model = lscpu().get("Model name")
    if model:
        return model
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def facts() -> dict[str, object]:
    """The machine a result was measured on."""
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "uname": " ".join(part for part in platform.uname() if part),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_1min": load_average(),
    }


# --------------------------------------------------------------------------- contention


def cpu_pressure_total_s() -> float | None:
    """Linux PSI: total seconds during which some runnable task waited for a CPU (None where
    /proc/pressure/cpu is missing). Its growth over a wall-clock interval, divided by it, is the
    share of that interval the machine had more runnable threads than CPUs."""
    try:
        first = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    match = re.search(r"total=(\d+)", first)
    return int(match.group(1)) / 1e6 if match else None


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat (idle and iowait count as not busy)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
    return total - fields[3] - fields[4], total


def cpu_busy_fraction(sample_s: float) -> float | None:
    """Share of all CPUs' time that was busy while this process slept `sample_s`: what other
    processes used. Falls back to the load average per CPU where /proc/stat is missing."""
    before = _cpu_times()
    time.sleep(sample_s)
    after = _cpu_times()
    if before is None or after is None or after[1] == before[1]:
        load = load_average()
        return None if load is None else min(1.0, load / (os.cpu_count() or 1))
    return (after[0] - before[0]) / (after[1] - before[1])


class MachineBusy(RuntimeError):
    """The gate's policy is "refuse" and other processes kept the CPUs busy."""


@dataclasses.dataclass
class QuietGate:
    """Before each timed round, wait (a bounded time) until other processes leave the CPUs alone.

    On a 2-core machine a second process slows code with many small parallel regions far more
    than one large call, so contention does not hit the implementations alike and interleaving
    alone cannot cancel it. Policies: "wait" (wait up to `max_round_s` per round and `max_total_s`
    per run, then go on and record it), "refuse" (raise `MachineBusy` when a round's wait runs
    out), "off" (never wait; the pressure is still recorded with every call).
    """

    policy: str = "wait"
    busy_above: float = 0.15  # share of all CPUs busy while this process sleeps
    sample_s: float = 0.2
    max_round_s: float = 30.0
    max_total_s: float = 300.0
    waited_s: float = 0.0
    rounds_waited: int = 0
    busy_rounds: int = 0  # rounds that started busy because a wait ran out
    busy: Callable[[float], float | None] = cpu_busy_fraction  # how busy, sampled over a sleep

    def record(self) -> dict[str, object]:
        """The gate's settings and what it did, for the results."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "busy"}

    def __call__(self) -> None:
        if self.policy == "off":
            return
        start = time.perf_counter()
        while True:
            busy = self.busy(self.sample_s)
            if busy is None or busy <= self.busy_above:
                break
            spent = time.perf_counter() - start
            if spent > self.max_round_s or self.waited_s + spent > self.max_total_s:
                if self.policy == "refuse":
                    raise MachineBusy(
                        f"{100 * busy:.0f}% of the CPUs stayed busy for {spent:.0f} s "
                        f"(gate: > {100 * self.busy_above:.0f}%)"
                    )
                self.busy_rounds += 1
                break
            time.sleep(1.0)
        spent = time.perf_counter() - start
        if spent > 2 * self.sample_s:
            self.waited_s += spent
            self.rounds_waited += 1
            progress(f"[quiet] waited {spent:.0f} s for other processes ({self.waited_s:.0f} s)")


# --------------------------------------------------------------------------- the ceiling


def matmul_gflops(size: int = MATMUL_SIZE, repeats: int = MATMUL_REPEATS) -> float:
    """torch's fp32 matmul rate on this machine (size³, median of `repeats` after a warm-up)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2.0 * size**3 / statistics.median(times) / 1e9


def matmul_spread(
    dtype: torch.dtype = torch.bfloat16, size: int = 1024, samples: int = 15, sample_s: float = 0.05
) -> list[float]:
    """GFLOP/s of `samples` short samples of torch's size³ matmul in `dtype`, each about
    `sample_s` long (as many products as the warm-up says fit): their spread is how steady the
    unit that runs them (a shared tile unit, say) was, where one median would hide it."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    start = time.perf_counter()
    a @ b
    a @ b
    per = max((time.perf_counter() - start) / 2, 1e-6)
    n = max(1, round(sample_s / per))
    rates = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(n):
            a @ b
        rates.append(2.0 * size**3 * n / (time.perf_counter() - start) / 1e9)
    return rates
