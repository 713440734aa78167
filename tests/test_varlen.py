"""qkv.attention_varlen: packed sequences equal attention run on each sequence alone."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.kernels import TiledBackend


def _packed(lq, lk, H=4, Hkv=2, D=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    cq = torch.tensor([0, *lq]).cumsum(0)
    ck = torch.tensor([0, *lk]).cumsum(0)
    q = torch.randn(sum(lq), H, D, generator=g, dtype=dtype)
    k = torch.randn(sum(lk), Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(sum(lk), Hkv, D + 2, generator=g, dtype=dtype)
    return q, k, v, cq, ck


def _per_sequence(q, k, v, cq, ck, causal):
    outs, lses = [], []
    for s in range(len(cq) - 1):
        qs = q[cq[s] : cq[s + 1]].transpose(0, 1)
        ks, vs = (t[ck[s] : ck[s + 1]].transpose(0, 1) for t in (k, v))
        o, lse = qkv.attention(qs, ks, vs, causal=causal, backend="reference", return_lse=True)
        outs.append(o.transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize(
    "be", ["auto", TiledBackend(4, 4, max_rows=8, max_cols=8)], ids=["auto", "small"]
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", [([5, 0, 17, 9], [7, 3, 17, 20]), ([1], [1]), ([30, 2], [30, 2])])
def test_matches_each_sequence_alone(lq, lk, causal, be):
    q, k, v, cq, ck = _packed(lq, lk)
    out, lse = qkv.attention_varlen(q, k, v, cq, ck, causal=causal, backend=be, return_lse=True)
    ref, ref_lse = _per_sequence(q, k, v, cq, ck, causal)
    assert out.shape == (sum(lq), 4, 10) and lse.shape == (4, sum(lq))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)


def test_gradients_match_each_sequence_alone():
    q, k, v, cq, ck = _packed([6, 11], [9, 11])
    for t in (q, k, v):
        t.requires_grad_()
    out = qkv.attention_varlen(q, k, v, cq, ck, causal=True)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref, _ = _per_sequence(q, k, v, cq, ck, True)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_only_block_diagonal_tiles_are_kept():
    # 8 sequences of 64: with 64×64 tiles only the 8 diagonal tiles hold allowed pairs.
    cu = torch.arange(9) * 64
    layout = qkv.masks.varlen(cu, cu).blocks(512, 512, 64, 64)
    assert int((layout.kind != 0).sum()) == 8


@pytest.mark.parametrize(
    "cq,ck,match",
    [
        (
            torch.tensor([0, 5, 3]),
            torch.tensor([0, 5, 8]),
            r"cu_seqlens_q must start at 0 and never decrease",
        ),
        (torch.tensor([1, 5]), torch.tensor([0, 5]), r"cu_seqlens_q must start at 0"),
        (torch.tensor([0, 5]), torch.tensor([0, 2, 5]), r"same number of sequences, got 1 and 2"),
        (
            torch.tensor([0, 4]),
            torch.tensor([0, 5]),
            r"cu_seqlens describe 4 query and 5 key tokens, got Nq=5, Nk=5",
        ),
    ],
)
def test_bad_cu_seqlens(cq, ck, match):
    q, k, v, _, _ = _packed([5], [5])
    with pytest.raises(ValueError, match=match):
        qkv.attention_varlen(q, k, v, cq, ck)


def test_bad_layout_and_dtype():
    q, k, v, cq, ck = _packed([5], [5])
    with pytest.raises(ValueError, match=r"q must have shape \(total_tokens, heads, dim\)"):
        qkv.attention_varlen(q[None], k, v, cq, ck)
    with pytest.raises(TypeError, match=r"cu_seqlens_q must be an int32/int64 tensor"):
        qkv.attention_varlen(q, k, v, cq.float(), ck)
