"""Every backend against the fp64 golden with the error-ratio rule, on awkward shapes."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.kernels import BACKENDS as KERNELS
from qkv.plan import make_plan, to_4d

from .helpers import BACKENDS, assert_error_ratio, golden, make_qkv

CASES = {
    "N1": dict(B=1, H=2, Nq=1, D=8),
    "N2": dict(B=2, H=1, Nq=2, D=8),
    "N17-D40": dict(B=1, H=3, Nq=17, D=40),
    "N97-D59": dict(B=2, H=2, Nq=97, D=59),
    "N255-D64": dict(B=1, H=2, Nq=255, D=64),
    "N1025-D128": dict(B=1, H=1, Nq=1025, D=128),
    "Nq<Nk": dict(B=1, H=2, Nq=17, Nk=97, D=8),
    "Nq>Nk": dict(B=1, H=2, Nq=97, Nk=17, D=8),
    "Dv!=D": dict(B=1, H=2, Nq=65, D=40, Dv=24),
    "GQA-6-2": dict(B=2, H=6, Hkv=2, Nq=33, Nk=70, D=16),
    "MQA-4-1": dict(B=1, H=4, Hkv=1, Nq=40, D=8),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _mask(kind, q, k):
    B, H, Nq, Nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    g = torch.Generator().manual_seed(1)
    if kind == "none":
        return None
    if kind == "bool":  # per (batch, query, key), broadcast over heads
        return torch.rand(B, 1, Nq, Nk, generator=g) > 0.3
    if kind == "float":  # a per-head additive bias with some −inf
        bias = torch.randn(1, H, Nq, Nk, generator=g).to(q.dtype)
        return bias.masked_fill(torch.rand(1, H, Nq, Nk, generator=g) < 0.2, -torch.inf)
    raise AssertionError(kind)


def _run(backend, q, k, v, **kw):
    kw = {"finite_inputs": True, **kw}  # the inputs are random normals: the promise holds
    if backend == "sdpa":
        plan = make_plan(q, k, v, **kw)
        why = KERNELS["sdpa"].why_not(plan, *(to_4d(t) for t in (q, k, v)))
        if why is not None:
            pytest.skip(f"sdpa cannot: {why}")
    return qkv.attention(q, k, v, backend=backend, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_error_ratio(backend, case, causal, dtype):
    q, k, v = make_qkv(**CASES[case], dtype=dtype)
    out = _run(backend, q, k, v, causal=causal)
    ref = qkv.attention(q, k, v, causal=causal, backend="reference")
    assert out.dtype == dtype and out.shape == ref.shape
    assert_error_ratio(out, ref, golden(q, k, v, causal=causal))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", ["N97-D59", "Nq<Nk", "Nq>Nk", "GQA-6-2"])
def test_masked_forward_error_ratio(backend, case, causal, mask_kind, dtype):
    q, k, v = make_qkv(**CASES[case], dtype=dtype)
    mask = _mask(mask_kind, q, k)
    out = _run(backend, q, k, v, causal=causal, mask=mask)
    ref = qkv.attention(q, k, v, causal=causal, mask=mask, backend="reference")
    assert_error_ratio(out, ref, golden(q, k, v, causal=causal, mask=mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", ["N17-D40", "N97-D59", "Nq<Nk", "Nq>Nk", "Dv!=D", "GQA-6-2"])
def test_gradient_error_ratio(backend, case, causal, dtype):
    if backend == "sdpa" and dtype == torch.float32:
        pytest.skip(
            "torch SDPA's float32 backward is outside the 3× rule on some inputs (measured: up "
            "to 1.3× the allowance on ~3% of seeds); auto takes tiled's backward for float32"
        )
    q, k, v = make_qkv(**CASES[case], dtype=dtype, requires_grad=True)
    mask = _mask("bool", q, k) if case == "N97-D59" else None
    dout = torch.randn(
        golden(q, k, v, causal=causal).shape, generator=torch.Generator().manual_seed(2)
    )

    def grads(be, inputs, dt):
        out = _run(be, *inputs, causal=causal, mask=mask)
        return torch.autograd.grad(out, inputs, dout.to(dt))

    g64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    gold = grads("reference", g64, torch.float64)
    ref = grads("reference", (q, k, v), dtype)
    got = grads(backend, (q, k, v), dtype)
    for name, a, r, g in zip("qkv", got, ref, gold, strict=True):
        assert a.dtype == dtype
        assert_error_ratio(a, r, g, factor=3.0, what=f"d{name}")


@pytest.mark.parametrize("name", ["reference", "tiled-small", "tiled"])
def test_lse_matches_golden(name):
    q, k, v = make_qkv(B=2, H=6, Hkv=3, Nq=50, Nk=77, D=24)
    _, lse = qkv.attention(q, k, v, causal=True, backend=BACKENDS[name], return_lse=True)
    _, lse_ref = qkv.attention(q, k, v, causal=True, backend="reference", return_lse=True)
    g64 = [t.double() for t in (q, k, v)]
    _, lse_gold = qkv.attention(*g64, causal=True, backend="reference", return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (2, 6, 50)
    # Independent check of the golden itself: logsumexp of the masked, scaled scores.
    s = (g64[0] @ g64[1].repeat_interleave(2, dim=1).transpose(-1, -2)) / 24**0.5
    s = s.masked_fill(~torch.ones(50, 77, dtype=torch.bool).tril(77 - 50), -torch.inf)
    torch.testing.assert_close(lse_gold, torch.logsumexp(s, -1), rtol=0, atol=1e-12)
    assert_error_ratio(lse, lse_ref, lse_gold, what="lse")


def test_non_contiguous_inputs(backend):
    # (B, N, H, D) storage viewed as (B, H, N, D): the layout projections usually produce.
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 37, 4, 16, generator=g).transpose(1, 2)
    k = torch.randn(2, 23, 2, 16, generator=g).transpose(1, 2)
    v = torch.randn(2, 46, 2, 20, generator=g)[:, ::2].transpose(1, 2)[..., :12]  # strided
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out = qkv.attention(q, k, v, causal=True, backend=backend, finite_inputs=True)
    ref = qkv.attention(q, k, v, causal=True, backend="reference")
    assert_error_ratio(out, ref, golden(q, k, v, causal=True))


@pytest.mark.parametrize("rank", [2, 3])
def test_lower_rank_layouts(backend, rank):
    q, k, v = make_qkv(B=1, H=1 if rank == 2 else 3, Nq=19, Nk=23, D=8)
    squeeze = (lambda t: t[0, 0]) if rank == 2 else (lambda t: t[0])
    out, lse = qkv.attention(
        squeeze(q), squeeze(k), squeeze(v), causal=True, backend="reference", return_lse=True
    )
    got = _run(backend, squeeze(q), squeeze(k), squeeze(v), causal=True)
    assert got.shape == out.shape == (*squeeze(q).shape[:-1], 8)
    assert lse.shape == squeeze(q).shape[:-1]
    assert_error_ratio(got, out, squeeze(golden(q, k, v, causal=True)))
