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


def verdict(holds: bool, lang: str) -> str:
    """The words a summary uses to say whether a claim held in this run."""
    if lang == "zh":
        return "成立" if holds else "不成立"
    return "holds" if holds else "does not hold"


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
    }
