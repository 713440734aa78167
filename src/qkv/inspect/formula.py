"""`qkv explain --html FILE`: the walk-through as a page you can touch, one file, no network.

The chapter's example (N = 4 tokens of width d = 8, projected to d_k = 4) as heatmaps of X, the
projections W^Q, W^K, W^V, Q, K, V, S = QKᵀ, S·scale, A = softmax and Out = AV, each value on
hover. Click a score S[i, j] to see q_i · k_j term by term. A slider, its ends labelled, moves
the scale from none (1) to 1/√d_k and shows the softmax saturate without it; a d_k selector, a
causal switch, re-roll, and English or Chinese. A matrix wider than the window (d_k = 64 on a
laptop) scrolls sideways inside its own box, and its caption says so.

The page computes in JavaScript's float64 from the X and W that `qkv.inspect.explain.walkthrough`
draws for each (seed, d_k), embedded for `ROLLS` seeds from the one asked for (re-roll steps
through them) and every d_k of `DK_CHOICES`: what it shows is `qkv.reference.steps` on those
numbers (`qkv explain --seed S --dk K` prints the same), tested in headless Chromium.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .explain import ExplainError, walkthrough
from .seeds import SEED_MAX
from .viewer import script_json

PLACEHOLDER = "/*QKV_FORMULA*/"
DK_CHOICES = (1, 2, 4, 8, 16, 64)
ROLLS = 8  # seeds embedded: the one asked for and the next ones (re-roll)
MAX_TOKENS = 12  # a page of heatmaps a person can read
MAX_WIDTH = 16


def formula_data(
    n: int = 4, d: int = 8, d_k: int = 4, seed: int = 0, causal: bool = False, lang: str = "en"
) -> dict:
    """What the page embeds: for each of `ROLLS` seeds, X and every d_k's projections."""
    if not 1 <= n <= MAX_TOKENS or not 1 <= d <= MAX_WIDTH:
        raise ExplainError(
            f"the page shows up to {MAX_TOKENS} tokens of width up to {MAX_WIDTH}, got N={n}, "
            f"d={d} (the text walk-through takes any size)"
        )
    if d_k not in DK_CHOICES:
        raise ExplainError(f"the page's d_k is one of {', '.join(map(str, DK_CHOICES))}")
    if lang not in ("en", "zh"):
        raise ValueError(f"lang must be en or zh, got {lang!r}")
    rolls = []
    for r in range(ROLLS):
        s = (seed + r) % (SEED_MAX + 1)
        per_dk = {}
        for dk in DK_CHOICES:
            w = walkthrough(n=n, d=d, d_k=dk, seed=s)
            per_dk[str(dk)] = {"Wq": w.W_q.tolist(), "Wk": w.W_k.tolist(), "Wv": w.W_v.tolist()}
        rolls.append({"seed": s, "X": w.X.tolist(), "W": per_dk})
    return {"n": n, "d": d, "dk": d_k, "causal": causal, "lang": lang, "rolls": rolls}


def formula_html(**options) -> str:
    """The page as one HTML string (`formula_data`'s options)."""
    template = resources.files("qkv.inspect").joinpath("formula.html").read_text(encoding="utf-8")
    return template.replace(PLACEHOLDER, script_json(formula_data(**options)))


def write_formula_page(path: str | Path, **options) -> Path:
    """Write the page to `path`; returns it."""
    path = Path(path)
    path.write_text(formula_html(**options), encoding="utf-8")
    return path
