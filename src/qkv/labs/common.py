"""What every lab shares: the progress bar, the thread setting for tiny models, the languages.

A lab is a module with `QUICK` and `FULL` presets, `run(preset, seed=..., progress=...) -> dict`
(the JSON document), `summary(doc, lang) -> str` and `figure(doc, path)`; `qkv lab NAME` and
`qkv demo` call nothing else.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

LANGS = ("en", "zh")


class Progress:
    """A progress bar over `total` units of work on stderr: tqdm when installed, else a plain
    counter line; silent when disabled. Call `step(n)`, and `close()` at the end (also after
    an interrupt)."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.done = total, desc, 0
        self._bar = None
        self._plain = False
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            self._plain = True
            return
        self._bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False)

    def step(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._plain:
            print(f"\r{self.desc}: {self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._plain:
            print(file=sys.stderr)


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run torch on `n` threads inside the block, then restore the setting.

    The labs train models of a few thousand parameters: each operation is so small that a
    second thread only adds synchronisation (and on a shared machine, waiting for a busy core)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pick(text: dict[str, dict[str, str]], lang: str) -> Callable[..., str]:
    """`t(key, **values)`: the sentence `key` in `lang`, formatted."""
    if lang not in LANGS:
        raise ValueError(f"lang must be one of {', '.join(LANGS)}, got {lang!r}")
    table = text[lang]

    def t(key: str, **values: object) -> str:
        return table[key].format(**values)

    return t


HOLDS, FAILS, UNSURE = "holds", "does not hold", "inconclusive"
WORDS = {"zh": {HOLDS: "成立", FAILS: "不成立", UNSURE: "无法判断"}}


def decided(holds: bool) -> dict:
    """A verdict the measurements settle: `{"verdict": "holds" | "does not hold", "why": None}`."""
    return {"verdict": HOLDS if holds else FAILS, "why": None}


def inconclusive(en: str, zh: str) -> dict:
    """A verdict this run cannot give, and why (in both languages)."""
    return {"verdict": UNSURE, "why": {"en": en, "zh": zh}}


def as_verdict(v: bool | dict | None) -> dict:
    """A lab's claim as its JSON verdict (a bare bool is a settled one)."""
    return v if isinstance(v, dict) else decided(bool(v))


def verdict(v: bool | dict, lang: str) -> str:
    """The words a summary uses for a claim's verdict in this run: holds, does not hold, or
    inconclusive with the reason."""
    v = as_verdict(v)
    word = WORDS.get(lang, {}).get(v["verdict"], v["verdict"])
    if v["why"] is None:
        return word
    return f"{word}（{v['why']['zh']}）" if lang == "zh" else f"{word} ({v['why']['en']})"


def cpu_pressure() -> float | None:
    """Linux's CPU pressure: the share (%) of the last 10 s in which some runnable task waited
    for a core (`/proc/pressure/cpu`, "some avg10"); None where the kernel does not say."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(line.split("avg10=")[1].split()[0])
    return None


BUSY_PRESSURE = 10.0  # % of time a task waited for a core: too busy to time parallel speed-ups


BUSY_TEXT = {
    "en": {
        "pressure": "CPU pressure {pressure:.0f}%",
        "load": "load average {load} on {cores} cores",
    },
    "zh": {
        "pressure": "CPU 压力 {pressure:.0f}%（有任务在等空闲核心的时间占比）",
        "load": "{cores} 个核心上的平均负载为 {load}",
    },
}


def busy(m: dict, lang: str = "en") -> str | None:
    """Why the machine `m` (from `machine()`) was too busy to decide a timed claim, in `lang`,
    or None: CPU pressure at or above `BUSY_PRESSURE`, or, where the kernel gives none, a load
    average above the core count."""
    t = pick(BUSY_TEXT, lang)
    pressure = m.get("cpu_pressure")
    if pressure is not None:
        return t("pressure", pressure=pressure) if pressure >= BUSY_PRESSURE else None
    load, cores = m.get("load_1min"), m.get("cores")
    if load is not None and cores and load > cores:
        return t("load", load=load, cores=cores)
    return None


def machine() -> dict[str, object]:
    """Where a lab ran: CPU model, torch, threads and the load average (a shared machine's other
    work slows and disturbs the timings; the load says how busy it was)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = None
    with contextlib.suppress(OSError, AttributeError):
        load = round(os.getloadavg()[0], 2)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_1min": load,
        "cpu_pressure": cpu_pressure(),
    }
