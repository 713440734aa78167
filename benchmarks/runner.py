"""The runner: executes a suite's steps and returns its `Results`.

Timing (`interleave`): for each case and pass the implementations take turns, round after round,
in reverse order every other round, so that load from other processes and the order itself hit
them alike; round 0 is a warm-up (two calls where outputs are kept for the accuracy check), then
each implementation is timed in up to `repeats` rounds.
The quiet gate runs before every timed round, and the CPU pressure (Linux PSI) is recorded during
every timed call. Memory probes run each call in a fresh process (`benchmarks.probe`). The matmul
ceiling, when the suite asks for it, is measured before and after the steps; the machine facts,
load and gate record go with the results. After every case the results so far go to
`checkpoint`, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from . import machine
from .machine import QuietGate, cpu_pressure_total_s, progress
from .probe import bind_call, cuda_peak, measure, short_error
from .results import CaseRecord, MemoryResult, Results, Timing, params, type_path
from .suite import FWD, Group, Impl, Memory, Prepared, Stage, Suite

Clock = Callable[[Callable[[], Any]], tuple[float, Any]]


@dataclasses.dataclass
class Options:
    mode: str = "full"  # a key of the suite's settings
    gate: str = "wait"  # the quiet gate's policy: wait, refuse or off
    dry_run: bool = False  # list what would run; build and time nothing
    budget_s: float | None = None  # overrides the suite's runtime budget
    command: str = ""
    suite_ref: str = ""  # "module:attribute" of the suite, for probe processes (default: by name)
    checkpoint: Callable[[Results], None] = lambda results: None


@dataclasses.dataclass
class Series:
    """What `interleave` measured for one implementation."""

    warmup_s: float | None = None
    times_s: list[float | None] = dataclasses.field(default_factory=list)
    pressure: list[float | None] = dataclasses.field(default_factory=list)
    error: str | None = None
    output: Any = None


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        second()

    return both


def wall_clock(run: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = run()
    return time.perf_counter() - start, out


def cuda_clock(run: Callable[[], Any]) -> tuple[float, Any]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3, out


def only(impl: Impl) -> str:
    """The note of a pass an implementation does not run."""
    return "forward only" if impl.passes == (FWD,) else f"{'/'.join(impl.passes)} only"


def interleave(
    calls: dict[str, tuple[Callable[[], Any], Callable[[], None]]],
    repeats: int,
    *,
    round_budget_s: float | None = None,
    before_round: Callable[[], None] = lambda: None,
    clock: Clock = wall_clock,
    pressure: Callable[[], float | None] = cpu_pressure_total_s,
    keep_outputs: bool = False,
    label: str = "",
) -> dict[str, Series]:
    """Seconds per call of every (run, reset) pair, the calls taking turns round after round.

    Round 0 is a warm-up (timed apart, as `warmup_s`: a compiling implementation's first call).
    With `keep_outputs` (each call's output kept until the next call of its implementation
    returns) the warm-up calls each implementation twice, untimed the second time, so the timed
    rounds start where a loop `out = f()` settles: one output alive while the next is made (an
    allocator that reuses freed blocks has one to reuse from the first timed round on).
    Then up to `repeats` timed rounds, odd rounds in the given order, even rounds reversed. With
    `round_budget_s` an implementation sits out the rounds beyond as many as fit in that budget
    by its warm-up time (at least one): `times_s[r]` is None for a round it sat out. A call that
    raises ends that implementation's turns; its error is recorded."""
    names = list(calls)
    series = {name: Series() for name in names}
    counts: dict[str, int] = {}
    last = 0
    r = 0
    while r <= last:
        if r > 0:
            before_round()
        order = names[::-1] if r > 0 and r % 2 == 0 else names
        for name in order:
            s = series[name]
            if s.error is not None or (r > 0 and r > counts[name]):
                if r > 0:
                    s.times_s.append(None)
                    s.pressure.append(None)
                continue
            run, reset = calls[name]
            reset()
            before = pressure()
            try:
                elapsed, out = clock(run)
            except Exception as error:  # a failing implementation is a result, not a crash
                s.error = f"failed: {short_error(error)}"
                progress(f"{label} {name} {s.error}")
                if r > 0:
                    s.times_s.append(None)
                    s.pressure.append(None)
                continue
            after = pressure()
            if keep_outputs:
                s.output = out
            if r == 0:
                s.warmup_s = elapsed
                if keep_outputs:  # the steady state: one output alive while the next is made
                    reset()
                    s.output = run()
                continue
            s.times_s.append(elapsed)
            s.pressure.append(
                (after - before) / elapsed if before is not None and after is not None else None
            )
        if r == 0:
            for name, s in series.items():
                if s.error is not None or s.warmup_s is None:
                    counts[name] = 0
                elif round_budget_s is None:
                    counts[name] = repeats
                else:
                    fit = int(round_budget_s / max(s.warmup_s, 1e-9))
                    counts[name] = max(1, min(repeats, fit))
            last = max(counts.values(), default=0)
        latest = ", ".join(
            f"{n} {s.times_s[-1] * 1e3:.1f}"
            for n, s in series.items()
            if s.times_s and s.times_s[-1]
        )
        progress(f"{label} {'warm-up' if r == 0 else f'round {r}/{last}'}: {latest or '-'} ms")
        r += 1
    return series


class Runner:
    """One run of one suite (see the module's docstring)."""

    def __init__(self, suite: Suite, options: Options):
        self.suite, self.options = suite, options
        self.settings = suite.settings[options.mode]
        self.gate = QuietGate(policy=options.gate)
        self.clock: Clock = cuda_clock if suite.device == "cuda" else wall_clock
        self.started = time.perf_counter()
        self.budget_s = (
            options.budget_s if options.budget_s is not None else suite.budget_s(self.settings)
        )
        settings = self.settings
        self.results = Results(
            suite=suite.name,
            mode=options.mode,
            command=options.command,
            machine=machine.facts(),
            settings=dataclasses.asdict(settings)
            if dataclasses.is_dataclass(settings)
            else dict(settings),
            dry_run=options.dry_run,
        )

    def run(self) -> Results:
        res, suite = self.results, self.suite
        pressure_start = cpu_pressure_total_s()
        res.load["start"] = machine.load_average()
        before = None
        if not self.options.dry_run:
            suite.prepare(self.settings)
            res.facts = suite.facts(self.settings)
            if suite.ceiling:
                before = machine.matmul_gflops()
                progress(f"[ceiling] fp32 matmul {before:.1f} GFLOP/s")
        for step in suite.steps:
            if isinstance(step, Group):
                self.group(step)
            elif isinstance(step, Memory):
                self.memory(step)
            elif isinstance(step, Stage) and not self.options.dry_run:
                progress(f"[{step.name}] ...")
                res.stages[step.name] = step.run(self.settings, res)
            self.options.checkpoint(res)
        if before is not None:
            after = machine.matmul_gflops()
            progress(f"[ceiling] fp32 matmul {after:.1f} GFLOP/s (after)")
            res.ceiling = {
                "size": machine.MATMUL_SIZE,
                "repeats": machine.MATMUL_REPEATS,
                "before_gflops": before,
                "after_gflops": after,
                "gflops": max(before, after),
            }
        res.runtime_s = time.perf_counter() - self.started
        res.load["end"] = machine.load_average()
        pressure_end = cpu_pressure_total_s()
        if pressure_start is not None and pressure_end is not None and res.runtime_s > 0:
            res.pressure_fraction = (pressure_end - pressure_start) / res.runtime_s
        res.gate = self.gate.record()
        res.targets = [t.evaluate(res) for t in suite.targets]
        res.complete = True
        return res

    # ------------------------------------------------------------------ timing

    def over_budget(self) -> str | None:
        if self.budget_s is None or time.perf_counter() - self.started <= self.budget_s:
            return None
        return f"not run (runtime budget of {self.budget_s / 60:.0f} min reached)"

    def group(self, group: Group) -> None:
        cases = list(group.cases(self.settings))
        for i, case in enumerate(cases, start=1):
            label = f"[{group.name} {i}/{len(cases)}] " + " ".join(
                f"{k}={v}" for k, v in params(case).items()
            )
            self.case(group, case, label)
            self.results.derive(group)
            self.options.checkpoint(self.results)

    def case(self, group: Group, case: Any, label: str) -> None:
        res = self.results
        record = CaseRecord(group.name, type_path(case), params(case))
        res.cases.append(record)
        impls = [impl for impl in group.impls if impl.when(case)]

        def note_all(impl: Impl, note: str) -> None:
            for pass_ in group.passes:
                here = note if pass_ in impl.passes else only(impl)
                res.timings.append(Timing(group.name, record.params, impl.name, pass_, note=here))

        dropped = group.drop(self.settings, case)
        reason = f"not run ({dropped})" if dropped else self.over_budget()
        if reason is not None or self.options.dry_run:
            record.note = reason
            for impl in impls:
                note_all(impl, reason or impl.skip(case, res) or "dry run")
            progress(f"{label}: {reason or 'dry run'}")
            return
        if group.describe is not None:
            record.extras = group.describe(case)
        progress(f"{label} {record.extras or ''}")
        first_note = len(res.timings)
        calls: dict[str, Any] = {}
        for impl in impls:
            reason = impl.skip(case, res)
            if reason is None:
                try:
                    made = impl.make(case)
                except Exception as error:
                    reason = f"failed: {short_error(error)}"
            if reason is not None:
                note_all(impl, reason)
                continue
            if isinstance(made, Prepared):
                record.impl_extras[impl.name] = dict(made.extras)
                made = made.call
            calls[impl.name] = made
        for pass_ in group.passes:
            self.time_pass(group, case, record, pass_, calls, f"{label} {pass_}")
        # this case's rows in declared order (skipped implementations were noted first)
        order = {impl.name: i for i, impl in enumerate(group.impls)}
        passes = {p: i for i, p in enumerate(group.passes)}
        mine = res.timings[first_note:]
        res.timings[first_note:] = sorted(mine, key=lambda t: (order[t.impl], passes[t.pass_]))

    def time_pass(
        self, group: Group, case: Any, record: CaseRecord, pass_: str, calls: dict, label: str
    ) -> None:
        res = self.results
        here = {
            impl.name: calls[impl.name]
            for impl in group.impls
            if impl.name in calls and pass_ in impl.passes
        }
        for impl in group.impls:
            if impl.name in calls and pass_ not in impl.passes:
                note = only(impl)
                res.timings.append(Timing(group.name, record.params, impl.name, pass_, note=note))
        if not here:
            return
        args, grad = group.inputs(case, pass_ != FWD)
        bound = {name: bind_call(call, args, grad) for name, call in here.items()}
        if group.before_call is not None:
            bound = {n: (run, _then(reset, group.before_call)) for n, (run, reset) in bound.items()}
        series = interleave(
            bound,
            group.repeats(self.settings, case),
            round_budget_s=group.round_budget_s,
            before_round=self.gate,
            clock=self.clock,
            keep_outputs=pass_ == FWD and group.check is not None,
            label=label,
        )
        for name, s in series.items():
            res.timings.append(
                Timing(
                    group.name,
                    record.params,
                    name,
                    pass_,
                    warmup_s=s.warmup_s,
                    times_s=s.times_s,
                    pressure=s.pressure,
                    note=s.error,
                )
            )
        if pass_ == FWD and group.check is not None:
            outputs = {n: s.output for n, s in series.items() if s.error is None}
            for name, figures in group.check(case, outputs).items():
                record.impl_extras.setdefault(name, {}).update(figures)
        if self.suite.device == "cuda" and grad is not None:
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            for name, (run, reset) in bound.items():
                if series[name].error is None:
                    reset()
                    peak = cuda_peak(run, device)
                    res.memory.append(
                        MemoryResult(group.name, record.params, name, pass_, peak, type=record.type)
                    )

    # ------------------------------------------------------------------ memory

    def memory(self, step: Memory) -> None:
        probes = list(step.probes(self.settings))
        for i, probe in enumerate(probes, start=1):
            label = (
                f"[memory {i}/{len(probes)}] {probe.group} {params(probe.case)} {probe.impl} "
                f"{probe.pass_}"
            )
            if self.options.dry_run:
                result = MemoryResult(
                    probe.group,
                    params(probe.case),
                    probe.impl,
                    probe.pass_,
                    error="dry run",
                    type=type_path(probe.case),
                )
            else:
                ref = self.options.suite_ref or f"benchmarks.suites.{self.suite.name}:SUITE"
                result = measure(ref, self.options.mode, probe, step.address_limit)
            self.results.memory.append(result)
            shown = result.error or f"{result.peak_mib:.1f} MiB beyond the inputs"
            progress(f"{label}: {shown}")


def run(suite: Suite, options: Options) -> Results:
    return Runner(suite, options).run()
