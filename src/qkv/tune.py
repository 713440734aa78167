"""`qkv tune`: measure where the compiled CPU kernel beats torch SDPA on this machine.

For every request class `auto` decides between the two (`qkv.kernels.cpu.crossover`: decoding,
causal and dense; float32, bfloat16, float16; forward and forward+backward, float32 gradients
excepted, which never go to SDPA), both backends are timed on a ladder of sizes, alternating
call by call after a warm-up, and the ratio of their medians is the point. The points are stored
beside the compiled kernel (`crossovers.json`) and read by `auto` from then on; `qkv.dispatch`
names the table that decided. `quick` measures fewer sizes with fewer repeats, for tests (how
long a run takes: docs/cpu.md).

Shapes of the ladders (B = 1, `finite_inputs=True`, the kernel's current path), each at head
dimension D = Dv = 64 and 128:

- decode-mha: H = Hkv = 8; decode-gqa: H = 32 query heads on Hkv = 8; each with Nq = 1 (q1)
  and Nq = 8 (qN, several-query decoding); Nk from 64 to 16384;
- causal, dense and masked (a bool padding mask on the last quarter of the keys): Nq = Nk = N,
  H = Hkv = 4, N from 4 to 2048 (forward) or 1024 (with the backward).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .functional import attention
from .kernels.cpu import build, crossover
from .kernels.cpu.backend import kernel_status
from .plan import make_plan

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)
DECODE_NK = (64, 256, 1024, 4096, 16384)
PREFILL_N = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
GRAD_MAX_N = 1024
QUICK_DECODE_NK, QUICK_PREFILL_N = (64, 1024), (16, 256)
HEADS = {"decode-mha": (8, 8), "decode-gqa": (32, 8)}  # (H, Hkv); prefill: 4 on 4
DECODE_QUERIES = {"q1": 1, "qN": 8}


@dataclass(frozen=True)
class Ladder:
    """One request class measured at several sizes."""

    kind: str  # decode-{mha,gqa}-{q1,qN}, causal, dense or masked
    dtype: torch.dtype
    grad: bool  # forward + backward
    d: int  # head dimension of q, k and v
    sizes: tuple[int, ...]  # Nk (decoding) or N = Nq = Nk

    def inputs(self, n: int):
        g = torch.Generator().manual_seed(n)
        h, hkv = HEADS.get(self.kind[:10], (4, 4))
        nq = DECODE_QUERIES[self.kind[11:]] if self.kind.startswith("decode") else n
        shapes = ((1, h, nq, self.d), (1, hkv, n, self.d), (1, hkv, n, self.d))
        return [
            torch.randn(s, generator=g).to(self.dtype).requires_grad_(self.grad) for s in shapes
        ]

    def kwargs(self, n: int) -> dict:
        mask = padding(n) if self.kind == "masked" else None
        return dict(causal=self.kind == "causal", mask=mask, finite_inputs=True)


def padding(n: int) -> torch.Tensor:
    """The `masked` ladder's mask: the last quarter of the keys are padding, `(1, 1, 1, N)`."""
    keep = torch.ones(1, 1, 1, n, dtype=torch.bool)
    keep[..., n - n // 4 :] = False
    return keep


def _call(ladder: Ladder, n: int, backend: str, q, k, v) -> Callable[[], object]:
    kw = dict(ladder.kwargs(n), backend=backend)
    if not ladder.grad:

        def run():
            with torch.no_grad():
                return attention(q, k, v, **kw)

        return run
    dout = torch.ones(q.shape, dtype=q.dtype)

    def run_grad():
        out = attention(q, k, v, **kw)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    return run_grad


def _race(calls: dict[str, Callable[[], object]], budget_s: float, most: int) -> dict[str, float]:
    """Median seconds of each call, the calls alternating (reversed every other round)."""
    first = {}
    for name, call in calls.items():  # warm-up, which also sizes the number of rounds
        start = time.perf_counter()
        call()
        first[name] = time.perf_counter() - start
    rounds = max(3, min(most, int(budget_s / max(sum(first.values()), 1e-6))))
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def ladders(quick: bool = False) -> Iterator[Ladder]:
    """Every request class the tune measures (float32 gradients excepted: never SDPA's)."""
    decode_nk = QUICK_DECODE_NK if quick else DECODE_NK
    prefill_n = QUICK_PREFILL_N if quick else PREFILL_N
    grad_n = tuple(n for n in prefill_n if n <= GRAD_MAX_N)
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            for heads in HEADS:
                for queries in DECODE_QUERIES:
                    yield Ladder(f"{heads}-{queries}", dtype, False, d, decode_nk)
            for kind in ("causal", "dense", "masked"):
                yield Ladder(kind, dtype, False, d, prefill_n)
                if dtype != torch.float32:
                    yield Ladder(kind, dtype, True, d, grad_n)


def measure(quick: bool = False, progress: Callable[[str], None] | None = None) -> crossover.Table:
    """Time the kernel against SDPA on every ladder; the table of winners for the kernel's
    current path (raises RuntimeError when the kernel cannot run here)."""
    isa, why = kernel_status()
    if isa is None:
        raise RuntimeError(why)
    budget_s, most = (0.02, 3) if quick else (0.2, 11)
    points: dict[str, list[tuple[float, float]]] = {}
    for ladder in ladders(quick):
        for n in ladder.sizes:
            q, k, v = ladder.inputs(n)
            calls = {b: _call(ladder, n, b, q, k, v) for b in ("cpu", "sdpa")}
            t = _race(calls, budget_s, most)
            with torch.set_grad_enabled(ladder.grad):
                plan = make_plan(q, k, v, **ladder.kwargs(n))
            cls = crossover.class_of(plan)
            ratio = round(t["sdpa"] / t["cpu"], 3)
            points.setdefault(cls, []).append((crossover.work_of(plan), ratio))
            if progress is not None:
                size = f"{'Nk' if ladder.kind.startswith('decode') else 'N '}={n:<6}"
                progress(f"{cls:<34} {size} kernel {ratio:5.2f}× SDPA")
    table = {cls: tuple(sorted(pts)) for cls, pts in points.items()}
    return crossover.Table(isa, "calibrated", machine(), table)


def machine() -> str:
    """The CPU (model, family and model numbers), torch and the date, for `measured_on`."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = build.cpu_model()
    if "cpu family" in fields and "model" in fields:
        cpu += f" (family {fields['cpu family']}, model {fields['model']})"
    return f"{cpu}, torch {torch.__version__}, {datetime.date.today().isoformat()}"


def busy() -> str | None:
    """Why the machine is too busy for a fair measurement (None: it looks quiet)."""
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    if load > 0.5 * cores + 0.5:
        return f"load {load:.1f} on {cores} cores"
    return None


def save(table: crossover.Table) -> Path:
    """Store a calibration beside the kernel (other paths' tables kept); atomic. Raises OSError
    when the folder cannot be written."""
    path = crossover.calibrated_path()
    if path is None:
        raise OSError("the kernel's cache folder is unavailable")
    tables = {}
    if path.exists():
        try:
            tables = crossover.parse(json.loads(path.read_text()), "calibrated")
        except (OSError, ValueError, TypeError, KeyError):
            tables = {}
    tables[table.isa] = table
    text = json.dumps(crossover.to_json(tables), indent=1) + "\n"

    def write(part: Path) -> None:
        part.write_text(text)

    build.write_atomic(path, write)
    crossover.clear()
    return path
