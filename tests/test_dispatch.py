"""`auto` picks the fastest exact backend and explains every rejection."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.kernels import sdpa
from qkv.plan import make_plan

from .helpers import cpu_kernel_or, make_qkv


@pytest.fixture
def qkv3():
    return make_qkv(B=1, H=4, Nq=9, Nk=12, D=8)


def test_plain_request_goes_to_sdpa(qkv3):
    d = qkv.dispatch(*qkv3)
    assert d.name == "sdpa"
    assert set(d.reasons) == {"cpu", "triton", "tiled", "reference"}
    assert "sdpa is preferred" in d.reasons["tiled"]
    if cpu_kernel_or("") == "cpu":  # a problem this small: SDPA keeps it (measured faster)
        assert "torch SDPA is faster below" in d.reasons["cpu"]


def test_causal_with_nq_lt_nk_skips_sdpa_and_nq_gt_nk_takes_it(qkv3):
    # Bottom-right causality with Nq < Nk would reach torch SDPA only as a dense Nq×Nk mask;
    # with Nq > Nk it is a square causal problem on the last Nk rows (no mask).
    q, k, v = qkv3  # Nq = 9 < Nk = 12
    d = qkv.dispatch(q, k, v, causal=True, finite_inputs=True)
    assert d.name == cpu_kernel_or("tiled")
    plan = make_plan(q, k, v, causal=True, finite_inputs=True)
    assert "bottom-right" in sdpa.auto_passes_over(plan)
    for a, b in ((q, k), (k, q)):
        d = qkv.dispatch(b, a, a, causal=True, finite_inputs=True)
        assert d.name == ("sdpa" if b is k else cpu_kernel_or("tiled"))
        got = qkv.attention(b, a, a, causal=True, backend="sdpa", finite_inputs=True)
        ref = qkv.attention(b, a, a, causal=True, backend="reference")
        torch.testing.assert_close(got, ref)


def test_small_requests_sdpa_would_not_get_stay_on_the_compiled_kernel():
    # Below its size threshold the compiled kernel hands SDPA what `auto` would give SDPA, and
    # nothing else: float32 gradients go past SDPA, and tiled is slower than the kernel.
    q, k, v = make_qkv(B=1, H=2, Nq=16, D=8, requires_grad=True)
    assert qkv.dispatch(q, k, v).name == cpu_kernel_or("tiled")
    with torch.no_grad():
        assert qkv.dispatch(q, k, v).name == "sdpa"
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    assert qkv.dispatch(qb, kb, vb).name == "sdpa"  # 16-bit gradients: SDPA's bound holds


@pytest.mark.parametrize(
    "kwargs,chosen,why_not_sdpa",
    [
        (dict(return_lse=True), "tiled", "returns no lse"),
        (dict(dropout_p=0.2), "tiled", "draws its own dropout mask"),
        (dict(return_weights=True), "reference", "cannot return the attention weights"),
    ],
)
def test_auto_reasons(qkv3, kwargs, chosen, why_not_sdpa):
    chosen = cpu_kernel_or(chosen) if chosen == "tiled" else chosen
    d = qkv.dispatch(*qkv3, **kwargs)
    assert d.name == chosen
    if chosen == "cpu":  # chosen before sdpa is asked; asked by name, sdpa says why not
        assert d.reasons["sdpa"] == "cpu is preferred (faster) and can run it"
        with pytest.raises(NotImplementedError, match=why_not_sdpa):
            qkv.dispatch(*qkv3, backend="sdpa", **kwargs)
    else:
        assert why_not_sdpa in d.reasons["sdpa"]
    text = str(d)
    assert text.startswith(f"chosen: {chosen}") and "not sdpa: " in text


def test_nan_in_masked_values_steers_auto_away_from_sdpa(qkv3):
    q, k, v = qkv3
    v = v.clone()
    v[:, :, -1] = float("nan")
    d = qkv.dispatch(q, k, v, causal=True)
    assert d.name == cpu_kernel_or("tiled")
    assert "NaN/inf" in sdpa.refusal(make_plan(q, k, v, causal=True))
    assert qkv.dispatch(q, k, v).name == "sdpa"  # nothing masked: NaN propagates either way


def test_float_mask_of_another_dtype_goes_to_tiled(qkv3):
    q, k, v = qkv3
    bias = torch.zeros(9, 12, dtype=torch.float64)
    d = qkv.dispatch(q, k, v, mask=bias)
    assert d.name == "tiled" and "float mask of q's dtype" in d.reasons["sdpa"]


def test_float_mask_with_grad_goes_to_reference(qkv3):
    q, k, v = qkv3
    bias = torch.zeros(9, 12, requires_grad=True)
    lse_request = qkv.dispatch(q, k, v, mask=bias, return_lse=True)
    assert lse_request.name == "reference"
    assert "does not differentiate a float mask" in lse_request.reasons["tiled"]
    out = qkv.attention(q, k, v, mask=bias, return_lse=True)[0]
    out.sum().backward()
    assert bias.grad is not None


def test_named_backend_decision(qkv3):
    d = qkv.dispatch(*qkv3, backend="tiled")
    assert d.name == "tiled"
    assert d.reasons == {
        "cpu": "backend='tiled' was asked for",
        "sdpa": "backend='tiled' was asked for",
        "triton": "backend='tiled' was asked for",
        "reference": "backend='tiled' was asked for",
    }


def test_auto_result_equals_chosen_backend(qkv3):
    q, k, v = qkv3
    for kwargs in (dict(), dict(return_lse=True), dict(causal=True, return_lse=True)):
        name = qkv.dispatch(q, k, v, **kwargs).name
        a = qkv.attention(q, k, v, **kwargs)
        b = qkv.attention(q, k, v, backend=name, **kwargs)
        pairs = zip(
            a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,), strict=True
        )
        for x, y in pairs:
            torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("isa", ["amx", "avx512", "avx2", "portable"])
def test_without_avx512_plain_forwards_go_to_sdpa(isa, monkeypatch):
    # Where the kernel's forward was measured slower than SDPA's (no AVX-512: avx2 or portable
    # path; AMX in float16, which has no tile path while SDPA's own products use the tiles), auto
    # hands SDPA the plain forward requests it would take, and with AMX float16 gradients too;
    # float32 and bfloat16 gradients, decoding and structured masks stay on the kernel, and with
    # AMX float32 and bfloat16 forwards.
    if cpu_kernel_or("") != "cpu":
        pytest.skip("the compiled CPU kernel is not available here")
    from qkv.kernels import cpu_backend

    monkeypatch.setattr(cpu_backend, "kernel_status", lambda: (isa, None))
    fast = isa in ("avx512", "amx")
    q, k, v = make_qkv(B=1, H=2, Nq=256, D=16)
    d = qkv.dispatch(q, k, v)
    assert d.name == ("cpu" if fast else "sdpa")
    if not fast:
        assert f"its {isa} path" in d.reasons["cpu"]
    assert qkv.dispatch(q, k, v, causal=True, finite_inputs=True).name == d.name
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    assert qkv.dispatch(qb, kb, vb).name == ("cpu" if fast else "sdpa")  # bf16
    qh, kh, vh = (t.half() for t in (q, k, v))
    assert qkv.dispatch(qh, kh, vh).name == ("cpu" if isa == "avx512" else "sdpa")  # fp16
    qb, kb, vb = (t.requires_grad_() for t in (qb, kb, vb))
    assert qkv.dispatch(qb, kb, vb).name == "cpu"  # bf16 gradients
    qh, kh, vh = (t.detach().half().requires_grad_() for t in (qb, kb, vb))
    assert qkv.dispatch(qh, kh, vh).name == ("sdpa" if isa == "amx" else "cpu")  # fp16 gradients
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    assert qkv.dispatch(qf, kf, vf).name == "cpu"  # float32 gradients never go to SDPA
    qd, kd, vd = make_qkv(B=1, H=2, Nq=1, Nk=65536, D=16)
    assert qkv.dispatch(qd, kd, vd).name == "cpu"  # decoding
    assert qkv.dispatch(q, k, v, mask=qkv.masks.sliding_window(8)).name == "cpu"
