"""A NaN in a query row reaches that row on the compiled kernel, as in the formula: the row
maxima pass over NaN (max(NaN, x) is x), so a row whose scores are all NaN looked empty and
came back as zeros, and `auto` now sends small requests to the kernel."""

from __future__ import annotations

import pytest
import torch

import qkv

from .cpu_kernel import require_kernel

OPS, ISA = require_kernel()


@pytest.mark.parametrize(
    "shape",
    [
        (1, 1, 1, 8, 1, 8, False),  # one key: a partial tile
        (1, 2, 2, 8, 40, 8, False),
        (1, 4, 2, 1, 5000, 64, False),  # decoding: the row is split across threads and merged
        (1, 2, 2, 300, 300, 64, True),
        (2, 6, 2, 97, 200, 40, True),  # grouped heads, Nq ≠ Nk
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_in_a_query_row_reaches_that_row_only(shape, dtype):
    B, H, Hkv, Nq, Nk, D, causal = shape
    g = torch.Generator().manual_seed(Nq * Nk)
    q = torch.randn(B, H, Nq, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, Nk, D, generator=g).to(dtype) for _ in range(2))
    q[0, 0, Nq - 1, 3] = float("nan")
    out, lse = qkv.attention(q, k, v, causal=causal, backend="cpu", return_lse=True)
    golden = qkv.attention(*(t.double() for t in (q, k, v)), causal=causal, backend="reference")
    assert torch.equal(torch.isnan(out).any(-1), torch.isnan(golden).any(-1))
    assert torch.isnan(out[0, 0, Nq - 1]).all() and torch.isnan(lse[0, 0, Nq - 1])
    rest = torch.ones_like(lse, dtype=torch.bool)
    rest[0, 0, Nq - 1] = False
    assert torch.isfinite(out[rest]).all() and torch.isfinite(lse[rest]).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_query_row_poisons_the_gradients_as_the_formula_does(bad, causal, dtype):
    """NaN or ±inf in a query row: its output row and its dq row are non-finite, and so are
    dK and dV of its kv head (the formula's P ∘ (dP − Δ) with a NaN row); the other kv head's
    gradients and every other row's dq stay finite. A row that attends nothing keeps zeros."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 40, 16, generator=g)
    k, v = (torch.randn(1, 2, 70, 16, generator=g) for _ in range(2))
    q[0, 1, 33, 5] = bad  # head 1: kv head 0
    t = [x.to(dtype).detach().clone().requires_grad_() for x in (q, k, v)]
    out = qkv.attention(*t, causal=causal, backend="cpu")
    out.float().sum().backward()
    dq, dk, dv = (x.grad for x in t)
    assert not torch.isfinite(out[0, 1, 33]).any()
    assert not torch.isfinite(dq[0, 1, 33]).any()
    assert not torch.isfinite(dk[0, 0]).any() and not torch.isfinite(dv[0, 0]).any()
    others = torch.ones(4, 40, dtype=torch.bool)
    others[1, 33] = False
    assert torch.isfinite(dq[0][others]).all()
    assert torch.isfinite(dk[0, 1]).all() and torch.isfinite(dv[0, 1]).all()
    # the same row with no key to attend (a mask that leaves it empty): output and dq zero,
    # dV finite, as the formula (whose dK = dSᵀ Q is 0 · NaN there, NaN, on every backend)
    mask = torch.ones(40, 70, dtype=torch.bool)
    mask[33] = False
    t = [x.to(dtype).detach().clone().requires_grad_() for x in (q, k, v)]
    out = qkv.attention(*t, mask=mask, backend="cpu")
    out.float().sum().backward()
    assert (out[0, :, 33] == 0).all() and torch.isfinite(t[0].grad).all()
    assert torch.isfinite(t[2].grad).all()
