"""Pictures of attention and of its cost, drawn with matplotlib (imported only here).

Each function returns a `matplotlib.figure.Figure` (a notebook shows it) and, given `path`,
also saves it as a PNG. No pyplot state is touched, so this works headless and in notebooks.

User text (the sentence, its words) is never markup: every artist that shows it is drawn with
`parse_math=False`, so "$x^$" is shown as typed instead of crashing matplotlib's math parser,
and with a CJK font after the default one where such a font is installed.

Every figure takes `lang` ("en", the default, or "zh"): its titles, axes, legends and notes in
that language. Chinese needs a CJK font (`CJK_FONTS`, by name, else any font file that looks
like one); where none is installed the figure is drawn in English and one `FontWarning` per
process says which font is missing and how to install it. Layers and heads are numbered from 0,
as `qkv attend --layer/--head` and the JSON count them; Chinese labels write such an index as a
label ("层 3"), never as an ordinal ("第 3 层"), and say once that counting starts at 0.
"""

from __future__ import annotations

import contextlib
import functools
import math
import unicodedata
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from .attend import AttentionMap

VIZ_HINT = "pip install 'qkv[viz]'"
LANGS = ("en", "zh")
CJK_FONTS = (
    "Noto Sans CJK SC",
    "Noto Sans SC",
    "WenQuanYi Zen Hei",
    "WenQuanYi Micro Hei",
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


NO_CJK_FONT = (
    "no CJK font found (looked for {fonts}), so figures asked for in Chinese are drawn with "
    "English labels; install one to draw them in Chinese (Debian/Ubuntu: apt-get install "
    "fonts-noto-cjk)"
)


NO_CJK_FONT_ZH = (
    "没有找到 CJK 字体（找过 {fonts} 等），所以要求用中文的图改用英文标注；安装一个即可显示中文"
    "（Debian/Ubuntu：apt-get install fonts-noto-cjk）"
)


class FontWarning(UserWarning):
    """A figure asked for in Chinese is drawn in English: no CJK font is installed."""


def _cjk_installed() -> str | None:
    from matplotlib import font_manager

    names = {f.name for f in font_manager.fontManager.ttflist}
    listed = [name for name in CJK_FONTS if name in names]
    # a font collection (.ttc) is listed under its first face: "Noto Sans CJK JP"
    found = listed or sorted(n for n in names if "CJK" in n)
    return found[0] if found else None


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


@functools.cache
def _warn_no_cjk_font() -> None:
    """Say once per process that Chinese figures fall back to English (no CJK font)."""
    warnings.warn(NO_CJK_FONT.format(fonts=", ".join(CJK_FONTS[:2])), FontWarning, stacklevel=4)


def font_note(lang: str) -> str | None:
    """What a command says, in `lang`, when figures asked for in Chinese are drawn in English
    (no CJK font installed); None when nothing needs saying."""
    if lang != "zh" or cjk_font() is not None:
        return None
    return NO_CJK_FONT_ZH.format(fonts="、".join(CJK_FONTS[:2]))


def figure_lang(lang: str) -> str:
    """The language a figure's labels are drawn in: `lang`, except Chinese without a CJK font,
    which is drawn in English (never as boxes) after one `FontWarning` per process."""
    if lang not in LANGS:
        raise ValueError(f"lang must be one of {', '.join(LANGS)}, got {lang!r}")
    if lang == "zh" and cjk_font() is None:
        _warn_no_cjk_font()
        return "en"
    return lang


def labels(table: dict[str, dict[str, str]], lang: str) -> Callable[..., str]:
    """`t(key, **values)`: the label `key` of `table` in `lang`, formatted."""
    chosen = table[lang]

    def t(key: str, **values: object) -> str:
        return chosen[key].format(**values)

    return t


def finish(fig, path: str | Path | None, lang: str):
    """Give every text of `fig` the CJK font when its labels are Chinese, then `save` it."""
    if lang == "zh":
        from matplotlib.text import Text

        for text in fig.findobj(Text):
            text.set_fontfamily(list(_families()))
    return save(fig, path)


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


TEXT = {
    "en": {
        "weight": "attention weight",
        "grid_title": "{model}: {text!r}",
        "attention": "attention",
        "layer": "layer {layer}",
        "heads_ylabel": "head (0..{last} within each layer)",
        "heads_title": "where {word!r} looks, every layer and head",
        "looks": "where {word!r} looks in each layer\n(heads averaged)",
        "draws": "where {word!r} draws from after layers 0..l\n(rollout)",
        "layers_ylabel": "layer (counted from 0)",
        "rollout_weight": "weight",
        "time": "time (s)",
        "memory": "peak memory (MiB)",
        "time_short": "time",
        "memory_short": "peak memory",
        "slope": "{method} (slope {slope:.2f})",
        "n": "sequence length N",
        "pass_title": "{name}: {what}",
        "forward": "forward",
        "forward+backward": "forward+backward",
        "cost_title": "The cost of attention: dense grows as N², a sliding window as N",
    },
    "zh": {
        "weight": "注意力权重",
        "grid_title": "{model}：“{text}”",
        "attention": "注意力",
        "layer": "层 {layer}",
        "heads_ylabel": "头（每层内编号 0..{last}）",
        "heads_title": "“{word}”看向哪里：每一层、每个头",
        "looks": "“{word}”在每一层看向哪里\n（各头平均）",
        "draws": "经过层 0 到层 l 之后，“{word}”的信息来自哪里\n（注意力展开）",
        "layers_ylabel": "层（从 0 开始编号）",
        "rollout_weight": "权重",
        "time": "时间（秒）",
        "memory": "峰值内存（MiB）",
        "time_short": "时间",
        "memory_short": "峰值内存",
        "slope": "{method}（斜率 {slope:.2f}）",
        "n": "序列长度 N",
        "pass_title": "{name}：{what}",
        "forward": "前向",
        "forward+backward": "前向+反向",
        "cost_title": "注意力的开销：稠密注意力随 N² 增长，滑动窗口随 N 增长",
    },
}


def attention_grid(amap: AttentionMap, path: str | Path | None = None, *, lang: str = "en"):
    """Every layer × head as a heatmap (rows: looking word, columns: attended word)."""
    lang = figure_lang(lang)
    t = labels(TEXT, lang)
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
    fig.colorbar(image, ax=axes, shrink=0.6, label=t("weight"))
    model = amap.model or t("attention")
    title = t("grid_title", model=model, text=amap.text) if amap.text else amap.model
    fig.suptitle(title, **plain())
    return finish(fig, path, lang)


def token_heads(
    amap: AttentionMap, word: str | int, path: str | Path | None = None, *, lang: str = "en"
):
    """Where one word looks, in every head: rows are (layer, head), columns the words."""
    lang = figure_lang(lang)
    t = labels(TEXT, lang)
    i = word if isinstance(word, int) else amap.index(word)
    L, H, W = amap.layers, amap.heads, len(amap.words)
    rows = amap.weights[:, :, i, :].reshape(L * H, W).numpy()
    fig = new_figure(max(4.0, 0.45 * W + 2.0), max(3.0, 0.12 * L * H + 1.5))
    ax = fig.subplots()
    image = ax.imshow(rows, vmin=0, vmax=1, cmap="magma", aspect="auto")
    ax.set_xticks(range(W), amap.words, rotation=60, ha="right", fontsize=8, **plain())
    ax.set_yticks([layer * H for layer in range(L)], [t("layer", layer=n) for n in range(L)])
    for layer in range(1, L):
        ax.axhline(layer * H - 0.5, color="white", linewidth=0.6)
    ax.set_ylabel(t("heads_ylabel", last=H - 1))
    ax.set_title(t("heads_title", word=amap.words[i]), **plain())
    fig.colorbar(image, ax=ax, label=t("weight"))
    return finish(fig, path, lang)


def rollout_figure(
    amap: AttentionMap, word: str | int, path: str | Path | None = None, *, lang: str = "en"
):
    """Where one word looks in each layer (heads averaged) beside where it draws from after
    each layer (attention rollout): rows are layers, columns the words."""
    lang = figure_lang(lang)
    t = labels(TEXT, lang)
    i = word if isinstance(word, int) else amap.index(word)
    L, W = amap.layers, len(amap.words)
    raw = amap.weights[:, :, i, :].mean(1).numpy()  # (L, W)
    rolled = amap.rollout()[:, i, :].numpy()  # (L, W)
    fig = new_figure(max(7.0, 0.9 * W + 2.5), max(3.0, 0.35 * L + 2.2))
    axes = fig.subplots(1, 2, sharey=True)
    titles = (t("looks", word=amap.words[i]), t("draws", word=amap.words[i]))
    image = None
    for ax, rows, title in zip(axes, (raw, rolled), titles, strict=True):
        image = ax.imshow(rows, vmin=0, vmax=1, cmap="magma", aspect="auto")
        ax.set_xticks(range(W), amap.words, rotation=60, ha="right", fontsize=8, **plain())
        ax.set_title(title, fontsize=9, **plain())
        _annotate(ax, rows)
    axes[0].set_yticks(range(L), [t("layer", layer=n) for n in range(L)])
    axes[0].set_ylabel(t("layers_ylabel"))
    fig.colorbar(image, ax=axes, label=t("rollout_weight"))
    return finish(fig, path, lang)


def _annotate(ax, rows) -> None:
    """Write each weight of at least 0.1 in its cell."""
    for layer in range(rows.shape[0]):
        for j in range(rows.shape[1]):
            value = rows[layer, j]
            if value >= 0.1:
                color = "black" if value > 0.6 else "white"
                ax.text(j, layer, f"{value:.2f}", ha="center", va="center", fontsize=6, color=color)


def cost_plot(records: Sequence[dict], path: str | Path | None = None, *, lang: str = "en"):
    """Log-log time and peak memory against N, one line per method, with fitted slopes.

    `records` are what `qkv.inspect.bench.measure` returns."""
    from .bench import slopes

    lang = figure_lang(lang)
    t = labels(TEXT, lang)
    passes = [p for p in ("forward", "forward+backward") if any(r["pass"] == p for r in records)]
    fig = new_figure(5.2 * len(passes), 8.0)
    axes = fig.subplots(2, len(passes), squeeze=False)
    for col, pas in enumerate(passes):
        mine = [r for r in records if r["pass"] == pas]
        fitted = slopes(mine, "time_s")
        for metric, row, key in (("time_s", 0, "time"), ("peak_mib", 1, "memory")):
            ax = axes[row][col]
            for method in dict.fromkeys(r["method"] for r in mine):
                pts = [(r["n"], r[metric]) for r in mine if r["method"] == method and r[metric]]
                if not pts:
                    continue
                name = method
                if metric == "time_s" and not math.isnan(fitted.get(method, math.nan)):
                    name = t("slope", method=method, slope=fitted[method])
                ax.loglog(*zip(*pts, strict=True), marker="o", label=name, base=2)
            ax.set_xlabel(t("n"))
            ax.set_ylabel(t(key))
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
            ax.set_title(t("pass_title", name=t(pas), what=t(f"{key}_short")))
    fig.suptitle(t("cost_title"))
    return finish(fig, path, lang)
