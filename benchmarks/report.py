"""The reporter: a suite's section of docs/benchmarks.md (and its JSON) from its `Results`.

A section is the header every suite shares (date, machine, software, command, load, gate), the
suite's method bullets and the runner's own, the matmul ceiling, the suite's tables and blocks,
what was not run, and the targets. Sections live between `<!-- BEGIN name -->` and
`<!-- END name -->`; `write_section` replaces one and leaves the others byte for byte.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .machine import QuietGate
from .results import CONTENDED, MemoryResult, Results, Timing, rebuild
from .suite import Suite

DOC_HEADER = """# Benchmarks

Each section below is written by one suite of `benchmarks/` and only by it:
`python -m benchmarks.run <suite> --out docs/benchmarks.md` replaces the text between
`<!-- BEGIN <suite> -->` and `<!-- END <suite> -->`, leaves the other sections alone and writes
`docs/benchmarks-<suite>.json` beside it (`python -m benchmarks.run --list` names the suites;
`benchmarks/README.md` says how to add one). Regenerate, never edit the numbers by hand.

How every section is measured (`benchmarks/runner.py`, `benchmarks/probe.py`), unless it says
otherwise; each section gives its shapes, machine, date, load and its own method:

- **Time:** for each case and pass the implementations take turns, round after round, in
  reverse order every other round, so that load from other processes and the order hit them
  alike; one warm-up round (a compiling implementation's first call), then the median of the
  timed rounds. Forward under `torch.no_grad()`; forward + backward as `out.backward(grad)` with
  a fixed random `grad`, the gradients cleared (untimed) before each call.
- **×A** (speed relative to A) = `time_A / time_impl` within each round in which both ran, the
  median over those rounds (> 1: faster than A), A measured in the same run on the same shapes:
  the two calls of a round see nearly the same load, so this is steadier than a ratio of medians
  on a shared machine.
- **Quiet gate:** before each timed round the runner sleeps {sample} s and reads how busy the
  CPUs were meanwhile (`/proc/stat`), and waits (≤ {round_s} s per round, ≤ {total_s} s per run)
  while more than {busy}% were busy (policy `wait`; `refuse` stops the run instead). The CPU
  pressure (Linux PSI) during every timed call is recorded; † marks a time whose median
  pressure is above {contended}% (contended: read it with care).
- **Memory:** each call runs once in a fresh Python process with the same thread count, capped
  in address space. After building the inputs and one call on a small case (lazy set-up is not
  the call's memory), freed memory is given back to the system, the resident set is the
  baseline and the peak mark is reset (`/proc/self/clear_refs`); the figure is the peak (VmHWM)
  during the call minus that baseline, so it includes what the call returns. `ru_maxrss` is not
  used: on Linux a child inherits its parent's high-water mark across exec.
- **Ceiling:** torch's fp32 matmul rate (2048³), measured before and after the timings of the
  same run; the higher is used.
""".format(
    sample=QuietGate.sample_s,
    round_s=f"{QuietGate.max_round_s:.0f}",
    total_s=f"{QuietGate.max_total_s:.0f}",
    busy=f"{100 * QuietGate.busy_above:.0f}",
    contended=f"{100 * CONTENDED:.0f}",
)

_SECTION = re.compile(
    r"<!-- BEGIN (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- END (?P=name) -->\n?", re.S
)


# --------------------------------------------------------------------------- cells


def fmt(value: float | None, spec: str, missing: str = "—") -> str:
    return missing if value is None else format(value, spec)


def short_note(note: str | None) -> str:
    """A cell's word for a missing figure: "skipped", "failed", "not run", "forward only"."""
    return note.split(" (")[0].split(":")[0] if note else "—"


def time_cell(t: Timing | None, counts: bool = False, scale: float = 1e3, spec: str = ".1f") -> str:
    """The median time (ms by default), `(rounds)` when asked, † when measured under contention;
    else the short note."""
    if t is None:
        return "—"
    if t.median_s is None:
        return short_note(t.note)
    cell = format(t.median_s * scale, spec)
    if counts:
        cell += f" ({t.rounds})"
    return cell + (" †" if t.contended else "")


# --------------------------------------------------------------------------- rows and tables


@dataclasses.dataclass(frozen=True)
class Row:
    """A table row: one case of a group, or one (case, implementation)."""

    results: Results
    group: str
    case: Any
    impl: str | None = None

    def timing(self, pass_: str, impl: str | None = None) -> Timing | None:
        return self.results.timing(self.group, self.case, impl or self.impl or "", pass_)

    def median(self, pass_: str, impl: str | None = None) -> float | None:
        t = self.timing(pass_, impl)
        return t.median_s if t else None

    def ratio(self, pass_: str, anchor: str) -> dict[str, float] | None:
        t = self.timing(pass_)
        return t.ratios.get(anchor) if t else None

    def rate(self, pass_: str, kind: str) -> float | None:
        t = self.timing(pass_)
        return t.rates.get(kind) if t else None

    def memory(self, pass_: str) -> MemoryResult | None:
        return self.results.memory_of(self.group, self.case, self.impl or "", pass_)

    def extra(self, key: str, impl: str | None = None) -> Any:
        """A figure recorded with the case, or with an implementation at the case."""
        record = self.results.case_record(self.group, self.case)
        if record is None:
            return None
        name = impl or self.impl
        if name is not None:
            return record.impl_extras.get(name, {}).get(key)
        return record.extras.get(key)

    @property
    def note(self) -> str | None:
        record = self.results.case_record(self.group, self.case)
        return record.note if record else None


def rows(results: Results, group: str, where: Callable[[Any], bool] = lambda c: True) -> list[Row]:
    """One row per (case, implementation) of `group`, in the order they ran."""
    return [
        Row(results, group, case, impl)
        for case in results.case_objects(group)
        if where(case)
        for impl in results.impls(group, case)
    ]


def case_rows(
    results: Results, group: str, where: Callable[[Any], bool] = lambda c: True
) -> list[Row]:
    """One row per case of `group`."""
    return [Row(results, group, case) for case in results.case_objects(group) if where(case)]


@dataclasses.dataclass(frozen=True)
class Column:
    header: str
    cell: Callable[[Any], str]
    align: str = "r"  # "r" or "l"


@dataclasses.dataclass(frozen=True)
class Table:
    """A Markdown table: `rows(results)` gives the rows, each column turns a row into a cell.
    `title` becomes a `###` heading, `intro(results)` a paragraph before the table."""

    columns: tuple[Column, ...]
    rows: Callable[[Results], list[Any]]
    title: str | Callable[[Results], str] | None = None
    intro: Callable[[Results], str] | None = None

    def render(self, results: Results) -> list[str]:
        lines: list[str] = []
        if self.title is not None:
            title = self.title(results) if callable(self.title) else self.title
            lines += [f"### {title}", ""]
        if self.intro is not None:
            lines += [self.intro(results), ""]
        found = self.rows(results)
        if not found:
            return lines
        lines += [
            "| " + " | ".join(c.header for c in self.columns) + " |",
            "|" + "|".join("---:" if c.align == "r" else ":---" for c in self.columns) + "|",
        ]
        lines += ["| " + " | ".join(c.cell(row) for c in self.columns) + " |" for row in found]
        return [*lines, ""]


def field(name: str, header: str | None = None, align: str = "r") -> Column:
    """A parameter of the row's case."""
    return Column(header or name, lambda r: str(getattr(r.case, name)), align)


def impl_column(header: str = "impl") -> Column:
    return Column(header, lambda r: str(r.impl), "l")


def time_column(
    pass_: str, header: str, counts: bool = False, scale: float = 1e3, spec: str = ".1f"
) -> Column:
    """The median time of a pass (ms unless `scale` says otherwise)."""
    return Column(header, lambda r: time_cell(r.timing(pass_), counts, scale, spec))


def ratio_column(
    pass_: str, anchor: str, header: str, digits: int = 2, span: bool = False
) -> Column:
    """The speed relative to `anchor` (its median over rounds, or with `span` its range)."""

    def cell(r: Row) -> str:
        ratio = r.ratio(pass_, anchor)
        if ratio is None:
            return "—"
        return f"{ratio['lo']:.2f} – {ratio['hi']:.2f}" if span else f"{ratio['median']:.{digits}f}"

    return Column(header, cell, "l" if span else "r")


def rate_column(pass_: str, kind: str, header: str, share: str = "") -> Column:
    """GFLOP/s of `kind`; `share="also"` adds its share of the matmul ceiling in brackets,
    `share="only"` shows the share alone."""

    def cell(r: Row) -> str:
        rate = r.rate(pass_, kind)
        ceiling = r.results.ceiling
        if rate is None or (share and not ceiling):
            return "—"
        pct = f"{100 * rate / ceiling['gflops']:.0f}%" if ceiling else ""
        return {"": f"{rate:.1f}", "also": f"{rate:.1f} ({pct})", "only": pct}[share]

    return Column(header, cell)


def peak_column(pass_: str, header: str) -> Column:
    def cell(r: Row) -> str:
        m = r.memory(pass_)
        if m is None:
            return "—"
        return "failed" if m.error and m.error != "dry run" else fmt(m.peak_mib, ".1f")

    return Column(header, cell)


def pressure_column(passes: tuple[str, ...], header: str) -> Column:
    def cell(r: Row) -> str:
        shown = []
        for pass_ in passes:
            t = r.timing(pass_)
            value = t.pressure_median if t else None
            shown.append("—" if value is None else f"{100 * value:.0f}%")
        return " / ".join(shown)

    return Column(header, cell)


@dataclasses.dataclass(frozen=True)
class MemoryRow:
    case: Any
    impl: str
    result: MemoryResult


def memory_rows(
    group: str, where: Callable[[Any], bool] = lambda c: True
) -> Callable[[Results], list[MemoryRow]]:
    """The memory probes of `group` (those not measured with a timing row), in the order run."""

    def select(results: Results) -> list[MemoryRow]:
        found = [MemoryRow(rebuild(m.type, m.case), m.impl, m) for m in results.memory]
        return [m for m in found if m.result.group == group and where(m.case)]

    return select


MEMORY_COLUMNS = (
    Column("inputs MiB", lambda m: fmt(m.result.inputs_mib, ".0f")),
    Column("peak MiB beyond inputs", lambda m: fmt(m.result.peak_mib, ".1f")),
    Column("wall s", lambda m: fmt(m.result.wall_s, ".1f")),
    Column("note", lambda m: m.result.error or "", "l"),
)


# --------------------------------------------------------------------------- the section


def header(suite: Suite, results: Results) -> list[str]:
    info, load, gate = results.machine, results.load, results.gate
    software = {"torch": info["torch"], **results.facts.get("software", {})}
    device = results.facts.get("device")
    pressure = results.pressure_fraction
    lines = [
        f"## {suite.title}",
        "",
        f"Generated by `python -m benchmarks.run {suite.name}` (`benchmarks/suites/"
        f"{suite.name}.py`); regenerate it, never edit the numbers by hand.",
        "",
    ]
    if results.dry_run:
        lines += ["**Dry run: nothing was measured.**", ""]
    elif not results.complete:
        lines += ["**Partial: the run stopped before its end; below is what it measured.**", ""]
    load_text = (
        f"1-minute load average {fmt(load.get('start'), '.2f')} at the start, "
        f"{fmt(load.get('end'), '.2f')} at the end, on {info['cores_available']} CPUs"
    )
    if pressure is not None:
        load_text += (
            f"; CPU pressure (Linux PSI: share of the run a task waited for a CPU) {pressure:.0%}"
        )
    if gate:
        load_text += (
            f"; quiet gate `{gate['policy']}`: waited {gate['waited_s']:.0f} s before "
            f"{gate['rounds_waited']} rounds, {gate['busy_rounds']} rounds started busy"
        )
    lines += [
        f"- **Date:** {info['date_utc']}",
        f"- **Machine:** CPU {info['cpu_model']}, {info['cores_available']} of {info['cpus']} "
        f"CPUs available, CPU capability {info['cpu_capability']}"
        + (f"; GPU {device}" if device else "")
        + f"; {info['uname']}",
        "- **Software:** "
        + ", ".join(f"{k} {v}" for k, v in software.items())
        + f", Python {info['python']}, `torch.get_num_threads()` = {info['torch_threads']}",
        f"- **Command:** `{results.command}` (total runtime {results.runtime_s / 60:.1f} min)",
        f"- **Load:** {load_text}",
        "",
    ]
    return lines


def ceiling_block(results: Results) -> list[str]:
    c = results.ceiling
    if not c:
        return []
    size = c["size"]
    return [
        "### Ceiling: torch fp32 matmul",
        "",
        f"`{size}×{size} @ {size}×{size}`, median of {c['repeats']} after a warm-up, measured "
        f"before and after the timings: {c['before_gflops']:.1f} and {c['after_gflops']:.1f} "
        f"GFLOP/s. The ceiling used is the higher, **{c['gflops']:.1f} GFLOP/s**.",
        "",
    ]


def not_run(results: Results) -> list[str]:
    """Every figure that is missing and why: cases not run, then implementations by reason."""
    lines = [f"- {case_text(c.params)}: {c.note}." for c in results.cases if c.note]
    dropped = {json.dumps(c.params, sort_keys=True) for c in results.cases if c.note}
    where: dict[str, list[str]] = {}
    for t in results.timings:
        quiet = t.note is None or t.note.endswith(" only") or t.note == "dry run"
        if t.median_s is None and not quiet and json.dumps(t.case, sort_keys=True) not in dropped:
            where.setdefault(f"`{t.impl}` {t.note}", []).append(f"{case_text(t.case)} {t.pass_}")
    lines += [f"- {note}: {'; '.join(places)}." for note, places in where.items()]
    return ["### Not run", "", *lines, ""] if lines else []


def case_text(case: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in case.items())


def targets_block(results: Results) -> list[str]:
    if not results.targets:
        return []
    lines = [
        "### Targets",
        "",
        "| target | threshold | measured | result |",
        "|:---|:---|---:|:---|",
    ]
    for t in results.targets:
        result = {True: "PASS", False: "**FAIL**", None: "not measured"}[t["passed"]]
        name = t["name"].replace("|", "\\|")
        lines.append(f"| {name} | {t['threshold']} | {t['shown'] or '—'} | {result} |")
    return [*lines, ""]


def doc_bullets(doc: str) -> list[str]:
    """The bullet list of a docstring ("- " starts a bullet, indented lines continue it)."""
    bullets: list[str] = []
    inside = False
    for line in doc.splitlines():
        if line.startswith("- "):
            bullets.append(line)
        elif inside and line.startswith("  ") and line.strip():
            bullets[-1] += " " + line.strip()
        inside = line.startswith("- ") or (inside and line.startswith("  ") and bool(line.strip()))
    return bullets


def render(suite: Suite, results: Results) -> str:
    """The suite's section of docs/benchmarks.md (without the BEGIN/END markers)."""
    lines = header(suite, results)
    method = [*doc_bullets(suite.doc), *suite.method(results)] if not results.dry_run else []
    if method:
        lines += ["### Method", "", *method, ""]
    lines += ceiling_block(results)
    for item in suite.report:
        lines += item.render(results) if isinstance(item, Table) else item(results)
    lines += not_run(results)
    lines += targets_block(results)
    return "\n".join(lines).rstrip("\n") + "\n"


# --------------------------------------------------------------------------- the document


def read_sections(text: str) -> dict[str, str]:
    """The sections of a benchmarks document, name → body (markers excluded), in order."""
    return {m["name"]: m["body"] for m in _SECTION.finditer(text)}


def splice(text: str, name: str, body: str) -> str:
    """The document with section `name` replaced (or appended), the others kept as they were,
    in their order, under the common header."""
    sections = read_sections(text)
    if text.strip() and not sections:
        raise ValueError("the document has no <!-- BEGIN name --> sections: not a benchmarks file")
    sections[name] = body.rstrip("\n") + "\n"
    parts = [DOC_HEADER] + [
        f"<!-- BEGIN {n} -->\n{b}<!-- END {n} -->\n" for n, b in sections.items()
    ]
    return "\n".join(parts)


def write_section(path: Path, name: str, body: str) -> None:
    """Replace section `name` of the document at `path`, under a lock held from read to write
    (two suites finishing at the same moment do not drop each other's section)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = splice(f.read(), name, body)
        f.seek(0)
        f.truncate()
        f.write(text)


def json_path(out: Path, suite: str) -> Path:
    """docs/benchmarks.md → docs/benchmarks-<suite>.json."""
    return out.with_name(f"{out.stem}-{suite}.json")
