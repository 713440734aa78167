"""The runner's interleaved rounds, on fake calls and a fake clock (no wall-clock figures)."""

from __future__ import annotations

import pytest
from benchmarks.runner import interleave


def calls(log: list[str], names: str, fail: dict[str, int] | None = None):
    """(run, reset) pairs that log their calls; `fail[name] = k` makes the k-th call raise."""
    counts = dict.fromkeys(names, 0)

    def make(name: str):
        def run() -> str:
            counts[name] += 1
            if fail and fail.get(name) == counts[name]:
                raise RuntimeError(f"{name} broke\ndetails")
            log.append(name)
            return name

        return run, lambda: log.append(f"reset {name}")

    return {name: make(name) for name in names}


def clock(seconds: dict[str, float]):
    """A clock that says each call took `seconds[its name]`."""

    def timed(run):
        out = run()
        return seconds[out], out

    return timed


def runs(log: list[str]) -> list[str]:
    return [entry for entry in log if not entry.startswith("reset")]


def test_rounds_alternate_and_the_warm_up_is_timed_apart():
    log: list[str] = []
    rounds: list[int] = []
    series = interleave(
        calls(log, "abc"),
        3,
        clock=clock({"a": 1.0, "b": 2.0, "c": 4.0}),
        before_round=lambda: rounds.append(len(runs(log))),
        pressure=lambda: None,
    )
    # warm-up, then rounds in the given order, reversed, given again
    assert "".join(runs(log)) == "abc" + "abc" + "cba" + "abc"
    assert rounds == [3, 6, 9]  # the gate runs before every timed round, not the warm-up
    assert log[:2] == ["reset a", "a"]  # gradients cleared before every call
    assert series["b"].warmup_s == 2.0 and series["b"].times_s == [2.0, 2.0, 2.0]
    assert series["c"].error is None and series["c"].pressure == [None, None, None]


def test_a_round_budget_sits_slow_implementations_out():
    log: list[str] = []
    series = interleave(
        calls(log, "ab"),
        3,
        round_budget_s=1.0,
        clock=clock({"a": 0.6, "b": 0.25}),
        pressure=lambda: None,
    )
    assert series["a"].times_s == [0.6, None, None]  # 1 s fits one 0.6 s call (at least one)
    assert series["b"].times_s == [0.25, 0.25, 0.25]  # capped at `repeats`
    assert "".join(runs(log)) == "ab" + "ab" + "b" + "b"


def test_a_failing_call_ends_its_turns_and_is_recorded():
    log: list[str] = []
    series = interleave(
        calls(log, "ab", fail={"b": 3}), 3, clock=clock({"a": 1.0, "b": 1.0}), pressure=lambda: None
    )
    assert series["b"].error == "failed: RuntimeError: b broke"
    assert series["b"].times_s == [1.0, None, None]
    assert series["a"].times_s == [1.0, 1.0, 1.0]
    broken_in_warm_up = interleave(
        calls([], "ab", fail={"a": 1}), 2, clock=clock({"a": 1.0, "b": 1.0}), pressure=lambda: None
    )
    assert broken_in_warm_up["a"].warmup_s is None
    assert broken_in_warm_up["a"].times_s == [None, None]


def test_pressure_is_the_share_of_each_call_spent_waiting_for_a_cpu():
    totals = iter([10.0, 10.5, 20.0, 20.0, 30.0, 30.25])  # before/after warm-up, then two rounds
    series = interleave(calls([], "a"), 2, clock=clock({"a": 0.5}), pressure=lambda: next(totals))
    assert series["a"].pressure == [0.0, 0.5]


@pytest.mark.parametrize("keep", [True, False])
def test_outputs_are_kept_only_when_asked(keep: bool):
    series = interleave(calls([], "ab"), 1, clock=clock({"a": 1, "b": 1}), keep_outputs=keep)
    assert series["a"].output == ("a" if keep else None)


def test_kept_outputs_warm_up_twice_so_timing_starts_in_the_steady_state():
    log: list[str] = []
    series = interleave(calls(log, "ab"), 2, clock=clock({"a": 1.0, "b": 2.0}), keep_outputs=True)
    # each warm-up call is followed by an untimed second one (its reset first), then the rounds
    assert log[:8] == ["reset a", "a", "reset a", "a", "reset b", "b", "reset b", "b"]
    assert "".join(runs(log)) == "aabb" + "ab" + "ba"
    assert series["a"].warmup_s == 1.0 and series["a"].times_s == [1.0, 1.0]
