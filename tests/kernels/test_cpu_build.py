"""Building, loading and choosing the compiled CPU kernel: the `qkv build` command, the cache
folder, instruction-set paths forced by QKV_CPU_ISA, and qkv still working (with a reason) when
the kernel cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import qkv
from qkv.cli import main
from qkv.kernels.cpu import build, isa

from ..helpers import assert_error_ratio, golden, make_qkv
from .cpu_kernel import require_kernel

OPS, _ = require_kernel()


def test_qkv_build_reports_the_library_and_the_paths(capsys):
    assert main(["build", "--no-tune"]) == 0
    out = capsys.readouterr().out
    assert str(build.build_dir()) in out and "qkv_cpu.so" in out
    assert "avx512" in out and "avx2" in out and "portable yes" in out
    assert "runs: " in out


def test_the_build_folder_is_per_torch_cpu_and_sources(monkeypatch, tmp_path):
    folder = build.build_dir()
    assert torch.__version__.replace("+", "_") in folder.name and "src" in folder.name
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    assert build.build_dir().parent == tmp_path / "cpu-kernel"
    assert build.build_dir().name == folder.name


@pytest.mark.parametrize("name", isa.ISAS)
def test_every_path_this_cpu_has_matches_the_golden(monkeypatch, name):
    if not OPS.isa_supported(name):
        pytest.skip(f"this CPU lacks the {name} instructions")
    monkeypatch.setenv(isa.ENV, name)
    assert isa.choose(OPS) == (name, None)
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=77, Nk=150, D=40, Dv=24, requires_grad=True)
    out = qkv.attention(q, k, v, causal=True, backend="cpu")
    ref = qkv.attention(q, k, v, causal=True, backend="reference")
    assert_error_ratio(out, ref, golden(q, k, v, causal=True))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


def _all_results(monkeypatch, name, case):
    monkeypatch.setenv(isa.ENV, name)
    q, k, v = make_qkv(**case["shape"], dtype=case.get("dtype", torch.float32), requires_grad=True)
    out, lse = qkv.attention(
        q,
        k,
        v,
        mask=case.get("mask"),
        causal=case.get("causal", False),
        backend="cpu",
        return_lse=True,
    )
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out).mul_(0.5).add_(out.detach()))
    return [out, lse, *grads]


BIT_CASES = [
    {"shape": dict(B=1, H=4, Nq=300, D=64)},  # dense, 16-key tails
    {"shape": dict(B=1, H=4, Hkv=2, Nq=513, D=64), "causal": True},  # GQA
    {"shape": dict(B=1, H=2, Nq=700, D=40), "mask": qkv.masks.sliding_window(100)},
    {"shape": dict(B=1, H=2, Nq=256, D=128), "causal": True, "dtype": torch.bfloat16},
    {"shape": dict(B=1, H=8, Hkv=2, Nq=1, Nk=900, D=64)},  # decoding
]


@pytest.mark.parametrize("case", BIT_CASES, ids=["dense", "causal-gqa", "window", "bf16", "decode"])
def test_avx512_and_avx2_give_the_same_bits(monkeypatch, case):
    """The AVX-512 path forms the scores, P·V and the backward's sums in the AVX2 path's chains
    (32 products, one chain per tile span, 32 terms) with the same exponential, so where a CPU
    has both the two agree to the bit: a change to one path's arithmetic shows here."""
    if not (OPS.isa_supported("avx512") and OPS.isa_supported("avx2")):
        pytest.skip("this CPU lacks AVX-512 (or AVX2)")
    wide, narrow = (
        _all_results(monkeypatch, "avx512", case),
        _all_results(monkeypatch, "avx2", case),
    )
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), wide, narrow, strict=True):
        assert torch.equal(a, b), f"{name}: max diff {(a.double() - b.double()).abs().max():.3e}"


SAME_ON_AMX = [
    (torch.float16, BIT_CASES[0]),
    (torch.float16, BIT_CASES[4]),
    (torch.float32, BIT_CASES[4]),  # decoding's float32 scores are dot products, not tile products
]


@pytest.mark.parametrize(
    ("dtype", "case"),
    SAME_ON_AMX,
    ids=[f"{str(d)[6:]}-{'decode' if c is BIT_CASES[4] else 'dense'}" for d, c in SAME_ON_AMX],
)
def test_the_amx_path_is_the_avx512_path_where_no_tile_runs(monkeypatch, dtype, case):
    """The amx path runs the AVX-512 path's arithmetic for float16 and for float32 decoding: the
    same bits. (Its bfloat16 products and its float32 scores run on the tiles, other sums with
    other last bits: the kernel's tests, run on this path, judge them against the golden.)"""
    if not OPS.isa_supported("amx"):
        pytest.skip("this CPU lacks AMX-BF16 (or the OS's leave to use the tiles)")
    case = {**case, "dtype": dtype}
    tiles, plain = (_all_results(monkeypatch, name, case) for name in ("amx", "avx512"))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), tiles, plain, strict=True):
        assert torch.equal(a, b), f"{name}: max diff {(a.double() - b.double()).abs().max():.3e}"


