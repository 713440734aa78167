"""qkv.masks: every pattern's dense form, its tile layout, composition, and bad arguments."""

from __future__ import annotations

import pytest
import torch

from qkv import masks
from qkv.masks import EMPTY, FULL

PATTERNS = {
    "causal": masks.causal(),
    "window": masks.sliding_window(5),
    "window-causal-local": masks.sliding_window(4, 0),
    "window-asym": masks.sliding_window(2, 7),
    "dilated": masks.dilated_window(3, 2),
    "global": masks.global_tokens([0, 5, 40]),
    "strided": masks.strided(4),
    "fixed": masks.fixed(8, 2),
    "bigbird": masks.bigbird(window=1, n_global=1, n_random=2, block=8, seed=3),
    "document": masks.document([10, 0, 33, 20]),
    "prefix_lm": masks.prefix_lm(9),
    "padding": masks.padding([63, 20, 0]),
    "key_mask": masks.key_mask(torch.rand(2, 63, generator=torch.Generator().manual_seed(2)) > 0.3),
    "longformer": masks.sliding_window(4) | masks.global_tokens([1, 30]),
    "and-not": masks.causal() & ~masks.sliding_window(3),
    "doc-causal": masks.document([30, 33]) & masks.causal(),
}
SIZES = [(63, 63), (40, 63)]  # Nq < Nk: queries are the last positions (bottom-right)


