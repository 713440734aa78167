"""The crossover tables that decide between the compiled kernel and torch SDPA: reading them,
where they come from (calibrated / default), `qkv tune`, and what `auto` then picks."""

from __future__ import annotations

import json

import pytest
import torch

import qkv
from qkv.cli import main
from qkv.kernels.cpu import crossover
from qkv.plan import make_plan

from .cpu_kernel import require_kernel

OPS, ISA = require_kernel()


@pytest.fixture
def calibration(monkeypatch, tmp_path):
    """A calibration file of our own (the machine's is left alone), read afresh."""
    path = tmp_path / crossover.CALIBRATED
    monkeypatch.setattr(crossover, "calibrated_path", lambda: path)
    monkeypatch.delenv(crossover.ENV, raising=False)
    crossover.clear()
    yield path
    crossover.clear()


def write(path, isa: str, points: dict, version: str | None = None) -> None:
    data = {"qkv_version": version or crossover.qkv_version()}
    data["paths"] = {isa: {"measured_on": "a test", "points": points}}
    path.write_text(json.dumps(data))


def decode_request(nk: int, dtype=torch.float32):
    q = torch.randn(1, 32, 1, 128, dtype=dtype)
    k = torch.randn(1, 8, nk, 128, dtype=dtype)
    return q, k, k.clone()


def test_a_request_takes_the_smoothed_ratio_of_the_nearest_point_in_log_work():
    pts = ((1e3, 0.5), (1e4, 0.8), (1e5, 1.3), (1e6, 1.6), (1e7, 1.2))
    t = crossover.Table("x", "default", "-", {"c": pts})
    assert t.winner("c", 1) == "sdpa"
    assert t.winner("c", 2.9e4) == "sdpa"  # log-nearer to 1e4 (median of 0.5, 0.8, 1.3)
    assert t.winner("c", 3.5e4) == "cpu"  # log-nearer to 1e5 (median of 0.8, 1.3, 1.6)
    assert t.winner("c", 5e9) == "cpu"  # beyond the ladder: the last points hold
    assert t.winner("other", 1e5) is None


def test_one_outlier_does_not_flip_a_band():
    pts = ((1e3, 1.4), (1e4, 1.5), (1e5, 0.2), (1e6, 1.6), (1e7, 1.5))  # a busy moment at 1e5
    t = crossover.Table("x", "default", "-", {"c": pts})
    assert t.winner("c", 1e5) == "cpu"


def test_tables_round_trip_through_json():
    t = crossover.Table("avx2", "calibrated", "m", {"c": ((1.0, 1.5), (2.0, 0.75))})
    back = crossover.parse(json.loads(json.dumps(crossover.to_json({"avx2": t}))), "calibrated")
    assert back == {"avx2": t}


def test_classes_of_requests():
    q, k, v = decode_request(64)
    assert crossover.class_of(make_plan(q, k, v)) == "decode-gqa-q1/float32/fwd/D128"
    assert crossover.class_of(make_plan(q[:, :8], k, v)) == "decode-mha-q1/float32/fwd/D128"
    q4 = torch.randn(1, 32, 4, 128)
    assert crossover.class_of(make_plan(q4, k, v)) == "decode-gqa-qN/float32/fwd/D128"
    x = torch.randn(1, 4, 32, 16, dtype=torch.bfloat16, requires_grad=True)
    assert crossover.class_of(make_plan(x, x, x, causal=True)) == "causal/bfloat16/fwd+bwd/D64"
    pad = torch.ones(1, 1, 1, 32, dtype=torch.bool)
    assert crossover.class_of(make_plan(x, x, x, mask=pad)) == "masked/bfloat16/fwd+bwd/D64"
    one = x[:, :, :1]  # one query against one key: a square problem, not decoding
    assert crossover.class_of(make_plan(one, one, one)) == "dense/bfloat16/fwd+bwd/D64"
    plan = make_plan(x, x, x, causal=True)
    assert crossover.work_of(plan) == 4 * 32 * 32 * 32 / 2


