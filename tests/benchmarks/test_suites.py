"""Every suite's declaration, through the one entry point: it dry-runs (cases × implementations
listed, nothing built or timed), its section renders and re-renders from its JSON; and the
arithmetic of the suites' own figures on synthetic results."""

from __future__ import annotations

import pytest
from benchmarks.report import Row, read_sections
from benchmarks.results import CaseRecord, Results, Timing, type_path
from benchmarks.run import load_suite, main, suite_names
from benchmarks.suite import FWD, Group
from benchmarks.suites import decode, distributed, sparse

SUITES = ("core", "decode", "distributed", "gpu", "hf", "sparse", "vision")


def test_the_suites_are_found_by_name(capsys):
    assert set(SUITES) <= set(suite_names())
    assert main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in SUITES)
    with pytest.raises(SystemExit, match="no suite 'nope'"):
        load_suite("nope")


@pytest.mark.parametrize("name", SUITES)
def test_each_suite_dry_runs_and_renders(name: str, tmp_path):
    out = tmp_path / "benchmarks.md"
    assert main([name, "--dry-run", "--out", str(out)]) == 0
    section = read_sections(out.read_text())[name]
    assert "**Dry run: nothing was measured.**" in section
    results = Results.read(tmp_path / f"benchmarks-{name}.json")
    assert results.dry_run and results.complete
    suite = load_suite(name)
    settings = suite.settings["full"]
    for group in (s for s in suite.steps if isinstance(s, Group)):
        cases = list(group.cases(settings))
        assert [c.params for c in results.cases if c.group == group.name] == [
            dict(vars(c)) for c in cases
        ]
        for case in cases:  # every implementation that belongs has a row, and no figure
            for impl in (i for i in group.impls if i.when(case)):
                for pass_ in group.passes:
                    t = results.timing(group.name, case, impl.name, pass_)
                    assert t is not None and t.median_s is None
    assert len(results.targets) == len(suite.targets)
    again = tmp_path / "again.md"
    assert (
        main([name, "--from-json", str(tmp_path / f"benchmarks-{name}.json"), "--out", str(again)])
        == 0
    )
    assert read_sections(again.read_text())[name] == section


def test_sparse_flex_mask_mods_and_tile_densities_match_the_masks():
    sparse.prepare(sparse.QUICK)  # raises where a mask_mod or a density differs
    figures = sparse.sparsity(sparse.PATTERNS["sliding"].mask(4096), 4096)
    assert figures == {
        "density": pytest.approx(0.1213, abs=1e-4),
        "kept_tiles": 556,
        "total_tiles": 4096,
    }


def test_sparse_cases_run_the_slowest_comparison_last():
    cases = sparse.cases(sparse.FULL)
    tail = [c for c in cases if c.pattern == "causal" and c.n > sparse.SDPA_MAX_N]
    assert cases[-len(tail) :] == tail and len(cases) == 25


def results_for(group: str, case, medians: dict[str, float]) -> Results:
    res = Results(suite="x", mode="full", command="", machine={})
    res.cases.append(CaseRecord(group, type_path(case), dict(vars(case))))
    for impl, seconds in medians.items():
        res.timings.append(Timing(group, dict(vars(case)), impl, FWD, median_s=seconds))
    return res


def test_decode_per_token_and_speed_up():
    case = decode.Case(512, 32)
    res = results_for("decode", case, {"prompt forward": 0.1, "qkv cache": 0.42, "re-forward": 3.3})
    row = Row(res, "decode", case)
    assert decode.per_token(row, "qkv cache") == pytest.approx(0.01)
    assert decode.speedup(row) == pytest.approx(10.0)
    assert decode.SUITE.targets[0].evaluate(res)["passed"] is True
    assert "| 512 | 32 | 100.0 | 10.00 | 100.00 | — | 10.0× |" in decode.TABLE.render(res)


def test_distributed_shares_and_balance():
    res = Results(suite="distributed", mode="full", command="", machine={})
    row = {"name": "", "world": 4, "method": "ring", "tiles": [10, 10, 11, 10]}
    res.stages["configs"] = [
        {
            **row,
            "name": distributed.SINGLE,
            "world": 1,
            "method": "single",
            "peak_mib": 100.0,
            "inputs_mib": 100.0,
        },
        {**row, "name": "ring zigzag P=4", "peak_mib": 30.0, "inputs_mib": 25.0},
    ]
    zigzag = res.stages["configs"][1]
    assert distributed.share(res, zigzag, False) == pytest.approx(0.3)
    assert distributed.share(res, zigzag, True) == pytest.approx(0.275)
    assert distributed.balance(zigzag) == pytest.approx(1.1)
    targets = [t.evaluate(res) for t in distributed.SUITE.targets]
    assert [t["passed"] for t in targets] == [True, None, True]
