"""The tiled kernel's own promises: exact gradients, O(N) saved state, skipped causal tiles."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.kernels import TiledBackend

from ..helpers import make_qkv, matmul_flops

GRADCHECK_CASES = {
    "plain": dict(shape=dict(B=1, H=2, Nq=7, Nk=9, D=4), kw=dict()),
    "causal-Nq<Nk": dict(shape=dict(B=1, H=2, Nq=5, Nk=11, D=4), kw=dict(causal=True)),
    "causal-Nq>Nk": dict(shape=dict(B=1, H=1, Nq=11, Nk=6, D=3), kw=dict(causal=True)),
    "gqa-Dv": dict(shape=dict(B=2, H=4, Hkv=2, Nq=6, Nk=8, D=3, Dv=5), kw=dict(causal=True)),
    "bool-mask": dict(shape=dict(B=1, H=2, Nq=8, Nk=8, D=4), kw=dict(mask="bool")),
    "float-mask": dict(shape=dict(B=1, H=2, Nq=8, Nk=8, D=4), kw=dict(mask="float")),
}


def _materialise(kw, nq, nk):
    g = torch.Generator().manual_seed(4)
    if kw.get("mask") == "bool":
        m = torch.rand(nq, nk, generator=g) > 0.4
        m[2] = False  # one fully masked row
        return {**kw, "mask": m}
    if kw.get("mask") == "float":
        return {**kw, "mask": torch.randn(nq, nk, generator=g, dtype=torch.float64)}
    return kw


@pytest.mark.parametrize("be", ["tiled", TiledBackend(2, 3), "reference", "sdpa"], ids=str)
@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_gradcheck_fp64(be, case):
    spec = GRADCHECK_CASES[case]
    q, k, v = make_qkv(**spec["shape"], dtype=torch.float64, requires_grad=True)
    kw = _materialise(spec["kw"], q.shape[2], k.shape[2])
    want_lse = be != "sdpa"

    def f(q, k, v):
        res = qkv.attention(q, k, v, backend=be, return_lse=want_lse, finite_inputs=True, **kw)
        if not want_lse:
            return res
        out, lse = res
        return out, torch.where(torch.isinf(lse), 0.0, lse)  # gradcheck needs finite outputs

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_backward_saves_no_score_matrix():
    # What the autograd graph keeps between forward and backward must be O(N·d), never N².
    N, D = 300, 16
    q, k, v = make_qkv(B=1, H=2, Nq=N, D=D, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = qkv.attention(q, k, v, causal=True, backend=TiledBackend(32, 64))
    assert max(saved) <= 2 * N * D  # q, k, v, out (2·N·D each) and lse (2·N)
    assert sum(saved) <= 4 * 2 * N * D + 2 * N
    out.sum().backward()


@pytest.mark.parametrize("nq,nk,kept", [(64, 64, 10), (32, 64, 7), (64, 32, 3)])
def test_causal_skips_empty_tiles(nq, nk, kept):
    # 16×16 tiles. Nq=Nk=64: 4 rows of tiles, 1+2+3+4 = 10 of 16 computed. Bottom-right
    # alignment (query i sees j ≤ i + Nk − Nq): Nq=32, Nk=64 → row tiles see 3 and 4 key tiles
    # (7); Nq=64, Nk=32 → row tiles 0 and 1 see nothing, then 1 and 2 key tiles (3).
    lay = qkv.layout.block_layout(None, nq, nk, causal=True, block_q=16, block_k=16)
    assert lay.nnz == kept
    # Only the diagonal tiles need the mask; the ones below it run without mask arithmetic.
    assert int((~lay.full).sum()) == min(nq, nk) // 16
    q, k, v = make_qkv(B=1, H=1, Nq=nq, Nk=nk, D=4, requires_grad=True)
    be = TiledBackend(16, 16, max_rows=64, max_cols=64)
    out = qkv.attention(q, k, v, causal=True, backend=be)
    tile = 2 * 16 * 16 * 4  # one 16×16 tile's product with D = Dv = 4
    fwd = matmul_flops(lambda: qkv.attention(q, k, v, causal=True, backend=be))
    # S = Q Kᵀ and P V on the kept tiles only, and on the partial ones the count of NaN/inf
    # values a positive weight sees (masked garbage never reaches a row)
    partial = int((~lay.full).sum())
    assert fwd == (kept * 2 + partial) * tile
    bwd = matmul_flops(lambda: out.sum().backward())
    assert bwd == kept * 5 * tile  # S, dP, dV, dQ, dK
    ref = qkv.attention(q, k, v, causal=True, backend="reference")
    torch.testing.assert_close(out, ref)


def test_lse_gradient_flows():
    q, k, v = make_qkv(B=1, H=2, Nq=12, D=4, dtype=torch.float64, requires_grad=True)
    grads = []
    for be in ("reference", TiledBackend(4, 4)):
        _, lse = qkv.attention(q, k, v, causal=True, backend=be, return_lse=True)
        grads.append(torch.autograd.grad(lse.sum(), (q, k)))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert grads[0][0].abs().sum() > 0


def test_backward_keeps_short_strips_and_recomputes_long_ones(monkeypatch):
    """With strips on both sides of STRIP_KEEP (causal: strip lengths grow), the strips that fit
    keep P and dP between the backward's phases, the others recompute them: same gradients,
    bit for bit (it failed with an empty buffer when the longest strip did not fit)."""
    from qkv.kernels.tiled import steps

    be = TiledBackend(8, 8, max_rows=8, max_cols=16)
    q, k, v = make_qkv(B=1, H=2, Nq=64, D=8, requires_grad=True)

    def grads():
        out = qkv.attention(q, k, v, causal=True, backend=be)
        return torch.autograd.grad(out.square().sum(), (q, k, v))

    kept = grads()
    monkeypatch.setattr(steps, "STRIP_KEEP", 2 * 8 * 32)  # strips of ≤ 32 keys still fit
    mixed = grads()
    for a, b in zip(kept, mixed, strict=True):
        assert torch.equal(a, b)
