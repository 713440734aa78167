"""Masks, score modifiers and held layouts travel: they pickle (any protocol ≥ 2), go through
`torch.save` / `torch.load`, and reach `multiprocessing` spawn workers, and come back computing
exactly what they computed before (dense form, tile layout, attention output).

Equality is what it always was: a Mask, ScoreMod or BlockLayout is equal only to itself, so a
copy is a new object (a new owner of its own cached layouts), never confused with the original.
"""

from __future__ import annotations

import gc
import io
import multiprocessing
import pickle
from copy import deepcopy

import pytest
import torch

import qkv
from qkv import masks, scores
from qkv.kernels import TiledBackend

from .helpers import assert_error_ratio, golden, make_qkv

N = 63
SMALL = TiledBackend(8, 16, max_rows=16, max_cols=32)  # many tiles, many kinds per problem


def only_even_keys(b, h, q, kv):
    """A custom rule at module level (what `Mask(fn)` needs to pickle)."""
    return (kv % 2 == 0) | (kv == q)


CU = torch.tensor([0, 10, 40, 63])
MASKS = {
    "causal": lambda: masks.causal(),
    "window": lambda: masks.sliding_window(8),
    "window-asym": lambda: masks.sliding_window(2, 7),
    "dilated": lambda: masks.dilated_window(3, 2),
    "global": lambda: masks.global_tokens([0, 5, 40]),
    "global-none": lambda: masks.global_tokens([]),
    "strided": lambda: masks.strided(4),
    "fixed": lambda: masks.fixed(8, 2),
    "bigbird": lambda: masks.bigbird(window=1, n_global=1, n_random=2, block=8, seed=3),
    "document": lambda: masks.document([10, 0, 33, 20]),
    "prefix_lm": lambda: masks.prefix_lm(9),
    "padding": lambda: masks.padding([63, 20, 0]),
    "key_mask": lambda: masks.key_mask(
        torch.rand(2, N, generator=torch.Generator().manual_seed(2)) > 0.3
    ),
    "from_tensor": lambda: masks.from_tensor(
        torch.rand(2, N, N, generator=torch.Generator().manual_seed(5)) > 0.5
    ),
    "varlen": lambda: masks.varlen(CU, CU),
    "varlen-causal": lambda: masks.varlen(CU, CU, causal=True),
    "custom": lambda: masks.Mask(only_even_keys, "even keys"),
    # combinations
    "longformer": lambda: masks.sliding_window(4) | masks.global_tokens([1, 30]),
    "and-not": lambda: masks.causal() & ~masks.sliding_window(3),
    "not-or": lambda: ~(masks.fixed(8, 2) | masks.sliding_window(1)),
    "doc-causal": lambda: masks.document([30, 33]) & masks.causal(),
    "nested": lambda: (
        (masks.strided(5) & masks.causal()) | (masks.padding([50, 63]) & ~masks.causal())
    ),
    "shifted": lambda: (masks.sliding_window(6) | masks.global_tokens([3])).shifted(20, 10, 200),
}


def _torch_round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


ROUND_TRIPS = {
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "pickle-2": lambda obj: pickle.loads(pickle.dumps(obj, protocol=2)),
    "torch.save": _torch_round_trip,
}


def _equality_as_always(copy, original):
    """Equal only to itself, hashable and stable: what `==` and `hash` always were for these
    objects (qkv's caches tell owners apart by object, so a copy is a new owner)."""
    assert copy == copy and copy is not original and copy != original
    assert hash(copy) == hash(copy)
    assert {copy: 1}[copy] == 1


