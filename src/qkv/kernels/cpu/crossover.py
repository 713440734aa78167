"""Where the compiled kernel beats torch SDPA on this machine: a table per instruction-set path.

`auto` sends a CPU request that torch SDPA can run exactly (no lse, no qkv dropout, no score
modifier, dense or causal, a bool mask with `finite_inputs=True`) to whichever of the two was
measured faster for requests of its class and size. Everything else is decided by semantics,
not by this table: structured masks, bottom-right causal with Nq < Nk and float32 gradients
never go to SDPA.

A request's class is `kind/dtype/pass/D`:

- kind: `decode-mha-q1`, `decode-mha-qN`, `decode-gqa-q1`, `decode-gqa-qN` (a KV-cache step,
  one query, or several-query decoding, up to `DECODE_ROWS` queries, against more keys than
  queries; without and with grouped heads), else `masked` (a bool mask tensor, such as a padding
  mask), `causal` or `dense`;
- dtype: `float32`, `bfloat16`, `float16`;
- pass: `fwd` (no gradient) or `fwd+bwd`;
- D: the head dimension's bucket, `D64` (D ≤ 64) or `D128` (larger).

Its size is its work: for decoding the key and value elements it reads, `B · Hkv · Nk · (D +
Dv)`; otherwise `B · H · Nq · Nk · (D + Dv)` multiply-adds (halved for square causal).
A table holds, per class, points `(work, ratio)` measured on a ladder of sizes, where ratio is
SDPA's time ÷ the kernel's (> 1: the kernel is faster). A request takes the point nearest to it
in log(work) and runs on the kernel when that point's ratio, smoothed as the median of it and
its neighbours on the ladder (one outlier from a busy moment does not flip a band), is ≥ 1: a
crossover lies halfway (geometrically) between two measured points, and beyond the ladder the
last point holds.

Where the tables come from, in order (`basis(isa)` says which one answers):

1. `calibrated`: measured on this machine by `qkv tune` (also run by `qkv build`), stored as
   `crossovers.json` beside the compiled kernel (the same folder: torch, Python, CPU model and
   sources in its name) with the qkv version; a table for another qkv version is not read.
2. `default`: `crossovers_default.json` in this package, one table per path, each measured on
   the machine its `measured_on` names with the same `qkv tune` (`python -m
   benchmarks.crossover_defaults` writes it); the `amx` and `avx512bf16` paths, which have
   none, read the `avx512` one (the stand-ins of `csrc/isa_paths.h`). `QKV_CROSSOVERS=default`
   makes `auto` read these even where a calibration exists.

Nothing is measured on a user's call: the tables are read once per process (`clear()` forgets
them, and `QKV_CROSSOVERS` is read again, for tests and after `qkv tune`), decisions are
remembered per class and size. Under `torch.compile` the class's table comes into the graph as
a constant (its bands: `Table.bands`) and a symbolic size is compared with the band bounds, each
comparison a guard torch keeps: with dynamic shapes one graph serves every size on the same side
of a crossover, and a size that crosses one is traced again (`_traced`).

`QKV_CROSSOVERS` (`setting()`): unset, empty or `calibrated` (this machine's calibration where
there is one, else the default) or `default`; any other value warns once, naming the variable
and these values, and reads as unset.
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from ...plan import AttentionPlan
from .isa import STAND_INS  # a path without a default table of its own -> the one it reads

ENV = "QKV_CROSSOVERS"  # "default": ignore this machine's calibration (tests, comparisons)
DECODE_ROWS = 16  # queries up to which a request against a longer cache is a decoding step
CALIBRATED = "crossovers.json"
DEFAULTS = Path(__file__).resolve().parent / "crossovers_default.json"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def qkv_version() -> str:
    try:
        return metadata.version("qkv")
    except metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "unknown"


def kind_of(plan: AttentionPlan) -> str:
    """`decode-{mha,gqa}-{q1,qN}`, `masked`, `causal` or `dense` (the module docstring)."""
    # Nk > Nq first: under torch.compile a self-attention request's Nq and Nk are one symbol,
    # so this is known false without a guard, and no guard on Nq ≤ DECODE_ROWS is kept either
    if plan.kv_len > plan.q_len and plan.q_len <= DECODE_ROWS:
        heads = "gqa" if plan.groups > 1 else "mha"
        return f"decode-{heads}-{'q1' if plan.q_len == 1 else 'qN'}"
    if plan.pairs.mask is not None:
        return "masked"
    return "causal" if plan.pairs.causal else "dense"


def class_of(plan: AttentionPlan) -> str:
    """`kind/dtype/pass/D` of a request."""
    dtype = DTYPE_NAMES.get(plan.dtype, str(plan.dtype).removeprefix("torch."))
    grad = "fwd+bwd" if plan.wants_grad else "fwd"
    return f"{kind_of(plan)}/{dtype}/{grad}/D{64 if plan.head_dim <= 64 else 128}"


def work_of(plan: AttentionPlan) -> float:
    """The request's size: for a decoding step the key and value elements it reads,
    `B·Hkv·Nk·(D+Dv)` (a few queries against a long cache take the time of reading it: Nq = 4
    at Nk = 16384 runs like Nq = 8 there, not like Nq = 8 at half the keys); otherwise the
    forward's multiply-adds `B·H·Nq·Nk·(D+Dv)`, halved for square causal."""
    if kind_of(plan).startswith("decode"):
        return float(plan.batch * plan.kv_heads * plan.kv_len * (plan.head_dim + plan.v_dim))
    return twice_work(plan) / 2


