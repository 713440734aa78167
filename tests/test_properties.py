"""Property test: random shapes, heads, masks and tilings against the fp64 golden."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.kernels import TiledBackend

from .helpers import assert_error_ratio, golden


@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 3))
    H = Hkv * draw(st.integers(1, 3))
    Nq, Nk = draw(st.integers(0, 40)), draw(st.integers(0, 40))
    D, Dv = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, Nk, Dv, generator=g, dtype=torch.float64)
    kwargs = {"causal": draw(st.booleans())}
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    shape = draw(st.sampled_from([(Nq, Nk), (1, Nk), (B, 1, Nq, Nk), (1, H, Nq, 1)]))
    if mask_kind == "bool":
        kwargs["mask"] = torch.rand(shape, generator=g) < draw(st.floats(0.0, 1.0))
    elif mask_kind == "float":
        bias = torch.randn(shape, generator=g, dtype=torch.float64)
        kwargs["mask"] = bias.masked_fill(torch.rand(shape, generator=g) < 0.3, -torch.inf)
    if draw(st.booleans()):
        kwargs["scale"] = draw(st.floats(0.01, 3.0))
    tiles = TiledBackend(draw(st.integers(1, 17)), draw(st.integers(1, 17)))
    return q, k, v, kwargs, tiles


@settings(max_examples=60, deadline=None)
@given(problems())
def test_every_backend_matches_the_golden(problem):
    q, k, v, kwargs, tiles = problem
    gold, gold_lse = qkv.attention(q, k, v, backend="reference", return_lse=True, **kwargs)
    for be in ("auto", "tiled", tiles):
        out, lse = qkv.attention(q, k, v, backend=be, return_lse=True, **kwargs)
        assert_error_ratio(out, gold, gold)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(gold_lse))
        finite = torch.isfinite(gold_lse)
        assert ((lse - gold_lse)[finite].abs() < 1e-10).all()
    plain = qkv.attention(q, k, v, **kwargs)  # auto without lse: usually sdpa
    assert_error_ratio(plain, gold, golden(q, k, v, **kwargs))
