"""The gpu suite (`python -m benchmarks.run gpu`), the prepared device run, on a machine without a
GPU: it refuses to run without CUDA, its dry run lists every case, and its FLOP counts, targets
and tables are right. (Its correctness stage is run on CPU in the interpreter by test_triton.py.)"""

from __future__ import annotations

import pytest
import torch
from benchmarks.report import render
from benchmarks.results import CaseRecord, Results, Timing, type_path
from benchmarks.run import main
from benchmarks.suite import FWD, FWD_BWD
from benchmarks.suites import gpu


def load_script():
    """The gpu suite's module (test_triton.py runs its correctness stage)."""
    return gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_exits_with_a_clear_message_without_cuda(capsys, tmp_path):
    assert main(["gpu", "--out", str(tmp_path / "benchmarks.md")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_dry_run_lists_every_case(tmp_path):
    out = tmp_path / "benchmarks.md"
    assert main(["gpu", "--dry-run", "--out", str(out)]) == 0
    results = Results.read(tmp_path / "benchmarks-gpu.json")
    assert results.dry_run is True
    rows = [t for t in results.timings if t.group == "timing"]
    n_cases = len(gpu.HEAD_DIMS) * len(gpu.SEQ_LENS) * len(gpu.PATTERNS)
    n_flex = len(gpu.PATTERNS) * len(gpu.FLEX_N) * len(gpu.FLEX_D)
    assert len(rows) == 2 * (n_cases * (1 + len(gpu.SDPA_BACKENDS)) + n_flex)  # fwd, fwd+bwd
    assert len([t for t in results.timings if t.group == "sweep"]) == 2 * 2 * len(gpu.SWEEP)
    assert all(t.median_s is None for t in results.timings)  # nothing measured
    md = out.read_text()
    assert "Dry run: nothing was measured" in md and "not measured" in md
    for case in results.case_objects("timing"):
        b, h, n, d = gpu.shape_of(case.n, case.d)
        assert b * n == gpu.TOKENS and h * d == gpu.WIDTH


def test_flop_counts():
    b, h = gpu.TOKENS // 1024, gpu.WIDTH // 64
    dense = 4.0 * b * h * 1024 * 1024 * 64
    assert gpu.flops("dense", 1024, 64, FWD) == dense
    assert gpu.flops("causal", 1024, 64, FWD) == dense / 2
    assert gpu.flops("dense", 1024, 64, FWD_BWD) == 3.5 * dense
    assert gpu.density("window", 1024) == 1.0  # a 1024-wide window covers N = 1024 fully
    n = 16384
    want = sum(min(n - 1, i + 1024) - max(0, i - 1024) + 1 for i in range(n)) / n**2
    assert gpu.density("window", n) == pytest.approx(want) and want < 0.13


def test_targets_and_tables_from_results():
    # Synthetic times (one round each), only to check the arithmetic and formatting.
    res = Results(suite="gpu", mode="full", command="python -m benchmarks.run gpu", machine={})
    res.machine = {
        "date_utc": "-", "cpu_model": "-", "cpus": 1, "cores_available": 1, "cpu_capability": "-",
        "uname": "-", "torch": "-", "torch_threads": 1, "python": "-",
    }  # fmt: skip
    dense, window = gpu.Case(128, 8192, "dense"), gpu.Case(128, 16384, "window")
    for case in (dense, window, gpu.Case(128, 8192, "causal")):
        res.cases.append(CaseRecord("timing", type_path(case), vars(case).copy()))

    def timing(case, impl, fwd_ms, both_ms):
        for pass_, ms in ((FWD, fwd_ms), (FWD_BWD, both_ms)):
            res.timings.append(Timing("timing", vars(case).copy(), impl, pass_, times_s=[ms / 1e3]))

    timing(dense, "triton", 2.0, 8.0)
    timing(dense, "sdpa-flash", 1.0, 4.0)
    timing(dense, "sdpa-efficient", 3.0, 9.0)
    timing(window, "triton", 1.0, 4.0)
    timing(window, "flex", 1.5, 3.0)
    res.timings.append(
        Timing(
            "timing", vars(dense).copy(), "sdpa-cudnn", FWD, note="failed: RuntimeError: no kernel"
        )
    )
    res.derive(gpu.TIMING)
    res.complete = True
    res.targets = [t.evaluate(res) for t in gpu.SUITE.targets]
    result = {t["name"]: t for t in res.targets}
    assert result["forward ≥ 0.9× best SDPA, dense"]["measured"] == 0.5
    assert result["forward ≥ 0.9× best SDPA, dense"]["passed"] is False
    assert result["window forward ≥ 1.0× Flex"]["passed"] is True
    assert result["window fwd+bwd ≥ 1.0× Flex"]["measured"] == 0.75
    assert result["forward ≥ 0.9× best SDPA, causal"]["passed"] is None
    md = render(gpu.SUITE, res)
    assert "| 8192 | dense | 2.00 ms · " in md
    assert "- `sdpa-cudnn` failed: RuntimeError: no kernel: d=128, n=8192, pattern=dense fwd." in md
    assert "| window forward ≥ 1.0× Flex | ≥ 1× | 1.50× | PASS |" in md


def test_torchs_sync_mode_notice_is_not_a_sync():
    """torch warns once that the sync debug mode is a prototype; that notice is not a
    synchronizing call (the H200 run recorded it as one), a real sync still is."""
    notice = gpu.SYNC_MODE_NOTICE + " and does not yet detect all synchronizing operations"
    real = "called a synchronizing CUDA operation"
    assert gpu.real_syncs([notice, real]) == [real]
    check = {"check": "no host syncs", "pass": False, "syncs": {"dense": [notice], "causal": []}}
    res = Results(suite="gpu", mode="full", command="-", machine={})
    res.stages["correctness"] = [check]
    assert "| no host syncs | ok |" in gpu.correctness_lines(res)
    check["syncs"]["causal"] = [real]
    assert f"| no host syncs | FAIL: causal: {real} |" in gpu.correctness_lines(res)
