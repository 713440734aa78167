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
