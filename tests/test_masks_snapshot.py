"""Masks built from tensors are values: changing the tensor in place after building the Mask
changes nothing (the Mask holds its own copy), on every backend, so no layout qkv keeps for the
Mask can go stale."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks

from .helpers import assert_error_ratio, cpu_kernel_or, golden, make_qkv

N = 70


def _tensors() -> dict[str, tuple]:
    g = torch.Generator().manual_seed(0)
    valid = torch.ones(2, N, dtype=torch.bool)
    valid[1, 50:] = False
    dense = torch.rand(2, 1, N, N, generator=g) > 0.4
    dense[..., 0] = True
    cu = torch.tensor([0, 30, N])
    return {
        "key_mask": (valid, masks.key_mask, lambda t: t[0, 5:].fill_(False)),
        "from_tensor": (
            dense,
            masks.from_tensor,
            lambda t: t.fill_(False).__setitem__((..., 0), True),
        ),
        "varlen": (cu, lambda t: masks.varlen(t, t), lambda t: t.__setitem__(1, 10)),
    }


@pytest.mark.parametrize("backend", ["reference", "tiled", cpu_kernel_or("tiled")])
@pytest.mark.parametrize("kind", ["key_mask", "from_tensor", "varlen"])
def test_changing_the_tensor_in_place_changes_nothing(kind, backend):
    tensor, make, change = _tensors()[kind]
    original = tensor.clone()
    mask = make(tensor)
    q, k, v = make_qkv(B=2, H=2, Nq=N, D=8)
    first = qkv.attention(q, k, v, mask=mask, backend=backend)  # layouts built and kept
    change(tensor)
    assert not torch.equal(tensor, original)
    again = qkv.attention(q, k, v, mask=mask, backend=backend)
    expected = make(original)  # the Mask as it was built
    ref = qkv.attention(q, k, v, mask=expected, backend="reference")
    gold = golden(q, k, v, mask=expected)
    assert_error_ratio(first, ref, gold)
    assert_error_ratio(again, ref, gold)
