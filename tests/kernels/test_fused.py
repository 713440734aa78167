"""The fused-strips path of the tiled backend (kernels/tiled/fused.py) against the fp64 golden.

Small layout tiles (8×8), strips of at most 16 rows, windows wider than 24 keys run alone and
a small byte budget: so that N=50 already has many strips, several groups, batches cut by the
budget and padded windows. The gradient is always the tiled loop's backward.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks
from qkv.kernels import TiledBackend
from qkv.kernels.tiled import backend as tiled_mod
from qkv.kernels.tiled import fused as fused_mod
from qkv.kernels.tiled import op as tiled_op
from qkv.kernels.tiled.fused import FusedStrips

from ..helpers import assert_error_ratio, make_qkv

FUSED = TiledBackend(8, 8, fused=FusedStrips(rows=16, wide=24, budget=40_000))


def _valid(n):
    g = torch.Generator().manual_seed(3)
    valid = torch.rand(2, n, generator=g) > 0.3
    valid[0, : n // 3] = False  # left padding
    return valid


PATTERNS = {
    "causal": lambda n: masks.causal(),
    "sliding": lambda n: masks.sliding_window(5),
    "causal-local": lambda n: masks.sliding_window(6, 0),
    "dilated": lambda n: masks.dilated_window(3, 3),
    "global": lambda n: masks.global_tokens([1, n // 2]),
    "longformer": lambda n: masks.sliding_window(4) | masks.global_tokens([0, n // 2]),
    "strided": lambda n: masks.strided(5) & masks.causal(),
    "fixed": lambda n: masks.fixed(8, 2),
    "bigbird": lambda n: masks.bigbird(window=1, n_global=1, n_random=1, block=8, seed=1),
    "document": lambda n: masks.document([n // 3, n - n // 3 - 5, 5] if n >= 9 else [n]),
    "prefix_lm": lambda n: masks.prefix_lm(n // 4),
    "padding": lambda n: masks.padding([n, n // 3]),
    "key_mask": lambda n: masks.key_mask(_valid(n)),
    "and-not": lambda n: masks.causal() & ~masks.sliding_window(2),
    "from_tensor": lambda n: masks.from_tensor(
        torch.rand(n, n, generator=torch.Generator().manual_seed(0)) > 0.5
    ),
    "varlen": lambda n: masks.varlen(torch.tensor([0, n // 2, n]), torch.tensor([0, n // 2, n])),
}


def _count_calls(monkeypatch):
    """fwd: fused op calls; loop: forwards of the tiled loop; bwd: backwards of the loop."""
    calls = {"fwd": 0, "bwd": 0, "loop": 0}

    def count(key, f):
        def wrapped(*a, **kw):
            calls[key] += 1
            return f(*a, **kw)

        return wrapped

    monkeypatch.setattr(fused_mod, "fused_forward_op", count("fwd", fused_mod.fused_forward_op))
    for module in (tiled_op, tiled_mod):  # the custom op; the score-modifier path
        monkeypatch.setattr(module, "forward_loop", count("loop", module.forward_loop))
        monkeypatch.setattr(module, "backward_loop", count("bwd", module.backward_loop))
    return calls


def _check(q, k, v, dtype, be=FUSED, **kw):
    """Forward (with and without autograd: float32 gradients run the loop's forward) and q/k/v
    gradients of `be` against the fp64 golden (dense mask, reference)."""
    nq, nk = q.shape[-2], k.shape[-2]
    m = kw.pop("mask")
    with torch.no_grad():  # the inputs are finite: the fused path may run
        out_inference = qkv.attention(q, k, v, mask=m, backend=be, finite_inputs=True, **kw)
    out = qkv.attention(q, k, v, mask=m, backend=be, finite_inputs=True, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    dense = m.dense4(nq, nk)
    ref = qkv.attention(q, k, v, mask=dense, backend="reference", **kw)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    g64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    gold = qkv.attention(*g64, mask=dense, backend="reference", **kw)
    gold_grads = torch.autograd.grad(gold, g64, dout.double())
    assert_error_ratio(out_inference, ref, gold)
    assert_error_ratio(out, ref, gold)
    for name, a, r, g in zip("qkv", grads, ref_grads, gold_grads, strict=True):
        assert_error_ratio(a, r, g, factor=3.0, what=f"d{name}")
    return out, grads


@pytest.mark.parametrize("causal", [False, True], ids=["", "causal"])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern_fp32_fused_vs_golden(monkeypatch, name, causal):
    calls = _count_calls(monkeypatch)
    n = 50
    q, k, v = make_qkv(B=2, H=6, Hkv=2, Nq=n, D=8, requires_grad=True)
    _check(q, k, v, torch.float32, mask=PATTERNS[name](n), causal=causal)
    assert calls["fwd"] > 1  # the fused forward ran without autograd,
    assert calls["loop"] == 1 and calls["bwd"] == 1  # the loop's forward and backward with


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_non_contiguous_gqa_gradients(monkeypatch, dtype):
    # Regression: transposed (B, N, H, D)-strided inputs gave zero gradients, because the
    # gradients were allocated with the inputs' strides and scattered into a reshaped copy.
    calls = _count_calls(monkeypatch)
    g = torch.Generator().manual_seed(7)

    def mk(h, n=40):
        return torch.randn(2, n, h, 8, generator=g).to(dtype).transpose(1, 2).requires_grad_()

    q, k, v = mk(6), mk(2), mk(2)
    assert not q.is_contiguous()
    for m in (masks.sliding_window(5, 0), PATTERNS["longformer"](40)):
        _, grads = _check(q, k, v, dtype, mask=m)
        assert all(t.abs().sum() > 0 for t in grads)
    assert calls["fwd"] > 1 and calls["bwd"] == 2 and calls["loop"] == 2


@pytest.mark.parametrize(
    "nq,nk", [(1, 1), (3, 3), (1, 50), (17, 50), (50, 17), (97, 97)], ids=lambda x: str(x)
)
@pytest.mark.parametrize("name", ["sliding", "longformer", "bigbird", "and-not", "padding"])
def test_awkward_sizes_fp64(monkeypatch, name, nq, nk):
    if name == "bigbird" and nq > nk:
        pytest.skip("bigbird needs Nq ≤ Nk")
    calls = _count_calls(monkeypatch)
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=nq, Nk=nk, D=5, dtype=torch.float64, requires_grad=True)
    _check(q, k, v, torch.float64, mask=PATTERNS[name](nk))  # fp64: ≤ 1e-10 of the golden
    assert calls["loop"] == 1  # the gradient call (the fused forward ran if any tile is kept)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["longformer", "document", "key_mask"])
def test_low_precision(name, dtype):
    q, k, v = make_qkv(B=2, H=4, Nq=70, D=16, dtype=dtype, requires_grad=True)
    out, _ = _check(q, k, v, dtype, mask=PATTERNS[name](70), causal=name == "document")
    assert out.dtype == dtype


def test_default_settings_fp32_long_window(monkeypatch):
    # The production settings (64×64 tiles, 64-row strips, strided views of the band).
    calls = _count_calls(monkeypatch)
    n = 700
    q, k, v = make_qkv(B=1, H=2, Nq=n, D=16, requires_grad=True)
    m = masks.sliding_window(100) | masks.global_tokens([3, 400])
    _check(q, k, v, torch.float32, be=TiledBackend(), mask=m)
    assert calls["loop"] == 1 and calls["fwd"] >= 2


def test_fully_masked_rows_give_zero_and_neg_inf():
    n = 40
    q, k, v = make_qkv(B=3, H=2, Nq=n, D=8, dtype=torch.float64, requires_grad=True)
    # Row 5 (a "global" token under ~) sees nothing; batch element 2 has no real key at all.
    m = (masks.sliding_window(3) & ~masks.global_tokens([5])) & masks.padding([n, 9, 0])
    out, lse = qkv.attention(q, k, v, mask=m, backend=FUSED, return_lse=True, finite_inputs=True)
    dense = m.dense4(n, n)
    ref, ref_lse = qkv.attention(q, k, v, mask=dense, backend="reference", return_lse=True)
    empty = ~dense.expand(3, 2, n, n).any(-1)  # (B, H, Nq)
    assert empty[:, :, 5].all() and empty[2].all()
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], rtol=0, atol=1e-12)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.isfinite(dq).all() and (dq[empty] == 0).all()
    assert (dk[2] == 0).all() and (dv[2] == 0).all()


def test_rows_no_strip_computes_are_zero_and_neg_inf():
    # Query rows 0..15 see no key: their whole rows of 8×8 tiles are empty, so no strip covers
    # them and the output (allocated uninitialised) must still give 0 and −inf there.
    n = 40
    allowed = torch.rand(n, n, generator=torch.Generator().manual_seed(2)) > 0.5
    allowed[:16] = False
    m = masks.from_tensor(allowed)
    q, k, v = make_qkv(B=1, H=2, Nq=n, D=4, dtype=torch.float64)
    plan = qkv.plan.make_plan(q, k, v, mask=m)
    assert fused_mod.schedule(plan, 8, 8, FUSED.fused).uncovered.tolist() == list(range(16))
    for _ in range(2):  # the second call reuses the cached schedule (and maybe freed memory)
        out, lse = qkv.attention(
            q, k, v, mask=m, backend=FUSED, return_lse=True, finite_inputs=True
        )
        assert (out[:, :, :16] == 0).all() and torch.isneginf(lse[:, :, :16]).all()
    ref = qkv.attention(q, k, v, mask=m.dense4(n, n), backend="reference")
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_lse_gradient_is_exact(monkeypatch):
    # The op has no lse gradient; the loop's backward, which the fused path runs, has.
    q, k, v = make_qkv(B=1, H=4, Hkv=2, Nq=30, D=4, dtype=torch.float64, requires_grad=True)
    m = PATTERNS["longformer"](30)
    grads = []
    for be in ("reference", FUSED):
        mask = m.dense4(30, 30) if be == "reference" else m
        out, lse = qkv.attention(q, k, v, mask=mask, backend=be, return_lse=True)
        loss = out.square().sum() + lse.sum()
        grads.append(torch.autograd.grad(loss, (q, k, v)))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_gradcheck_fp64():
    q, k, v = make_qkv(B=1, H=2, Hkv=1, Nq=14, D=3, dtype=torch.float64, requires_grad=True)
    m = PATTERNS["longformer"](14)
    be = TiledBackend(4, 4, fused=FusedStrips(rows=8, wide=8, budget=1_000))
    assert torch.autograd.gradcheck(
        lambda q, k, v: qkv.attention(q, k, v, mask=m, backend=be), (q, k, v)
    )


def test_no_nq_by_nk_tensor():
    # The masks built are O(N · window): each (strips, 1, rows, width) with rows × width within
    # one strip's window, and all of them together far below N².
    n, w = 2048, 32
    q, k, v = make_qkv(B=1, H=2, Nq=n, D=8)
    m = masks.sliding_window(w)
    plan = qkv.plan.make_plan(q, k, v, mask=m)
    sched = fused_mod.schedule(plan, 64, 64, FusedStrips())
    shapes = [
        tuple(mask.shape)
        for i in range(len(sched.batches))
        for mask, _ in [sched.mask(i, None, plan)]
        if mask is not None
    ]
    assert shapes
    assert max(s[-2] * s[-1] for s in shapes) <= 128 * (128 + 2 * w + 2 * 64)
    distinct = sum(torch.Size(s[1:]).numel() for s in shapes)  # a band's mask is broadcast
    assert distinct <= n * (128 + 2 * w + 2 * 64)
    assert max(torch.Size(s).numel() for s in shapes) < n * n // 8


@pytest.mark.parametrize(
    "kw,why",
    [
        (dict(dropout_p=0.2), "dropout"),
        (dict(score_mod=qkv.scores.softcap(5.0)), "score modifiers"),
        (dict(dv=6), "Dv == D"),
        (dict(nan_v=True), "NaN/inf"),
    ],
    ids=["dropout", "score_mod", "dv", "nan"],
)
def test_falls_back_to_the_loop(monkeypatch, kw, why):
    calls = _count_calls(monkeypatch)
    kw = dict(kw)
    q, k, v = make_qkv(B=1, H=2, Nq=30, D=4, Dv=kw.pop("dv", 4), dtype=torch.float64)
    m = masks.sliding_window(3)
    if kw.pop("nan_v", False):
        v[:, :, 20] = torch.nan  # only query rows 17..23 see it
    plan = qkv.plan.make_plan(q, k, v, mask=m, **kw)
    assert why in FUSED.fused_reason(plan, q, k, v)
    torch.manual_seed(0)
    out = qkv.attention(q, k, v, mask=m, backend=FUSED, **kw)
    torch.manual_seed(0)
    ref = qkv.attention(q, k, v, mask=m.dense4(30, 30), backend="reference", **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12, equal_nan=True)
    assert calls["fwd"] == 0 and calls["loop"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_inference_runs_fused_training_runs_the_loop(monkeypatch, dtype):
    # Training needs what the loop's forward keeps for its backward: a float64 lse (the fused
    # op's float32 one put float32 gradients beyond the error bound) and the one-hot rows.
    calls = _count_calls(monkeypatch)
    q, k, v = make_qkv(B=1, H=2, Nq=30, D=4, dtype=dtype, requires_grad=True)
    m = masks.sliding_window(5)
    with torch.no_grad():
        qkv.attention(q, k, v, mask=m, backend="tiled", finite_inputs=True)
        plan = qkv.plan.make_plan(q, k, v, mask=m, finite_inputs=True)
        assert TiledBackend().fused_reason(plan, q, k, v) is None
    assert calls["fwd"] > 0 and calls["loop"] == 0
    fwd = calls["fwd"]
    out = qkv.attention(q, k, v, mask=m, backend="tiled", finite_inputs=True)  # with grad
    assert calls["fwd"] == fwd and calls["loop"] == 1 and calls["bwd"] == 0
    plan = qkv.plan.make_plan(q, k, v, mask=m, finite_inputs=True)
    assert "gradients" in TiledBackend().fused_reason(plan, q, k, v)
    out.float().sum().backward()
    assert calls["bwd"] == 1 and q.grad is not None and q.grad.abs().sum() > 0


def test_fused_false_runs_the_loop(monkeypatch):
    calls = _count_calls(monkeypatch)
    q, k, v = make_qkv(B=1, H=2, Nq=30, D=4)
    be = TiledBackend(8, 8, fused=False)
    assert be.fused_reason(qkv.plan.make_plan(q, k, v, mask=masks.causal()), q, k, v)
    qkv.attention(q, k, v, mask=masks.causal(), backend=be)
    assert calls["fwd"] == 0 and calls["loop"] > 0
    assert "fused=False" in repr(be) and "fused=FusedStrips" in repr(FUSED)
    assert "fused" not in repr(TiledBackend())  # the default
    assert "fused" not in repr(TiledBackend(fused=True))
    with pytest.raises(TypeError, match="fused"):
        TiledBackend(fused="yes")
    with pytest.raises(ValueError, match="rows"):
        FusedStrips(rows=0)


def test_strips_are_sized_from_the_problem(monkeypatch):
    """The default backend sizes its strips from the plan: packed segments (document, varlen)
    run in segment-long strips, which the fused op receives as such; other masks in the
    default ones; settings given to the backend are kept as they are."""
    seen = []
    real = fused_mod.schedule
    monkeypatch.setattr(
        fused_mod, "schedule", lambda plan, bq, bk, cfg: seen.append(cfg) or real(plan, bq, bk, cfg)
    )
    q, k, v = make_qkv(B=1, H=2, Nq=300, D=8)
    cu = torch.tensor([0, 100, 300])
    cases = [
        (masks.document([100, 200]), tiled_mod.SEGMENT_STRIPS),
        (masks.varlen(cu, cu), tiled_mod.SEGMENT_STRIPS),
        (masks.sliding_window(20), FusedStrips()),
    ]
    assert FusedStrips() != tiled_mod.SEGMENT_STRIPS
    for mask, want in cases:
        plan = qkv.plan.make_plan(q, k, v, mask=mask, finite_inputs=True)
        assert TiledBackend().strips_for(plan) == want
        assert FUSED.strips_for(plan) is FUSED.fused
        assert TiledBackend(fused=False).strips_for(plan) is None
        with torch.no_grad():
            qkv.attention(q, k, v, mask=mask, backend="tiled", finite_inputs=True)
        assert seen.pop() == want
