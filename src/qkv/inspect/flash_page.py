"""`qkv explain --flash --html FILE`: FlashAttention as a page to step through, one file, no
network.

The walk-through's Q, K, V (`qkv.inspect.explain.walkthrough`) attended tile by tile: S as ghost
cells never all stored, the current tile lit, each row's running max m, the rescale factor α,
the running sum l and the output O updating (next / back / play, arrow keys); the textbook
softmax of a row beside the online one, equal at the end; a mask switch (dense, causal, sliding
window, Longformer's window + a global token, packed documents) greying the tiles the kernel
skips, with the products saved; and a decoding view where a KV cache grows one token per step,
its tiles cut into splits whose partial results merge into the unsplit one. English or Chinese.

Everything the page shows comes from `qkv.inspect.flash.flash_steps` (the `tiled` backend's
own step functions), embedded as JSON for every (N, tile) of the page's choices: each mask's
tile kinds and the tiles of S the kernel computed, the kernel's final m, l and output, the
reference's S, A and output, and each decoding step's split partials. The page folds the tiles
in JavaScript's float64 exactly as `fold_run` does (tested in headless Chromium against
`flash_steps`, step by step).
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path

import torch

from .. import masks, reference
from .explain import ExplainError, walkthrough
from .flash import FlashSteps, flash_steps
from .viewer import script_json

PLACEHOLDER = "/*QKV_FLASH*/"
N_CHOICES = (4, 8, 16)  # token counts the page offers (with the one asked for)
TILE_CHOICES = (1, 2, 4)  # tile sizes the page offers (with the one asked for)
SPLIT_CHOICES = (1, 2, 3, 4)  # splits of the decoding view
MAX_N = 32  # a grid of S a person can read
MAX_DK = 16  # columns of O a box can show
VIEWS = ("dense", "causal", "window", "longformer", "documents")


def _num(x: float) -> float | None:
    """A float for JSON; −inf (a masked score, a row's max before any key) as null."""
    return None if x == -math.inf else float(x)


def _nums(t: torch.Tensor | None):
    """A tensor as nested lists of `_num` (None stays None)."""
    if t is None:
        return None
    if t.dim() == 0:
        return _num(t.item())
    return [_nums(x) for x in t] if t.dim() > 1 else [_num(x) for x in t.tolist()]


def doc_lengths(n: int) -> list[int]:
    """Three packed documents of near-equal lengths (fewer when n < 3)."""
    base, extra = divmod(n, 3)
    return [base + (1 if i < extra else 0) for i in range(3) if base + (1 if i < extra else 0)]


def view_masks(n: int) -> dict[str, tuple[bool, masks.Mask | None, dict]]:
    """Each view's (causal, mask, parameters shown on the page) for n tokens."""
    w, lw = max(1, n // 4), max(1, n // 8)
    lens = doc_lengths(n)
    return {
        "dense": (False, None, {}),
        "causal": (True, None, {}),
        "window": (False, masks.sliding_window(w), {"w": w}),
        "longformer": (False, masks.sliding_window(lw) | masks.global_tokens([0]), {"w": lw}),
        "documents": (False, masks.document(lens), {"lens": lens}),
    }


def _walk_view(fs: FlashSteps) -> dict:
    """One mask's walk for one tile size: the tile kinds, the kernel's tiles of S, its final m,
    l and output, and what it computed and held."""
    nqb, nkb = len(fs.kinds), len(fs.kinds[0])
    tiles = [[None] * nkb for _ in range(nqb)]
    last = {}
    for s in fs.steps:
        tiles[s.q_tile][s.k_tile] = _nums(s.scores)
        last[s.q_tile] = s
    return {
        "kinds": [[k[0] for k in row] for row in fs.kinds],  # f(ull), p(artial), e(mpty)
        "tiles": tiles,
        "kernel": {
            "m": [_num(x) for r in range(nqb) for x in last[r].m.tolist()],
            "l": [x for r in range(nqb) for x in last[r].l.tolist()],
            "out": _nums(fs.out),
        },
        "products": fs.products,
        "allowed": fs.allowed,
        "total": fs.not_held,
        "held": fs.scores_held,
        "state": fs.state_held,
    }


def _decode(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, tile: int) -> list[dict]:
    """The decoding view for one tile size: for each cache length t (the newest token's query
    over the t cached keys, all of which it sees) and each split count, the splits' partial
    (m, l, acc), beside the unsplit output (the page merges the partials itself)."""
    steps = []
    for t in range(1, Q.shape[0] + 1):
        q, k, v = Q[t - 1 : t], K[:t], V[:t]
        by_split, unsplit = {}, None
        for n_splits in SPLIT_CHOICES:
            fs = flash_steps(q, k, v, tile_q=1, tile_k=tile, splits=n_splits)
            unsplit = fs.out[0] if n_splits == 1 else unsplit
            parts = [
                {"tiles": list(p.k_tiles), "m": _num(p.m.item()), "l": p.l.item(),
                 "acc": _nums(p.acc[0])}
                for p in fs.splits[0]
            ]  # fmt: skip
            by_split[str(n_splits)] = {"parts": parts}  # the page merges them
        steps.append({"unsplit": _nums(unsplit), "splits": by_split})
    return steps


def _size(n: int, tiles: list[int], d: int, d_k: int, seed: int) -> dict:
    """Everything the page shows for n tokens: the reference's S, A and output of each view,
    the decoding view's scores, and for each tile size the walks and the decoding splits."""
    w = walkthrough(n=n, d=d, d_k=d_k, seed=seed)
    views = {}
    walks: dict[str, dict] = {str(t): {} for t in tiles}
    for name, (causal, mask, params) in view_masks(n).items():
        st = reference.steps(w.Q, w.K, w.V, causal=causal, mask=mask)
        views[name] = {
            "mask": repr(mask) if mask is not None else "",
            "params": params,
            "S": _nums(st.S_scaled),
            "A": _nums(st.A),
            "out": _nums(st.out),
        }
        for t in tiles:
            fs = flash_steps(w.Q, w.K, w.V, tile_q=t, tile_k=t, causal=causal, mask=mask)
            walks[str(t)][name] = _walk_view(fs)
    scale = d_k**-0.5
    decode = [
        {
            "scores": _nums((w.Q[t - 1] @ w.K[:t].T) * scale),
            "ref": _nums(reference.attention(w.Q[t - 1 : t], w.K[:t], w.V[:t])[0]),
        }
        for t in range(1, n + 1)
    ]
    return {
        "n": n,
        "scale": scale,
        "V": _nums(w.V),
        "views": views,
        "decode": decode,
        "tiles": {
            str(t): {"views": walks[str(t)], "decode": _decode(w.Q, w.K, w.V, t)} for t in tiles
        },
    }


def _check(n: int, tile: int, d: int, d_k: int, lang: str) -> None:
    for name, value, top in (("n", n, MAX_N), ("tile", tile, MAX_N), ("d_k", d_k, MAX_DK)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise ExplainError(
                f"the flash page takes {name} from 1 to {top}, got {name}={value!r} "
                f"(the text walk, `qkv explain --flash`, takes larger ones)"
            )
    if tile > n:
        raise ExplainError(f"tile must be at most n, got tile={tile}, n={n}")
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ExplainError(f"d must be a positive int, got d={d!r}")
    if lang not in ("en", "zh"):
        raise ValueError(f"lang must be en or zh, got {lang!r}")


def _tiles_for(nn: int, tiles: list[int], n: int, tile: int) -> list[int]:
    """The tile sizes offered for nn tokens: those that cut S into at least 2 × 2 tiles, and
    the one asked for at the size asked for."""
    return [t for t in tiles if 2 * t <= nn or (nn, t) == (n, tile)]


def flash_data(
    *,
    lang: str = "en",
    n: int = 8,
    tile: int = 2,
    seed: int = 0,
    d: int = 8,
    d_k: int = 4,
    causal: bool = False,
) -> dict:
    """What the page embeds: a configuration for each N of `N_CHOICES` (and `n`) and tile
    size of `TILE_CHOICES` (and `tile`) no larger than N; it opens on (n, tile), on the causal
    view when `causal`."""
    _check(n, tile, d, d_k, lang)
    sizes = sorted({n, *N_CHOICES})
    tiles = sorted({tile, *TILE_CHOICES})
    configs = {str(nn): _size(nn, _tiles_for(nn, tiles, n, tile), d, d_k, seed) for nn in sizes}
    return {
        "lang": lang,
        "seed": seed,
        "d": d,
        "dk": d_k,
        "start": {"n": n, "tile": tile, "view": "causal" if causal else "dense"},
        "sizes": sizes,
        "tiles": tiles,
        "splits": list(SPLIT_CHOICES),
        "views": list(VIEWS),
        "configs": configs,
    }


def flash_html(**options) -> str:
    """The page as one HTML string (`flash_data`'s options)."""
    template = resources.files("qkv.inspect").joinpath("flash.html").read_text(encoding="utf-8")
    return template.replace(PLACEHOLDER, script_json(flash_data(**options)))


def write_flash_page(path: str | Path, **options) -> Path:
    """Write the page to `path` (`flash_data`'s options: English or Chinese, switchable on the
    page); returns it."""
    path = Path(path)
    path.write_text(flash_html(**options), encoding="utf-8")
    return path
