"""Blocks chosen per batch element and kv head (`qkv.sparse.select_blocks`, a
`qkv.masks.ChosenBlocks`) on the tiled and triton backends: each (batch element, kv head) runs
over its own kept tiles (tiled: `steps.kv_parts`, inside the custom ops; triton: tile lists per
(b, h), `host.group_layout`), and stays exact: out, lse, dq, dk, dv against the fp64 reference
on the mask's dense form, by the error rule of docs/design.md (section 7).

The tests also check that the per-group path is the one taken (the loops see one problem per
(b, kv head), their kept tiles fewer than the union's, fewer matrix FLOPs), so that removing it
fails here. The triton tests run in Triton's interpreter on CPU tensors (as
tests/kernels/test_triton.py, which sets TRITON_INTERPRET=1); without triton they are skipped
and the tiled tests still run.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import scores, sparse
from qkv.kernels import TiledBackend
from qkv.kernels.tiled import backend as tiled_backend
from qkv.kernels.tiled import op as tiled_op
from qkv.kernels.tiled import steps
from qkv.layout import layout_for
from qkv.masks import chosen_blocks
from qkv.pairs import Pairs
from qkv.plan import make_plan

from .helpers import assert_error_ratio, make_qkv, matmul_flops

try:  # Triton in its interpreter (sets TRITON_INTERPRET=1 first), or why not
    from .kernels import test_triton as _interpreted

    NO_TRITON = None
except pytest.skip.Exception as e:  # triton missing, or imported without the interpreter
    _interpreted, NO_TRITON = None, str(e)

needs_triton = pytest.mark.skipif(NO_TRITON is not None, reason=str(NO_TRITON))

SMALL = TiledBackend(16, 32, max_rows=32, max_cols=64)  # many tiles, products cut short

CASES = {  # shape, select_blocks arguments
    "gqa-causal-300-block32": (dict(H=4, Hkv=2, Nq=300, D=64), dict(block=32, topk=3)),
    "mha-full-300-block96": (
        dict(H=4, Nq=300, D=32),
        dict(block=96, topk=1, causal=False),
    ),
    "gqa-decode1-1000-block96-D256": (
        dict(H=4, Hkv=2, Nq=1, Nk=1000, D=256),
        dict(block=96, topk=3),
    ),
    "mha-decode5-1000-block64-D128": (
        dict(H=4, Nq=5, Nk=997, D=128),
        dict(block=64, topk=4),
    ),
    "gqa-Nq<Nk-full-Dv": (
        dict(H=4, Hkv=2, Nq=200, Nk=300, D=16, Dv=24),
        dict(block=32, topk=2, causal=False),
    ),
}


def _problem(case, dtype=torch.float32, seed=0):
    shape, choose = CASES[case]
    q, k, v = make_qkv(B=2, dtype=dtype, seed=seed, **shape)
    return q, k, v, sparse.select_blocks(q, k, **choose)


def _dense(chosen, q, k):
    """The chosen pairs as a bool `(B, H, Nq, Nk)` tensor (what the golden runs)."""
    return chosen.to_dense(q.shape[2], k.shape[2]).expand(*q.shape[:2], q.shape[2], k.shape[2])


def _run(backend, q, k, v, grad=True, **kw):
    """out, lse and (dq, dk, dv) of a loss that uses both out and lse."""
    leaves = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
    out, lse = qkv.attention(*leaves, backend=backend, return_lse=True, **kw)
    if not grad:
        return out, lse, ()
    g = torch.Generator().manual_seed(5)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    w_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    finite_lse = torch.where(torch.isinf(lse), 0.0, lse)
    loss = (out.double() * w_out).sum() + (finite_lse.double() * w_lse).sum()
    return out.detach(), lse.detach(), torch.autograd.grad(loss, leaves)


def _check(backend, q, k, v, chosen, grad=True, **kw):
    """The backend on the chosen blocks against the fp64 reference on their dense form, scaled
    by the reference on the dense form in the inputs' dtype."""
    dense = _dense(chosen, q, k)
    got = _run(backend, q, k, v, grad, mask=chosen, **kw)
    ref = _run("reference", q, k, v, grad, mask=dense, **kw)
    gold = _run("reference", *(t.double() for t in (q, k, v)), grad, mask=dense, **kw)
    assert_error_ratio(got[0], ref[0], gold[0], what="out")
    assert_error_ratio(got[1], ref[1], gold[1], what="lse")
    names = ("dq", "dk", "dv")[: len(got[2])]
    for name, a, r, g in zip(names, got[2], ref[2], gold[2], strict=True):
        assert_error_ratio(a, r, g, factor=3.0, what=name)
    return got


