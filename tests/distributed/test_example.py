"""`python -m qkv.examples.long_context`: spawns its own ranks, checks, reports."""

from __future__ import annotations

import subprocess
import sys

import pytest

MODULE = [sys.executable, "-m", "qkv.examples.long_context"]


@pytest.mark.slow
def test_example_runs_checks_and_reports():
    args = ["--nproc", "2", "--seq-len", "1024", "--check-len", "64", "--backward"]
    proc = subprocess.run(
        [*MODULE, *args, "--timeout", "60"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(OK, limit 1e-10)" in proc.stdout
    assert "N=1024 tokens over 2 ranks (512 each)" in proc.stdout
    assert "work balance: busiest / least busy rank = 1.00" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line[:4].strip() in ("0", "1")]
    assert len(rows) == 2 and all(float(r[-2]) > 0 for r in rows)  # bytes sent by each rank


def test_example_rejects_a_length_that_does_not_divide():
    proc = subprocess.run(
        [*MODULE, "--nproc", "4", "--seq-len", "1001"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "must be divisible by 8" in proc.stderr
