"""The semantics table's edge cases (docs/design.md, section 6): empty rows, garbage in masked
slots, huge scores, zero-length sequences, low precision."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks
from qkv.kernels import BACKENDS
from qkv.kernels.tiled.fused import FusedStrips
from qkv.plan import make_plan

from .helpers import BACKENDS as TEST_BACKENDS
from .helpers import assert_error_ratio, golden, make_qkv

LSE_BACKENDS = ["reference", "tiled", qkv.kernels.TiledBackend(8, 16), "cpu"]
# The compiled CPU kernel ("cpu") refuses float masks (auto gives them to tiled): it joins the
# tests below for bool masks, structured masks and causality.
NO_FLOAT_MASK = {"cpu"}


def _fully_masked_cases():
    q, k, v = make_qkv(B=1, H=2, Nq=20, Nk=24, D=8)
    bool_mask = torch.ones(20, 24, dtype=torch.bool)
    bool_mask[[0, 7, 19]] = False
    bias = torch.zeros(20, 24).masked_fill(~bool_mask, -torch.inf)
    return {
        "bool": (q, k, v, dict(mask=bool_mask), [0, 7, 19]),
        "float": (q, k, v, dict(mask=bias), [0, 7, 19]),
        # bottom-right causal with Nq > Nk: the first Nq − Nk queries see no key at all
        "causal-Nq>Nk": (*make_qkv(B=1, H=2, Nq=24, Nk=20, D=8), dict(causal=True), [0, 1, 2, 3]),
    }


@pytest.mark.parametrize("case", ["bool", "float", "causal-Nq>Nk"])
def test_fully_masked_rows_are_zero_with_zero_grads(backend, case):
    q, k, v, kw, rows = _fully_masked_cases()[case]
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = qkv.attention(q, k, v, backend=backend, finite_inputs=True, **kw)
    assert torch.isfinite(out).all()
    assert (out[:, :, rows] == 0).all()
    out.backward(torch.randn_like(out))
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, rows] == 0).all()
    assert_error_ratio(out.detach(), out.detach(), golden(q, k, v, **kw))


@pytest.mark.parametrize("be", LSE_BACKENDS, ids=str)
@pytest.mark.parametrize("case", ["bool", "float", "causal-Nq>Nk"])
def test_fully_masked_rows_have_lse_minus_inf(be, case):
    if case == "float" and be in NO_FLOAT_MASK:
        pytest.skip(f"{be} refuses float masks")
    q, k, v, kw, rows = _fully_masked_cases()[case]
    q = q.clone().requires_grad_()
    out, lse = qkv.attention(q, k, v, backend=be, return_lse=True, **kw)
    assert torch.isneginf(lse[:, :, rows]).all()
    others = [i for i in range(q.shape[2]) if i not in rows]
    assert torch.isfinite(lse[:, :, others]).all()
    (out.sum() + lse[:, :, others].sum()).backward()
    assert torch.isfinite(q.grad).all() and (q.grad[:, :, rows] == 0).all()


@pytest.mark.parametrize("case", ["bool", "causal-Nq>Nk"])
def test_fully_masked_rows_are_zero_with_zero_grads_on_the_cpu_kernel(case):
    test_fully_masked_rows_are_zero_with_zero_grads("cpu", case)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), 1e30])
@pytest.mark.parametrize("backend", [*TEST_BACKENDS.values(), "cpu"], ids=[*TEST_BACKENDS, "cpu"])
def test_garbage_in_padded_keys_and_values_does_not_leak(backend, garbage):
    # The last 5 key positions are padding (an unused KV-cache slot, say): masked for every row.
    q, k, v = make_qkv(B=2, H=2, Nq=13, Nk=21, D=8)
    mask = torch.ones(21, dtype=torch.bool)
    mask[-5:] = False
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, -5:] = garbage
    v_bad[:, :, -5:] = garbage
    finite = garbage == 1e30  # a huge value is finite: promise it, and sdpa may run
    if backend == "sdpa" and not finite:
        with pytest.raises(NotImplementedError, match="NaN/inf"):
            qkv.attention(q, k_bad, v_bad, mask=mask, backend=backend)
        return
    out = qkv.attention(q, k_bad, v_bad, mask=mask, backend=backend, finite_inputs=finite)
    ref = qkv.attention(q, k, v, mask=mask, backend="reference")
    assert_error_ratio(out, ref, golden(q, k, v, mask=mask))


@pytest.mark.parametrize("garbage", [float("nan"), float("inf")])
@pytest.mark.parametrize("be", ["tiled", "cpu", "auto"])
def test_garbage_hidden_by_a_structured_mask_leaks_into_no_output_or_gradient(be, garbage):
    # Padding as a qkv.masks.Mask: keys 17 … 20 of batch element 0 sit in a PARTIAL tile, so
    # the mask is applied pair by pair (a NaN score must be replaced, not added to); no promise.
    q, k, v = make_qkv(B=2, H=2, Nq=13, Nk=21, D=8)
    mask = masks.padding([17, 21])
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[0, :, 17:, 1] = garbage
    v_bad[0, :, 17:] = garbage
    results = []
    for kk, vv in ((k, v), (k_bad, v_bad)):
        t = [x.clone().requires_grad_() for x in (q, kk, vv)]
        out, lse = qkv.attention(*t, mask=mask, backend=be, return_lse=True)
        grads = torch.autograd.grad((out.sum(), lse.sum()), t)
        results.append((out, lse, grads[0], grads[1][:, :, :17], grads[2][:, :, :17]))
    for clean, dirty in zip(*results, strict=True):
        assert torch.isfinite(dirty).all()
        torch.testing.assert_close(dirty, clean, rtol=0, atol=0)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf")])
@pytest.mark.parametrize("be", ["tiled", qkv.kernels.TiledBackend(4, 8), "auto"], ids=str)
def test_garbage_behind_a_float_mask_leaks_into_no_output_or_gradient(be, garbage):
    # A −inf column of an additive bias excludes key 5 from every row, in tiles the layout
    # keeps whole (a bias never empties a tile): its NaN key and value must reach nothing.
    q, k, v = make_qkv(B=1, H=2, Nq=6, Nk=9, D=4)
    bias = torch.zeros(6, 9)
    bias[:, 5] = -torch.inf
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, 5] = garbage
    v_bad[:, :, 5] = garbage
    results = []
    for kk, vv in ((k, v), (k_bad, v_bad)):
        t = [x.clone().requires_grad_() for x in (q, kk, vv)]
        out = qkv.attention(*t, mask=bias, backend=be)
        grads = torch.autograd.grad(out.sum(), t)
        keep = [0, 1, 2, 3, 4, 6, 7, 8]
        results.append((out, grads[0], grads[1][:, :, keep], grads[2][:, :, keep]))
    for clean, dirty in zip(*results, strict=True):
        assert torch.isfinite(dirty).all()
        torch.testing.assert_close(dirty, clean)


@pytest.mark.parametrize("be", ["reference", "tiled", qkv.kernels.TiledBackend(4, 8)], ids=str)
def test_nan_value_reaches_only_rows_that_see_it(be):
    # Causal: key 9 is visible to rows ≥ 9 only. A NaN in v[9] must poison exactly those rows.
    q, k, v = make_qkv(B=1, H=2, Nq=16, D=8)
    v_bad = v.clone()
    v_bad[:, :, 9, 3] = float("nan")
    out = qkv.attention(q, k, v_bad, causal=True, backend=be)
    assert torch.isfinite(out[:, :, :9]).all()
    assert torch.isnan(out[:, :, 9:, 3]).all()
    assert torch.isfinite(out[:, :, 9:, [0, 1, 2, 4, 5, 6, 7]]).all()
    ref = qkv.attention(q, k, v, causal=True, backend="reference")
    assert_error_ratio(out[:, :, :9], ref[:, :, :9], golden(q, k, v, causal=True)[:, :, :9])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scores_near_1e4_do_not_overflow(backend, dtype):
    q, k, v = make_qkv(B=1, H=2, Nq=40, D=16, dtype=dtype)
    q = q * 100  # scaled scores |S·scale| reach ~1e4
    k = k * 25
    out = qkv.attention(q, k, v, causal=True, backend=backend, finite_inputs=True)
    ref = qkv.attention(q, k, v, causal=True, backend="reference")
    gold = golden(q, k, v, causal=True)
    s = (q.double() @ k.double().transpose(-1, -2)).abs().max().item() / 4
    assert s > 5e3, s
    assert_error_ratio(out, ref, gold)


@pytest.mark.parametrize("nq,nk", [(0, 7), (7, 0), (0, 0)])
def test_zero_length_sequences(backend, nq, nk):
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=nq, Nk=nk, D=8, Dv=6, requires_grad=True)
    out = qkv.attention(q, k, v, causal=True, backend=backend, finite_inputs=True)
    assert out.shape == (2, 4, nq, 6)
    assert (out == 0).all()
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and (t.grad == 0).all()


@pytest.mark.parametrize("be", LSE_BACKENDS, ids=str)
def test_zero_keys_give_lse_minus_inf(be):
    q, k, v = make_qkv(B=1, H=2, Nq=5, Nk=0, D=8)
    _, lse = qkv.attention(q, k, v, backend=be, return_lse=True)
    assert lse.shape == (1, 2, 5) and torch.isneginf(lse).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("be", LSE_BACKENDS, ids=str)
def test_low_precision_returns_input_dtype_and_fp32_lse(be, dtype):
    q, k, v = make_qkv(B=1, H=2, Nq=30, D=8, dtype=dtype)
    out, lse = qkv.attention(q, k, v, backend=be, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    _, lse_gold = qkv.attention(*(t.double() for t in (q, k, v)), return_lse=True)
    # lse is accumulated in fp32: it must be far closer to the golden than dtype rounding.
    assert (lse.double() - lse_gold).abs().max() < 1e-4


@pytest.mark.parametrize("nk", [1, 2, 8, 15, 16, 40])
def test_nan_in_a_query_row_reaches_that_row_on_every_backend(backend, nk):
    # torch's CPU SDPA kernel returned zeros for this row when Nk < 16 (auto picked it).
    q, k, v = make_qkv(B=1, H=1, Nq=8, Nk=nk, D=8)
    q[0, 0, 0, 0] = float("nan")
    out = qkv.attention(q, k, v, backend=backend)
    assert torch.isnan(out[0, 0, 0]).all()
    assert torch.isfinite(out[0, 0, 1:]).all()


@pytest.mark.parametrize("width", [4, 8, 16])
def test_nan_in_a_query_row_reaches_it_through_narrow_fused_strips(width):
    # Documents of `width` tokens on tiles of that size: FULL strips that see < 16 keys, which
    # torch's fused op (the tiled backend's fast forward) answered with zeros.
    fused = qkv.kernels.TiledBackend(width, width, fused=FusedStrips(rows=16))
    q, k, v = make_qkv(B=1, H=2, Nq=48, D=8)
    q[0, 0, 9, 0] = float("nan")
    m = masks.document([width] * (48 // width))
    with torch.no_grad():  # k, v finite (the NaN is in q): the fused path runs
        out = qkv.attention(q, k, v, mask=m, backend=fused, finite_inputs=True)
    assert torch.isnan(out[0, 0, 9]).all()
    assert int(torch.isnan(out).sum()) == 8  # only that row


@pytest.mark.parametrize("garbage", [float("nan"), float("inf")])
def test_garbage_key_hidden_by_a_float_minus_inf_does_not_leak(backend, garbage):
    # NaN + (−inf) is NaN: a float mask's −inf must exclude the pair whatever its score.
    q, k, v = make_qkv(B=2, H=2, Nq=13, Nk=21, D=8)
    bias = torch.randn(1, 2, 13, 21, generator=torch.Generator().manual_seed(4))
    bias[..., 6] = -torch.inf  # key 6 hidden from every row
    k_bad = k.clone()
    k_bad[:, :, 6] = garbage
    if backend == "sdpa":
        with pytest.raises(NotImplementedError, match="NaN/inf"):
            qkv.attention(q, k_bad, v, mask=bias, backend=backend)
        return
    out = qkv.attention(q, k_bad, v, mask=bias, backend=backend)
    ref = qkv.attention(q, k, v, mask=bias, backend="reference")
    assert_error_ratio(out, ref, golden(q, k, v, mask=bias))


@pytest.mark.parametrize("be", ["tiled", qkv.kernels.TiledBackend(4, 8)], ids=str)
def test_garbage_key_hidden_by_a_float_mask_keeps_gradients_finite(be):
    q, k, v = make_qkv(B=1, H=2, Nq=13, Nk=21, D=8, requires_grad=True)
    bias = torch.zeros(13, 21)
    bias[:, 6] = -torch.inf
    k_bad = k.detach().clone()
    k_bad[:, :, 6] = float("nan")
    k_bad.requires_grad_()
    out = qkv.attention(q, k_bad, v, mask=bias, backend=be)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k_bad, v))
    assert torch.isfinite(dq).all() and torch.isfinite(dv).all()
    assert torch.isfinite(dk[:, :, [i for i in range(21) if i != 6]]).all()


@pytest.mark.parametrize("nq,nk", [(8191, 8192), (40, 4096), (9, 5)])
def test_causal_with_nq_not_nk_never_builds_an_nq_by_nk_mask(monkeypatch, nq, nk):
    # auto handed torch SDPA a dense Nq×Nk bool mask for bottom-right causality (+337 MB at
    # Nq = 8191, Nk = 8192). Record every mask that reaches torch's SDPA.
    import torch.nn.functional as F

    seen = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    q, k, v = (torch.randn(1, 1, n, 4) for n in (nq, nk, nk))
    decision = qkv.dispatch(q, k, v, causal=True, finite_inputs=True)
    with torch.no_grad():
        out = qkv.attention(q, k, v, causal=True, finite_inputs=True)
    assert all(m is None for m in seen), [tuple(m.shape) for m in seen if m is not None]
    if nq < nk:
        # (the compiled CPU kernel, where built, comes first and sdpa is not asked)
        plan = make_plan(q, k, v, causal=True, finite_inputs=True)
        assert decision.name != "sdpa" and "bottom-right" in BACKENDS["sdpa"].auto_skip(plan)
    if nq <= 64:  # small enough to check against the formula
        ref = qkv.attention(q, k, v, causal=True, backend="reference")
        assert_error_ratio(out, ref, golden(q, k, v, causal=True))