def twice_work(plan: AttentionPlan) -> int:
    """2 · `work_of(plan)`, an integer made of the plan's sizes only: under torch.compile with
    dynamic shapes a symbolic one, which `decide` compares with the integer band bounds of
    `Table.bands` (each comparison a guard torch keeps)."""
    if kind_of(plan).startswith("decode"):
        return 2 * plan.batch * plan.kv_heads * plan.kv_len * (plan.head_dim + plan.v_dim)
    w = plan.batch * plan.heads * plan.q_len * plan.kv_len * (plan.head_dim + plan.v_dim)
    return w if plan.pairs.causal and plan.q_len == plan.kv_len else 2 * w


@dataclass(frozen=True)
class Table:
    """The measurements of one path: `points[class] = ((work, ratio), ...)` by work, ratio =
    SDPA's time ÷ the kernel's."""

    isa: str  # the kernel's instruction-set path the points were measured on
    source: str  # "calibrated" or "default"
    measured_on: str  # CPU model, torch version and date of the measurement
    points: dict[str, tuple[tuple[float, float], ...]]

    def winner(self, cls: str, work: float) -> str | None:
        """ "cpu" or "sdpa" by the smoothed ratio of the nearest point in log(work); None when
        the class is not measured."""
        bands = self.bands(cls)
        if bands is None:
            return None
        return next(who for bound, who in bands if bound is None or work <= bound)

    def bands(self, cls: str) -> tuple[tuple[float | None, str], ...] | None:
        """The class's table as bands of work with one winner each, by size: `((bound, who),
        ...)`, a band holding the work up to its bound (the geometric midpoint between the
        last point of the band and the first of the next: a request takes the nearest point
        in log(work), the lower one on a tie), the last band unbounded (None); None when the
        class is not measured. Neighbouring points with the same winner share a band, so a
        band's end is a crossover."""
        found = self._bands.get(cls)
        if found is None and cls in self.points and self.points[cls]:
            pts = self.points[cls]
            sizes = [max(w, 1.0) for w, _ in pts]
            made: list[tuple[float | None, str]] = []
            for i in range(len(pts)):
                near = [r for _, r in pts[max(i - 1, 0) : i + 2]]
                who = "cpu" if statistics.median(near) >= 1.0 else "sdpa"
                bound = (
                    math.exp((math.log(sizes[i]) + math.log(sizes[i + 1])) / 2)
                    if i + 1 < len(pts)
                    else None
                )
                if made and made[-1][1] == who:
                    made[-1] = (bound, who)
                else:
                    made.append((bound, who))
            self._bands[cls] = tuple(made)
        return self._bands.get(cls)

    @functools.cached_property
    def _bands(self) -> dict[str, tuple[tuple[float | None, str], ...]]:
        return {}  # class -> its bands, worked out on first use

    def describe(self) -> str:
        how = "measured here by `qkv tune`" if self.source == "calibrated" else "qkv's default"
        return f"{self.source} ({how}; {self.isa} path measured on {self.measured_on})"


