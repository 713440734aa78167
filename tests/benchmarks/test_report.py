"""The reporter: sections spliced into the document without touching the others, and a section
rendered from results (tables, what was not run, targets)."""

from __future__ import annotations

import pytest
from benchmarks.report import DOC_HEADER, read_sections, render, splice, write_section
from benchmarks.results import CaseRecord, MemoryResult, Results, Timing, type_path
from benchmarks.suite import FWD, FWD_BWD

from .fake_suite import GROUP, SUITE, Case

OTHER = "## Other\n\n| a | b |\n|---:|---:|\n| 1 | 2 |\n\ntrailing  spaces  \n"
DOC = (
    "# Benchmarks\n\nold header\n\n"
    f"<!-- BEGIN first -->\n{OTHER}<!-- END first -->\n\n"
    "<!-- BEGIN toy -->\nold toy\n<!-- END toy -->\n\n"
    "<!-- BEGIN last -->\nlast body\n<!-- END last -->\n"
)


def test_splice_replaces_one_section_and_keeps_the_others_byte_for_byte():
    text = splice(DOC, "toy", "new toy\n")
    sections = read_sections(text)
    assert list(sections) == ["first", "toy", "last"]  # the order they had
    assert sections["first"] == OTHER and sections["last"] == "last body\n"
    assert sections["toy"] == "new toy\n"
    assert text.startswith(DOC_HEADER)  # the header is the current one
    assert splice(text, "toy", "new toy") == text  # idempotent


def test_splice_appends_a_new_section_and_starts_an_empty_document():
    text = splice(DOC, "new", "hello")
    assert list(read_sections(text)) == ["first", "toy", "last", "new"]
    assert read_sections(splice("", "toy", "x")) == {"toy": "x\n"}


def test_splice_refuses_a_document_without_sections():
    with pytest.raises(ValueError, match="not a benchmarks file"):
        splice("# README\n\nsome text\n", "toy", "x")


def test_write_section_on_a_file(tmp_path):
    path = tmp_path / "docs" / "benchmarks.md"
    write_section(path, "a", "one")
    write_section(path, "b", "two")
    write_section(path, "a", "three")
    assert read_sections(path.read_text()) == {"a": "three\n", "b": "two\n"}


def fake_results() -> Results:
    res = Results(
        suite="toy",
        mode="full",
        command="python -m benchmarks.run toy",
        machine={
            "date_utc": "2026-01-01 00:00 UTC",
            "cpu_model": "Test CPU",
            "cpus": 2,
            "cores_available": 2,
            "cpu_capability": "AVX2",
            "uname": "Linux",
            "torch": "2.x",
            "torch_threads": 2,
            "python": "3.x",
        },
        load={"start": 0.5, "end": 0.75},
        gate={
            "policy": "wait",
            "waited_s": 3.0,
            "rounds_waited": 1,
            "busy_rounds": 0,
            "sample_s": 0.2,
            "max_round_s": 30.0,
            "max_total_s": 300.0,
            "busy_above": 0.15,
        },
        complete=True,
    )
    kind = type_path(Case(8))
    res.cases += [
        CaseRecord("toy", kind, {"n": 8}),
        CaseRecord("toy", kind, {"n": 1000}, note="not run (too big for a toy)"),
    ]
    res.timings += [
        Timing("toy", {"n": 8}, "fast", FWD, times_s=[0.001, 0.002, 0.003]),
        Timing(
            "toy", {"n": 8}, "slow", FWD, times_s=[0.004, 0.004, 0.006], pressure=[0.5, 0.5, 0.5]
        ),
        Timing("toy", {"n": 8}, "broken", FWD, note="failed: RuntimeError: no kernel"),
        Timing("toy", {"n": 8}, "fwd-only", FWD_BWD, note="forward only"),
        Timing("toy", {"n": 1000}, "fast", FWD, note="not run (too big for a toy)"),
    ]
    res.memory.append(MemoryResult("toy", {"n": 16}, "alloc", FWD, 64.5, 0.1, 0.2, type=kind))
    res.stages["extra"] = {"answer": 42}
    res.derive(GROUP)
    res.targets = [t.evaluate(res) for t in SUITE.targets]
    return res


def test_render_a_section():
    text = render(SUITE, fake_results())
    assert text.startswith("## Toy suite\n")
    assert "- **Machine:** CPU Test CPU, 2 of 2 CPUs available" in text
    assert "quiet gate `wait`: waited 3 s before 1 rounds" in text
    assert "### Method\n\n- First bullet, continued.\n- Second bullet.\n- Computed.\n" in text
    assert "| 8 | fast | 2.0 | 1.00 | — |" in text
    assert "| 8 | slow | 4.0 † | 0.50 | — |" in text  # † : measured under contention
    assert "| 8 | broken | failed | — | — |" in text
    assert "| 8 | fwd-only | — | — | forward only |" in text
    assert "| 1000 | fast | not run | — | — |" in text
    assert "| alloc | 0 | 64.5 | 0.2 |  |" in text
    assert "The answer is 42." in text
    assert "- n=1000: not run (too big for a toy)." in text  # a dropped case once
    assert "- `broken` failed: RuntimeError: no kernel: n=8 fwd." in text
    assert "| a \\| pipe in a name | ≤ 1 MiB | — | not measured |" in text
    assert "| fast ×fast at 16 | ≥ 1× | — | not measured |" in text


def test_a_partial_or_dry_run_says_so():
    res = fake_results()
    res.complete = False
    assert "**Partial: the run stopped before its end" in render(SUITE, res)
    res.dry_run = True
    assert "**Dry run: nothing was measured.**" in render(SUITE, res)
