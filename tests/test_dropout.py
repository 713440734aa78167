"""Dropout: repeatable under torch.manual_seed, identical across backends and tilings, the
backward sees the forward's mask, and the mask has the right statistics."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.dropout import keep_mask
from qkv.kernels import TiledBackend

from .helpers import make_qkv

DROPOUT_BACKENDS = ["reference", "tiled", TiledBackend(8, 16), "auto"]


def _seeded(seed, backend, q, k, v, **kw):
    torch.manual_seed(seed)
    return qkv.attention(q, k, v, backend=backend, **kw)


@pytest.mark.parametrize("be", DROPOUT_BACKENDS, ids=str)
def test_manual_seed_repeats_dropout(be):
    q, k, v = make_qkv(B=1, H=2, Nq=33, D=8)
    a = _seeded(7, be, q, k, v, dropout_p=0.3)
    b = _seeded(7, be, q, k, v, dropout_p=0.3)
    c = _seeded(8, be, q, k, v, dropout_p=0.3)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)
    assert not torch.equal(a, qkv.attention(q, k, v))


@pytest.mark.parametrize("be", ["tiled", TiledBackend(8, 16), TiledBackend(5, 3)], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_dropout_equals_reference_forward_and_backward(be, causal):
    # Same seed, different tilings: the mask depends on (seed, b, h, i, j) only.
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=29, Nk=37, D=8, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(29, 37, generator=torch.Generator().manual_seed(1)) > 0.2
    outs, grads = [], []
    for backend in ("reference", be):
        out, lse = _seeded(
            3, backend, q, k, v, dropout_p=0.4, causal=causal, mask=mask, return_lse=True
        )
        g = torch.autograd.grad((out * torch.linspace(-1, 1, 8)).sum() + lse.sum(), (q, k, v))
        outs.append(out)
        grads.append(g)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_tiled_dropout_gradcheck():
    q, k, v = make_qkv(B=1, H=2, Hkv=1, Nq=9, Nk=11, D=4, dtype=torch.float64, requires_grad=True)

    def f(q, k, v):
        return _seeded(11, TiledBackend(4, 4), q, k, v, dropout_p=0.25, causal=True)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_dropped_weights_are_zero_or_rescaled():
    q, k, v = make_qkv(B=1, H=2, Nq=40, D=8, dtype=torch.float64)
    st = qkv.reference.steps(q, k, v, dropout_p=0.25, dropout_seed=5)
    kept = st.A_dropped != 0
    torch.testing.assert_close(st.A_dropped[kept], st.A[kept] / 0.75, rtol=1e-15, atol=0)
    torch.testing.assert_close(st.out, st.A_dropped @ v, rtol=1e-12, atol=1e-12)
    assert 0 < kept.double().mean() < 1


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_one_minus_p(p):
    bh = torch.arange(6).reshape(6, 1, 1)
    rows = torch.arange(400).unsqueeze(1)
    cols = torch.arange(500)
    keep = keep_mask(1234, p, bh, rows, cols).double()  # 1.2M draws
    n = keep.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(keep.mean().item() - (1 - p)) < 6 * sigma
    # Heads, rows and columns get different masks, and neighbours are not correlated.
    assert not torch.equal(keep[0], keep[1])
    corr = ((keep[:, :, 1:] - (1 - p)) * (keep[:, :, :-1] - (1 - p))).mean().item()
    assert abs(corr) < 6 * p * (1 - p) / n**0.5


def test_dropout_zero_is_plain_attention():
    q, k, v = make_qkv(B=1, H=2, Nq=10, D=8)
    torch.testing.assert_close(
        qkv.attention(q, k, v, dropout_p=0.0, backend="tiled"),
        qkv.attention(q, k, v, backend="tiled"),
        rtol=0,
        atol=0,
    )
