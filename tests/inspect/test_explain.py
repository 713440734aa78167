"""The walk-through's matrices are qkv.reference.steps on the same numbers."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.inspect import cost, render, walkthrough


@pytest.mark.parametrize("causal", [False, True])
def test_walkthrough_equals_reference_steps(causal):
    w = walkthrough(n=4, d=8, d_k=4, seed=3, causal=causal)
    assert w.X.shape == (4, 8) and w.W_q.shape == (8, 4) and w.S.shape == (4, 4)
    st = qkv.reference.steps(w.X @ w.W_q, w.X @ w.W_k, w.X @ w.W_v, causal=causal)
    for name, want in (("S", st.S), ("S_scaled", st.S_scaled), ("A", st.A), ("Out", st.out)):
        torch.testing.assert_close(getattr(w, name), want, rtol=0, atol=0)
    torch.testing.assert_close(w.A.sum(-1), torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("lang,word", [("en", "softmax by rows"), ("zh", "按行做 softmax")])
def test_render_prints_every_step_and_the_cost(lang, word):
    text = render(walkthrough(), lang)
    for step in ("X", "Q = X W^Q", "S = Q Kᵀ", "S / √d_k", "A = softmax", "Out = A V"):
        assert step in text
    assert word in text and "(4, 4)" in text
    assert "1,048,576" in text and "4.4 TB" in text  # 4 · (2^20)² bytes of fp32 scores


def test_cost():
    assert cost(512, 64) == (4 * 512 * 512 * 64, 4 * 512 * 512)


def test_bad_arguments():
    with pytest.raises(ValueError, match="n must be a positive int"):
        walkthrough(n=0)
    with pytest.raises(ValueError, match="lang must be one of"):
        render(walkthrough(), "fr")
