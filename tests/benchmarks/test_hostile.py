"""The hostile suite's service cases (compile, pickle, limit, signal): what their children count
and how the parent judges what they printed, on small real runs and canned child outputs."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from benchmarks.results import Results
from benchmarks.suites import _hostile_children as ch
from benchmarks.suites import _hostile_service as svc
from benchmarks.suites import hostile

from qkv import masks, scores


def _returning(module, name: str) -> set[str]:
    return {
        n
        for n, f in vars(module).items()
        if inspect.isfunction(f) and not n.startswith("_")
        if inspect.signature(f).return_annotation == name
    }


def test_every_mask_constructor_and_score_modifier_travels():
    assert _returning(masks, "Mask") <= set(ch.masks_to_travel())
    assert _returning(scores, "ScoreMod") <= set(ch.mods_to_travel())


def test_a_copy_computes_the_same_and_a_difference_is_seen():
    m = ch.masks_to_travel()["window | global"]
    want = ch.computed(m, "mask")
    for how in ("pickle", "protocol 2", "torch.save"):
        assert ch._same(ch.computed(ch._round_trip(m, how), "mask"), want)
    assert not ch._same(ch.computed(masks.sliding_window(4), "mask"), want)
    mod = ch.mods_to_travel()["relative_bias"]
    assert ch._same(ch.computed(ch._round_trip(mod, "pickle"), "mod"), ch.computed(mod, "mod"))


def test_graph_breaks_are_counted_and_fullgraph_refuses_them():
    def make():
        def f(x):
            x = x + 1
            torch._dynamo.graph_break()
            return x * 2

        return f

    calls = [(torch.randn(n),) for n in (3, 5, 7)]
    assert "error" in ch._compiled(make, calls)
    loose = ch._compiled(make, calls, fullgraph=False)
    assert loose["breaks"] >= 1 and loose["graphs"] == 2
    whole = ch._compiled(lambda: lambda x: x * 2, calls)
    assert (whole["breaks"], whole["graphs"]) == (0, 1)
    assert all(torch.equal(o, x * 2) for o, (x,) in zip(whole["outs"], calls, strict=True))


def test_the_error_rule_as_a_ratio():
    gold = torch.randn(4, 8, dtype=torch.float64)
    ref = (gold + 1e-3).float()
    assert ch.rule_ratio(ref, ref, gold) <= 0.5
    assert ch.rule_ratio((gold + 1e-2).float(), ref, gold) > 1


GOOD = {
    "eager": ["sdpa", "sdpa", "cpu"],
    "sdpa_graphs": 1,
    "graphs": 2,
    "breaks": 0,
    "calls": 3,
    "identical": 3,
    "rule_ratio": 0.5,
    "changes": 1,
    "seconds": 1.0,
}


@pytest.mark.parametrize(
    ("change", "held"),
    [
        ({}, True),
        ({"graphs": 3}, False),  # a graph more than the one crossover explains
        ({"identical": 2}, False),
        ({"rule_ratio": 1.5}, False),
        ({"error": "Unsupported: x | y", "breaks": 6, "graphs": 7}, False),
    ],
)
def test_a_compile_case_holds_only_without_breaks_extra_graphs_or_other_bits(change, held):
    row = svc._compile_row("dense", {"rc": 0, "seconds": 9, "cases": {"dense": GOOD | change}})
    assert row["held"] is held
    if "error" in change:
        assert "without fullgraph: 6 graph breaks, 7 graphs" in row["outcome"]
        assert "x \\| y" in row["outcome"]  # safe in a table cell
    else:
        assert "eager `auto` picks sdpa → cpu" in row["outcome"]
    dead = svc._compile_row("dense", {"rc": 1, "seconds": 9, "stderr": "boom\n"})
    assert not dead["held"] and "boom" in dead["outcome"]


def test_pickle_rows_count_what_differs():
    r = {"rc": 0, "seconds": 5.0, "masks": 17, "mods": 4, "trips": 66, "trips_same": 65}
    r |= {"failed": ["pickle: custom"], "spawned": 22, "spawn_same": 22, "spawn_s": 2.0}
    trips, spawn = svc._pickle_rows(r)
    assert not trips["held"] and "65 of 66" in trips["outcome"] and "custom" in trips["outcome"]
    assert spawn["held"] and spawn["seconds"] == 2.0


def _canned(monkeypatch, answers: dict[str, Any]) -> list[tuple]:
    seen = []

    def run(case, cache, timeout=300, code="", args=(), preexec_fn=None, **env):
        seen.append((case, args, preexec_fn))
        return {"rc": 0, "seconds": 1.0, "stderr": "", **answers[case](*args)}

    monkeypatch.setattr(hostile, "_run", run)
    return seen


def test_limit_rows_hold_for_a_refusal_naming_rlimit_as_before_allocating(monkeypatch, tmp_path):
    refusal = {"raised": "MemoryRefusal", "memory_error": True, "need": 2**31}
    refusal |= {"available": 2**30, "limit": "RLIMIT_AS (ulimit -v)", "peak_grew_mib": 0.1}
    answers = {
        "vm-size": lambda: {"vm_size": 2**29},
        "limit": lambda what, n: (
            refusal if what == "reference" else {"raised": "OutOfMemoryError", "message": "a|b"}
        ),
    }
    seen = _canned(monkeypatch, answers)
    ref, sdpa = svc._limit_rows(tmp_path)
    assert ref["held"] and "needing 2.0 GiB, 1.0 GiB allowed" in ref["outcome"]
    assert not sdpa["held"] and "raised OutOfMemoryError: a\\|b" in sdpa["outcome"]
    assert [a for _, a, _ in seen] == [(), ("reference", "16384"), ("sdpa", "32768")]
    assert all(callable(p) for _, _, p in seen[1:])


@pytest.mark.parametrize(
    ("answer", "held"),
    [
        ({"interrupted": True, "after_s": 0.1, "same": True}, True),
        ({"interrupted": True, "after_s": 6.0, "same": True}, False),
        ({"interrupted": True, "after_s": 0.1, "same": False}, False),
        ({"interrupted": False, "call_s": 30.0, "same": True}, False),
    ],
)
def test_a_signal_row_holds_for_a_prompt_interrupt_and_the_same_bits(
    monkeypatch, tmp_path, answer, held
):
    _canned(monkeypatch, {"signal": lambda which, n: answer})
    row = svc._signal_row("forward", 65536, tmp_path)
    assert row["held"] is held
    assert ("not interrupted (the call ran 30 s)" in row["outcome"]) is (not answer["interrupted"])


def test_service_section_and_targets():
    res = Results(suite="hostile", mode="full", command="", machine={})
    assert hostile.service_table(res) == []
    res.stages["service"] = [
        hostile._case("a", "what", {"seconds": 1.0}, True, "fine"),
        hostile._case(
            "Ctrl-C in a long forward", "w", {"seconds": 2.0, "after_s": 0.2}, False, "x"
        ),
    ]
    lines = hostile.service_table(res)
    assert lines[0].startswith("### In a training job or a service")
    assert "| a | what | fine | yes | 1.0 |" in lines
    shown = {t.name: t.evaluate(res) for t in hostile.SUITE.targets}
    assert shown["compile, pickle, limit and signal cases not held"]["measured"] == 1
    assert shown["Ctrl-C to KeyboardInterrupt, long forward"]["shown"] == "0.20 s"
    assert shown["process cases not held"]["measured"] is None
