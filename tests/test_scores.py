"""qkv.scores: modifiers applied inside the tiles equal the same bias applied densely."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks, scores
from qkv.kernels import TiledBackend

from .helpers import assert_error_ratio, cpu_kernel_or, make_qkv

SMALL = TiledBackend(8, 8, max_rows=16, max_cols=16)


def _positions(nq, nk):
    qpos = torch.arange(nq).view(nq, 1) + (nk - nq)
    return qpos, torch.arange(nk).view(1, nk)


def test_alibi_is_minus_slope_times_distance():
    q, k, v = make_qkv(B=1, H=4, Nq=9, Nk=12, D=8, dtype=torch.float64)
    slopes = scores.alibi_slopes(4)
    st = qkv.reference.steps(q, k, v, score_mod=scores.alibi(slopes))
    plain = qkv.reference.steps(q, k, v)
    qpos, kpos = _positions(9, 12)
    bias = -slopes.view(4, 1, 1).double() * (qpos - kpos).abs()
    torch.testing.assert_close(st.S_scaled, plain.S_scaled + bias, rtol=0, atol=1e-12)


def test_alibi_slopes_follow_the_paper():
    torch.testing.assert_close(
        scores.alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)])
    )
    assert scores.alibi_slopes(6).shape == (6,)


def test_softcap_bounds_scores():
    q, k, v = make_qkv(B=1, H=2, Nq=10, D=8, dtype=torch.float64)
    st = qkv.reference.steps(q * 50, k, v, score_mod=scores.softcap(5.0))
    raw = qkv.reference.steps(q * 50, k, v).S_scaled
    torch.testing.assert_close(st.S_scaled, 5.0 * torch.tanh(raw / 5.0), rtol=0, atol=1e-12)
    assert st.S_scaled.abs().max() <= 5.0  # tanh saturates to exactly ±cap in fp64


def test_relative_bias_reads_the_table_by_clipped_distance():
    table = torch.arange(2 * 7 * 2 + 2, dtype=torch.float64).view(2, 15)
    q, k, v = make_qkv(B=1, H=2, Nq=20, D=4, dtype=torch.float64)
    st = qkv.reference.steps(q, k, v, score_mod=scores.relative_bias(table, 7))
    plain = qkv.reference.steps(q, k, v)
    qpos, kpos = _positions(20, 20)
    idx = (kpos - qpos).clamp(-7, 7) + 7
    torch.testing.assert_close(st.S_scaled, plain.S_scaled + table[:, idx], rtol=0, atol=1e-12)


def _mods(H, dtype=torch.float32):
    table = (torch.randn(H, 11, generator=torch.Generator().manual_seed(9)) * 0.5).to(dtype)
    table.requires_grad_()
    return {
        "alibi": (scores.alibi(scores.alibi_slopes(H)), None),
        "softcap": (scores.softcap(1.5), None),
        "relative": (scores.relative_bias(table, 5), table),
        "composed": (
            scores.compose(
                scores.alibi(scores.alibi_slopes(H)),
                scores.relative_bias(table, 5),
                scores.softcap(2.0),
            ),
            table,
        ),
    }


@pytest.mark.parametrize("mask", [None, "longformer"])
@pytest.mark.parametrize("name", ["alibi", "softcap", "relative", "composed"])
def test_tiled_score_mods_match_reference(name, mask):
    be = "tiled"
    H = 4
    mod, table = _mods(H)[name]
    q, k, v = make_qkv(B=2, H=H, Hkv=2, Nq=45, Nk=53, D=8, requires_grad=True)
    m = masks.sliding_window(6) | masks.global_tokens([0]) if mask else None
    inputs = (q, k, v) if table is None else (q, k, v, table)
    dout = torch.randn(2, H, 45, 8, generator=torch.Generator().manual_seed(1))

    def run(backend, tensors, dt):
        qq, kk, vv = tensors[:3]
        mm = m.dense4(45, 53) if (m is not None and backend == "reference") else m
        out = qkv.attention(qq, kk, vv, causal=True, mask=mm, score_mod=mod, backend=backend)
        return out, torch.autograd.grad(out, tensors, dout.to(dt))

    out, grads = run(be, inputs, torch.float32)
    ref, ref_grads = run("reference", inputs, torch.float32)
    g64 = [t.detach().double().requires_grad_() for t in inputs[:3]]
    if table is not None:  # the golden reads the same (fp32) table: differentiate it too
        g64.append(table)
    gold, gold_grads = run("reference", g64, torch.float64)
    assert_error_ratio(out, ref, gold)
    for a, r, g in zip(grads, ref_grads, gold_grads, strict=True):
        assert_error_ratio(a, r, g.to(torch.float64), factor=3.0, what="grad")
    if table is not None:
        assert grads[-1].abs().sum() > 0


@pytest.mark.parametrize("name", ["alibi", "softcap", "relative", "composed"])
def test_small_tiles_fp64_exact(name):
    # Tiny tiles stress the online softmax across many runs; in fp64 they must be exact.
    # (In fp32 their sequential accumulation over many tiny runs is not comparable with one
    # GEMM's, so the error-ratio rule is applied to the default tiles above.)
    mod, table = _mods(4, torch.float64)[name]
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=45, Nk=53, D=8, dtype=torch.float64, requires_grad=True)
    m = masks.sliding_window(6) | masks.global_tokens([0])
    inputs = (q, k, v) if table is None else (q, k, v, table)
    results = []
    for be, mm in ((SMALL, m), ("reference", m.dense4(45, 53))):
        out = qkv.attention(q, k, v, causal=True, mask=mm, score_mod=mod, backend=be)
        results.append((out, *torch.autograd.grad(out.sum(), inputs)))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_relative_bias_table_gradcheck_through_tiled():
    table = torch.randn(2, 7, dtype=torch.float64, requires_grad=True)
    q, k, v = make_qkv(B=1, H=2, Nq=9, D=4, dtype=torch.float64, requires_grad=True)
    be = TiledBackend(4, 4, max_rows=4, max_cols=4)

    def f(q, k, v, table):
        return qkv.attention(
            q, k, v, causal=True, score_mod=scores.relative_bias(table, 3), backend=be
        )

    assert torch.autograd.gradcheck(f, (q, k, v, table))


def test_sdpa_cannot_take_a_score_mod():
    q, k, v = make_qkv(B=1, H=2, Nq=5, D=4)
    with pytest.raises(NotImplementedError, match="no score modifiers"):
        qkv.attention(q, k, v, score_mod=scores.softcap(3.0), backend="sdpa")
    assert qkv.dispatch(q, k, v, score_mod=scores.softcap(3.0)).name == cpu_kernel_or("tiled")


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: scores.softcap(0), ValueError, r"cap must be a number > 0, got 0"),
        (lambda: scores.softcap(float("inf")), ValueError, r"cap must be finite"),
        (
            lambda: scores.relative_bias(torch.zeros(2, 5), 3),
            ValueError,
            r"table must have shape \(H, 2·max_distance \+ 1\) = \(H, 7\), got \(2, 5\)",
        ),
        (
            lambda: scores.relative_bias(torch.zeros(2, 7), -1),
            ValueError,
            r"max_distance must be an int ≥ 0",
        ),
        (lambda: scores.alibi([]), ValueError, r"slopes must be a non-empty tensor"),
        (lambda: scores.alibi_slopes(0), ValueError, r"n_heads must be a positive int"),
        (
            lambda: scores.compose(scores.softcap(1.0), "x"),
            TypeError,
            r"compose takes ScoreMod objects",
        ),
    ],
)
def test_bad_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_head_count_mismatch_and_wrong_type():
    q, k, v = make_qkv(B=1, H=4, Nq=5, D=4)
    with pytest.raises(ValueError, match=r"is written for 8 heads, got H=4"):
        qkv.attention(q, k, v, score_mod=scores.alibi(scores.alibi_slopes(8)))
    with pytest.raises(TypeError, match=r"score_mod must be a qkv.scores.ScoreMod or None"):
        qkv.attention(q, k, v, score_mod=lambda s, b, h, i, j: s)


def test_builtin_modifiers_describe_themselves_for_compiled_kernels():
    table = torch.zeros(2, 5, requires_grad=True)
    slopes = scores.alibi_slopes(2)
    mod = scores.compose(scores.alibi(slopes), scores.softcap(3.0), scores.relative_bias(table, 2))
    kinds = [p[0] for p in mod.parts]
    assert kinds == ["alibi", "softcap", "rel"]
    assert torch.equal(mod.parts[0][1], slopes.double()) and mod.parts[1][1] == 3.0
    assert mod.parts[2][1] is table and mod.parts[2][2] == 2
    custom = scores.ScoreMod(lambda s, b, h, q, kv: s)
    assert custom.parts is None and scores.compose(scores.softcap(1.0), custom).parts is None
