"""Ratios against the anchors, rates, targets and the JSON round trip of `Results`."""

from __future__ import annotations

import pytest
from benchmarks.results import CaseRecord, Results, Timing, paired_ratio, type_path
from benchmarks.suite import FWD, BestOf, Group, Impl, Target

from .fake_suite import Case


def test_the_ratio_is_taken_within_each_round_then_the_median():
    # anchor / impl per round where both ran: 2/1, 6/2 (round 3: the anchor sat out)
    ratio = paired_ratio([[2.0, 6.0, None]], [1.0, 2.0, 5.0])
    assert ratio == {"median": 2.5, "lo": 2.0, "hi": 3.0, "rounds": 2}
    assert paired_ratio([[None]], [1.0]) is None


def test_a_best_of_anchor_is_the_fastest_in_each_round():
    ratio = paired_ratio([[4.0, 1.0], [2.0, 3.0]], [2.0, 2.0])  # fastest: 2.0, then 1.0
    assert ratio == {"median": 0.75, "lo": 0.5, "hi": 1.0, "rounds": 2}


def group(**kwargs) -> Group:
    impl = Impl("x", lambda c: lambda: None)
    defaults = dict(name="g", cases=lambda s: [], inputs=lambda c, b: ((), None), impls=(impl,))
    return Group(**{**defaults, **kwargs})


def results(*timings: Timing, extras: dict | None = None) -> Results:
    res = Results(suite="toy", mode="full", command="", machine={})
    res.cases.append(CaseRecord("g", type_path(Case(8)), {"n": 8}, extras=extras or {}))
    res.timings.extend(timings)
    return res


def test_derive_fills_medians_rates_and_ratios():
    res = results(
        Timing("g", {"n": 8}, "a", FWD, times_s=[2.0, 4.0, 3.0], pressure=[0.1, 0.5, 0.3]),
        Timing("g", {"n": 8}, "b", FWD, times_s=[1.0, 1.0, None]),
        Timing("g", {"n": 8}, "c", FWD, times_s=[4.0, 2.0, 2.0]),
        Timing("g", {"n": 8}, "skipped", FWD, note="skipped (too big)"),
        extras={"density": 0.5},
    )
    g = group(
        anchors=("a", BestOf("best", ("a", "c"))),
        rates={"work": lambda c, pass_, fig: 1e9 * c.n * fig["density"]},
    )
    res.derive(g)
    a, b, _, skipped = res.timings
    assert a.median_s == 3.0 and a.pressure_median == pytest.approx(0.3)
    assert b.rates == {"work": 4.0}  # 8 · 0.5 GFLOP in 1 s
    assert b.ratios["a"] == {"median": 3.0, "lo": 2.0, "hi": 4.0, "rounds": 2}
    assert b.ratios["best"]["median"] == 2.0  # rounds: min(2, 4) / 1, min(4, 2) / 1
    assert a.ratios["a"]["median"] == 1.0
    assert skipped.median_s is None and skipped.ratios == {} and skipped.rates == {}
    assert res.ratio("g", Case(8), "b", FWD, "a") == 3.0
    assert res.ratio("g", Case(8), "skipped", FWD, "a") is None
    assert res.median("g", {"n": 8}, "c", FWD) == 2.0


def test_json_round_trip_keeps_everything():
    res = results(Timing("g", {"n": 8}, "a", FWD, times_s=[1.0, None], note=None))
    res.derive(group(anchors=("a",)))
    again = Results.from_json(res.to_json())
    assert again.to_json() == res.to_json()
    assert list(again.case_objects("g")) == [Case(8)]  # the case type is rebuilt


@pytest.mark.parametrize(
    ("value", "at_least", "unit", "threshold", "shown", "passed"),
    [
        (1.23456, True, "×", "≥ 1.2×", "1.23×", True),
        (0.5, True, "%", "≥ 120%", "50%", False),
        (700.0, False, " MiB", "≤ 1.2 MiB", "700.00 MiB", False),
        (None, True, "", "≥ 1.2", None, None),
    ],
)
def test_targets(value, at_least, unit, threshold, shown, passed):
    t = Target("t", lambda r: value, 1.2, at_least=at_least, unit=unit).evaluate(None)
    assert (t["threshold"], t["shown"], t["passed"]) == (threshold, shown, passed)
