"""received_attention equals the column sums of the reference's A; FastV-style prune."""

from __future__ import annotations

import importlib

import pytest
import torch

import qkv
from qkv import masks
from qkv.kernels.tiled import received
from qkv.vision import prune, received_attention

from ..helpers import assert_error_ratio, make_qkv


def _column_sums(q, k, **kwargs):
    """The oracle: the reference's attention matrix A, summed over the query rows."""
    _, weights = qkv.attention(q, k, k, backend="reference", return_weights=True, **kwargs)
    return weights.sum(-2)


def _check(q, k, **kwargs):
    gold = _column_sums(q.double(), k.double(), **_double(kwargs))
    ref = _column_sums(q, k, **kwargs)
    got = received_attention(q, k, **kwargs)
    assert got.dtype == torch.float32 and got.shape == gold.shape
    assert_error_ratio(got, ref, gold)
    return got


def _double(kwargs):
    m = kwargs.get("mask")
    if isinstance(m, torch.Tensor) and m.dtype.is_floating_point:
        return {**kwargs, "mask": m.double()}
    return kwargs


@pytest.fixture(params=[None, 2048, 64 * 1024], ids=["one-band", "bands-2k", "bands-64k"])
def band(request, monkeypatch):
    """Small bands split the rows into many bands (and restrict their keys under masks)."""
    if request.param is not None:
        monkeypatch.setattr(received, "BAND_BYTES", request.param)
    return request.param


@pytest.mark.parametrize("Nq,Nk", [(1, 1), (17, 17), (97, 97), (33, 70), (70, 33), (255, 255)])
def test_dense_and_causal(band, Nq, Nk):
    q, k, _ = make_qkv(B=2, H=6, Hkv=2, Nq=Nq, Nk=Nk, D=16, seed=Nq)
    got = _check(q, k)
    torch.testing.assert_close(got.sum(-1), torch.full((2, 6), float(Nq)), rtol=1e-5, atol=1e-4)
    _check(q, k, causal=True)
    _check(q, k, scale=0.05)


@pytest.mark.parametrize(
    "mask",
    [
        masks.sliding_window(8),
        masks.sliding_window(16, 0),
        masks.document([30, 50, 20]),
        masks.sliding_window(4) | masks.global_tokens([0, 99]),
        masks.padding([60, 100]),
    ],
    ids=repr,
)
def test_structured_masks(band, mask):
    q, k, _ = make_qkv(B=2, H=4, Nq=100, D=8, seed=5)
    _check(q, k, mask=mask)


def test_tensor_masks_and_fully_masked_rows(band):
    q, k, _ = make_qkv(B=2, H=4, Nq=40, Nk=50, D=8, seed=6)
    g = torch.Generator().manual_seed(0)
    allowed = torch.rand(2, 4, 40, 50, generator=g) > 0.5
    allowed[:, :, 3] = False  # a row that may attend nowhere adds nothing
    got = _check(q, k, mask=allowed)
    rows_with_keys = allowed.any(-1).sum(-1).float()
    torch.testing.assert_close(got.sum(-1), rows_with_keys, rtol=1e-5, atol=1e-4)
    bias = torch.randn(1, 4, 40, 50, generator=g)
    _check(q, k, mask=bias)
    _check(q, k, mask=torch.randn(2, 1, 1, 50, generator=g))  # a key-side bias (ToMe's log s)


@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"mask": masks.sliding_window(9)}])
def test_with_the_lse_qkv_returned(kwargs):
    q, k, v = make_qkv(B=1, H=4, Nq=90, D=16, seed=7)
    _, lse = qkv.attention(q, k, v, return_lse=True, **kwargs)
    gold = _column_sums(q.double(), k.double(), **kwargs)
    ref = _column_sums(q, k, **kwargs)
    assert_error_ratio(received_attention(q, k, lse=lse, **kwargs), ref, gold)


