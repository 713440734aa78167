"""The cost curve: records, slopes, skipping what would not fit, the table and the JSON."""

from __future__ import annotations

import json
import math

import pytest

from qkv.inspect import bench

TINY = bench.Sizes(ns=(64, 128), heads=2, window=16, repeats=1, dim=16)


def test_measure_records_every_method_pass_and_size():
    records = bench.measure(TINY, progress=False)
    assert len(records) == 2 * len(bench.METHODS) * len(bench.PASSES)
    for r in records:
        assert r["time_s"] > 0 and r["note"] == ""
        assert r["peak_mib"] is None or r["peak_mib"] >= 0
    report = bench.report(records, TINY)
    json.dumps(report, allow_nan=False)  # strict JSON: no NaN slopes
    assert list(report["sizes"]["ns"]) == [64, 128] and set(report["slopes"]) == set(bench.PASSES)


def test_what_would_not_fit_is_skipped_with_a_note(monkeypatch):
    # free memory for the window at N=128 (it needs half of what is free), not for the N² scores
    need = bench.estimate_mib("window", "forward", 128, TINY.heads, TINY.dim)
    assert bench.estimate_mib("naive", "forward", 128, TINY.heads, TINY.dim) > 1.01 * need
    monkeypatch.setattr(bench, "available_mib", lambda: 2.02 * need)
    records = bench.measure(TINY, ["naive", "window"], ["forward"], progress=False)
    at_128 = {r["method"]: r for r in records if r["n"] == 128}
    assert at_128["naive"]["time_s"] is None
    assert at_128["naive"]["note"].startswith("skipped: needs about")
    assert at_128["window"]["time_s"] > 0
    assert "skipped" in bench.table(records)


def test_slopes_recover_the_exponent():
    recs = [
        {"method": m, "pass": "forward", "n": n, "time_s": c * n**p, "peak_mib": None}
        for m, p, c in (("dense", 2, 1e-9), ("band", 1, 3e-6))
        for n in (512, 1024, 2048, 4096)
    ]
    fitted = bench.slopes(recs)
    assert fitted["dense"] == pytest.approx(2, rel=1e-12)
    assert fitted["band"] == pytest.approx(1, rel=1e-12)
    assert math.isnan(bench.slopes(recs[:1])["dense"])  # one point: no slope


def test_estimate_grows_as_n_squared_only_for_the_naive_formula():
    small, big = (bench.estimate_mib("naive", "forward", n, 8, 64) for n in (1024, 2048))
    assert big / small > 3.5
    small, big = (bench.estimate_mib("tiled", "forward", n, 8, 64) for n in (1024, 2048))
    assert big / small == pytest.approx(2)


def test_bad_method_is_a_clear_error():
    with pytest.raises(ValueError, match="method 'fast' is unknown"):
        bench.measure(TINY, ["fast"], progress=False)