def parse(data: dict, source: str) -> dict[str, Table]:
    """Tables by path from the JSON form `{"paths": {isa: {"measured_on", "points"}}}`."""
    tables = {}
    for isa, entry in data.get("paths", {}).items():
        points = {
            cls: tuple(sorted((float(w), float(r)) for w, r in pts))
            for cls, pts in entry.get("points", {}).items()
        }
        tables[isa] = Table(isa, source, str(entry.get("measured_on", "?")), points)
    return tables


def to_json(tables: dict[str, Table]) -> dict:
    paths = {}
    for isa, t in tables.items():
        points = {c: [list(x) for x in p] for c, p in t.points.items()}
        paths[isa] = {"measured_on": t.measured_on, "points": points}
    return {"qkv_version": qkv_version(), "paths": paths}


_loaded: dict[str, dict[str, Table]] = {}  # "calibrated" / "default" -> tables by path
_decided: dict[tuple, tuple[str, str]] = {}  # (path, class fields, work) -> decision
DECIDED_MAX = 4096  # decisions remembered (emptied when full)


def _read(source: str) -> dict[str, Table]:
    if source not in _loaded:
        tables: dict[str, Table] = {}
        try:
            if source == "default":
                tables = parse(json.loads(DEFAULTS.read_text()), "default")
            else:
                path = calibrated_path()
                if path is not None and path.exists():
                    data = json.loads(path.read_text())
                    if data.get("qkv_version") == qkv_version():
                        tables = parse(data, "calibrated")
        except (OSError, ValueError, TypeError, KeyError):
            tables = {}  # an unreadable or foreign file is no calibration
        _loaded[source] = tables
    return _loaded[source]


def calibrated_path() -> Path | None:
    """Where `qkv tune` keeps its tables: beside the compiled kernel (None: no kernel folder)."""
    from .build import build_dir

    try:
        return build_dir() / CALIBRATED
    except OSError:
        return None


def clear() -> None:
    """Forget the tables read so far (the next decision reads the files again)."""
    global _generation
    _loaded.clear()
    _decided.clear()
    _warned.clear()
    _generation += 1


def generation() -> int:
    """How many times `clear()` ran: part of the key under which dispatch remembers a choice."""
    return _generation


_generation = 0


def table(isa: str) -> Table | None:
    """The table that decides for a path: the calibration if there is one (and `QKV_CROSSOVERS`
    is not `default`), else the default."""
    if setting() != "default":
        found = _read("calibrated").get(isa)
        if found is not None:
            return found
    return default_table(isa)


SETTINGS = ("calibrated", "default")  # QKV_CROSSOVERS's values (unset or empty: calibrated)
_warned: set[str] = set()  # values of QKV_CROSSOVERS already warned about in this process


def setting() -> str:
    """`QKV_CROSSOVERS` as `calibrated` (unset, empty or `calibrated`: this machine's
    calibration where `qkv tune` stored one, else qkv's default) or `default` (qkv's default
    only). Any other value is a mistake: it warns once per value, naming the variable and the
    accepted values, and reads as unset (the choice is about speed: both backends are exact)."""
    raw = os.environ.get(ENV, "")
    value = raw.strip().lower()
    if value in SETTINGS:
        return value
    if value and raw not in _warned:
        _warned.add(raw)
        warnings.warn(
            f"{ENV}={raw!r} is not a value qkv knows; expected one of "
            f"{', '.join(SETTINGS)} (or unset). It is read as unset: auto's size crossovers "
            "come from this machine's calibration (`qkv tune`) where there is one, else from "
            "qkv's default",
            RuntimeWarning,
            stacklevel=2,
        )
    return "calibrated"


