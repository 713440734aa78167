"""`scores.compose` applies its modifiers left to right, as its docstring says, on every backend.

Pinned with the pair whose order differs between libraries: FlashAttention caps the score
first and adds ALiBi after, which in qkv is `compose(softcap(cap), alibi(slopes))`.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import scores

from .helpers import make_qkv

H, CAP = 4, 1.5  # a small cap, so that capping before or after the bias differs clearly
SLOPES = scores.alibi_slopes(H)


def _distance(nq: int, nk: int) -> torch.Tensor:
    """|q − kv| with qkv's bottom-right aligned query positions, `(Nq, Nk)`."""
    q = torch.arange(nq).view(-1, 1) + (nk - nq)
    return (q - torch.arange(nk).view(1, -1)).abs().double()


def _flash_order(s: torch.Tensor, nq: int, nk: int) -> torch.Tensor:
    """FlashAttention's scores: softcap, then ALiBi."""
    return CAP * torch.tanh(s / CAP) - SLOPES.double().view(-1, 1, 1) * _distance(nq, nk)


def test_compose_applies_left_to_right():
    nq, nk = 5, 7
    s = torch.randn(1, H, nq, nk, dtype=torch.float64) * 4
    b, h = torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(H).view(1, H, 1, 1)
    q = (torch.arange(nq) + nk - nq).view(1, 1, nq, 1)
    kv = torch.arange(nk).view(1, 1, 1, nk)
    cap_then_alibi = scores.compose(scores.softcap(CAP), scores.alibi(SLOPES))
    alibi_then_cap = scores.compose(scores.alibi(SLOPES), scores.softcap(CAP))
    want = _flash_order(s[0], nq, nk)[None]
    torch.testing.assert_close(cap_then_alibi(s, b, h, q, kv), want, rtol=0, atol=1e-12)
    assert (alibi_then_cap(s, b, h, q, kv) - want).abs().max() > 0.1  # the other order differs
    # the name reads right to left, like f ∘ g; the compiled kernel reads `parts` left to right
    assert repr(cap_then_alibi) == f"alibi({H} heads) ∘ softcap({CAP})"
    assert [p[0] for p in cap_then_alibi.parts] == ["softcap", "alibi"]


@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
def test_softcap_then_alibi_is_flash_attentions_order_in_attention(backend):
    q, k, v = make_qkv(B=1, H=H, Nq=9, Nk=13, D=8, dtype=torch.float64)
    q = q * 3  # scores of a few units, where the cap bends them
    mod = scores.compose(scores.softcap(CAP), scores.alibi(SLOPES))
    got = qkv.attention(q, k, v, causal=True, score_mod=mod, backend=backend)
    s = (q @ k.transpose(-1, -2))[0] / 8**0.5
    bias = _flash_order(s, 9, 13)
    causal = torch.ones(9, 13, dtype=torch.bool).tril(13 - 9)
    weights = torch.softmax(bias.masked_fill(~causal, float("-inf")), dim=-1)
    torch.testing.assert_close(got[0], weights @ v[0], rtol=0, atol=1e-10)