def _same_layout(a: qkv.BlockLayout, b: qkv.BlockLayout):
    assert (a.q_len, a.kv_len, a.block_q, a.block_k, a.causal) == (
        b.q_len, b.kv_len, b.block_q, b.block_k, b.causal,
    )  # fmt: skip
    for field in ("row_ptr", "col", "full", "col_ptr", "by_col"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and torch.equal(x, y), field


def _problem(m: masks.Mask, dtype=torch.float32):
    B, H = m.batch or 2, m.heads or 2
    return make_qkv(B=B, H=H, Nq=N, D=16, dtype=dtype, seed=7)


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
@pytest.mark.parametrize("name", list(MASKS))
def test_mask_round_trips_and_computes_the_same(name, how):
    m = MASKS[name]()
    copy = ROUND_TRIPS[how](m)
    assert type(copy) is masks.Mask
    _equality_as_always(copy, m)
    assert repr(copy) == repr(m)
    assert (copy.batch, copy.heads, copy.has_bounds, copy.exact_ranges) == (
        m.batch, m.heads, m.has_bounds, m.exact_ranges,
    )  # fmt: skip
    assert torch.equal(copy.dense4(N, N), m.dense4(N, N))
    assert torch.equal(copy.to_dense(N, N), m.to_dense(N, N))
    for bq, bk in [(16, 16), (7, 13)]:
        _same_layout(copy.blocks(N, N, bq, bk), m.blocks(N, N, bq, bk))
        assert torch.equal(copy.tile_kinds(N, N, bq, bk), m.tile_kinds(N, N, bq, bk))
    seg, seg_copy = m.segments(N, N), copy.segments(N, N)
    assert (seg is None) == (seg_copy is None)
    if seg is not None:
        assert all(torch.equal(x, y) for x, y in zip(seg, seg_copy, strict=True))
    q, k, v = _problem(m)
    for backend in ["reference", "tiled", SMALL]:
        got = qkv.attention(q, k, v, mask=copy, backend=backend)
        assert torch.equal(got, qkv.attention(q, k, v, mask=m, backend=backend)), backend
    ref = qkv.attention(q, k, v, mask=copy.dense4(N, N), backend="reference")
    assert_error_ratio(got, ref, golden(q, k, v, mask=m.dense4(N, N)))


def test_a_copy_outlives_its_original_and_keeps_its_own_layouts():
    m = masks.sliding_window(5) | masks.global_tokens([0, 31])
    q, k, v = make_qkv(B=1, H=2, Nq=N, seed=1)
    want = qkv.attention(q, k, v, mask=m, backend=SMALL)
    copy = pickle.loads(pickle.dumps(m))
    del m
    gc.collect()
    assert torch.equal(qkv.attention(q, k, v, mask=copy, backend=SMALL), want)


def test_a_mask_of_a_lambda_says_what_cannot_pickle():
    """A custom rule pickles when its function does (module level); a lambda cannot, and
    pickle's own error names it."""
    with pytest.raises((pickle.PicklingError, AttributeError), match="lambda"):
        pickle.dumps(masks.Mask(lambda b, h, q, kv: kv <= q))


# ------------------------------------------------------------------------- score modifiers


def _table(requires_grad=True):
    g = torch.Generator().manual_seed(11)
    return (0.3 * torch.randn(2, 2 * 6 + 1, generator=g)).requires_grad_(requires_grad)


MODS = {
    "alibi": lambda: scores.alibi(scores.alibi_slopes(2)),
    "softcap": lambda: scores.softcap(2.0),
    "relative_bias": lambda: scores.relative_bias(_table(), 6),
    "relative_bias-shared": lambda: scores.relative_bias(_table()[:1].detach(), 6),
    "relative_bias-parameter": lambda: scores.relative_bias(torch.nn.Parameter(_table()), 6),
    "compose": lambda: scores.compose(
        scores.softcap(3.0), scores.relative_bias(_table(), 6), scores.alibi([0.5, 0.25])
    ),
}


@pytest.mark.parametrize("how", [*ROUND_TRIPS, "deepcopy"])
@pytest.mark.parametrize("name", list(MODS))
def test_score_mod_round_trips_and_computes_the_same(name, how):
    """(`copy.deepcopy` too: a copied relative bias reads the table its `params` hold, so the
    copy's gradients reach the copy's table.)"""
    mod = MODS[name]()
    copy = ROUND_TRIPS[how](mod) if how in ROUND_TRIPS else deepcopy(mod)
    assert type(copy) is qkv.ScoreMod
    _equality_as_always(copy, mod)
    assert (repr(copy), copy.heads) == (repr(mod), mod.heads)
    assert len(copy.params) == len(mod.params)
    for p, c in zip(mod.params, copy.params, strict=True):
        assert type(c) is type(p) and c.requires_grad == p.requires_grad
        assert torch.equal(c, p) and c is not p
    assert (copy.parts is None) == (mod.parts is None)
    for a, b in zip(mod.parts, copy.parts, strict=True):
        assert a[0] == b[0] and len(a) == len(b)
        for x, y in zip(a[1:], b[1:], strict=True):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    # a learnable table is one tensor: what the modifier reads is what receives gradients
    held = [p for part in copy.parts for p in part if isinstance(p, torch.Tensor)]
    for p in copy.params:
        assert any(p is x for x in held)

    q, k, v = make_qkv(B=1, H=2, Nq=N, D=16, seed=3)
    for backend in ["reference", "tiled", SMALL]:
        for p in (*mod.params, *copy.params):
            p.grad = None
        want = qkv.attention(q, k, v, causal=True, score_mod=mod, backend=backend)
        got = qkv.attention(q, k, v, causal=True, score_mod=copy, backend=backend)
        assert torch.equal(got, want), backend
        if any(p.requires_grad for p in mod.params):
            want.sum().backward()
            got.sum().backward()
            for p, c in zip(mod.params, copy.params, strict=True):
                assert c.grad is not None and torch.equal(c.grad, p.grad), backend
    gold = golden(q, k, v, causal=True, score_mod=copy).detach()  # tables cast to fp64 there
    ref = qkv.attention(q, k, v, causal=True, score_mod=copy, backend="reference")
    assert_error_ratio(got.detach(), ref.detach(), gold)


# ------------------------------------------------------------------------------ held layouts


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
def test_held_block_layout_round_trips(how):
    m = masks.document([20, 43]) & (masks.sliding_window(9) | masks.global_tokens([2]))
    lay = qkv.block_layout(m, N, block_q=16, block_k=8)
    strips = lay.strips(32, 16)  # cached on the layout: it travels with it
    copy, copy_mask = ROUND_TRIPS[how]((lay, m))
    assert type(copy) is qkv.BlockLayout
    _equality_as_always(copy, lay)
    assert copy.mask is copy_mask and repr(copy.mask) == repr(m)  # one Mask, still shared
    _same_layout(copy, lay)
    assert copy.show() == lay.show() and copy.rows() == lay.rows()
    assert copy.strips(32, 16) == strips and copy.strips(64, 64) == lay.strips(64, 64)
    _same_layout(copy.transposed, lay.transposed)
    q, k, v = make_qkv(B=1, H=2, Nq=N, D=16, seed=4)
    want = qkv.attention(q, k, v, mask=lay, backend="tiled")
    assert torch.equal(qkv.attention(q, k, v, mask=copy, backend="tiled"), want)
    ref = qkv.attention(q, k, v, mask=m.dense4(N, N), backend="reference")
    assert_error_ratio(want, ref, golden(q, k, v, mask=m.dense4(N, N)))


# ---------------------------------------------------------------------------- spawn workers


def compute_in_worker(job):
    """Run in a spawned worker: the mask's dense form and attention under mask and modifier."""
    mask, mod, q, k, v = job
    torch.set_num_threads(1)
    with torch.no_grad():  # a result that requires grad could not travel back
        dense = mask.to_dense(q.shape[-2], k.shape[-2])
        return dense, qkv.attention(q, k, v, mask=mask, score_mod=mod, backend="tiled")


def test_masks_and_modifiers_reach_a_spawn_worker():
    jobs = []
    for name, mod in [
        ("longformer", MODS["compose"]()),
        ("bigbird", MODS["alibi"]()),
        ("varlen-causal", None),
        ("key_mask", MODS["relative_bias"]()),
        ("custom", None),
    ]:
        m = MASKS[name]()
        jobs.append((m, mod, *_problem(m)))
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        results = pool.map(compute_in_worker, jobs, chunksize=len(jobs))
    for (m, mod, q, k, v), (dense, out) in zip(jobs, results, strict=True):
        assert torch.equal(dense, m.to_dense(N, N)), m
        want = qkv.attention(q, k, v, mask=m, score_mod=mod, backend="tiled")
        assert torch.equal(out, want.detach()), m
