"""qkv.nn.SelfAttention and MultiHeadAttention against the formula and torch's module."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks
from qkv import nn as qnn


def test_self_attention_is_the_textbook_formula():
    torch.manual_seed(0)
    layer = qnn.SelfAttention(d_model=8, d_k=4).double()
    X = torch.randn(4, 8, dtype=torch.float64)
    Q, K, V = X @ layer.W_q, X @ layer.W_k, X @ layer.W_v
    A = torch.softmax(Q @ K.T / 2.0, dim=-1)
    out, weights = layer(X, return_weights=True)
    assert layer.W_q.shape == (8, 4) and out.shape == (4, 4)
    torch.testing.assert_close(out, A @ V, rtol=0, atol=1e-12)
    torch.testing.assert_close(weights, A, rtol=0, atol=1e-12)
    batched = layer(X.expand(3, 4, 8), causal=True)
    torch.testing.assert_close(batched[1], layer(X, causal=True), rtol=0, atol=0)


def test_self_attention_bias_and_dv():
    layer = qnn.SelfAttention(6, 3, d_v=5, bias=True)
    assert layer(torch.randn(2, 7, 6)).shape == (2, 7, 5)
    assert layer.b_v.shape == (5,)


def _manual_mha(m, x, context=None, causal=False):
    B, N, _ = x.shape
    src = x if context is None else context
    H, Hkv, hd = m.n_heads, m.n_kv_heads, m.head_dim
    q = m.q_proj(x).view(B, N, H, hd).transpose(1, 2)
    k = m.k_proj(src).view(B, -1, Hkv, hd).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    v = m.v_proj(src).view(B, -1, Hkv, hd).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    s = q @ k.transpose(-1, -2) / hd**0.5
    if causal:
        s = s.masked_fill(~torch.ones(N, k.shape[2], dtype=torch.bool).tril(), -torch.inf)
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, N, H * hd)
    return m.o_proj(o)


@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_multi_head_and_grouped_query_match_the_formula(n_kv):
    torch.manual_seed(1)
    m = qnn.MultiHeadAttention(32, 4, n_kv).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    torch.testing.assert_close(m(x, causal=True), _manual_mha(m, x, causal=True))
    ctx = torch.randn(2, 5, 32, dtype=torch.float64)
    torch.testing.assert_close(m(x, context=ctx), _manual_mha(m, x, context=ctx))
    assert m(x[0]).shape == (9, 32)  # unbatched


def test_masks_pass_straight_through():
    torch.manual_seed(2)
    m = qnn.MultiHeadAttention(16, 2).double()
    x = torch.randn(1, 20, 16, dtype=torch.float64)
    w = masks.sliding_window(3)
    torch.testing.assert_close(m(x, mask=w), m(x, mask=w.to_dense(20, 20)), rtol=0, atol=1e-12)
    _, weights = m(x, mask=w, return_weights=True)
    assert (weights[0, :, 0, 5:] == 0).all()


@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_gives_equal_outputs(bias):
    torch.manual_seed(3)
    ref = torch.nn.MultiheadAttention(24, 3, bias=bias, batch_first=True).double().eval()
    m = qnn.MultiHeadAttention.from_torch(ref).eval()
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    want = ref(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(m(x), want, rtol=0, atol=1e-12)
    causal = torch.ones(11, 11, dtype=torch.bool).triu(1)  # torch: True = masked
    want_causal = ref(x, x, x, attn_mask=causal, need_weights=False)[0]
    torch.testing.assert_close(m(x, causal=True), want_causal, rtol=0, atol=1e-12)


def test_dropout_only_in_training():
    torch.manual_seed(4)
    m = qnn.MultiHeadAttention(16, 2, dropout=0.5)
    x = torch.randn(1, 10, 16)
    m.eval()
    torch.testing.assert_close(m(x), m(x), rtol=0, atol=0)
    m.train()
    assert not torch.equal(m(x), m(x))


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (
            lambda: qnn.MultiHeadAttention(30, 4),
            ValueError,
            r"d_model=30 is not divisible by n_heads=4",
        ),
        (
            lambda: qnn.MultiHeadAttention(32, 4, 3),
            ValueError,
            r"n_heads=4 must be a multiple of n_kv_heads=3",
        ),
        (lambda: qnn.MultiHeadAttention(32, 0), ValueError, r"n_heads must be a positive int"),
        (
            lambda: qnn.MultiHeadAttention(32, 4, dropout=1.0),
            ValueError,
            r"dropout=1.0 is out of range",
        ),
        (lambda: qnn.SelfAttention(8, 0), ValueError, r"d_k must be a positive int"),
    ],
)
def test_bad_construction(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_wrong_input_width_and_mask_shape():
    m = qnn.MultiHeadAttention(16, 2)
    with pytest.raises(
        ValueError,
        match=r"x must have shape .* with d_model=16, got \(2, 5, 12\)",
    ):
        m(torch.randn(2, 5, 12))
    with pytest.raises(ValueError, match=r"mask of shape \(4, 4\) is not broadcastable"):
        m(torch.randn(2, 5, 16), mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"x must have shape"):
        qnn.SelfAttention(8, 4)(torch.randn(3, 7))


def test_backend_is_used():
    m = qnn.MultiHeadAttention(16, 2, backend="tiled")
    with pytest.raises(NotImplementedError, match="tiled"):
        m(torch.randn(1, 4, 16), return_weights=True)
    assert isinstance(qkv.nn.MultiHeadAttention, type)
