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
   none, read the `avx512` one. `QKV_CROSSOVERS=default` makes `auto` read these even where a
   calibration exists.

Nothing is measured on a user's call: the tables are read once per process (`clear()` forgets
them, and `QKV_CROSSOVERS` is read again, for tests and after `qkv tune`), decisions are
remembered per class and size, and `torch.compile` keeps the decision as a constant.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from ...plan import AttentionPlan

ENV = "QKV_CROSSOVERS"  # "default": ignore this machine's calibration (tests, comparisons)
DECODE_ROWS = 16  # queries up to which a request against a longer cache is a decoding step
CALIBRATED = "crossovers.json"
DEFAULTS = Path(__file__).resolve().parent / "crossovers_default.json"
# a path without a default table of its own -> the one that stands in
STAND_INS = {"amx": "avx512", "avx512bf16": "avx512"}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def qkv_version() -> str:
    try:
        return metadata.version("qkv")
    except metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "unknown"


def kind_of(plan: AttentionPlan) -> str:
    """`decode-{mha,gqa}-{q1,qN}`, `masked`, `causal` or `dense` (the module docstring)."""
    if plan.q_len <= DECODE_ROWS and plan.kv_len > plan.q_len:
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
    w = plan.batch * plan.heads * plan.q_len * plan.kv_len * (plan.head_dim + plan.v_dim)
    return w / 2 if plan.pairs.causal and plan.q_len == plan.kv_len else float(w)


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
        pts = self.points.get(cls)
        if not pts:
            return None
        x = math.log(max(work, 1.0))
        i = min(range(len(pts)), key=lambda j: abs(math.log(max(pts[j][0], 1.0)) - x))
        near = [r for _, r in pts[max(i - 1, 0) : i + 2]]
        return "cpu" if statistics.median(near) >= 1.0 else "sdpa"

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
    _generation += 1


def generation() -> int:
    """How many times `clear()` ran: part of the key under which dispatch remembers a choice."""
    return _generation


_generation = 0


def table(isa: str) -> Table | None:
    """The table that decides for a path: the calibration if there is one (and `QKV_CROSSOVERS`
    is not `default`), else the default."""
    if os.environ.get(ENV, "").strip().lower() != "default":
        found = _read("calibrated").get(isa)
        if found is not None:
            return found
    return default_table(isa)


def default_table(isa: str) -> Table | None:
    """qkv's default for a path; the AVX-512 path's stands in for `amx` and `avx512bf16` (the
    same vector code, with bfloat16 products on top), which have no default of their own."""
    defaults = _read("default")
    return defaults.get(isa) or defaults.get(STAND_INS.get(isa, ""))


def decide(plan: AttentionPlan, isa: str) -> tuple[str, str]:
    """`(winner, why)` for a request SDPA can run: `("cpu", basis)`, the kernel (also when
    nothing was measured), or `("sdpa", the sentence saying why SDPA runs it)`."""
    if torch.compiler.is_compiling():  # a constant of the graph (see below)
        return _winner(isa, class_of(plan), work_of(plan))
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


def basis(isa: str) -> str:
    """Which table decides for a path, in words (for `qkv.dispatch`)."""
    t = table(isa)
    if t is None:
        return f"no crossover table for the {isa} path: the kernel is preferred"
    return t.describe()


# torch.compile calls these while tracing and keeps the answers as constants of the graph (what
# `torch.compiler.assume_constant_result` does, without importing torch._dynamo here): the
# tables are read from files once per process, never in a compiled graph.
_winner._dynamo_marked_constant = True  # type: ignore[attr-defined]
basis._dynamo_marked_constant = True  # type: ignore[attr-defined]
