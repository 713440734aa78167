"""The avx512bf16 path: the compiled kernel with the products of bfloat16 inputs on AVX512-BF16's
dot-product instruction (tiles_dpbf16.h), for CPUs without a tile unit. Float32 and float16 run
the avx512 path's arithmetic there (the same bits); bfloat16 forward and backward pass the
error-ratio rule against the float64 golden over masks, GQA, Nq ≠ Nk, Dv ≠ D, modifiers and
decoding, and dropout drops what the reference drops. (CI also runs every test_cpu*.py module on
this path, `QKV_CPU_ISA=avx512bf16`, where the CPU has it.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import qkv
from qkv import masks, scores
from qkv.kernels.cpu import isa

from ..helpers import assert_error_ratio, make_qkv
from .cpu_kernel import require_kernel

OPS, _ = require_kernel()
PATH = "avx512bf16"
needs_path = pytest.mark.skipif(
    not OPS.isa_supported(PATH), reason="this CPU lacks AVX512-BF16 (or AVX-512)"
)


def _run(monkeypatch, name, q, k, v, dout=None, **kw):
    """out and (with dout) dq, dk, dv of the compiled kernel on path `name`."""
    monkeypatch.setenv(isa.ENV, name)
    leaves = [t.detach().clone().requires_grad_(dout is not None) for t in (q, k, v)]
    out = qkv.attention(*leaves, backend="cpu", **kw)
    if dout is None:
        return [out.detach()]
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


def _reference(q, k, v, dout, dtype, **kw):
    """The reference in `dtype` and the float64 golden: out, dq, dk, dv of each."""
    runs = []
    for t in (dtype, torch.float64):
        leaves = [x.detach().to(t).requires_grad_() for x in (q, k, v)]
        mask = kw.get("mask")
        if isinstance(mask, masks.Mask):
            mask = mask.dense4(q.shape[-2], k.shape[-2])
        out = qkv.attention(*leaves, backend="reference", **{**kw, "mask": mask})
        runs.append([out.detach(), *torch.autograd.grad(out, leaves, dout.to(t))])
    return runs


def test_the_path_is_a_choice_and_auto_takes_it_on_amd_only():
    assert PATH in isa.ISAS
    best = str(OPS.best_isa())
    cpuinfo = Path("/proc/cpuinfo")
    vendor = cpuinfo.read_text() if cpuinfo.exists() else ""
    if OPS.isa_supported("amx"):
        assert best == "amx"
    elif OPS.isa_supported(PATH):  # Zen 4/5: twice the FMA rate; Intel's cores: half of it
        assert (best == PATH) == ("AuthenticAMD" in vendor), best


SAME_BITS = [
    (torch.float32, dict(B=1, H=4, Hkv=2, Nq=300, D=64), dict(causal=True)),
    (torch.float32, dict(B=1, H=2, Nq=200, D=40), dict(mask=masks.sliding_window(50))),
    (torch.float32, dict(B=1, H=8, Hkv=2, Nq=1, Nk=900, D=64), {}),  # decoding
    (torch.float16, dict(B=1, H=4, Nq=300, D=64), dict(causal=True)),
    (torch.float16, dict(B=1, H=8, Hkv=2, Nq=1, Nk=900, D=64), {}),
]


@needs_path
@pytest.mark.parametrize(("dtype", "shape", "kw"), SAME_BITS, ids=range(len(SAME_BITS)))
def test_float32_and_float16_run_the_avx512_arithmetic(monkeypatch, dtype, shape, kw):
    q, k, v = make_qkv(**shape, dtype=dtype)
    dout = torch.randn(q.shape[:-1] + v.shape[-1:]).to(dtype)
    dots, plain = (_run(monkeypatch, name, q, k, v, dout, **kw) for name in (PATH, "avx512"))
    for what, a, b in zip(("out", "dq", "dk", "dv"), dots, plain, strict=True):
        assert torch.equal(a, b), f"{what}: max diff {(a.double() - b.double()).abs().max():.3e}"


ALIBI_4_HEADS = scores.alibi(scores.alibi_slopes(4))
MATRIX = {
    "dense": (dict(B=2, H=4, Nq=300, D=64), {}),
    "causal-gqa": (dict(B=1, H=8, Hkv=2, Nq=257, D=64), dict(causal=True)),
    "nq<nk": (dict(B=1, H=4, Nq=100, Nk=333, D=64), dict(causal=True)),
    "nq>nk": (dict(B=1, H=4, Nq=200, Nk=90, D=64), dict(causal=True)),
    "dv!=d": (dict(B=1, H=4, Nq=200, D=40, Dv=96), {}),
    "d128": (dict(B=1, H=2, Nq=200, D=128), dict(causal=True)),
    "d256": (dict(B=1, H=2, Nq=130, D=256, Dv=200), {}),
    "window": (dict(B=1, H=4, Nq=500, D=64), dict(mask=masks.sliding_window(70))),
    "document": (dict(B=1, H=4, Nq=300, D=64), dict(mask=masks.document([100, 37, 163]))),
    "alibi-softcap": (
        dict(B=1, H=4, Nq=200, D=64),
        dict(causal=True, score_mod=scores.compose(ALIBI_4_HEADS, scores.softcap(2.0))),
    ),
    # 16 heads: the backward walks all 5 key columns in one chunk, reading the query tiles'
    # rows from its packed cache after the first
    "one-chunk": (dict(B=4, H=4, Nq=300, D=64), dict(causal=True)),
    "decode": (dict(B=2, H=8, Hkv=2, Nq=1, Nk=1000, D=64), {}),
    "decode-window": (dict(B=1, H=4, Nq=3, Nk=700, D=64), dict(causal=True)),
}


@needs_path
@pytest.mark.parametrize("case", list(MATRIX))
def test_bfloat16_passes_the_rule_on_the_dot_products(monkeypatch, case):
    shape, kw = MATRIX[case]
    q, k, v = make_qkv(**shape, dtype=torch.bfloat16)
    dout = torch.randn(q.shape[:-1] + v.shape[-1:], generator=torch.Generator().manual_seed(1))
    got = _run(monkeypatch, PATH, q, k, v, dout.bfloat16(), **kw)
    ref, gold = _reference(q, k, v, dout, torch.bfloat16, **kw)
    factors = (2, 3, 3, 3)  # gradients: test_cpu.py's factor
    for what, a, r, g, f in zip(("out", "dq", "dk", "dv"), got, ref, gold, factors, strict=True):
        assert a.dtype == torch.bfloat16
        assert_error_ratio(a, r, g, factor=f, what=what)
    plain = _run(monkeypatch, "avx512", q, k, v, dout.bfloat16(), **kw)
    if case == "dense":  # the dot products ran: other sums than the float path's, other bits
        assert not all(torch.equal(a, b) for a, b in zip(got, plain, strict=True))


@needs_path
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bfloat16_peaked_rows_pass_the_rule(monkeypatch, causal):
    # keys = queries: each row's largest weight (on its own key, score |q|²/8 ≈ 8) exceeds one
    # half, so the backward forms dP exactly and dS = P ∘ (dP − Δ) in double there, reading the
    # rows as floats at every column (not only from the packed cache: B·H = 16 heads make one
    # chunk of all 5 columns); the other tiles round P and dS to bfloat16 from float
    g = torch.Generator().manual_seed(4)
    q, v = (torch.randn(4, 4, 300, 64, generator=g).bfloat16() for _ in range(2))
    dout = torch.randn(4, 4, 300, 64, generator=g)
    got = _run(monkeypatch, PATH, q, q, v, dout.bfloat16(), causal=causal)
    ref, gold = _reference(q, q, v, dout, torch.bfloat16, causal=causal)
    for what, a, r, gl in zip(("dq", "dk", "dv"), got[1:], ref[1:], gold[1:], strict=True):
        assert_error_ratio(a, r, gl, factor=3, what=what)


@needs_path
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_dropout_drops_what_the_reference_drops(monkeypatch, causal):
    # V = I: the output is the dropped weight matrix, its zeros the mask
    B, H, N = 1, 2, 150
    q, k, _ = make_qkv(B=B, H=H, Nq=N, D=64, dtype=torch.bfloat16)
    eye = torch.eye(N).expand(B, H, N, N).contiguous().bfloat16()
    monkeypatch.setenv(isa.ENV, PATH)
    torch.manual_seed(5)
    got = qkv.attention(q, k, eye, dropout_p=0.25, causal=causal, backend="cpu")
    torch.manual_seed(5)
    ref = qkv.attention(q, k, eye, dropout_p=0.25, causal=causal, backend="reference")
    assert torch.equal(got != 0, ref != 0)
    torch.manual_seed(5)
    gold = qkv.attention(q.double(), k.double(), eye.double(), dropout_p=0.25, causal=causal,
                         backend="reference")  # fmt: skip
    assert_error_ratio(got, ref, gold)


def test_the_core_limits_probe_measures_and_refuses_a_bad_kind():
    """`torch.ops.qkv_cpu.peak_gflops`, the cpu suite's limits: a positive rate for the float32
    FMAs on an x86 CPU with AVX2 or AVX-512, 0 for the dot products and the AMX tile multiply
    where the CPU lacks them, and a clear error for a kind it does not know."""
    peak = torch.ops.qkv_cpu.peak_gflops
    if OPS.isa_supported("avx2"):
        assert peak("fma_f32", 0.02) > 0
    assert (peak("dp_bf16", 0.02) > 0) == bool(OPS.isa_supported(PATH))
    assert (peak("amx_bf16", 0.02) > 0) == bool(OPS.isa_supported("amx"))
    with pytest.raises(RuntimeError, match="fma_f32, dp_bf16 or amx_bf16"):
        peak("fma64", 0.02)
