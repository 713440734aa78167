"""The runner's results: raw times per round and per call, memory, stage data, and the figures
derived from them (medians, ratios against the anchors, rates). JSON in, JSON out: the reporter
renders a section from a `Results`, fresh or read back from its JSON file.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .suite import BestOf, Group

CONTENDED = 0.25  # median CPU pressure during a figure's calls above which it is flagged


def params(case: Any) -> dict[str, Any]:
    """A case's parameters: the fields of its dataclass (or the dict itself)."""
    return dataclasses.asdict(case) if dataclasses.is_dataclass(case) else dict(case)


def case_key(group: str, case: Any) -> str:
    return f"{group}:{json.dumps(params(case), sort_keys=True)}"


def type_path(case: Any) -> str:
    cls = type(case)
    return f"{cls.__module__}:{cls.__qualname__}"


def rebuild(path: str, fields: dict[str, Any]) -> Any:
    """The case object of a recorded case (its dict if the type cannot be imported)."""
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)(**fields)
    except (ImportError, AttributeError, TypeError):
        return fields


def median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


@dataclasses.dataclass
class Timing:
    """One (case, implementation, pass): seconds per call, by round (None: it sat the round out),
    the CPU pressure during each timed call, and why there is no figure (`note`)."""

    group: str
    case: dict[str, Any]
    impl: str
    pass_: str
    warmup_s: float | None = None
    times_s: list[float | None] = dataclasses.field(default_factory=list)
    pressure: list[float | None] = dataclasses.field(default_factory=list)
    note: str | None = None
    median_s: float | None = None
    pressure_median: float | None = None
    ratios: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    rates: dict[str, float] = dataclasses.field(default_factory=dict)  # GFLOP/s by kind

    @property
    def rounds(self) -> int:
        return sum(t is not None for t in self.times_s)

    @property
    def contended(self) -> bool:
        return self.pressure_median is not None and self.pressure_median > CONTENDED


@dataclasses.dataclass
class MemoryResult:
    """Peak memory of one call in a fresh process, beyond what it held before the call."""

    group: str
    case: dict[str, Any]
    impl: str
    pass_: str
    peak_mib: float | None = None
    inputs_mib: float | None = None
    wall_s: float | None = None
    error: str | None = None
    type: str = ""  # the case's type, to rebuild it