class _Seen:
    """The `TileProblem`s the tiled loops run (forward and backward), recorded, in the custom
    ops and in the score-modifier path."""

    def __init__(self, monkeypatch):
        self.forward, self.backward = [], []
        fwd, bwd = steps.forward_loop, steps.backward_loop

        def forward(T, *args):
            self.forward.append(T)
            return fwd(T, *args)

        def backward(T, *args, **kw):
            self.backward.append(T)
            return bwd(T, *args, **kw)

        for module in (tiled_op, tiled_backend):
            monkeypatch.setattr(module, "forward_loop", forward)
            monkeypatch.setattr(module, "backward_loop", backward)


def _union(chosen, q, k, bq, bk):
    """Kept tiles of the union layout (every head's tiles in one)."""
    return layout_for(Pairs(q.shape[2], k.shape[2], False, chosen), bq, bk).nnz


# -- tiled ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", ["tiled", SMALL], ids=["default-tiles", "small-tiles"])
@pytest.mark.parametrize("case", list(CASES))
def test_tiled_is_exact_per_group(case, backend, dtype, monkeypatch):
    q, k, v, chosen = _problem(case, dtype)
    seen = _Seen(monkeypatch)
    _check(backend, q, k, v, chosen)
    B, H, Hkv = q.shape[0], q.shape[1], k.shape[1]
    # one problem per (b, kv head) in each direction, each its G heads over its own tiles
    for found in (seen.forward, seen.backward):
        assert len(found) == B * Hkv
        assert all((T.plan.batch, T.plan.heads, T.plan.kv_heads) == (1, H // Hkv, 1) for T in found)
    tiling = seen.forward[0].tiling
    own = [T.layout.nnz for T in seen.forward]
    for T, (b, g, pairs) in zip(seen.forward, chosen_groups(q, k, chosen), strict=True):
        assert T.layout.nnz == layout_for(pairs, tiling.block_q, tiling.block_k).nnz, (b, g)
    assert sum(own) <= B * Hkv * _union(chosen, q, k, tiling.block_q, tiling.block_k)


def chosen_groups(q, k, chosen):
    plan = make_plan(q, k, k, mask=chosen)
    return plan.pairs.kv_groups(plan.batch, plan.kv_heads)


@pytest.mark.parametrize("case", ["gqa-causal-300-block32", "mha-decode5-1000-block64-D128"])
def test_tiled_no_grad_fused_strips_per_group(case, monkeypatch):
    # without a gradient (and with the finite promise) the forward runs torch's fused op in
    # strips: per group as well
    q, k, v, chosen = _problem(case)
    seen = _Seen(monkeypatch)
    calls = []
    fused_op = tiled_op.fused_mod.fused_forward_op

    def counted(*args, **kw):
        calls.append(1)
        return fused_op(*args, **kw)

    monkeypatch.setattr(tiled_op.fused_mod, "fused_forward_op", counted)
    _check("tiled", q, k, v, chosen, grad=False, finite_inputs=True)
    assert calls and not seen.forward


def test_tiled_computes_fewer_tiles_and_flops_than_the_union(monkeypatch):
    # 8 heads, each choosing its own blocks: a query tile of the union computes several times
    # the tiles one head needs; the per-group path computes each head's alone
    q, k, v = make_qkv(B=1, H=8, Nq=1024, D=16, requires_grad=True, seed=3)
    chosen = sparse.select_blocks(q, k, block=64, topk=2)
    seen = _Seen(monkeypatch)

    def step():
        out = qkv.attention(q, k, v, mask=chosen, backend="tiled")
        out.square().sum().backward()

    grouped = matmul_flops(step)
    own = sum(T.layout.nnz for T in seen.forward)
    union = _union(chosen, q, k, steps.BLOCK_Q, steps.BLOCK_K)
    assert len(seen.forward) == 8 and 2 * own < 8 * union, (own, union)
    monkeypatch.setattr(steps, "kv_parts", lambda plan: None)  # the union layout, for scale
    monkeypatch.setattr(tiled_op, "kv_parts", lambda plan: None)
    whole = matmul_flops(step)
    assert 2 * grouped < whole, (grouped, whole)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_tiled_dropout_draws_the_reference_mask(dtype):
    # each group's dropout counter is the whole problem's b·H + h: the reference's mask, bit
    # for bit (fp64 agrees with the golden to 1e-10; one differing weight would be O(1))
    q, k, v, chosen = _problem("gqa-causal-300-block32", dtype)
    dense = _dense(chosen, q, k)
    results = []
    for backend, t, mask in (
        ("tiled", dtype, chosen),
        ("reference", dtype, dense),
        ("reference", torch.float64, dense),
    ):
        torch.manual_seed(11)
        results.append(_run(backend, *(x.to(t) for x in (q, k, v)), mask=mask, dropout_p=0.3))
    got, ref, gold = results
    assert_error_ratio(got[0], ref[0], gold[0], what="out")
    for name, a, r, g in zip(("dq", "dk", "dv"), got[2], ref[2], gold[2], strict=True):
        assert_error_ratio(a, r, g, factor=3.0, what=name)


def test_tiled_score_modifier_per_group(monkeypatch):
    # a modifier keeps the head index of the whole problem (ALiBi's slope per head)
    q, k, v, chosen = _problem("gqa-causal-300-block32")
    seen = _Seen(monkeypatch)
    _check("tiled", q, k, v, chosen, score_mod=scores.alibi(scores.alibi_slopes(4)))
    assert len(seen.forward) == len(seen.backward) == 4


def test_mask_chosen_for_fewer_kv_heads_than_k(monkeypatch):
    # index chosen for one kv head, k with two: each of k's kv heads runs the one choice
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=100, D=16)
    index = sparse.select_blocks(q, k[:, :1], block=32, topk=1).index
    chosen = chosen_blocks(index, 32, heads=4, q_len=100, kv_len=100)
    seen = _Seen(monkeypatch)
    _check("tiled", q, k, v, chosen)
    assert len(seen.forward) == 4


def test_tiled_vmap_grad_and_compile():
    q, k, v, chosen = _problem("gqa-causal-300-block32", torch.float64)

    def attend(q, k, v):
        return qkv.attention(q, k, v, mask=chosen, backend=SMALL)

    def loss(q, k, v):
        return attend(q, k, v).square().sum()

    Q, K, V = (torch.stack([t, 2 * t]) for t in (q, k, v))  # vmap folds into the batch
    out = torch.func.vmap(attend)(Q, K, V)
    for i in range(2):
        torch.testing.assert_close(out[i], attend(Q[i], K[i], V[i]), rtol=0, atol=1e-12)
    got = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad(loss(*leaves), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    for g, w in zip(got, want, strict=True):  # the same ops on the same inputs
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# -- triton (interpreter) ---------------------------------------------------------------------

TRITON_CASES = {  # shape, select_blocks arguments, TritonBackend tiles (None: its defaults)
    "gqa-causal-70-block24": (dict(H=4, Hkv=2, Nq=70, D=16), dict(block=24, topk=2), (16, 16)),
    "mha-full-40x90-block32": (
        dict(H=4, Nq=40, Nk=90, D=32, Dv=24),
        dict(block=32, topk=1, causal=False),
        (16, 32),
    ),
    "gqa-decode1-1000-block96-D256": (
        dict(H=4, Hkv=2, Nq=1, Nk=1000, D=256),
        dict(block=96, topk=2),
        None,
    ),
    "mha-decode5-1000-block96": (dict(H=4, Nq=5, Nk=1000, D=64), dict(block=96, topk=2), None),
}


def _triton(tiles):
    from qkv.kernels import TritonBackend

    return TritonBackend() if tiles is None else TritonBackend(*tiles)


def _triton_problem(case, dtype=torch.float32):
    shape, choose, tiles = TRITON_CASES[case]
    q, k, v = make_qkv(B=2, dtype=dtype, **shape)
    return q, k, v, sparse.select_blocks(q, k, **choose), _triton(tiles)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_triton_is_exact_per_group(case, dtype, monkeypatch):
    from qkv.kernels.triton import host

    q, k, v, chosen, backend = _triton_problem(case, dtype)
    built = []
    real = host.build_layout
    monkeypatch.setattr(host, "build_layout", lambda *a: built.append(real(*a)) or built[-1])
    _check(backend, q, k, v, chosen)
    assert built and all(lay.tiles is None and len(lay.groups) == 2 * k.shape[1] for lay in built)


@pytest.mark.parametrize("case", [*TRITON_CASES, "mha-8-heads-256-block32"])
def test_triton_lists_are_each_groups_own_tiles(case):
    # the kernels walk the lists of (b, h): they hold that group's kept tiles, FULL and
    # PARTIAL with their bank, rebuilding exactly the chosen pairs of (b, h); at most the
    # union's, and with 8 heads choosing apart, fewer than half (host code: no Triton needed)
    from qkv.kernels.triton import host

    from .kernels.test_triton_host import _rebuild_dense

    if case == "mha-8-heads-256-block32":
        q, k, v = make_qkv(B=2, H=8, Nq=256, D=16, seed=2)
        chosen, backend = sparse.select_blocks(q, k, block=32, topk=1), _triton((16, 16))
    else:
        q, k, v, chosen, backend = _triton_problem(case)
    plan = make_plan(q, k, v, mask=chosen)
    bm, bn = backend.config(plan).fwd_block
    lay = host.build_layout(plan, bm, bn, torch.device("cpu"))
    dense = _dense(chosen, q, k)
    B, H, G = plan.batch, plan.heads, plan.groups
    kept = lay.fwd.full_num + lay.fwd.part_num  # (B, H, query tiles)
    for b in range(B):
        for h in range(H):
            group = lay.groups[b * plan.kv_heads + h // G]
            assert int(kept[b, h].sum()) == group.nnz
            assert torch.equal(_rebuild_dense(lay, plan, b, h), dense[b, h]), (b, h)
    union = B * H * _union(chosen, q, k, bm, bn)
    assert int(kept.sum()) <= union
    if H == 8:
        assert 2 * int(kept.sum()) < union, (int(kept.sum()), union)


@needs_triton
def test_triton_dropout_draws_the_reference_mask():
    q, k, v, chosen, backend = _triton_problem("gqa-causal-70-block24")
    dense = _dense(chosen, q, k)
    results = []
    for be, t, mask in (
        (backend, torch.float32, chosen),
        ("reference", torch.float32, dense),
        ("reference", torch.float64, dense),
    ):
        torch.manual_seed(11)
        results.append(_run(be, *(x.to(t) for x in (q, k, v)), mask=mask, dropout_p=0.3))
    got, ref, gold = results
    assert_error_ratio(got[0], ref[0], gold[0], what="out")
    for name, a, r, g in zip(("dq", "dk", "dv"), got[2], ref[2], gold[2], strict=True):
        assert_error_ratio(a, r, g, factor=3.0, what=name)
