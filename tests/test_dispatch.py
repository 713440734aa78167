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
        assert "torch SDPA was measured faster" in d.reasons["cpu"]
        assert "crossovers: default" in d.reasons["cpu"] and d.basis.startswith("default")


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
        if b is k:  # Nq > Nk: SDPA may take it (the measured crossover decides against cpu)
            assert (
                sdpa.auto_passes_over(make_plan(b, a, a, causal=True, finite_inputs=True)) is None
            )
            assert d.name in ("sdpa", cpu_kernel_or("sdpa"))
        else:
            assert d.name == cpu_kernel_or("tiled")
        got = qkv.attention(b, a, a, causal=True, backend="sdpa", finite_inputs=True)
        ref = qkv.attention(b, a, a, causal=True, backend="reference")
        torch.testing.assert_close(got, ref)


def test_requests_sdpa_would_not_get_stay_on_the_compiled_kernel(monkeypatch):
    # Where the table says SDPA is faster, the compiled kernel hands SDPA what `auto` would
    # give SDPA, and nothing else: float32 gradients go past SDPA (tiled is slower than the
    # kernel).
    from qkv.kernels.cpu import crossover

    classes = [f"dense/{t}/{p}/D64" for t in ("float32", "bfloat16") for p in ("fwd", "fwd+bwd")]
    slower = {c: ((1.0, 0.5),) for c in classes}
    table = crossover.Table("any", "default", "a test", slower)
    monkeypatch.setattr(crossover, "table", lambda isa: table)
    crossover.clear()
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


@pytest.mark.parametrize("isa", ["amx", "avx512bf16", "avx512", "avx2", "portable"])
def test_each_path_follows_its_measured_crossovers(isa, monkeypatch):
    # On requests SDPA can run exactly, auto takes the winner of the path's table (the
    # defaults here: conftest sets QKV_CROSSOVERS=default); the others stay on the kernel
    # whatever the table says: float32 gradients, structured masks, causal with Nq < Nk.
    if cpu_kernel_or("") != "cpu":
        pytest.skip("the compiled CPU kernel is not available here")
    from qkv.kernels.cpu import backend as cpu_backend
    from qkv.kernels.cpu import crossover

    monkeypatch.setattr(cpu_backend, "kernel_status", lambda: (isa, None))
    table = crossover.default_table(isa)
    assert table is not None
    x = make_qkv(B=1, H=2, Nq=256, D=16)
    dec = make_qkv(B=1, H=2, Nq=1, Nk=4096, D=16)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for grad in (False, True):
            for (q, k, v), causal in ((x, False), (x, True), (dec, False)):
                q, k, v = (t.detach().to(dtype).requires_grad_(grad) for t in (q, k, v))
                d = qkv.dispatch(q, k, v, causal=causal, finite_inputs=True)
                plan = make_plan(q, k, v, causal=causal, finite_inputs=True)
                if grad and dtype == torch.float32:
                    assert d.name == "cpu"  # float32 gradients never go to SDPA
                    continue
                # a class the tune does not measure (decoding with gradients): the kernel
                want = table.winner(crossover.class_of(plan), crossover.work_of(plan)) or "cpu"
                assert d.name == want, (dtype, grad, causal, plan.q_len)
                assert d.basis is not None and d.basis.startswith("default")
    q, k, v = x
    assert qkv.dispatch(q, k, v, mask=qkv.masks.sliding_window(8)).name == "cpu"
    assert qkv.dispatch(q[:, :, :100], k, v, causal=True, finite_inputs=True).name == "cpu"
