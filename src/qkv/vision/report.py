"""The `qkv tokens` command: what an image costs, as text and as a plot.

`describe(width, height)` is the text the command prints: per model the resize, the grid and the
token count, then the cost of one attention layer over those tokens (FLOPs and memory, dense vs
windowed). `plot(path)` draws tokens and attention cost against the image size, from 224² to 4K
(3840 pixels a side), for both models. matplotlib and Pillow are imported only when needed.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from ..inspect.text import ljust, rjust
from .tokens import (
    ENCODER_HEADS,
    LLM_HEADS,
    MODELS,
    QWEN25_WINDOW,
    AttentionCost,
    ImageTokens,
    attention_cost,
    image_tokens,
    window_lengths,
)

# Qwen2.5-VL's preprocessor raises max_pixels to 12845056 (16384 tokens); the plot shows both.
QWEN25_MAX_PIXELS = 12845056
PLOT_SIDES = (224, 336, 448, 560, 672, 896, 1008, 1344, 1680, 2016, 2688, 3360, 3840)


def parse_size(text: str) -> tuple[int, int] | None:
    """`"1344x1344"` (or `1344×1344`) → (width, height); None when it is not of that form."""
    m = re.fullmatch(r"\s*(\d+)\s*[x×X]\s*(\d+)\s*", text)
    return (int(m[1]), int(m[2])) if m else None


def image_size(path: str | Path) -> tuple[int, int]:
    """(width, height) of an image file, read with Pillow (an optional extra)."""
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError(
            f"reading an image file needs Pillow ({e}); install it with: pip install pillow, "
            f"or give the size as WIDTHxHEIGHT"
        ) from e
    with Image.open(path) as im:
        return im.size


def _num(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} "


def _bytes(x: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= div:
            return f"{x / div:.1f} {unit}"
    return f"{x:.0f} B"


TEXT = {
    "en": {
        "image": "image {w}×{h} ({mp:.2f} MP)",
        "qwen": "qwen2-vl    (min_pixels {lo}, max_pixels {hi})",
        "resized": "  resized to {w}×{h}: {pr}×{pc} patches of 14 px, 2×2 merge → {gr}×{gc} grid",
        "qwen_tokens": "  tokens: {n}  (+2 special: <|vision_start|> <|vision_end|>)",
        "llava": "llava-next  (336-px tiles, llava-v1.6 grid pinpoints, feature strategy default)",
        "best": "  best grid {w}×{h}: {tiles} tile{s} of 24×24 features + base image",
        "llava_tokens": "  tokens: {n} = {uf} unpadded features ({gr}×{gc}) + {nl} newlines "
        "+ {base} base image",
        "dense_qwen": "encoder, dense (Qwen2-VL)",
        "windows": "encoder, 112-px windows (Qwen2.5-VL)",
        "per_tile": "encoder, per 336 tile (CLIP)",
        "llm": "LLM over the image tokens, dense",
        "cost": "attention cost of one layer, forward, fp32 (encoder: 16 heads of 80 (Qwen), 16 of "
        "64\n(CLIP-L); LLM: 28 heads of 128 (Qwen2-7B), 32 of 128 (Mistral-7B)):",
        "notes": "tokens: what the layer attends over (the encoder's are patches, 4 per Qwen LLM "
        "token);\nweights: the attention matrix of every head if materialised (eager attention);"
        "\nO(N): what a tiled kernel such as qkv's keeps instead (output and lse).",
        "plot": "plot: {path}",
        "note": "note: {note}",
        "side": "image side (pixels, square image)",
        "tokens_y": "image tokens the LLM sees",
        "tokens_title": "Tokens per image",
        "flops_y": "FLOPs of one attention layer (forward)",
        "flops_title": "Attention cost (Qwen2-VL at max_pixels 12845056)",
        "series": "{model}: {label}",
        "max_pixels": "qwen2-vl, max_pixels 12845056",
    },
    "zh": {
        "image": "图像 {w}×{h}（{mp:.2f} 百万像素）",
        "qwen": "qwen2-vl    （min_pixels {lo}，max_pixels {hi}）",
        "resized": "  缩放到 {w}×{h}：{pr}×{pc} 个 14 像素的图块，2×2 合并 → {gr}×{gc} 的网格",
        "qwen_tokens": "  词元：{n}（另有 2 个特殊词元：<|vision_start|> <|vision_end|>）",
        "llava": "llava-next  （336 像素的图块，llava-v1.6 的 grid_pinpoints，"
        "特征选择策略 default）",
        "best": "  最佳网格 {w}×{h}：{tiles} 个图块，每块 24×24 个特征，另加基础图像",
        "llava_tokens": "  词元：{n} = {uf} 个去掉填充后的特征（{gr}×{gc}）+ {nl} 个换行词元 "
        "+ {base} 个基础图像词元",
        "dense_qwen": "编码器，稠密（Qwen2-VL）",
        "windows": "编码器，112 像素的窗口（Qwen2.5-VL）",
        "per_tile": "编码器，每个 336 像素图块（CLIP）",
        "llm": "LLM 处理图像词元，稠密",
        "cost": "一层注意力的开销，前向，fp32（编码器：16 个 80 维的头（Qwen）、16 个 64 维的头\n"
        "（CLIP-L）；LLM：28 个 128 维的头（Qwen2-7B）、32 个 128 维的头（Mistral-7B））：",
        "notes": "词元：这一层在多少个词元上做注意力（编码器的是图块，每个 Qwen LLM 词元对应 4 "
        "个图块）；\n权重矩阵：把每个头的注意力矩阵都存下来时占的内存（eager 注意力）；\n"
        "O(N)：分块内核（例如 qkv 的）只需保存的内容（输出和 lse）。",
        "plot": "图：{path}",
        "note": "注意：{note}",
        "side": "图像边长（像素，正方形图像）",
        "tokens_y": "LLM 看到的图像词元数",
        "tokens_title": "每张图像的词元数",
        "flops_y": "一层注意力的 FLOPs（前向）",
        "flops_title": "注意力的开销（Qwen2-VL，max_pixels 12845056）",
        "series": "{model}：{label}",
        "max_pixels": "qwen2-vl，max_pixels 12845056",
    },
}

# The cost table's column headers, by language.
COLUMNS = {
    "en": ("tokens", "FLOPs", "weights", "O(N)"),
    "zh": ("词元", "FLOPs", "权重矩阵", "O(N)"),
}


def _text(lang: str):
    """`t(key, **values)`: the report's sentence `key` in `lang`."""
    if lang not in TEXT:
        raise ValueError(f"lang must be one of {', '.join(TEXT)}, got {lang!r}")
    table = TEXT[lang]

    def t(key: str, **values: object) -> str:
        return table[key].format(**values)

    return t