def _tile_any_all(dense, bq, bk):
    nq, nk = dense.shape[-2:]
    nqb, nkb = -(-nq // bq), -(-nk // bk)
    any_ = torch.zeros((*dense.shape[:-2], nqb, nkb), dtype=torch.bool)
    all_ = torch.zeros_like(any_)
    for i in range(nqb):
        for j in range(nkb):
            t = dense[..., i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            any_[..., i, j] = t.flatten(-2).any(-1)
            all_[..., i, j] = t.flatten(-2).all(-1)
    return any_, all_


@pytest.mark.parametrize("bq,bk", [(16, 16), (7, 13), (64, 8)])
@pytest.mark.parametrize("nq,nk", SIZES)
@pytest.mark.parametrize("name", list(PATTERNS))
def test_blocks_agree_with_dense_tile_by_tile(name, nq, nk, bq, bk):
    m = PATTERNS[name]
    if name == "document" and nk != 63:
        pytest.skip("document lengths sum to 63")
    if name.startswith("doc-causal") and nk != 63:
        pytest.skip("document lengths sum to 63")
    dense = m.dense4(nq, nk)  # (Bm, Hm, Nq, Nk)
    any_, all_ = _tile_any_all(dense, bq, bk)
    kind = m.tile_kinds(nq, nk, bq, bk).expand(any_.shape)  # per batch element and head
    assert not (any_ & (kind == EMPTY)).any(), "a tile marked empty holds an allowed pair"
    assert not (~all_ & (kind == FULL)).any(), "a tile marked full holds a masked pair"
    # The layout the kernels read (kept tiles only, found through the rule's key ranges):
    # empty only where empty for every (b, h), full only where full for every one, and
    # exactly the union of the per-(b, h) kinds, so the key ranges lost no tile.
    union = m.blocks(nq, nk, bq, bk).kind
    assert not (any_.flatten(0, 1).any(0) & (union == EMPTY)).any()
    assert not (~all_.flatten(0, 1).all(0) & (union == FULL)).any()
    k = kind.flatten(0, 1)
    want = torch.where((k == EMPTY).all(0), EMPTY, torch.where((k == FULL).all(0), FULL, 1))
    assert torch.equal(union, want.to(torch.int8))


@pytest.mark.parametrize(
    "name",
    [
        "causal",
        "window",
        "window-asym",
        "global",
        "document",
        "prefix_lm",
        "padding",
        "bigbird",
        "fixed",
    ],
)
def test_structured_bounds_are_exact(name):
    # For these rules the bounds are exact: every tile is classified as tightly as possible.
    m = PATTERNS[name]
    dense = m.dense4(63, 63)
    any_, all_ = _tile_any_all(dense, 8, 8)
    kind = m.tile_kinds(63, 63, 8, 8).expand(any_.shape)
    assert torch.equal(kind == EMPTY, ~any_)
    assert torch.equal(kind == FULL, all_)


def test_dense_forms_of_the_patterns():
    w = masks.sliding_window(1, 0).to_dense(4, 4)
    assert w.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    c = masks.causal().to_dense(2, 4)  # bottom-right: query rows are positions 2 and 3
    assert c.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    d = masks.document([2, 3]).to_dense(5, 5)
    assert d.int().tolist() == [[1, 1, 0, 0, 0]] * 2 + [[0, 0, 1, 1, 1]] * 3
    g = masks.global_tokens([1]).to_dense(3, 3)
    assert g.tolist() == [[False, True, False], [True, True, True], [False, True, False]]
    p = masks.prefix_lm(2).to_dense(4, 4)
    assert p.int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    pad = masks.padding([1, 3]).to_dense(2, 3)
    assert pad.shape == (2, 1, 2, 3)
    assert pad[0, 0].int().tolist() == [[1, 0, 0]] * 2 and pad[1].all()
    assert masks.padding([1, 3]).to_dense(2, 3, b=0).int().tolist() == [[1, 0, 0]] * 2
    s = masks.strided(3).to_dense(7, 7)
    assert s[6].int().tolist() == [1, 0, 0, 1, 1, 1, 1]  # every 3rd back, and the local 3
    f = masks.fixed(4, 1).to_dense(8, 8)
    assert f[1].int().tolist() == [1, 1, 1, 1, 0, 0, 0, 1]  # own block + last of each block
    dil = masks.dilated_window(2, 3).to_dense(1, 13)  # query position 12
    assert dil[0].nonzero().flatten().tolist() == [6, 9, 12]


def test_bigbird_block_structure():
    m = masks.bigbird(window=1, n_global=1, n_random=2, block=4, seed=0)
    dense = m.to_dense(32, 32)
    blocks = dense.view(8, 4, 8, 4).any(3).any(1)  # (query block, key block)
    assert torch.equal(blocks, dense.view(8, 4, 8, 4).all(3).all(1))  # whole blocks only
    assert blocks[0].all() and blocks[:, 0].all()  # the global block
    for i in range(1, 8):
        band = {j for j in range(8) if abs(i - j) <= 1} | {0}
        extra = set(blocks[i].nonzero().flatten().tolist()) - band
        assert len(extra) <= 2  # the random blocks (some may land in the band)
    other = masks.bigbird(window=1, n_global=1, n_random=2, block=4, seed=1).to_dense(32, 32)
    assert not torch.equal(dense, other)


def test_from_tensor_round_trip():
    t = torch.rand(2, 3, 5, 7, generator=torch.Generator().manual_seed(0)) > 0.5
    m = masks.from_tensor(t)
    assert torch.equal(m.dense4(5, 7), t)
    assert torch.equal(masks.from_tensor(t[0, 0]).to_dense(5, 7), t[0, 0])


@pytest.mark.parametrize("op", ["and", "or", "not"])
def test_composition_equals_dense_logic(op):
    a, b = masks.sliding_window(3), masks.document([20, 13])
    da, db = a.to_dense(33, 33), b.to_dense(33, 33)
    got = {"and": a & b, "or": a | b, "not": ~a}[op]
    want = {"and": da & db, "or": da | db, "not": ~da}[op]
    assert torch.equal(got.to_dense(33, 33), want)


def test_reprs_are_readable():
    m = (masks.sliding_window(256) | masks.global_tokens([0, 1])) & ~masks.causal()
    assert repr(m) == "(sliding_window(256, 256) | global_tokens([0, 1])) & ~causal()"
    assert repr(masks.document([3, 4])) == "document([3, 4])"


def test_density_and_show():
    m = masks.causal()
    assert m.density(10, 10) == pytest.approx(55 / 100)
    layout = m.blocks(8, 8, 4, 4)
    assert layout.show() == "+.\n#+"
    assert layout.kept_fraction == pytest.approx(3 / 4)


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: masks.sliding_window(-1), ValueError, r"left=-1 must be ≥ 0"),
        (lambda: masks.sliding_window(2, -3), ValueError, r"right=-3 must be ≥ 0"),
        (lambda: masks.sliding_window(2.5), TypeError, r"left must be an int, got float 2.5"),
        (lambda: masks.dilated_window(2, 0), ValueError, r"dilation=0 must be ≥ 1"),
        (lambda: masks.global_tokens([-1]), ValueError, r"global token indices must be ≥ 0"),
        (lambda: masks.global_tokens("ab"), TypeError, r"indices must be a sequence of ints"),
        (lambda: masks.strided(0), ValueError, r"stride=0 must be ≥ 1"),
        (lambda: masks.fixed(4, 5), ValueError, r"summary=5 must be ≤ block=4"),
        (lambda: masks.document([3, -1]), ValueError, r"document lengths must be ≥ 0"),
        (lambda: masks.padding([1.5]), TypeError, r"lengths must hold ints"),
        (lambda: masks.bigbird(1, 1, 1, 0), ValueError, r"block=0 must be ≥ 1"),
        (lambda: masks.from_tensor(torch.ones(3, 3)), TypeError, r"from_tensor needs a bool"),
        (
            lambda: masks.key_mask(torch.ones(3)),
            TypeError,
            r"key_mask needs a bool tensor \(B, Nk\)",
        ),
        (lambda: masks.causal() & 3, TypeError, r"unsupported operand"),
    ],
)
def test_bad_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.parametrize(
    "mask,nq,nk,match",
    [
        (
            masks.global_tokens([0, 70]),
            64,
            64,
            r"global token index 70 is out of range for a sequence of 64 keys",
        ),
        (
            masks.document([10, 20]),
            31,
            31,
            r"document lengths sum to 30, but the sequence has 31 keys",
        ),
        (masks.padding([99]), 8, 8, r"padding length 99 exceeds the sequence of 8 keys"),
        (
            masks.from_tensor(torch.ones(4, 5, dtype=torch.bool)),
            4,
            6,
            r"has shape \(Nq, Nk\)=\(4, 5\)",
        ),
        (masks.document([4, 4]), 9, 8, r"document needs Nq ≤ Nk"),
        (
            masks.key_mask(torch.ones(1, 5, dtype=torch.bool)),
            6,
            6,
            r"key_mask covers 5 keys, but the sequence has 6",
        ),
    ],
)
def test_mask_that_does_not_fit_the_problem(mask, nq, nk, match):
    with pytest.raises(ValueError, match=match):
        mask.to_dense(nq, nk)


def test_batch_size_mismatch_is_an_error():
    import qkv

    q = torch.randn(2, 1, 4, 8)
    with pytest.raises(ValueError, match=r"is written for batch size 3, got B=2"):
        qkv.attention(q, q, q, mask=masks.padding([1, 2, 3]))
    with pytest.raises(ValueError, match=r"cannot combine"):
        masks.padding([1, 2]) | masks.padding([1, 2, 3])
