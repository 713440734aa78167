"""The oracle itself, checked against the textbook formula written independently."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import qkv


def test_textbook_walkthrough_n4_d8_dk4():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(4, 8, generator=g, dtype=torch.float64)  # N=4 tokens, d=8
    Wq, Wk, Wv = (torch.randn(8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    Q, K, V = X @ Wq, X @ Wk, X @ Wv  # (4, 4) each: d_k = 4
    st = qkv.reference.steps(Q, K, V)
    assert st.S.shape == st.S_scaled.shape == st.A.shape == (4, 4)
    assert st.out.shape == (4, 4) and st.lse.shape == (4,)
    torch.testing.assert_close(st.S, Q @ K.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(st.S_scaled, Q @ K.T / 2.0, rtol=0, atol=1e-12)  # 1/√4
    A = torch.exp(st.S_scaled) / torch.exp(st.S_scaled).sum(-1, keepdim=True)
    torch.testing.assert_close(st.A, A, rtol=0, atol=1e-12)
    torch.testing.assert_close(st.A.sum(-1), torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(st.out, A @ V, rtol=0, atol=1e-12)
    torch.testing.assert_close(st.lse, torch.logsumexp(st.S_scaled, -1), rtol=0, atol=1e-12)
    torch.testing.assert_close(qkv.reference.attention(Q, K, V), st.out, rtol=0, atol=0)


def test_steps_is_frozen():
    st = qkv.reference.steps(torch.randn(3, 2), torch.randn(3, 2), torch.randn(3, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.A = None


def test_masked_entries_are_exactly_zero_and_minus_inf():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 5, 6, 3, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(6, 6, generator=g) > 0.5
    st = qkv.reference.steps(q, k, v, mask=mask, causal=True)
    allowed = mask & torch.ones(6, 6, dtype=torch.bool).tril()
    assert (st.A[..., ~allowed] == 0).all()
    assert torch.isneginf(st.S_scaled[..., ~allowed]).all()
    rows = allowed.any(-1)
    torch.testing.assert_close(
        st.A.sum(-1)[..., rows], torch.ones(2, 5, int(rows.sum()), dtype=torch.float64)
    )
    assert (st.A.sum(-1)[..., ~rows] == 0).all()


def test_grouped_heads_equal_repeated_heads():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 6, 5, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 7, 4, generator=g, dtype=torch.float64) for _ in range(2))
    grouped = qkv.reference.attention(q, k, v)
    repeated = qkv.reference.attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1))
    torch.testing.assert_close(grouped, repeated, rtol=0, atol=1e-14)


def test_float_mask_is_added_to_scaled_scores():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(4, 4, generator=g, dtype=torch.float64)
    st = qkv.reference.steps(q, k, v, mask=bias, scale=0.7)
    torch.testing.assert_close(st.S_scaled, q @ k.T * 0.7 + bias, rtol=0, atol=1e-14)
    torch.testing.assert_close(st.out, torch.softmax(q @ k.T * 0.7 + bias, -1) @ v)
