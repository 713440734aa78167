"""The runner on a toy suite: cases × implementations, dropped cases and failures, memory in a
fresh process, stages, targets, checkpoints, the dry run and the quiet gate."""

from __future__ import annotations

import dataclasses

import pytest
from benchmarks.machine import MachineBusy, QuietGate
from benchmarks.probe import measure
from benchmarks.results import Results
from benchmarks.runner import Options, run
from benchmarks.suite import FWD, FWD_BWD, Probe

from .fake_suite import ALLOC_MIB, GROUP, SUITE, Case

REF = "tests.benchmarks.fake_suite:SUITE"


@pytest.fixture(scope="module")
def results() -> Results:
    return run(SUITE, Options(gate="off", suite_ref=REF))


def test_cases_run_in_order_and_a_dropped_case_is_recorded(results: Results):
    assert [c.params for c in results.cases] == [{"n": 8}, {"n": 16}, {"n": 1000}]
    assert [c.note for c in results.cases] == [None, None, "not run (too big for a toy)"]
    dropped = [t for t in results.timings if t.case == {"n": 1000}]
    assert {t.note for t in dropped} == {"not run (too big for a toy)", "forward only"}


def test_every_implementation_and_pass_has_a_row(results: Results):
    at_16 = [(t.impl, t.pass_) for t in results.timings if t.case == {"n": 16}]
    names = ("fast", "slow", "alloc", "broken", "fwd-only")
    assert at_16 == [(i, p) for i in names for p in (FWD, FWD_BWD)]  # declared order
    at_8 = {t.impl for t in results.timings if t.case == {"n": 8}}
    assert "broken" not in at_8  # `when` leaves it out at n=8


def test_timings_ratios_and_notes(results: Results):
    fast = results.timing("toy", Case(16), "fast", FWD)
    assert len(fast.times_s) == 3 and fast.median_s is not None and fast.warmup_s is not None
    assert fast.ratios["fast"]["median"] == 1.0 and fast.rates["work"] > 0
    assert results.timing("toy", Case(16), "slow", FWD_BWD).ratios["fast"]["rounds"] == 3
    broken = results.timing("toy", Case(16), "broken", FWD)
    assert broken.note == "failed: RuntimeError: no kernel for this case"
    assert broken.median_s is None
    assert results.timing("toy", Case(16), "fwd-only", FWD_BWD).note == "forward only"


def test_memory_probe_in_a_fresh_process(results: Results):
    (m,) = results.memory
    assert m.error is None, m.error
    assert ALLOC_MIB * 0.9 <= m.peak_mib <= ALLOC_MIB * 3  # the call's buffer, not the process
    assert m.inputs_mib == pytest.approx(16 * 4 / 2**20)
    assert results.memory_of("toy", Case(16), "alloc", FWD) is m


def test_probe_failures_are_results():
    broken = measure(REF, "full", Probe("toy", Case(16), "broken", FWD), 2**34)
    assert broken.peak_mib is None and "RuntimeError: no kernel for this case" in broken.error
    slow = measure(REF, "full", Probe("toy", Case(16), "fast", FWD, timeout_s=0.01), 2**34)
    assert slow.error == "timed out after 0 s"


def test_stages_targets_and_the_record(results: Results):
    assert results.stages == {"extra": {"answer": 42}}
    assert results.targets[0]["passed"] is True and results.targets[0]["measured"] == 1.0
    assert results.complete and results.ceiling is None  # the toy asks for no ceiling
    assert results.gate["policy"] == "off" and results.machine["cpu_model"]
    assert results.settings == {"sizes": (8, 16, 1000)}


def test_checkpoints_after_every_case_and_step():
    seen: list[int] = []
    run(SUITE, Options(mode="quick", gate="off", checkpoint=lambda r: seen.append(len(r.cases))))
    assert seen[:2] == [1, 1]  # after the case, then after its group


def test_a_dry_run_builds_and_calls_nothing():
    def boom(*args):
        raise AssertionError("a dry run built or ran something")

    group = dataclasses.replace(
        GROUP, inputs=boom, impls=tuple(dataclasses.replace(i, make=boom) for i in GROUP.impls)
    )
    stage = dataclasses.replace(SUITE.steps[2], run=boom)
    suite = dataclasses.replace(
        SUITE, steps=(group, SUITE.steps[1], stage), prepare=boom, facts=boom, ceiling=True
    )
    res = run(suite, Options(dry_run=True, gate="off"))
    assert res.dry_run and not res.stages and res.ceiling is None
    notes = {t.note for t in res.timings}
    assert notes == {"dry run", "forward only", "not run (too big for a toy)"}
    assert [m.error for m in res.memory] == ["dry run"]


def test_the_runtime_budget_stops_new_cases():
    res = run(SUITE, Options(gate="off", budget_s=0.0, suite_ref=REF))
    assert all(c.note == "not run (runtime budget of 0 min reached)" for c in res.cases[:2])


def busy(level: float):
    return lambda sample_s: level


def test_quiet_gate_policies():
    quiet = QuietGate(policy="wait", busy=busy(0.0))
    quiet()
    assert (quiet.rounds_waited, quiet.busy_rounds) == (0, 0)
    loud = QuietGate(policy="wait", max_round_s=0.0, busy=busy(1.0))
    loud()
    assert loud.busy_rounds == 1  # went on, and said so
    with pytest.raises(MachineBusy, match="100% of the CPUs stayed busy"):
        QuietGate(policy="refuse", max_round_s=0.0, busy=busy(1.0))()
    QuietGate(policy="off", busy=lambda s: pytest.fail("an off gate samples nothing"))()
    assert "busy" not in loud.record()


def test_before_call_runs_untimed_before_every_call():
    """A group's `before_call` (the work a call follows in a user's program) runs before each
    call, the warm-up's included, and takes no part in the times."""
    calls: list[str] = []
    group = dataclasses.replace(
        GROUP,
        impls=GROUP.impls[:2],
        cases=lambda s: [Case(8)],
        passes=(FWD,),
        before_call=lambda: calls.append("before"),
    )
    suite = dataclasses.replace(SUITE, steps=(group,), targets=())
    res = run(suite, Options(gate="off", suite_ref=REF))
    timed = [t for t in res.timings if t.times_s]
    rounds = 1 + len(timed[0].times_s)  # the warm-up and the timed rounds
    assert len(calls) == len(timed) * rounds
