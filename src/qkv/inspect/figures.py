"""Pictures of attention and of its cost, drawn with matplotlib (imported only here).

Each function returns a `matplotlib.figure.Figure` (a notebook shows it) and, given `path`,
also saves it as a PNG. No pyplot state is touched, so this works headless and in notebooks.

User text (the sentence, its words) is never markup: every artist that shows it is drawn with
`parse_math=False`, so "$x^$" is shown as typed instead of crashing matplotlib's math parser,
and with a CJK font after the default one where such a font is installed.
"""

from __future__ import annotations

import contextlib
import functools
import math
import unicodedata
import warnings
from collections.abc import Sequence
from pathlib import Path

from .attend import AttentionMap

VIZ_HINT = "pip install 'qkv[viz]'"
CJK_FONTS = (
    "Noto Sans CJK SC",
    "Noto Sans SC",
    "WenQuanYi Zen Hei",
    "Source Han Sans SC",
    "SimHei",
    "Microsoft YaHei",
    "PingFang SC",
    "Heiti SC",
)


# what a CJK font's file name holds (lower case, no "-" or "_"): Noto/Source Han, WenQuanYi,
# Droid's fallback, Windows' and macOS's Chinese fonts
CJK_FILES = ("cjk", "wqy", "sourcehan", "droidsansfallback", "simhei", "msyh", "pingfang")
CJK_HINT = (
    "no CJK font found, so Chinese, Japanese and Korean labels show as boxes; install one "
    "(Debian/Ubuntu: apt-get install fonts-noto-cjk)"
)


def _cjk_installed() -> str | None:
    from matplotlib import font_manager

    names = {f.name for f in font_manager.fontManager.ttflist}
    listed = [name for name in CJK_FONTS if name in names]
    # a font collection (.ttc) is listed under its first face: "Noto Sans CJK JP"
    return (listed or sorted(n for n in names if "CJK" in n) or [None])[0]


@functools.cache
def cjk_font() -> str | None:
    """The name of an installed CJK font matplotlib can draw with, or None. matplotlib keeps a
    list of fonts made the first time it ran; one installed since is found here among the
    system's font files and added."""
    from matplotlib import font_manager

    name = _cjk_installed()
    if name is None:
        for path in font_manager.findSystemFonts():
            key = Path(path).name.lower().replace("-", "").replace("_", "")
            if any(k in key for k in CJK_FILES):
                with contextlib.suppress(Exception):  # a font file matplotlib cannot read
                    font_manager.fontManager.addfont(path)
        name = _cjk_installed()
    return name


def cjk_note(texts: Sequence[str]) -> str | None:
    """`CJK_HINT` when `texts` hold a wide (CJK) character and no CJK font is installed."""
    wide = any(unicodedata.east_asian_width(c) in "WF" for text in texts for c in text)
    return CJK_HINT if wide and cjk_font() is None else None


@functools.cache
def _families() -> tuple[str, ...]:
    """The default sans-serif font, then an installed CJK font (matplotlib falls back glyph by
    glyph along this list)."""
    from matplotlib import rcParams

    cjk = cjk_font()
    return (rcParams["font.sans-serif"][0], *([cjk] if cjk else []))


def plain() -> dict[str, object]:
    """Text properties for user text: never parsed as math, CJK glyphs where a font has them."""
    return {"parse_math": False, "fontfamily": list(_families())}