def default_table(isa: str) -> Table | None:
    """qkv's default for a path; the AVX-512 path's stands in for `amx` and `avx512bf16` (the
    same vector code, with bfloat16 products on top), which have no default of their own."""
    defaults = _read("default")
    return defaults.get(isa) or defaults.get(STAND_INS.get(isa, ""))


def decide(plan: AttentionPlan, isa: str) -> tuple[str, str]:
    """`(winner, why)` for a request SDPA can run: `("cpu", basis)`, the kernel (also when
    nothing was measured), or `("sdpa", the sentence saying why SDPA runs it)`."""
    if torch.compiler.is_compiling():
        return _traced(isa, class_of(plan), twice_work(plan))
    work = work_of(plan)
    key = (isa, kind_of(plan), plan.dtype, plan.wants_grad, plan.head_dim <= 64, work)
    found = _decided.get(key)
    if found is None:
        if len(_decided) >= DECIDED_MAX:  # a decode loop meets a new size every step
            _decided.clear()
        found = _decided[key] = _winner(isa, class_of(plan), work)
    return found


def _winner(isa: str, cls: str, work: float) -> tuple[str, str]:
    t = table(isa)
    if t is None or t.winner(cls, work) != "sdpa":
        return "cpu", basis(isa)
    return "sdpa", (
        f"torch SDPA was measured faster on {cls} requests of this size ({work:.3g}, "
        f"crossover.work_of); crossovers: {basis(isa)}"
    )


def _traced(isa: str, cls: str, twice: int | torch.SymInt) -> tuple[str, str]:
    """`decide` while torch.compile traces, where `twice` (2 · work) may be a symbolic size:
    the class's bands come as a constant of the graph (`_bands_of`) and the work is compared
    with their integer bounds, each comparison a guard torch keeps, so the graph holds for the
    band its sizes fall in and is traced again only when a size crosses a crossover (the
    decision is then a different one). The same decision as outside torch.compile: a work w
    in a band of bound b has 2w ≤ ⌊2b⌋ exactly when w ≤ b, 2w being an integer."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true

    for last, who, why in _bands_of(isa, cls):
        if last is None or guard_or_false(twice <= last):
            return who, why
        if guard_or_true(twice <= last):
            # a size torch has no value for while tracing (data-dependent): the kernel,
            # which runs every request exactly, and no guard
            break
    return "cpu", basis(isa)


def _bands_of(isa: str, cls: str) -> tuple[tuple[int | None, str, str], ...]:
    """The bands (`Table.bands`) of a class as `(last, who, why)`: the largest 2 · work in the
    band (None: unbounded), its winner and the reason `decide` gives; empty when the class is
    not measured (the kernel runs it)."""
    t = table(isa)
    bands = None if t is None else t.bands(cls)
    if not bands:
        return ()
    found, low = [], None
    for bound, who in bands:
        last = None if bound is None else math.floor(2 * bound)
        if who == "cpu":
            why = basis(isa)
        else:
            size = (
                "any work" if low is None and bound is None
                else f"work ≤ {bound:.3g}" if low is None
                else f"work > {low:.3g}" if bound is None
                else f"{low:.3g} < work ≤ {bound:.3g}"
            )  # fmt: skip
            why = (
                f"torch SDPA was measured faster on {cls} requests of this size ({size}, "
                f"crossover.work_of); crossovers: {basis(isa)}"
            )
        found.append((last, who, why))
        low = bound
    return tuple(found)


def basis(isa: str) -> str:
    """Which table decides for a path, in words (for `qkv.dispatch`)."""
    t = table(isa)
    if t is None:
        return f"no crossover table for the {isa} path: the kernel is preferred"
    return t.describe()


# torch.compile calls these while tracing and keeps the answers as constants of the graph (what
# `torch.compiler.assume_constant_result` does, without importing torch._dynamo here): the
# tables are read from files once per process, never in a compiled graph. Their arguments are
# names, never sizes: a symbolic size cannot be made a constant (`_traced` compares it).
_bands_of._dynamo_marked_constant = True  # type: ignore[attr-defined]  # dynamo's marker
basis._dynamo_marked_constant = True  # type: ignore[attr-defined]  # dynamo's marker
