"""The triton backend's host side, which needs neither a GPU nor Triton itself: every `why_not`
reason, `auto` never picking it on CPU tensors, the modifiers it recognises, and the tile
lists and bank the kernels walk (rebuilt into a dense mask and compared with the rule)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import qkv
from qkv import masks, scores
from qkv.kernels import BACKENDS, TritonBackend
from qkv.kernels.triton import backend as triton_backend
from qkv.kernels.triton import host as triton_mod
from qkv.masks import EMPTY, FULL
from qkv.plan import make_plan

from ..helpers import cpu_kernel_or, make_qkv


@pytest.fixture
def as_if_interpreting(monkeypatch):
    """Pretend triton is installed and its interpreter on: only the request decides."""
    monkeypatch.setattr(triton_backend, "triton_available", lambda: True)
    monkeypatch.setattr(triton_backend, "interpreting", lambda: True)


def _why(q, k, v, **kw):
    plan = make_plan(q, k, v, **{"finite_inputs": True, **kw})  # random normals: finite
    return TritonBackend().why_not(plan, q, k, v)


def test_not_installed_reason(monkeypatch):
    monkeypatch.setattr(triton_backend, "triton_available", lambda: False)
    why = _why(*make_qkv(B=1, H=1, Nq=4, D=8))
    assert why.startswith("triton is not installed") and "pip install" in why
    with pytest.raises(NotImplementedError, match="triton is not installed"):
        qkv.attention(*make_qkv(B=1, H=1, Nq=4, D=8), backend="triton")


def test_cpu_without_interpreter_reason(monkeypatch):
    monkeypatch.setattr(triton_backend, "triton_available", lambda: True)
    monkeypatch.setattr(triton_backend, "interpreting", lambda: False)
    why = _why(*make_qkv(B=1, H=1, Nq=4, D=8))
    assert "tensors are on the CPU" in why and "runs on CUDA" in why
    assert "TRITON_INTERPRET=1" in why


@pytest.mark.usefixtures("as_if_interpreting")
@pytest.mark.parametrize(
    "make,expected",
    [
        (lambda: (make_qkv(D=8), dict(return_weights=True)), "never materialises"),
        (lambda: (make_qkv(D=8, dtype=torch.float64), dict()), "float64"),
        (lambda: (make_qkv(Nq=3, D=300), dict()), "head dims up to 256"),
        (lambda: (make_qkv(Nq=3, D=8, Dv=260), dict()), "Dv=260"),
        (
            lambda: (make_qkv(D=8), dict(mask=torch.zeros(33, 33, requires_grad=True))),
            "does not differentiate a float mask",
        ),
        (
            lambda: (make_qkv(D=8), dict(score_mod=scores.ScoreMod(lambda s, b, h, q, kv: s))),
            "Triton cannot compile",
        ),
        (
            lambda: (
                make_qkv(D=8),
                dict(score_mod=scores.compose(scores.softcap(2.0), scores.softcap(3.0))),
            ),
            "at most one softcap",
        ),
    ],
    ids=["weights", "fp64", "D", "Dv", "bias-grad", "custom-mod", "two-softcaps"],
)
def test_refusals(make, expected):
    (q, k, v), kw = make()
    why = _why(q, k, v, **kw)
    assert why is not None and expected in why
    with pytest.raises(NotImplementedError, match="backend='triton' cannot run this request"):
        qkv.attention(q, k, v, backend="triton", **kw)


@pytest.mark.usefixtures("as_if_interpreting")
def test_masked_requests_need_no_finite_promise():
    # The kernels keep NaN/inf of masked k/v slots out of every row themselves
    # (test_triton_masked_slots.py), so the promise decides nothing, masked or not.
    q, k, v = make_qkv(B=1, H=2, Nq=9, D=8)
    for causal in (False, True):
        for finite in (False, True):
            assert _why(q, k, v, causal=causal, finite_inputs=finite) is None


@pytest.mark.usefixtures("as_if_interpreting")
def test_accepted_requests():
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=9, Nk=12, D=40, Dv=24, dtype=torch.bfloat16)
    for kw in (
        dict(causal=True, return_lse=True),
        dict(mask=masks.sliding_window(3), dropout_p=0.1),
        dict(mask=torch.rand(9, 12) > 0.5),
        dict(mask=torch.randn(9, 12)),
        dict(score_mod=scores.compose(scores.alibi(scores.alibi_slopes(4)), scores.softcap(5.0))),
        dict(score_mod=scores.relative_bias(torch.zeros(4, 7, requires_grad=True), 3)),
    ):
        assert _why(q, k, v, **kw) is None, kw


@pytest.mark.usefixtures("as_if_interpreting")
def test_auto_never_picks_triton_on_cpu():
    q, k, v = make_qkv(B=1, H=2, Nq=9, D=8)
    d = qkv.dispatch(q, k, v, return_lse=True)  # sdpa cannot; triton could but must not
    assert d.name == cpu_kernel_or("tiled")
    if d.name == "tiled":  # (the compiled CPU kernel, where built, comes before triton)
        assert "interpreter" in d.reasons["triton"] and "auto never picks it" in d.reasons["triton"]
    assert list(BACKENDS).index("sdpa") < list(BACKENDS).index("triton")
    assert list(BACKENDS).index("triton") < list(BACKENDS).index("tiled")


def test_import_qkv_does_not_import_triton():
    code = "import sys, qkv; qkv.dispatch(*[__import__('torch').randn(2, 4)] * 3); "
    code += "assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_backend_arguments_are_checked():
    with pytest.raises(ValueError, match="power of two"):
        TritonBackend(48, 16)
    with pytest.raises(ValueError, match="≥ 16"):
        TritonBackend(8, 16)
    with pytest.raises(ValueError, match="num_warps"):
        TritonBackend(num_warps=0)
    assert repr(TritonBackend(32, 16, num_warps=4)) == (
        "TritonBackend(block_m=32, block_n=16, num_warps=4)"
    )


# -- score modifiers ---------------------------------------------------------------------------


def test_mod_spec_orders_additive_terms_around_the_softcap():
    slopes = scores.alibi_slopes(4)
    table = torch.zeros(1, 5)
    spec = triton_mod.mod_spec(
        scores.compose(scores.alibi(slopes), scores.softcap(3.0), scores.relative_bias(table, 2))
    )
    assert (spec.alibi, spec.rel, spec.cap, spec.max_distance) == (1, 2, 3.0, 2)
    assert spec.table is table and torch.equal(spec.slopes, slopes.double())
    spec = triton_mod.mod_spec(scores.alibi(slopes))
    assert (spec.alibi, spec.rel, spec.cap) == (1, 0, None)


# -- tile lists and bank -----------------------------------------------------------------------


def _rebuild_dense(lay, plan, b, h):
    """The allowed matrix as the kernels see it: from the lists, the causal rule and the bank."""
    nq, nk, bm, bn = plan.q_len, plan.kv_len, lay.block_m, lay.block_n
    dense = torch.zeros(nq, nk, dtype=torch.bool)
    lb, lh = b * lay.lay_b, h * lay.lay_h
    rows = torch.arange(nq).view(-1, 1)
    cols = torch.arange(nk)
    causal_ok = (
        cols <= rows + (nk - nq) if plan.pairs.causal else torch.ones(nq, nk, dtype=torch.bool)
    )
    bank = lay.bank.cpu() if lay.bank is not None else None
    for i in range(lay.fwd.full_num.shape[2]):
        r0, r1 = i * bm, min((i + 1) * bm, nq)
        for t in range(int(lay.fwd.full_num[lb, lh, i])):
            j = int(lay.fwd.full_idx[lb, lh, i, t])
            dense[r0:r1, j * bn : min((j + 1) * bn, nk)] = True
        for t in range(int(lay.fwd.part_num[lb, lh, i])):
            j = int(lay.fwd.part_idx[lb, lh, i, t])
            code = int(lay.fwd.part_code[lb, lh, i, t])
            c0, c1 = j * bn, min((j + 1) * bn, nk)
            ok = causal_ok[r0:r1, c0:c1].clone()
            if code >= 0:
                ok &= bank[code, : r1 - r0, : c1 - c0].bool()
            dense[r0:r1, c0:c1] = ok
    return dense


@pytest.mark.parametrize(
    "shape,kw",
    [
        (dict(B=1, H=2, Nq=37, Nk=45), dict(causal=True)),
        (dict(B=1, H=2, Nq=45, Nk=19), dict(causal=True)),
        (dict(B=1, H=2, Nq=70), dict(mask=masks.sliding_window(9))),
        (dict(B=1, H=2, Nq=70), dict(mask=masks.sliding_window(9), causal=True)),
        (dict(B=1, H=2, Nq=55), dict(mask=masks.document([20, 3, 32]))),
        (dict(B=2, H=2, Nq=40), dict(mask=masks.padding([40, 13]))),
        (dict(B=1, H=2, Nq=50), dict(mask=masks.prefix_lm(10) & masks.sliding_window(20))),
        (dict(B=2, H=3, Nq=29, Nk=35), dict(mask="bool")),
    ],
    ids=["causal", "causal-Nq>Nk", "window", "window-causal", "document", "padding", "and", "b"],
)
@pytest.mark.parametrize("tiles", [(16, 16), (32, 16), (16, 32)])
def test_lists_and_bank_rebuild_the_mask(shape, kw, tiles):
    q, k, v = make_qkv(**shape, D=8)
    if kw.get("mask") == "bool":
        m = torch.rand(shape["B"], 3, 29, 35, generator=torch.Generator().manual_seed(0)) > 0.5
        m[:, :, :, 16:32] = False
        kw = {**kw, "mask": m}
    plan = make_plan(q, k, v, **kw)
    lay = triton_mod.build_layout(plan, *tiles, torch.device("cpu"))
    want = qkv.attention(
        *(t.double() for t in (q, k, v)), backend="reference", return_weights=True, **kw
    )[1]
    for b in range(plan.batch):
        for h in range(plan.heads):
            # where the reference gives weight > 0 the kernel must allow, and vice versa
            got = _rebuild_dense(lay, plan, b, h)
            assert torch.equal(got, want[b, h] > 0), (b, h)
    # full and partial lists cover exactly the kept tiles (once per (b, h) list); the
    # transposed lists too
    lists = lay.fwd.full_num.shape[0] * lay.fwd.full_num.shape[1]
    kept = int((lay.tiles.kind != EMPTY).sum())
    assert kept == lay.tiles.nnz
    assert int(lay.fwd.full_num.sum()) <= lists * int((lay.tiles.kind == FULL).sum())
    assert int(lay.fwd.full_num.sum() + lay.fwd.part_num.sum()) == lists * kept
    assert int(lay.bwd.full_num.sum() + lay.bwd.part_num.sum()) == lists * kept


def test_layouts_of_a_mask_are_cached_per_object():
    q, k, v = make_qkv(B=1, H=2, Nq=64, D=8)
    rule = masks.sliding_window(8)
    plan = make_plan(q, k, v, mask=rule)
    a = triton_mod.layout_for_device(plan, 16, 16, torch.device("cpu"))
    assert triton_mod.layout_for_device(plan, 16, 16, torch.device("cpu")) is a
    other = make_plan(q, k, v, mask=masks.sliding_window(8))
    assert triton_mod.layout_for_device(other, 16, 16, torch.device("cpu")) is not a
    dense = make_plan(q, k, v, mask=torch.ones(64, 64, dtype=torch.bool))
    b1 = triton_mod.layout_for_device(dense, 16, 16, torch.device("cpu"))
    assert (
        triton_mod.layout_for_device(dense, 16, 16, torch.device("cpu")) is not b1
    )  # never cached
