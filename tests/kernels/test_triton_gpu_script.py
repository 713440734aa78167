"""benchmarks/gpu.py, the prepared device script, on a machine without a GPU: it refuses to run
without CUDA, its dry run lists every case, and its FLOP counts, targets and tables are right.
(Its correctness stage is run on CPU in the interpreter by test_triton.py.)"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


def load_script():
    spec = importlib.util.spec_from_file_location("qkv_bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu = load_script()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_exits_with_a_clear_message_without_cuda(capsys, tmp_path):
    assert gpu.main(["--out-dir", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "gpu.json").exists()


def test_dry_run_lists_every_case(tmp_path):
    assert gpu.main(["--dry-run", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["dry_run"] is True
    rows = report["timing"]
    n_cases = len(gpu.HEAD_DIMS) * len(gpu.SEQ_LENS) * len(gpu.PATTERNS)
    n_flex = len(gpu.PATTERNS) * 2  # default --flex-n 8192 16384, --flex-d 128
    assert len(rows) == n_cases * (1 + len(gpu.SDPA_BACKENDS)) + n_flex
    assert all("fwd_ms" not in r for r in rows)  # nothing measured
    md = (tmp_path / "gpu.md").read_text()
    assert "Dry run: nothing was measured" in md and "not measured" in md
    for b, h, n, d in (r["shape"] for r in rows):
        assert b * n == gpu.TOKENS and h * d == gpu.WIDTH


def test_flop_counts():
    b, h = gpu.TOKENS // 1024, gpu.WIDTH // 64
    dense = 4.0 * b * h * 1024 * 1024 * 64
    assert gpu.flops("dense", 1024, 64, "fwd") == dense
    assert gpu.flops("causal", 1024, 64, "fwd") == dense / 2
    assert gpu.flops("dense", 1024, 64, "fwd+bwd") == 3.5 * dense
    assert gpu.density("window", 1024) == 1.0  # a 1024-wide window covers N = 1024 fully
    n = 16384
    want = sum(min(n - 1, i + 1024) - max(0, i - 1024) + 1 for i in range(n)) / n**2
    assert gpu.density("window", n) == pytest.approx(want) and want < 0.13


def test_targets_and_tables_from_a_report():
    # Synthetic times, only to check the arithmetic and formatting of the report.
    def row(impl, pattern, n, fwd, both):
        r = {"d": 128, "n": n, "pattern": pattern, "impl": impl, "shape": gpu.shape_of(n, 128)}
        r.update({"fwd_ms": fwd, "fwd+bwd_ms": both, "peak_mib": 1.0})
        for which in ("fwd", "fwd+bwd"):
            r[f"{which}_tflops"] = gpu.flops(pattern, n, 128, which) / r[f"{which}_ms"] / 1e9
        return r

    rows = [
        row("triton", "dense", 8192, 2.0, 8.0),
        row("sdpa-flash", "dense", 8192, 1.0, 4.0),
        row("sdpa-efficient", "dense", 8192, 3.0, 9.0),
        row("triton", "window", 16384, 1.0, 4.0),
        row("flex", "window", 16384, 1.5, 3.0),
        {"d": 128, "n": 8192, "pattern": "causal", "impl": "sdpa-cudnn", "skipped": "no kernel"},
    ]
    report = {"environment": gpu.environment(None), "timing": rows}
    gpu.targets(report)
    result = {t["target"]: t for t in report["targets"]}
    assert result["forward ≥ 0.9× best SDPA, dense"]["ratio"] == 0.5
    assert result["forward ≥ 0.9× best SDPA, dense"]["result"] == "FAIL"
    assert result["window forward ≥ 1.0× Flex"]["result"] == "PASS"
    assert result["window fwd+bwd ≥ 1.0× Flex"]["ratio"] == 0.75
    assert result["forward ≥ 0.9× best SDPA, causal"]["result"] == "not measured"
    md = gpu.markdown(report)
    assert "| 8192 | dense | 2.00 ms ·" in md and "- sdpa-cudnn: no kernel" in md
    assert "| window forward ≥ 1.0× Flex | 1.50× | PASS |" in md
