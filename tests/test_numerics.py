"""The semantics table's edge cases (DESIGN.md §2): empty rows, garbage in masked slots,
huge scores, zero-length sequences, low precision."""

from __future__ import annotations

import pytest
import torch

import qkv

from .helpers import assert_error_ratio, golden, make_qkv

LSE_BACKENDS = ["reference", "tiled", qkv.kernels.TiledBackend(8, 16)]


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
    out = qkv.attention(q, k, v, backend=backend, **kw)
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
    q, k, v, kw, rows = _fully_masked_cases()[case]
    q = q.clone().requires_grad_()
    out, lse = qkv.attention(q, k, v, backend=be, return_lse=True, **kw)
    assert torch.isneginf(lse[:, :, rows]).all()
    others = [i for i in range(q.shape[2]) if i not in rows]
    assert torch.isfinite(lse[:, :, others]).all()
    (out.sum() + lse[:, :, others].sum()).backward()
    assert torch.isfinite(q.grad).all() and (q.grad[:, :, rows] == 0).all()


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), 1e30])
def test_garbage_in_padded_keys_and_values_does_not_leak(backend, garbage):
    # The last 5 key positions are padding (an unused KV-cache slot, say): masked for every row.
    q, k, v = make_qkv(B=2, H=2, Nq=13, Nk=21, D=8)
    mask = torch.ones(21, dtype=torch.bool)
    mask[-5:] = False
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, -5:] = garbage
    v_bad[:, :, -5:] = garbage
    if backend == "sdpa" and garbage != 1e30:
        with pytest.raises(NotImplementedError, match="NaN/inf"):
            qkv.attention(q, k_bad, v_bad, mask=mask, backend=backend)
        return
    out = qkv.attention(q, k_bad, v_bad, mask=mask, backend=backend)
    ref = qkv.attention(q, k, v, mask=mask, backend="reference")
    assert_error_ratio(out, ref, golden(q, k, v, mask=mask))


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
    out = qkv.attention(q, k, v, causal=True, backend=backend)
    ref = qkv.attention(q, k, v, causal=True, backend="reference")
    gold = golden(q, k, v, causal=True)
    s = (q.double() @ k.double().transpose(-1, -2)).abs().max().item() / 4
    assert s > 5e3, s
    assert_error_ratio(out, ref, gold)


@pytest.mark.parametrize("nq,nk", [(0, 7), (7, 0), (0, 0)])
def test_zero_length_sequences(backend, nq, nk):
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=nq, Nk=nk, D=8, Dv=6, requires_grad=True)
    out = qkv.attention(q, k, v, causal=True, backend=backend)
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