def test_the_avx512_default_sends_grouped_decoding_to_the_kernel_from_4096_keys():
    # A float32 KV-cache step of a 32:8 grouped model at D = 128 was measured faster on the
    # kernel than SDPA (its grouped heads packed as rows) from Nk = 4096 on the machine the
    # AVX-512 default comes from; the amx path reads that table too. (bfloat16 measured even
    # with SDPA there, 0.99–1.01×, so either may win it; other paths decide by their own
    # measurements.)
    defaults = crossover.parse(json.loads(crossover.DEFAULTS.read_text()), "default")
    assert {"avx512", "avx2", "portable"} <= set(defaults)
    for isa in ("amx", "avx512"):
        table = crossover.default_table(isa)
        for nk in (4096, 16384, 65536):
            plan = make_plan(*decode_request(nk, torch.float32))
            who = table.winner(crossover.class_of(plan), crossover.work_of(plan))
            assert who == "cpu", (isa, nk)


def test_auto_follows_a_calibration_and_says_so(calibration):
    q, k, v = decode_request(4096)
    write(calibration, ISA, {"decode-gqa-q1/float32/fwd/D128": [[1.0, 0.5]]})
    d = qkv.dispatch(q, k, v)
    assert d.name == "sdpa"
    assert "measured faster" in d.reasons["cpu"] and "calibrated" in d.reasons["cpu"]
    assert d.basis.startswith("calibrated") and "size crossovers: calibrated" in str(d)
    write(calibration, ISA, {"decode-gqa-q1/float32/fwd/D128": [[1.0, 2.0]]})
    crossover.clear()
    d = qkv.dispatch(q, k, v)
    assert d.name == "cpu" and d.basis.startswith("calibrated")


def test_the_default_decides_when_asked_or_for_a_foreign_calibration(calibration, monkeypatch):
    q, k, v = decode_request(4096)
    plan = make_plan(q, k, v)
    cls, work = crossover.class_of(plan), crossover.work_of(plan)
    default = crossover.default_table(ISA).winner(cls, work) or "cpu"
    opposite = [[1.0, 0.5 if default == "cpu" else 2.0]]  # a calibration that disagrees
    write(calibration, ISA, {cls: opposite})
    assert qkv.dispatch(q, k, v).name != default  # the calibration decides
    monkeypatch.setenv(crossover.ENV, "default")
    crossover.clear()  # read with the tables
    d = qkv.dispatch(q, k, v)
    assert d.name == default and d.basis.startswith("default")
    monkeypatch.delenv(crossover.ENV)
    write(calibration, ISA, {cls: opposite}, version="0.0.0-other")
    crossover.clear()
    d = qkv.dispatch(q, k, v)
    assert d.name == default and d.basis.startswith("default")
    calibration.write_text("{ not json")
    crossover.clear()
    assert qkv.dispatch(q, k, v).basis.startswith("default")


def test_requests_sdpa_cannot_take_never_read_the_table(calibration):
    write(calibration, ISA, {"dense/float32/fwd+bwd/D64": [[1.0, 0.5]]})
    x = torch.randn(1, 2, 300, 16, requires_grad=True)
    d = qkv.dispatch(x, x, x)  # float32 gradients never go to SDPA, whatever the table says
    assert d.name == "cpu" and d.basis is None


def test_qkv_tune_measures_stores_and_shows_a_table(calibration, capsys):
    assert main(["tune", "--quick", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert str(calibration) in out and "calibrated" in out
    data = json.loads(calibration.read_text())
    assert data["qkv_version"] == crossover.qkv_version()
    points = data["paths"][ISA]["points"]
    want = {
        "decode-gqa-q1/float32/fwd/D128",
        "masked/bfloat16/fwd+bwd/D64",
        "causal/float16/fwd/D64",
    }
    assert want <= set(points)
    assert "dense/float32/fwd+bwd/D64" not in points  # never goes to SDPA: not measured
    assert all(r > 0 for pts in points.values() for _, r in pts)
    assert qkv.dispatch(*decode_request(256)).basis.startswith("calibrated")
    assert main(["tune", "--show"]) == 0
    assert "decode-mha-q1/float32/fwd/D64" in capsys.readouterr().out


def test_a_compiled_call_keeps_the_decision_as_a_constant():
    q, k, v = decode_request(1024)
    fn = torch.compile(lambda q, k, v: qkv.attention(q, k, v), fullgraph=True, backend="eager")
    torch.testing.assert_close(fn(q, k, v), qkv.attention(q, k, v), rtol=0, atol=0)
