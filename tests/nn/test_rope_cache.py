"""RotaryEmbedding and KVCache: decoding through the cache equals one causal forward."""

from __future__ import annotations

import pytest
import torch

from qkv import masks
from qkv import nn as qnn


def test_rope_scores_depend_on_relative_position_only():
    rope = qnn.RotaryEmbedding(8)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)

    def score(p, pk):
        return (rope(q, torch.tensor([p])) * rope(k, torch.tensor([pk]))).sum()

    torch.testing.assert_close(score(3, 1), score(10, 8))
    torch.testing.assert_close(score(0, 0), (q * k).sum())  # position 0 is the identity


def test_rope_matches_the_llama_formula():
    rope = qnn.RotaryEmbedding(4, base=100.0)
    x = torch.arange(8.0).view(1, 1, 2, 4)
    pos = torch.tensor([0, 5])
    inv = 1.0 / 100.0 ** (torch.arange(0, 4, 2).float() / 4)
    ang = torch.cat([pos[:, None] * inv] * 2, -1)
    rot = torch.cat([-x[..., 2:], x[..., :2]], -1)
    torch.testing.assert_close(rope(x, pos), x * ang.cos() + rot * ang.sin())


def test_partial_rotary_leaves_the_rest():
    rope = qnn.RotaryEmbedding(4)
    x = torch.randn(1, 2, 3, 10)
    y = rope(x, torch.arange(3))
    torch.testing.assert_close(y[..., 4:], x[..., 4:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="dim must be a positive even int"):
        qnn.RotaryEmbedding(5)


def _decode(m, x, cache, prefill):
    outs = [m(x[:, :prefill], cache=cache)]
    outs += [m(x[:, i : i + 1], cache=cache) for i in range(prefill, x.shape[1])]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("n_kv,rope", [(4, False), (2, True), (1, True)])
def test_decoding_through_the_cache_equals_a_causal_forward(n_kv, rope):
    torch.manual_seed(0)
    m = qnn.MultiHeadAttention(32, 4, n_kv, rope=rope).double().eval()
    x = torch.randn(2, 17, 32, dtype=torch.float64)
    cache = qnn.KVCache(2, 17, n_kv, 8, dtype=torch.float64)
    torch.testing.assert_close(_decode(m, x, cache, 5), m(x, causal=True), rtol=0, atol=1e-12)
    assert cache.length == 17
    cache.reset()
    assert cache.length == 0
    torch.testing.assert_close(_decode(m, x, cache, 1), m(x, causal=True), rtol=0, atol=1e-12)


@pytest.mark.parametrize("window,prefill", [(4, 6), (4, 2), (1, 3), (8, 17)])
def test_windowed_cache_equals_a_sliding_window_forward(window, prefill):
    torch.manual_seed(1)
    m = qnn.MultiHeadAttention(16, 2, rope=True).double().eval()
    x = torch.randn(1, 17, 16, dtype=torch.float64)
    cache = qnn.KVCache(1, 10, 2, 8, window=window, dtype=torch.float64)
    want = m(x, mask=masks.sliding_window(window - 1, 0))
    torch.testing.assert_close(_decode(m, x, cache, prefill), want, rtol=0, atol=1e-12)
    assert cache.keys.shape[2] == window  # the ring never grows


def test_windowed_cache_takes_a_bool_mask_over_its_keys():
    torch.manual_seed(2)
    window, prefill = 4, 6
    m = qnn.MultiHeadAttention(16, 2, rope=True).double().eval()
    x = torch.randn(1, prefill + 1, 16, dtype=torch.float64)
    cache = qnn.KVCache(1, 10, 2, 8, window=window, dtype=torch.float64)
    m(x[:, :prefill], cache=cache)
    keep = torch.ones(1, 1, 1, window, dtype=torch.bool)
    keep[..., 1] = False  # the step may not see the window's second key
    got = m(x[:, prefill:], mask=keep, cache=cache)
    i = torch.arange(prefill + 1)
    dense = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    dense[prefill, prefill + 1 - window + 1] = False
    want = m(x, mask=dense)[:, -1:]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="takes a bool mask or a qkv Mask, not a float mask"):
        m(x[:, prefill:], mask=torch.zeros(1, 1, 1, window, dtype=torch.float64), cache=cache)
    assert cache.length == prefill + 1  # the refused step cached nothing


def test_cache_overflow_is_an_error():
    m = qnn.MultiHeadAttention(16, 2)
    cache = qnn.KVCache(1, 4, 2, 8)
    m(torch.randn(1, 3, 16), cache=cache)
    with pytest.raises(
        ValueError, match=r"KVCache overflow: 3 cached \+ 2 new positions exceed max_len=4"
    ):
        m(torch.randn(1, 2, 16), cache=cache)
    assert cache.length == 3  # nothing lost


def test_cache_shape_errors():
    cache = qnn.KVCache(2, 8, 2, 4)
    with pytest.raises(ValueError, match=r"k must have shape \(B=2, Hkv=2, n, head_dim=4\)"):
        cache.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    with pytest.raises(ValueError, match=r"window must be a positive int or None"):
        qnn.KVCache(1, 8, 1, 4, window=0)
    with pytest.raises(ValueError, match="do not pass context"):
        qnn.MultiHeadAttention(8, 2)(
            torch.randn(1, 2, 8), context=torch.randn(1, 3, 8), cache=qnn.KVCache(1, 8, 2, 4)
        )
