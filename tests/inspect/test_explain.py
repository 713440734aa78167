"""The walk-through's matrices are qkv.reference.steps on the same numbers."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.inspect import cost, render, walkthrough
from qkv.inspect.explain import SATURATED, SPREAD, peak
from qkv.inspect.formula import DK_CHOICES, ROLLS


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


@pytest.mark.parametrize("d_k", DK_CHOICES)
@pytest.mark.parametrize("causal", [False, True])
def test_the_scaled_rows_stay_spread_on_every_seed_of_the_page(d_k, causal):
    """The walk-through says the scale keeps the softmax from saturating: on every seed the
    formula page offers (it embeds ROLLS seeds from 0) and every d_k of its selector, A's rows
    hold at least SPREAD of an even row's entropy."""
    for seed in range(ROLLS):
        p = peak(walkthrough(d_k=d_k, seed=seed, causal=causal))
        assert p.share(p.scaled) >= SPREAD, (seed, p)


@pytest.mark.parametrize("seed", range(ROLLS))
def test_without_the_scale_the_rows_saturate_at_d_k_64(seed):
    """… and without it, at d_k = 64, they saturate (nearly one-hot) on every seed of the page,
    which the text says in so many words."""
    w = walkthrough(d_k=64, seed=seed)
    p = peak(w)
    assert p.share(p.raw) < SATURATED and p.saturates_unscaled, p
    assert "the softmax saturates" in render(w)


def test_the_text_does_not_claim_saturation_where_the_numbers_do_not_show_it():
    w = walkthrough(d_k=4, seed=0)  # the default: unscaled rows are not saturated at d_k = 4
    p = peak(w)
    assert p.share(p.raw) >= SATURATED
    text = render(w)
    assert "saturates" not in text and "changes little" in text


def test_in_a_notebook_the_walkthrough_shows_every_step_with_its_numbers():
    w = walkthrough(d_k=64, seed=1)
    page = w._repr_html_()
    for step in ("X", "Q = X W^Q", "S / √d_k", "A = softmax(S / √d_k)", "Out = A V"):
        assert f"<b>{step}</b>" in page
    assert f"{w.A[0, 0].item():.2f}</td>" in page and "(4, 64)" in page
    assert "the softmax saturates" in page  # the lesson, as the text says it
