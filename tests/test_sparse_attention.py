"""Attention with qkv.masks: the block-sparse tiled path against the reference on to_dense()."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks
from qkv.kernels import TiledBackend

from .helpers import assert_error_ratio, cpu_kernel_or, make_qkv, matmul_flops

SMALL = TiledBackend(8, 8, max_rows=16, max_cols=16)
PATTERNS = {
    "window": lambda n: masks.sliding_window(5),
    "causal-local": lambda n: masks.sliding_window(6, 0),
    "longformer": lambda n: masks.sliding_window(4) | masks.global_tokens([0, n // 2]),
    "bigbird": lambda n: masks.bigbird(window=1, n_global=1, n_random=1, block=8, seed=1),
    "document": lambda n: masks.document([n // 3, n - n // 3 - 5, 5]),
    "prefix_lm": lambda n: masks.prefix_lm(n // 4),
    "strided": lambda n: masks.strided(5) & masks.causal(),
    "fixed": lambda n: masks.fixed(8, 2),
    "dilated": lambda n: masks.dilated_window(3, 3),
    "and-not": lambda n: masks.causal() & ~masks.sliding_window(2),
}


def _dense_reference(q, k, v, m, **kw):
    nq, nk = q.shape[-2], k.shape[-2]
    return qkv.attention(q, k, v, mask=m.dense4(nq, nk), backend="reference", **kw)


@pytest.mark.parametrize("be", ["auto", "tiled", SMALL], ids=["auto", "tiled", "small"])
@pytest.mark.parametrize("causal", [False, True], ids=["", "causal"])
@pytest.mark.parametrize("n", [1, 3, 50])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern_matches_reference_on_dense_mask(name, n, causal, be):
    # Tiny sizes run in fp64 (exact to 1e-10): there a row often has one or two keys, where
    # autograd's softmax gradient is exactly 0 but FlashAttention's dS = P ∘ (dP − D) rounds
    # in fp32, so the fp32 error ratio would compare against an unrepresentatively exact
    # reference.
    dtype = torch.float64 if n < 8 else torch.float32
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=n, D=8, requires_grad=True, dtype=dtype)
    m = masks.document([n]) if name == "document" and n < 9 else PATTERNS[name](n)
    out = qkv.attention(q, k, v, mask=m, causal=causal, backend=be)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = _dense_reference(q, k, v, m, causal=causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    g64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    gold = _dense_reference(*g64, m, causal=causal)
    gold_grads = torch.autograd.grad(gold, g64, dout.double())
    assert_error_ratio(out, ref, gold)
    for name_, a, r, g in zip("qkv", grads, ref_grads, gold_grads, strict=True):
        assert_error_ratio(a, r, g, factor=3.0, what=f"d{name_}")


@pytest.mark.parametrize("name", ["longformer", "document", "bigbird"])
def test_pattern_fp64_nq_lt_nk_gqa_and_lse(name):
    q, k, v = make_qkv(B=1, H=6, Hkv=2, Nq=37, Nk=90, D=8, dtype=torch.float64)
    m = PATTERNS[name](90)
    out, lse = qkv.attention(q, k, v, mask=m, backend=SMALL, return_lse=True)
    ref, ref_lse = _dense_reference(q, k, v, m, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["longformer", "document"])
def test_gradcheck_fp64(name):
    q, k, v = make_qkv(B=1, H=2, Nq=20, D=4, dtype=torch.float64, requires_grad=True)
    m = PATTERNS[name](20)
    be = TiledBackend(4, 4, max_rows=8, max_cols=8)
    assert torch.autograd.gradcheck(
        lambda q, k, v: qkv.attention(q, k, v, mask=m, backend=be), (q, k, v)
    )


def test_key_mask_with_left_and_right_padding():
    q, k, v = make_qkv(B=2, H=2, Nq=30, D=8, dtype=torch.float64)
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[0, :11] = False  # left padding
    valid[1, 19:] = False  # right padding
    m = masks.key_mask(valid)
    out = qkv.attention(q, k, v, mask=m, causal=True, backend=SMALL)
    ref = _dense_reference(q, k, v, m, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_padding_mask_per_batch_element():
    q, k, v = make_qkv(B=3, H=2, Nq=30, D=8, dtype=torch.float64)
    m = masks.padding([30, 7, 0])
    out = qkv.attention(q, k, v, mask=m, backend=SMALL)
    torch.testing.assert_close(out, _dense_reference(q, k, v, m), rtol=0, atol=1e-12)
    assert (out[2] == 0).all()  # no real key at all: every row fully masked


def test_dropout_with_mask_equals_reference():
    q, k, v = make_qkv(B=1, H=2, Nq=40, D=8, dtype=torch.float64)
    m = PATTERNS["longformer"](40)
    torch.manual_seed(4)
    got = qkv.attention(q, k, v, mask=m, dropout_p=0.3, backend=SMALL)
    torch.manual_seed(4)
    ref = qkv.attention(q, k, v, mask=m, dropout_p=0.3, backend="reference")
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_auto_sends_a_mask_to_tiled_and_says_why():
    q, k, v = make_qkv(B=1, H=2, Nq=40, D=8)
    d = qkv.dispatch(q, k, v, mask=masks.sliding_window(4), finite_inputs=True)
    assert d.name == cpu_kernel_or("tiled")
    if d.name == "tiled":  # (with the compiled kernel, it comes first and sdpa is not asked)
        assert "dense Nq×Nk mask" in d.reasons["sdpa"]
    # Asked for by name, sdpa runs it through the dense mask.
    out = qkv.attention(q, k, v, mask=masks.sliding_window(4), backend="sdpa", finite_inputs=True)
    torch.testing.assert_close(out, _dense_reference(q, k, v, masks.sliding_window(4)))


def test_empty_tiles_are_never_computed():
    n, b = 256, 16
    m = masks.sliding_window(16)
    q, k, v = make_qkv(B=1, H=1, Nq=n, D=4)
    be = TiledBackend(b, b, max_rows=b, max_cols=4 * b, fused=False)  # the loop, unmerged
    lay = m.blocks(n, n, b, b)
    assert lay.nnz == 16 * 3 - 2  # the band: 3 tiles a row, 2 at the ends
    flops = matmul_flops(lambda: qkv.attention(q, k, v, mask=m, backend=be))
    # Q Kᵀ and P V on the kept tiles, and the partial tiles' count of non-finite values
    partial = int((~lay.full).sum())
    assert flops == (lay.nnz * 2 + partial) * (2 * b * b * 4)