def _model_lines(t: ImageTokens, options: dict, lang: str = "en") -> list[str]:
    say = _text(lang)
    if t.model == "qwen2-vl":
        lo = options.get("min_pixels", 56 * 56)
        hi = options.get("max_pixels", 14 * 14 * 4 * 1280)
        (w, h), (pr, pc), (gr, gc) = t.resized, t.patch_grid, t.grid
        return [
            say("qwen", lo=lo, hi=hi),
            say("resized", w=w, h=h, pr=pr, pc=pc, gr=gr, gc=gc),
            say("qwen_tokens", n=t.tokens),
        ]
    (w, h), (gr, gc) = t.resized, t.grid
    tiles = (h // 336) * (w // 336)
    p = t.parts
    return [
        say("llava"),
        say("best", w=w, h=h, tiles=tiles, s="s" * (tiles > 1)),
        say(
            "llava_tokens",
            n=t.tokens,
            uf=p["unpadded features"],
            gr=gr,
            gc=gc,
            nl=p["newlines"],
            base=p["base image"],
        ),
    ]


def costs(t: ImageTokens, lang: str = "en") -> list[tuple[str, AttentionCost]]:
    """The attention layers an image's tokens go through, labelled in `lang`, with their cost."""
    say = _text(lang)
    enc, llm = ENCODER_HEADS[t.model], LLM_HEADS[t.model]
    out = []
    if t.model == "qwen2-vl":
        out.append((say("dense_qwen"), attention_cost(t.encoder_segments, *_hd(enc))))
        win = window_lengths(t.patch_grid, QWEN25_WINDOW)
        out.append((say("windows"), attention_cost(win, *_hd(enc))))
    else:
        out.append((say("per_tile"), attention_cost(t.encoder_segments, *_hd(enc))))
    out.append((say("llm"), attention_cost([t.tokens], *_hd(llm))))
    return out


def _hd(h) -> tuple[int, int]:
    return h.heads, h.head_dim


def describe(
    width: int, height: int, models: tuple[str, ...] = MODELS, *, lang: str = "en", **options
) -> str:
    """The report `qkv tokens --image WIDTHxHEIGHT` prints, in `lang` ("en" or "zh").
    `options` go to Qwen2-VL (`min_pixels`, `max_pixels`)."""
    say = _text(lang)
    lines = [say("image", w=width, h=height, mp=width * height / 1e6), ""]
    rows: list[tuple[str, AttentionCost]] = []
    for model in models:
        t = image_tokens(model, width, height, **(options if model == "qwen2-vl" else {}))
        lines += _model_lines(t, options, lang)
        rows += [(f"{model:<11} {label}", c) for label, c in costs(t, lang)]
    cols = COLUMNS[lang]
    head = "".join(rjust(c, w) for c, w in zip(cols, (7, 14, 12, 11), strict=True))
    lines += ["", *say("cost").splitlines(), f"  {'':<52}{head}"]
    for label, c in rows:
        lines.append(
            f"  {ljust(label, 52)}{c.tokens:>7}{_num(c.flops) + 'FLOP':>14}"
            f"{_bytes(c.weights_bytes):>12}{_bytes(c.tiled_bytes):>11}"
        )
    lines += ["", *say("notes").splitlines()]
    return "\n".join(lines)


def sweep(sides=PLOT_SIDES, lang: str = "en") -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Tokens and attention FLOPs of square images of `sides` pixels, for the plot: two dicts,
    series name (in `lang`) → one value per side."""
    say = _text(lang)
    tokens: dict[str, list[int]] = {}
    flops: dict[str, list[int]] = {}
    for s in sides:
        q = image_tokens("qwen2-vl", s, s)
        q25 = image_tokens("qwen2-vl", s, s, max_pixels=QWEN25_MAX_PIXELS)
        ll = image_tokens("llava-next", s, s)
        tokens.setdefault("qwen2-vl", []).append(q.tokens)
        tokens.setdefault(say("max_pixels"), []).append(q25.tokens)
        tokens.setdefault("llava-next", []).append(ll.tokens)
        for model, t in (("qwen2-vl", q25), ("llava-next", ll)):
            for label, c in costs(t, lang):
                flops.setdefault(say("series", model=model, label=label), []).append(c.flops)
    return tokens, flops


def figure(sides=PLOT_SIDES, *, lang: str = "en"):
    """Tokens (left) and one attention layer's FLOPs (right) against the side of a square
    image, 224 to 3840 pixels, for Qwen2-VL and LLaVA-NeXT: a matplotlib Figure, its labels in
    `lang` (Chinese without a CJK font: English, see `qkv.inspect.figures.figure_lang`)."""
    from matplotlib.ticker import NullFormatter

    from ..inspect.figures import figure_lang, finish, new_figure

    lang = figure_lang(lang)
    say = _text(lang)
    tokens, flops = sweep(sides, lang)
    fig = new_figure(12, 4.6)
    ax1, ax2 = fig.subplots(1, 2)
    for label, values in tokens.items():
        ax1.plot(sides, values, marker="o", label=label)
    ax1.set(xscale="log", yscale="log", xlabel=say("side"), ylabel=say("tokens_y"),
            title=say("tokens_title"))  # fmt: skip
    for label, values in flops.items():
        ax2.plot(sides, values, marker=".", label=label)
    ax2.set(xscale="log", yscale="log", xlabel=say("side"), ylabel=say("flops_y"),
            title=say("flops_title"))  # fmt: skip
    ticks = [224, 448, 896, 1344, 2016, 3840]
    for ax in (ax1, ax2):
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return finish(fig, None, lang)


def plot(path: str | Path, sides=PLOT_SIDES, *, lang: str = "en") -> Path:
    """Draw `figure(sides, lang=lang)` and write it as a PNG to `path`."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"--plot needs matplotlib ({e}); install it with: pip install 'qkv[viz]'"
        ) from e
    from ..inspect.figures import save

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save(figure(sides, lang=lang), path, dpi=110)
    return path