def test_layouts_and_dtypes():
    q, k, _ = make_qkv(B=1, H=2, Nq=20, D=8)
    full = received_attention(q, k)
    torch.testing.assert_close(received_attention(q[0], k[0]), full[0])
    torch.testing.assert_close(received_attention(q[0, 0], k[0, 0]), full[0, 0])
    assert received_attention(q[0, 0], k[0, 0]).shape == (20,)
    assert received_attention(q.double(), k.double()).dtype == torch.float64
    half = received_attention(q.bfloat16(), k.bfloat16())
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, full, rtol=0.05, atol=0.05)
    assert received_attention(q[:, :, :0], k).abs().sum() == 0


def test_memory_is_a_band_not_the_matrix(monkeypatch):
    """Every band's scores hold at most BAND_BYTES (or one row), never Nq × Nk."""
    seen = []
    real = received._band

    def spy(*args):
        p = real(*args)
        seen.append(p.numel() * 4)
        return p

    monkeypatch.setattr(received, "_band", spy)
    monkeypatch.setattr(received, "BAND_BYTES", 64 * 1024)
    q, k, _ = make_qkv(B=1, H=4, Nq=512, D=8)
    received_attention(q, k)
    assert len(seen) == 512 // (64 * 1024 // (4 * 512 * 4)) and max(seen) <= 64 * 1024
    seen.clear()
    received_attention(q, k, mask=masks.sliding_window(8))
    # the window's bands keep only their key tiles: a fraction of the 512×512 scores in all
    assert max(seen) <= 64 * 1024 and sum(seen) <= 4 * 512 * 512 * 4 / 3
    seen.clear()
    received_attention(q, k, causal=True)
    # causal bands grow while their key range is short: fewer bands, about half the scores
    assert max(seen) <= 64 * 1024 and len(seen) < 64 and sum(seen) <= 0.6 * 4 * 512 * 512 * 4


def test_errors():
    q, k, _ = make_qkv(B=1, H=4, Nq=10, D=8)
    with pytest.raises(ValueError, match=r"lse must have shape \(B, H, Nq\)=\(1, 4, 10\)"):
        received_attention(q, k, lse=torch.zeros(1, 4, 9))
    with pytest.raises(ValueError, match="k's head dim must equal q's"):
        received_attention(q, k[..., :4])
    with pytest.raises(TypeError, match="causal must be a bool"):
        received_attention(q, k, causal=1)


# --------------------------------------------------------------------------- prune


def test_prune_keeps_the_top_scoring_candidates_in_order():
    x = torch.arange(8.0).view(1, 8, 1).repeat(2, 1, 3)
    scores = torch.tensor([[0.0, 5, 1, 4, 3, 2, 9, 0], [9.0, 1, 2, 3, 4, 5, 6, 7]])
    image = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 0]]).bool()
    kept, index = prune(x, scores, 2, candidates=image)
    assert index.tolist() == [[0, 1, 3, 6, 7], [0, 1, 5, 6, 7]]
    assert torch.equal(kept[..., 0], index.float())
    kept, index = prune(x, scores, 0.5, candidates=image)  # half of 5 candidates, rounded down
    assert index.shape == (2, 5)
    _, index = prune(x, scores, 3)
    assert index.tolist() == [[1, 3, 6], [0, 6, 7]]


def test_prune_with_received_attention_fastv_style():
    q, k, _ = make_qkv(B=1, H=4, Nq=30, D=8, seed=9)
    x = torch.randn(1, 30, 16)
    image = torch.zeros(1, 30, dtype=torch.bool)
    image[:, 5:25] = True
    scores = received_attention(q, k, causal=True).mean(1)  # (B, N), averaged over heads
    kept, index = prune(x, scores, 10, candidates=image)
    assert kept.shape == (1, 20, 16)
    dropped = sorted(set(range(5, 25)) - set(index[0].tolist()))
    kept_image = [i for i in index[0].tolist() if 5 <= i < 25]
    assert max(scores[0, dropped]) <= min(scores[0, kept_image])


