"""`qkv.pairs.Pairs`, the one description of which pairs may attend, and what consumers take
from it: sdpa's `attn_mask`, received attention's `band`."""

from __future__ import annotations

import pytest
import torch

from qkv import masks
from qkv.plan import make_plan

from .helpers import make_qkv

NQ, NK = 12, 20


def _pairs(mask=None, causal=False, nq=NQ, nk=NK):
    q, k, v = make_qkv(B=2, H=3, Nq=nq, Nk=nk, D=4)
    return make_plan(q, k, v, mask=mask, causal=causal).pairs


def _masks():
    g = torch.Generator().manual_seed(0)
    return {
        "none": None,
        "bool": torch.rand(2, 1, NQ, NK, generator=g) > 0.4,
        "key-padding": torch.rand(2, 1, 1, NK, generator=g) > 0.2,
        "bias": torch.randn(1, 3, NQ, NK, generator=g),
        "window": masks.sliding_window(5),
        "padding": masks.padding([7, 20]),
    }


def _oracle(pairs):
    """The pairs' mask written out pair by pair: bool, or the bias with −inf where forbidden."""
    B, H = 2, 3
    ok = torch.ones(B, H, pairs.q_len, pairs.kv_len, dtype=torch.bool)
    for i in range(pairs.q_len):
        for j in range(pairs.kv_len):
            if pairs.causal and j > i + pairs.kv_len - pairs.q_len:
                ok[:, :, i, j] = False
    if pairs.rule is not None:
        ok &= pairs.rule.dense4(pairs.q_len, pairs.kv_len)
    if pairs.mask is not None:
        ok &= pairs.mask
    if pairs.bias is None:
        return ok
    return pairs.bias.expand(B, H, -1, -1).masked_fill(~ok, -torch.inf)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", list(_masks()))
def test_attn_mask_is_the_pairs_written_out(name, causal):
    pairs = _pairs(_masks()[name], causal)
    got = pairs.attn_mask()
    if name == "none" and not causal:
        assert got is None
        return
    want = _oracle(pairs)
    assert got.dtype == want.dtype
    assert torch.equal(got.expand_as(want), want)


@pytest.mark.parametrize("name", ["bool", "key-padding", "bias"])
def test_attn_mask_passes_a_lone_tensor_as_given(name):
    """A tensor that alone restricts the pairs reaches SDPA as it is: no copy, its broadcast
    shape kept (sdpa's grouped-head packing reads it)."""
    pairs = _pairs(_masks()[name])
    given = pairs.mask if pairs.mask is not None else pairs.bias
    assert pairs.attn_mask() is given


def test_causal_only():
    assert _pairs(causal=True).causal_only
    assert not _pairs().causal_only
    assert not _pairs(_masks()["window"], causal=True).causal_only
    assert not _pairs(_masks()["bias"], causal=True).causal_only


@pytest.mark.parametrize("nq,nk", [(NQ, NK), (NK, NQ), (NQ, NQ)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", list(_masks()))
def test_band_is_dense_cut_to_the_band(name, causal, nq, nk):
    """What received attention asks: the hidden pairs of a band of query rows and keys are
    those `dense()` forbids there, and a band with a row that may attend nowhere says so."""
    mask = _masks()[name]
    if isinstance(mask, torch.Tensor):  # cut to this shape (the rows of a per-row mask too)
        mask = mask[..., : nq if mask.shape[-2] > 1 else 1, :nk]
        if mask.shape[-2] not in (1, nq):
            pytest.skip("the mask has fewer rows than this Nq")
    if name == "padding":
        mask = masks.padding([min(7, nk), nk])
    pairs = _pairs(mask, causal, nq, nk)
    dense = pairs.dense()
    dense = (
        torch.ones(2, 3, nq, nk, dtype=torch.bool) if dense is None else dense.expand(2, 3, -1, -1)
    )
    for b in range(2):
        for r0, r1, c0, c1 in [
            (0, nq, 0, nk),
            (0, 3, 0, 5),
            (2, 9, 4, nk),
            (nq - 1, nq, 1, nk - 1),
        ]:
            band = pairs.band(b, 3, r0, r1, c0, c1)
            assert c0 <= band.start <= c1
            assert dense[b, :, r0:r1, c0 : band.start].all()
            want = ~dense[b, :, r0:r1, band.start : c1]
            hidden = torch.zeros_like(want) if band.hidden is None else band.hidden
            assert torch.equal(hidden.expand_as(want), want)
            if not dense[b, :, r0:r1].any(-1).all() or pairs.bias is not None:
                assert band.empty_rows