@dataclasses.dataclass
class CaseRecord:
    group: str
    type: str
    params: dict[str, Any]
    note: str | None = None  # the case was not run, and why
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    impl_extras: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Results:
    suite: str
    mode: str  # "full" or "quick"
    command: str
    machine: dict[str, Any]
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    dry_run: bool = False
    complete: bool = False  # False while the run goes on, or if it stopped early
    runtime_s: float = 0.0
    load: dict[str, float | None] = dataclasses.field(default_factory=dict)
    pressure_fraction: float | None = None  # share of the run some task waited for a CPU
    gate: dict[str, Any] = dataclasses.field(default_factory=dict)
    ceiling: dict[str, float] | None = None
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)
    cases: list[CaseRecord] = dataclasses.field(default_factory=list)
    timings: list[Timing] = dataclasses.field(default_factory=list)
    memory: list[MemoryResult] = dataclasses.field(default_factory=list)
    stages: dict[str, Any] = dataclasses.field(default_factory=dict)
    targets: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, default=str) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Results:
        raw = json.loads(text)
        raw["cases"] = [CaseRecord(**c) for c in raw["cases"]]
        raw["timings"] = [Timing(**t) for t in raw["timings"]]
        raw["memory"] = [MemoryResult(**m) for m in raw["memory"]]
        return cls(**raw)

    @classmethod
    def read(cls, path: Path) -> Results:
        return cls.from_json(path.read_text())

    # ------------------------------------------------------------------ lookups

    def case_record(self, group: str, case: Any) -> CaseRecord | None:
        key = case_key(group, case)
        return next((c for c in self.cases if case_key(c.group, c.params) == key), None)

    def case_objects(self, group: str) -> Iterator[Any]:
        for c in self.cases:
            if c.group == group:
                yield rebuild(c.type, c.params)

    def timing(self, group: str, case: Any, impl: str, pass_: str) -> Timing | None:
        return self._index(self.timings).get((case_key(group, case), impl, pass_))

    def median(self, group: str, case: Any, impl: str, pass_: str) -> float | None:
        t = self.timing(group, case, impl, pass_)
        return t.median_s if t else None

    def ratio(self, group: str, case: Any, impl: str, pass_: str, anchor: str) -> float | None:
        t = self.timing(group, case, impl, pass_)
        r = t.ratios.get(anchor) if t else None
        return r["median"] if r else None

    def memory_of(self, group: str, case: Any, impl: str, pass_: str) -> MemoryResult | None:
        return self._index(self.memory).get((case_key(group, case), impl, pass_))

    def _index(self, items: list[Any]) -> dict[tuple[str, str, str], Any]:
        """(case key, impl, pass) → item, rebuilt when the list has grown."""
        cache = self.__dict__.setdefault("_indexes", {})
        index = cache.get(id(items))
        if index is None or index[0] != len(items):
            keys = {(case_key(i.group, i.case), i.impl, i.pass_): i for i in items}
            index = cache[id(items)] = (len(items), keys)
        return index[1]

    def impls(self, group: str, case: Any) -> list[str]:
        """The implementations with a row at this case, in the order they were declared."""
        key = case_key(group, case)
        seen = (t.impl for t in self.timings if case_key(t.group, t.case) == key)
        return list(dict.fromkeys(seen))

    # ------------------------------------------------------------------ derived figures

    def derive(self, group: Group) -> None:
        """Medians, pressure, rates, and ratios against the anchors, for `group`'s timings.

        A ratio is `time_anchor / time_impl` (> 1: faster than the anchor) within each round in
        which both ran, and the median over those rounds, with the lowest and highest: the two
        calls of a round see nearly the same load from other processes, so the per-round ratio
        is steadier than a ratio of medians on a shared machine."""
        mine = [t for t in self.timings if t.group == group.name]
        by_case: dict[str, dict[tuple[str, str], Timing]] = {}
        for t in mine:
            by_case.setdefault(case_key(t.group, t.case), {})[(t.impl, t.pass_)] = t
        for t in mine:
            t.median_s = median_or_none(t.times_s)
            t.pressure_median = median_or_none(t.pressure)
            t.ratios, t.rates = {}, {}
            if t.median_s is None:
                continue
            record = self.case_record(group.name, t.case)
            case = rebuild(record.type, t.case) if record else t.case
            for kind, count in group.rates.items():
                flops = count(case, t.pass_, record.extras if record else {})
                if flops is not None:
                    t.rates[kind] = flops / t.median_s / 1e9
            for anchor in group.anchors:
                name, members = (
                    (anchor.name, anchor.members)
                    if isinstance(anchor, BestOf)
                    else (anchor, (anchor,))
                )
                others = [by_case[case_key(t.group, t.case)].get((m, t.pass_)) for m in members]
                ratio = paired_ratio([o.times_s for o in others if o is not None], t.times_s)
                if ratio is not None:
                    t.ratios[name] = ratio


def paired_ratio(
    anchors: list[list[float | None]], times: list[float | None]
) -> dict[str, float] | None:
    """Median, lowest and highest over rounds of min(anchor times of the round) / time, over the
    rounds in which the implementation and at least one anchor ran."""
    ratios = []
    for r, t in enumerate(times):
        here = [a[r] for a in anchors if r < len(a) and a[r] is not None]
        if t is not None and here:
            ratios.append(min(here) / t)
    if not ratios:
        return None
    return {
        "median": statistics.median(ratios),
        "lo": min(ratios),
        "hi": max(ratios),
        "rounds": len(ratios),
    }