# --------------------------------------------------------------------------------- the command


def add_arguments(to) -> None:
    """Add the `qkv tokens` arguments to its parser."""
    to.add_argument(
        "--image", metavar="WxH|FILE", help="an image size such as 1344x1344, or a file"
    )
    to.add_argument("--model", choices=(*MODELS, "all"), default="all", help="which model")
    to.add_argument("--min-pixels", type=int, help="Qwen2-VL's min_pixels (default 3136)")
    to.add_argument("--max-pixels", type=int, help="Qwen2-VL's max_pixels (default 1003520)")
    to.add_argument(
        "--plot",
        nargs="?",
        const="qkv-tokens.png",
        metavar="FILE",
        help="draw tokens and attention cost from 224² to 4K (default file qkv-tokens.png)",
    )


def run(args) -> None:
    """Run `qkv tokens`; a bad argument raises ValueError (the command prints it, exit 2)."""
    lang = getattr(args, "lang", "en")
    if args.image is None and args.plot is None:
        raise ValueError("give --image WIDTHxHEIGHT (or an image file), --plot, or both")
    if args.image is not None:
        size = parse_size(args.image)
        if size is None:
            if not Path(args.image).is_file():
                if Path(args.image).suffix or "/" in args.image or "\\" in args.image:
                    raise ValueError(f"--image: no such file: {args.image}")
                raise ValueError(
                    f"--image expects WIDTHxHEIGHT such as 1344x1344 or an image file, got "
                    f"{args.image!r}"
                )
            size = image_size(args.image)
        options = {
            name: value
            for name, value in (("min_pixels", args.min_pixels), ("max_pixels", args.max_pixels))
            if value is not None
        }
        models = MODELS if args.model == "all" else (args.model,)
        print(describe(*size, models=models, lang=lang, **options))
    if args.plot is not None:
        _plot_and_say(args.plot, lang)


def _plot_and_say(path: str, lang: str) -> None:
    """Write the plot and say where; a missing CJK font is said as a note, not a warning."""
    from ..inspect.figures import FontWarning, font_note

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FontWarning)
        written = plot(path, lang=lang)
    say = _text(lang)
    print(say("plot", path=written))
    if note := font_note(lang):
        print(say("note", note=note))