def new_figure(width: float, height: float):
    """A headless matplotlib Figure of `width` × `height` inches (constrained layout)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"qkv's figures need matplotlib; install it with: {VIZ_HINT}") from e
    return Figure(figsize=(width, height), layout="constrained")


def save(fig, path: str | Path | None, dpi: int = 120):
    """Save `fig` to `path` (the format from the extension) when a path is given; return it."""
    if path is not None:
        with warnings.catch_warnings():  # no CJK font installed: boxes, not a warning per glyph
            warnings.filterwarnings("ignore", message="Glyph .* missing from font")
            fig.savefig(path, dpi=dpi)
    return fig


def attention_grid(amap: AttentionMap, path: str | Path | None = None):
    """Every layer × head as a heatmap (rows: looking word, columns: attended word)."""
    L, H, W = amap.layers, amap.heads, len(amap.words)
    cell = max(1.1, min(2.2, 0.14 * W))
    fig = new_figure(cell * H + 1.2, cell * L + 0.8)
    axes = fig.subplots(L, H, squeeze=False, sharex=True, sharey=True)
    image = None
    ticks = range(W) if W <= 40 else []
    fontsize = max(3.0, min(6.0, 90 / max(W, 1)))
    for layer in range(L):
        for head in range(H):
            ax = axes[layer][head]
            image = ax.imshow(amap.weights[layer, head].numpy(), vmin=0, vmax=1, cmap="viridis")
            ax.set_title(f"L{layer} H{head}", fontsize=7, pad=2)
            ax.set_xticks(list(ticks))
            ax.set_yticks(list(ticks))
            ax.tick_params(length=0, labelsize=fontsize)
            if ticks:
                ax.set_xticklabels(amap.words, rotation=90, **plain())
                ax.set_yticklabels(amap.words, **plain())
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    title = f"{amap.model or 'attention'}: {amap.text!r}" if amap.text else amap.model
    fig.suptitle(title, **plain())
    return save(fig, path)


def token_heads(amap: AttentionMap, word: str | int, path: str | Path | None = None):
    """Where one word looks, in every head: rows are (layer, head), columns the words."""
    i = word if isinstance(word, int) else amap.index(word)
    L, H, W = amap.layers, amap.heads, len(amap.words)
    rows = amap.weights[:, :, i, :].reshape(L * H, W).numpy()
    fig = new_figure(max(4.0, 0.45 * W + 2.0), max(3.0, 0.12 * L * H + 1.5))
    ax = fig.subplots()
    image = ax.imshow(rows, vmin=0, vmax=1, cmap="magma", aspect="auto")
    ax.set_xticks(range(W), amap.words, rotation=60, ha="right", fontsize=8, **plain())
    ax.set_yticks([layer * H for layer in range(L)], [f"layer {layer}" for layer in range(L)])
    for layer in range(1, L):
        ax.axhline(layer * H - 0.5, color="white", linewidth=0.6)
    ax.set_ylabel(f"head (0..{H - 1} within each layer)")
    ax.set_title(f"where {amap.words[i]!r} looks, every layer and head", **plain())
    fig.colorbar(image, ax=ax, label="attention weight")
    return save(fig, path)


def rollout_figure(amap: AttentionMap, word: str | int, path: str | Path | None = None):
    """Where one word looks in each layer (heads averaged) beside where it draws from after
    each layer (attention rollout): rows are layers, columns the words."""
    i = word if isinstance(word, int) else amap.index(word)
    L, W = amap.layers, len(amap.words)
    raw = amap.weights[:, :, i, :].mean(1).numpy()  # (L, W)
    rolled = amap.rollout()[:, i, :].numpy()  # (L, W)
    fig = new_figure(max(7.0, 0.9 * W + 2.5), max(3.0, 0.35 * L + 2.2))
    axes = fig.subplots(1, 2, sharey=True)
    titles = (
        f"where {amap.words[i]!r} looks in each layer (heads averaged)",
        f"where {amap.words[i]!r} draws from after layers 0..l (rollout)",
    )
    image = None
    for ax, rows, title in zip(axes, (raw, rolled), titles, strict=True):
        image = ax.imshow(rows, vmin=0, vmax=1, cmap="magma", aspect="auto")
        ax.set_xticks(range(W), amap.words, rotation=60, ha="right", fontsize=8, **plain())
        ax.set_title(title, fontsize=9, **plain())
        for layer in range(L):
            for j in range(W):
                value = rows[layer, j]
                if value >= 0.1:
                    color = "black" if value > 0.6 else "white"
                    ax.text(
                        j, layer, f"{value:.2f}", ha="center", va="center", fontsize=6, color=color
                    )
    axes[0].set_yticks(range(L), [f"layer {layer}" for layer in range(L)])
    fig.colorbar(image, ax=axes, label="weight")
    return save(fig, path)


def cost_plot(records: Sequence[dict], path: str | Path | None = None):
    """Log-log time and peak memory against N, one line per method, with fitted slopes.

    `records` are what `qkv.inspect.bench.measure` returns."""
    from .bench import slopes

    passes = [p for p in ("forward", "forward+backward") if any(r["pass"] == p for r in records)]
    fig = new_figure(5.2 * len(passes), 8.0)
    axes = fig.subplots(2, len(passes), squeeze=False)
    for col, pas in enumerate(passes):
        mine = [r for r in records if r["pass"] == pas]
        fitted = slopes(mine, "time_s")
        for metric, row, label in (("time_s", 0, "time (s)"), ("peak_mib", 1, "peak memory (MiB)")):
            ax = axes[row][col]
            for method in dict.fromkeys(r["method"] for r in mine):
                pts = [(r["n"], r[metric]) for r in mine if r["method"] == method and r[metric]]
                if not pts:
                    continue
                name = method
                if metric == "time_s" and not math.isnan(fitted.get(method, math.nan)):
                    name = f"{method} (slope {fitted[method]:.2f})"
                ax.loglog(*zip(*pts, strict=True), marker="o", label=name, base=2)
            ax.set_xlabel("sequence length N")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
            ax.set_title(f"{pas}: {label.split(' (')[0]}")
    fig.suptitle("The cost of attention: dense grows as N², a sliding window as N")
    return save(fig, path)
