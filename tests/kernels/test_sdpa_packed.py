"""The sdpa backend runs a few query rows of grouped heads as one head of G·Nq rows (decoding):
exact under the error rule for every mask shape it packs, and the shapes it must not pack (a
causal pattern, a mask that varies by row but not by head) still run grouped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.kernels import sdpa

from ..helpers import assert_error_ratio, golden, make_qkv

B, H, HKV, NK, D = 2, 8, 2, 70, 16


def _mask(kind: str, nq: int) -> torch.Tensor | None:
    g = torch.Generator().manual_seed(nq)
    shapes = {
        "none": None,
        "keys": (B, 1, 1, NK),  # key padding: one row of keys per batch element
        "keys-3d": (1, 1, NK),  # broadcast from fewer dims
        "per-head": (B, H, 1, NK),
        "per-head-row": (B, H, nq, NK),
        "per-row": (1, 1, nq, NK),  # varies by row, not by head: not packed
    }
    shape = shapes[kind]
    if shape is None:
        return None
    m = torch.rand(*shape, generator=g) > 0.3
    m[..., -1] = True  # every row keeps a key
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["none", "keys", "keys-3d", "per-head", "per-head-row", "per-row"])
@pytest.mark.parametrize("nq", [1, 4, 16, 17])
def test_grouped_rows_exact(nq, kind, dtype):
    q, k, v = make_qkv(B=B, H=H, Hkv=HKV, Nq=nq, Nk=NK, D=D, dtype=dtype, seed=nq)
    mask = _mask(kind, nq)
    got = qkv.attention(q, k, v, mask=mask, backend="sdpa", finite_inputs=True)
    ref = qkv.attention(q, k, v, mask=mask, backend="reference")
    assert_error_ratio(got, ref, golden(q, k, v, mask=mask))


def test_causal_decode_rows_exact():
    """Bottom-right causal with Nq < Nk (asked of sdpa by name): a 2-D row mask, not packed."""
    q, k, v = make_qkv(B=B, H=H, Hkv=HKV, Nq=4, Nk=NK, D=D)
    got = qkv.attention(q, k, v, causal=True, backend="sdpa", finite_inputs=True)
    ref = qkv.attention(q, k, v, causal=True, backend="reference")
    assert_error_ratio(got, ref, golden(q, k, v, causal=True))


def _calls(monkeypatch) -> list[dict]:
    seen: list[dict] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append({"q": tuple(q.shape), "gqa": kwargs.get("enable_gqa", False)})
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("kind", ["none", "keys", "per-head"])
def test_decode_runs_packed(monkeypatch, kind):
    q, k, v = make_qkv(B=B, H=H, Hkv=HKV, Nq=1, Nk=NK, D=D)
    seen = _calls(monkeypatch)
    qkv.attention(q, k, v, mask=_mask(kind, 1), backend="sdpa", finite_inputs=True)
    assert seen == [{"q": (B, HKV, H // HKV, D), "gqa": False}]


@pytest.mark.parametrize("nq,kind", [(17, "none"), (4, "per-row")])
def test_unpackable_runs_grouped(monkeypatch, nq, kind):
    q, k, v = make_qkv(B=B, H=H, Hkv=HKV, Nq=nq, Nk=NK, D=D)
    seen = _calls(monkeypatch)
    qkv.attention(q, k, v, mask=_mask(kind, nq), backend="sdpa", finite_inputs=True)
    assert seen == [{"q": (B, H, nq, D), "gqa": True}]
