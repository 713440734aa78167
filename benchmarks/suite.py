"""What a suite declares: groups of cases × implementations, memory probes, stages, targets.

A suite module in `benchmarks.suites` defines `SUITE = Suite(...)`. Its steps run in order:

- `Group`: cases × implementations, timed in interleaved rounds by the runner. A case is a frozen
  dataclass of the suite's (its fields are the case's parameters, recorded with every figure);
  `inputs(case, backward)` builds the call's arguments (and the upstream gradient for a backward
  pass); an `Impl` turns a case into the call that is timed;
- `Memory`: peak memory of (case, implementation, pass) calls, each in a fresh process;
- `Stage`: anything else (a correctness check, processes of their own): a function whose
  JSON-able result is recorded under its name.

`targets` are evaluated on the results; `report` lists what the section shows, in order: tables
(`benchmarks.report.Table`) or functions of the results returning Markdown lines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

FWD, FWD_BWD = "fwd", "fwd+bwd"
PASSES = (FWD, FWD_BWD)

Call = Callable[..., Any]
Inputs = tuple[tuple[Any, ...], Any]  # (arguments of the call, upstream gradient or None)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What `Impl.make` may return instead of a bare call: the call and figures of its set-up
    (recorded with the case, e.g. the time to build a block mask)."""

    call: Call
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)


def never(*_: Any) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation: `make(case)` returns the call that is timed (or a `Prepared`).

    `when(case)` is False where the implementation does not belong (no row at all); `skip(case,
    results)` gives the reason it is not run where it belongs (a row with a note). The results so
    far let a rule predict a call's time from a smaller case. `passes` limits the passes it runs.
    """

    name: str
    make: Callable[[Any], Call | Prepared]
    skip: Callable[[Any, Any], str | None] = never
    when: Callable[[Any], bool] = lambda case: True
    passes: tuple[str, ...] = PASSES


@dataclasses.dataclass(frozen=True)
class BestOf:
    """An anchor that is, in each round, the fastest of several implementations."""

    name: str
    members: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Group:
    """Cases × implementations, timed by interleaved rounds.

    For each case and pass the implementations take turns round after round (one warm-up round,
    then up to `repeats(settings, case)` timed rounds). With `round_budget_s`, an implementation
    takes part in as many rounds as fit in that many seconds by its warm-up time (at least one).
    `anchors` name the implementations every other is compared with (a `BestOf` stands for the
    fastest of several in each round). `rates` give FLOP counts, `rates[kind](case, pass,
    figures)` with the figures `describe` gave (None: no count), reported per second.
    `check(case, outputs)` compares the forward outputs (one per implementation) and returns
    figures per implementation. `describe(case)` gives figures of the case itself (density, say).
    `warm(case)` is a small case of the same kind: a memory probe calls it first, so that lazy
    set-up is not counted. `drop(settings, case)` gives the reason a listed case is not run at
    all (None: it runs). `before_call()` runs untimed before every call (warm-up and timed): the
    work a call follows in its users' programs, so that each starts as it would there.
    """

    name: str
    cases: Callable[[Any], Sequence[Any]]
    inputs: Callable[[Any, bool], Inputs]
    impls: tuple[Impl, ...]
    passes: tuple[str, ...] = PASSES
    anchors: tuple[str | BestOf, ...] = ()
    repeats: Callable[[Any, Any], int] = lambda settings, case: 5
    round_budget_s: float | None = None
    rates: dict[str, Callable[[Any, str, dict[str, Any]], float | None]] = dataclasses.field(
        default_factory=dict
    )
    check: Callable[[Any, dict[str, Any]], dict[str, dict[str, Any]]] | None = None
    describe: Callable[[Any], dict[str, Any]] | None = None
    warm: Callable[[Any], Any] | None = None
    drop: Callable[[Any, Any], str | None] = never
    before_call: Callable[[], None] | None = None

    def impl(self, name: str) -> Impl:
        return next(i for i in self.impls if i.name == name)


@dataclasses.dataclass(frozen=True)
class Probe:
    """One memory measurement: `impl` of `group` on `case`, one `pass_`, in a fresh process."""

    group: str
    case: Any
    impl: str
    pass_: str
    timeout_s: float = 1200.0


@dataclasses.dataclass(frozen=True)
class Memory:
    """Memory probes, each run in a fresh process capped at `address_limit` bytes (a call that
    would materialise N² scores fails instead of pushing a shared machine into the OOM killer)."""

    probes: Callable[[Any], Sequence[Probe]]
    address_limit: int = 16 * 2**30


@dataclasses.dataclass(frozen=True)
class Stage:
    """A step of its own: `run(settings, results)` returns JSON-able data stored under `name`."""

    name: str
    run: Callable[[Any, Any], Any]


Step = Group | Memory | Stage


@dataclasses.dataclass(frozen=True)
class Target:
    """A figure the suite promises: `value(results)` ≥ (or ≤) `threshold`.

    `unit` formats both: "×", "" (plain), " MiB", " s", or "%" (the value is a fraction)."""

    name: str
    value: Callable[[Any], float | None]
    threshold: float
    at_least: bool = True
    unit: str = "×"
    digits: int = 2

    def evaluate(self, results: Any) -> dict[str, Any]:
        measured = self.value(results)
        passed = None
        if measured is not None:
            passed = measured >= self.threshold if self.at_least else measured <= self.threshold
        sign = "≥" if self.at_least else "≤"
        return {
            "name": self.name,
            "threshold": f"{sign} {self.show(self.threshold, None)}",
            "measured": measured,
            "shown": None if measured is None else self.show(measured, self.digits),
            "passed": passed,
        }

    def show(self, value: float, digits: int | None) -> str:
        if self.unit == "%":
            return f"{100 * value:.0f}%"
        return (f"{value:g}" if digits is None else f"{value:.{digits}f}") + self.unit


@dataclasses.dataclass(frozen=True)
class Suite:
    """A benchmark suite: its steps, the targets and what its section of the report shows.

    `settings` maps a mode ("full", "quick") to the suite's settings object, handed to `cases`,
    `repeats`, `probes`, stages, `budget_s` and `facts`. `ceiling`: measure torch's fp32 matmul
    rate before and after the steps. `device`: "cpu" times with the wall clock, "cuda" with CUDA
    events (and peaks by `torch.cuda.max_memory_allocated`). `requires()` says why the suite
    cannot run here (None: it can). `prepare(settings)` runs once before the steps. `facts`
    returns figures of the run recorded with it (which backend `auto` picks, a library version).
    The section's method is the bullet list of `doc` (the suite module's docstring: "- " starts a
    bullet, indented lines continue it) and then the bullets `method(results)` computes.
    """

    name: str
    title: str
    settings: dict[str, Any]
    steps: tuple[Step, ...]
    targets: tuple[Target, ...] = ()
    report: tuple[Any, ...] = ()
    doc: str = ""
    method: Callable[[Any], list[str]] = lambda results: []
    ceiling: bool = False
    device: str = "cpu"
    budget_s: Callable[[Any], float | None] = lambda settings: None
    requires: Callable[[], str | None] = never
    prepare: Callable[[Any], None] = never
    facts: Callable[[Any], dict[str, Any]] = lambda settings: {}

    def group(self, name: str) -> Group:
        return next(s for s in self.steps if isinstance(s, Group) and s.name == name)