def test_prune_errors():
    x, s = torch.randn(2, 6, 3), torch.randn(2, 6)
    with pytest.raises(ValueError, match=r"keep=7 must be in \[0, 6\]"):
        prune(x, s, 7)
    with pytest.raises(ValueError, match=r"keep as a fraction must be in \(0, 1\]"):
        prune(x, s, 1.5)
    with pytest.raises(ValueError, match="same number of candidates"):
        prune(x, s, 1, candidates=torch.tensor([[1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]).bool())
    with pytest.raises(ValueError, match=r"scores must have shape \(B, N\)=\(2, 6\)"):
        prune(x, s[:, :5], 2)
    with pytest.raises(TypeError, match="keep must be an int count"):
        prune(x, s, "2")


# --------------------------------------------------------------------------- through dispatch


def test_dispatch_explains_a_received_request():
    q, k, _ = make_qkv(B=1, H=4, Nq=10, D=8)
    d = qkv.dispatch(q, k, causal=True, op="received")
    assert d.name == "tiled"
    assert set(d.reasons) == {"cpu", "sdpa", "triton", "reference"}
    for name, why in d.reasons.items():
        assert why == f"{name} has no received-attention operation (the column sums of A)"
    text = str(d)
    assert text.startswith("chosen: tiled") and "not reference: reference has no" in text
    named = qkv.dispatch(q, k, op="received", backend="tiled")
    assert named.name == "tiled" and named.reasons["cpu"] == "backend='tiled' was asked for"


def test_a_backend_without_the_operation_declines_with_its_reason():
    q, k, _ = make_qkv(B=1, H=4, Nq=10, D=8)
    with pytest.raises(
        NotImplementedError,
        match=r"backend='sdpa' cannot compute received attention: sdpa has no received-attention",
    ):
        qkv.dispatch(q, k, op="received", backend="sdpa")
    with pytest.raises(NotImplementedError, match="backend='cpu' cannot compute received"):
        qkv.dispatch(q, k, op="received", backend=qkv.kernels.CpuBackend())

    class Declines(qkv.kernels.TiledBackend):
        def why_not_received(self, plan, q, k):
            return "this one declines"

    with pytest.raises(NotImplementedError, match="cannot compute received attention: this one"):
        qkv.dispatch(q, k, op="received", backend=Declines())


def test_received_attention_runs_what_dispatch_chose(monkeypatch):
    """received_attention asks dispatch: a backend placed first that declares the operation
    runs it; one placed first that does not is passed over with its reason."""
    dispatch = importlib.import_module("qkv.dispatch")  # `qkv.dispatch` is the function
    q, k, _ = make_qkv(B=1, H=4, Nq=10, D=8)

    class First(qkv.kernels.Backend):
        name = "first"

        def why_not(self, plan, q, k, v):
            return None

        def forward(self, plan, q, k, v):
            raise AssertionError("attention is not asked for")

        def why_not_received(self, plan, q, k):
            return None

        def received(self, plan, q, k, lse):
            return torch.full((plan.batch, plan.heads, plan.kv_len), 7.0)

    monkeypatch.setattr(dispatch, "BACKENDS", {"first": First(), **dispatch.BACKENDS})
    assert qkv.dispatch(q, k, op="received").name == "first"
    assert torch.equal(received_attention(q, k), torch.full((1, 4, 10), 7.0))
    del First.why_not_received
    d = qkv.dispatch(q, k, op="received")
    assert d.name == "tiled" and "first has no received-attention" in d.reasons["first"]
    assert_error_ratio(received_attention(q, k), _column_sums(q, k), _column_sums(*_d(q, k)))


def _d(*tensors):
    return tuple(t.double() for t in tensors)


def test_received_dispatch_errors():
    q, k, v = make_qkv(B=1, H=4, Nq=10, D=8)
    with pytest.raises(ValueError, match="received attention reads no v"):
        qkv.dispatch(q, k, v, op="received")
    with pytest.raises(ValueError, match="op='received' takes q, k, mask, causal, scale"):
        qkv.dispatch(q, k, op="received", return_lse=True)
    with pytest.raises(ValueError, match="op must be 'attention' or 'received'"):
        qkv.dispatch(q, k, v, op="column sums")
    with pytest.raises(TypeError, match="causal must be a bool"):
        qkv.dispatch(q, k, op="received", causal=1)