def _hostile(q, k, kind):
    """Values the tiles' three-part split cannot carry: a non-finite key that only the rows past
    it see (causal: garbage the earlier rows must not see), or a row far below 2⁻⁸⁰ whose products
    with keys scaled up are still of order one."""
    q, k = q.detach().clone(), k.detach().clone()
    if kind == "inf-key":
        k[0, 0, 200, 3] = float("inf")
    elif kind == "tiny-row":
        q[0, 1, 40] *= 1e-30
        k[0, 1, :64] *= 1e30
    return q.requires_grad_(), k.requires_grad_()


@pytest.mark.parametrize(
    ("D", "kind"), [(64, "random"), (128, "random"), (40, "inf-key"), (64, "tiny-row")]
)
def test_amx_float32_scores_on_the_tiles_pass_the_rule(monkeypatch, D, kind):
    """On the amx path float32 scores are tile products of three bfloat16 parts per value (six
    products, chains of 32 values of d): other bits than the AVX-512 chains', the same rule. Rows
    and keys holding values the split cannot carry get the AVX-512 chains instead."""
    if not OPS.isa_supported("amx"):
        pytest.skip("this CPU lacks AMX-BF16 (or the OS's leave to use the tiles)")
    q, k, v = make_qkv(B=1, H=4, Nq=257, D=D, requires_grad=True)
    q, k = _hostile(q, k, kind)
    results = {}
    for name in ("amx", "avx512"):
        monkeypatch.setenv(isa.ENV, name)
        out = qkv.attention(q, k, v, causal=True, backend="cpu")
        results[name] = (out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    assert not torch.equal(results["amx"][0], results["avx512"][0]), "the tiles did not run"
    ref = qkv.attention(q, k, v, causal=True, backend="reference")
    gold = golden(q, k, v, causal=True)
    assert_error_ratio(results["amx"][0], ref, gold)
    if kind == "inf-key":  # rows that see the inf key are NaN; all before it match the golden
        assert torch.isfinite(gold[0, 0, :200]).all() and torch.isfinite(gold[0, 1:]).all()
        return
    ref_grads = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    g_out = qkv.attention(qd, kd, vd, causal=True, backend="reference")
    gold_grads = torch.autograd.grad(g_out, (qd, kd, vd), torch.ones_like(g_out))
    for got, r, g, what in zip(results["amx"][1:], ref_grads, gold_grads, "qkv", strict=True):
        assert_error_ratio(got, r, g, factor=3.0, what=f"d{what}")


@pytest.mark.parametrize("hostile", ["none", "tiny-dout-row", "tiny-value"])
def test_amx_float32_dp_on_the_tiles_passes_the_rule(monkeypatch, hostile):
    """On the amx path the float32 backward's dP = dO Vᵀ is formed as the scores are (three
    bfloat16 parts per value): other bits than the AVX-512 chains', the same rule. A row of dO or
    a value of V the split cannot carry (nonzero below 2⁻⁸⁰) sends that tile's dP to AVX-512."""
    if not OPS.isa_supported("amx"):
        pytest.skip("this CPU lacks AMX-BF16 (or the OS's leave to use the tiles)")
    q, k, v = make_qkv(B=1, H=4, Hkv=2, Nq=257, D=64)
    gen = torch.Generator().manual_seed(3)
    dout = torch.randn(1, 4, 257, 64, generator=gen)
    if hostile == "tiny-dout-row":
        dout[0, 1, 70] *= 1e-30
    elif hostile == "tiny-value":
        v = v.clone()
        v[0, 0, 100, 5] = 1e-30
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    grads = {}
    for name in ("amx", "avx512"):
        monkeypatch.setenv(isa.ENV, name)
        out = qkv.attention(q, k, v, causal=True, backend="cpu")
        grads[name] = torch.autograd.grad(out, (q, k, v), dout)
    assert not torch.equal(grads["amx"][0], grads["avx512"][0]), "the tiles did not run"
    ref = qkv.attention(q, k, v, causal=True, backend="reference")
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    g_out = qkv.attention(qd, kd, vd, causal=True, backend="reference")
    gold_grads = torch.autograd.grad(g_out, (qd, kd, vd), dout.double())
    for got, r, g, what in zip(grads["amx"], ref_grads, gold_grads, "qkv", strict=True):
        assert_error_ratio(got, r, g, factor=3.0, what=f"d{what}")


@pytest.mark.parametrize("hostile", ["none", "query-value", "key-value", "both"])
def test_amx_float32_key_tiles_packed_once_per_call_pass_the_rule(hostile):
    """Rows of more key tiles than a worker keeps (dense, N = 1300: 21 tiles) read each key
    tile's parts from a store packed once per call. A query row or a key holding one value the
    split cannot carry (nonzero below 2⁻⁸⁰; the rest of it ordinary, so a wrong key tile would
    show) has its scores formed from the tile itself on AVX-512, which the store's readers then
    pack for themselves."""
    if not OPS.isa_supported("amx"):
        pytest.skip("this CPU lacks AMX-BF16 (or the OS's leave to use the tiles)")
    q, k, v = make_qkv(B=1, H=4, Hkv=2, Nq=1300, D=64)
    q, k = q.clone(), k.clone()
    if hostile in ("query-value", "both"):
        q[0, 1, 900, 3] = 1e-30
    if hostile in ("key-value", "both"):
        k[0, 0, 700, 5] = 1e-30
    gen = torch.Generator().manual_seed(4)
    dout = torch.randn(1, 4, 1300, 64, generator=gen)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = qkv.attention(q, k, v, backend="cpu")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = qkv.attention(q, k, v, backend="reference")
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    gold = qkv.attention(qd, kd, vd, backend="reference")
    gold_grads = torch.autograd.grad(gold, (qd, kd, vd), dout.double())
    assert_error_ratio(out, ref, gold, factor=2.0, what="out")
    for got, r, g, what in zip(grads, ref_grads, gold_grads, "qkv", strict=True):
        assert_error_ratio(got, r, g, factor=3.0, what=f"d{what}")


@pytest.mark.parametrize("value", ["bogus", "avx512x"])
def test_a_bad_isa_request_is_a_reason_not_a_crash(monkeypatch, value):
    monkeypatch.setenv(isa.ENV, value)
    q, k, v = make_qkv(B=1, H=2, Nq=300, D=8)
    decision = qkv.dispatch(q, k, v, return_lse=True)
    assert decision.name == "tiled"
    assert f"{isa.ENV}={value!r} is not one of auto" in decision.reasons["cpu"]
    with pytest.raises(NotImplementedError, match="QKV_CPU_ISA"):
        qkv.attention(q, k, v, backend="cpu")


def test_an_isa_the_cpu_lacks_is_refused_with_the_reason(monkeypatch):
    lacking = [name for name in isa.ISAS if not OPS.isa_supported(name)]
    if not lacking:
        pytest.skip("this CPU has every path (AVX-512, AVX2, portable)")
    monkeypatch.setenv(isa.ENV, lacking[0])
    assert "lacks the instructions" in isa.choose(OPS)[1]


_NO_COMPILER = """
import sys, torch, qkv
q, k, v = (torch.randn(1, 2, 300, 8) for _ in range(3))
d = qkv.dispatch(q, k, v, return_lse=True)
out, lse = qkv.attention(q, k, v, return_lse=True)
ref = qkv.attention(q, k, v, return_lse=True, backend="reference")[0]
print(d.name)
print(d.reasons["cpu"])
print(float((out - ref).abs().max()))
"""


def _run_fresh(tmp_path, **env):
    proc = subprocess.run(
        [sys.executable, "-c", _NO_COMPILER],
        env={**os.environ, "QKV_CACHE_DIR": str(tmp_path), **env},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    name, reason, err = proc.stdout.strip().splitlines()[-3:]
    assert name == "tiled" and float(err) < 1e-5  # qkv works, on the pure-PyTorch path
    return reason, proc.stderr


@pytest.mark.slow
def test_without_a_compiler_qkv_works_and_says_why(tmp_path):
    reason, _ = _run_fresh(tmp_path, CXX=str(tmp_path / "no-such-c++"))
    assert "the compiled CPU kernel is unavailable: no C++ compiler" in reason
    assert "no-such-c++" in reason and "qkv build" in reason


@pytest.mark.slow
def test_a_failed_build_is_recorded_with_its_error_and_not_retried(tmp_path):
    # A "compiler" that answers questions (--version) but fails every compilation: the first
    # process tries, fails and records the compiler's error; the second reads the reason and
    # does not try again.
    cxx = tmp_path / "broken-c++"
    cxx.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" -c "*) ;; *) exec c++ "$@" ;; esac\n'
        "echo 'broken-c++: error: this compiler always fails' >&2\nexit 1\n"
    )
    cxx.chmod(0o755)
    first, first_err = _run_fresh(tmp_path, CXX=str(cxx))
    second, second_err = _run_fresh(tmp_path, CXX=str(cxx))
    for reason in (first, second):
        assert "building it failed: broken-c++: error: this compiler always fails" in reason
    assert "compiling the CPU attention kernel" in first_err
    assert "compiling" not in second_err
    failed = list(tmp_path.glob("cpu-kernel/*/" + build.FAILED))
    assert len(failed) == 1 and "always fails" in failed[0].read_text()
