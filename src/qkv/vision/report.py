"""The `qkv tokens` command: what an image costs, as text and as a plot.

`describe(width, height)` is the text the command prints: per model the resize, the grid and the
token count, then the cost of one attention layer over those tokens (FLOPs and memory, dense vs
windowed). `plot(path)` draws tokens and attention cost against the image size, from 224² to 4K
(3840 pixels a side), for both models. matplotlib and Pillow are imported only when needed.
"""

from __future__ import annotations

import re
from pathlib import Path

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


def _model_lines(t: ImageTokens, options: dict) -> list[str]:
    if t.model == "qwen2-vl":
        lo = options.get("min_pixels", 56 * 56)
        hi = options.get("max_pixels", 14 * 14 * 4 * 1280)
        (w, h), (pr, pc), (gr, gc) = t.resized, t.patch_grid, t.grid
        return [
            f"qwen2-vl    (min_pixels {lo}, max_pixels {hi})",
            f"  resized to {w}×{h}: {pr}×{pc} patches of 14 px, 2×2 merge → {gr}×{gc} grid",
            f"  tokens: {t.tokens}  (+2 special: <|vision_start|> <|vision_end|>)",
        ]
    (w, h), (gr, gc) = t.resized, t.grid
    tiles = (h // 336) * (w // 336)
    p = t.parts
    return [
        "llava-next  (336-px tiles, llava-v1.6 grid pinpoints, feature strategy default)",
        f"  best grid {w}×{h}: {tiles} tile{'s' * (tiles > 1)} of 24×24 features + base image",
        f"  tokens: {t.tokens} = {p['unpadded features']} unpadded features ({gr}×{gc}) "
        f"+ {p['newlines']} newlines + {p['base image']} base image",
    ]


def costs(t: ImageTokens) -> list[tuple[str, AttentionCost]]:
    """The attention layers an image's tokens go through, labelled, with their cost."""
    enc, llm = ENCODER_HEADS[t.model], LLM_HEADS[t.model]
    out = []
    if t.model == "qwen2-vl":
        out.append(("encoder, dense (Qwen2-VL)", attention_cost(t.encoder_segments, *_hd(enc))))
        win = window_lengths(t.patch_grid, QWEN25_WINDOW)
        out.append(("encoder, 112-px windows (Qwen2.5-VL)", attention_cost(win, *_hd(enc))))
    else:
        out.append(("encoder, per 336 tile (CLIP)", attention_cost(t.encoder_segments, *_hd(enc))))
    out.append(("LLM over the image tokens, dense", attention_cost([t.tokens], *_hd(llm))))
    return out


def _hd(h) -> tuple[int, int]:
    return h.heads, h.head_dim


def describe(width: int, height: int, models: tuple[str, ...] = MODELS, **options) -> str:
    """The report `qkv tokens --image WIDTHxHEIGHT` prints. `options` go to Qwen2-VL
    (`min_pixels`, `max_pixels`)."""
    lines = [f"image {width}×{height} ({width * height / 1e6:.2f} MP)", ""]
    rows: list[tuple[str, AttentionCost]] = []
    for model in models:
        t = image_tokens(model, width, height, **(options if model == "qwen2-vl" else {}))
        lines += _model_lines(t, options)
        rows += [(f"{model:<11} {label}", c) for label, c in costs(t)]
    lines += [
        "",
        "attention cost of one layer, forward, fp32 (encoder: 16 heads of 80 (Qwen), 16 of 64",
        "(CLIP-L); LLM: 28 heads of 128 (Qwen2-7B), 32 of 128 (Mistral-7B)):",
        f"  {'':<52}{'tokens':>7}{'FLOPs':>14}{'weights':>12}{'O(N)':>11}",
    ]
    for label, c in rows:
        lines.append(
            f"  {label:<52}{c.tokens:>7}{_num(c.flops) + 'FLOP':>14}"
            f"{_bytes(c.weights_bytes):>12}{_bytes(c.tiled_bytes):>11}"
        )
    lines += [
        "",
        "tokens: what the layer attends over (the encoder's are patches, 4 per Qwen LLM token);",
        "weights: the attention matrix of every head if materialised (eager attention);",
        "O(N): what a tiled kernel such as qkv's keeps instead (output and lse).",
    ]
    return "\n".join(lines)


def sweep(sides=PLOT_SIDES) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Tokens and attention FLOPs of square images of `sides` pixels, for the plot: two dicts,
    series name → one value per side."""
    tokens: dict[str, list[int]] = {}
    flops: dict[str, list[int]] = {}
    for s in sides:
        q = image_tokens("qwen2-vl", s, s)
        q25 = image_tokens("qwen2-vl", s, s, max_pixels=QWEN25_MAX_PIXELS)
        ll = image_tokens("llava-next", s, s)
        tokens.setdefault("qwen2-vl", []).append(q.tokens)
        tokens.setdefault("qwen2-vl, max_pixels 12845056", []).append(q25.tokens)
        tokens.setdefault("llava-next", []).append(ll.tokens)
        for model, t in (("qwen2-vl", q25), ("llava-next", ll)):
            for label, c in costs(t):
                flops.setdefault(f"{model}: {label}", []).append(c.flops)
    return tokens, flops


def plot(path: str | Path, sides=PLOT_SIDES) -> Path:
    """Draw tokens (left) and one attention layer's FLOPs (right) against the side of a square
    image, 224 to 3840 pixels, for Qwen2-VL and LLaVA-NeXT; write a PNG to `path`."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            f"--plot needs matplotlib ({e}); install it with: pip install 'qkv[viz]'"
        ) from e
    tokens, flops = sweep(sides)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    for label, values in tokens.items():
        ax1.plot(sides, values, marker="o", label=label)
    ax1.set(xscale="log", yscale="log", xlabel="image side (pixels, square image)",
            ylabel="image tokens the LLM sees", title="Tokens per image")  # fmt: skip
    for label, values in flops.items():
        ax2.plot(sides, values, marker=".", label=label)
    ax2.set(xscale="log", yscale="log", xlabel="image side (pixels, square image)",
            ylabel="FLOPs of one attention layer (forward)",
            title="Attention cost (Qwen2-VL at max_pixels 12845056)")  # fmt: skip
    ticks = [224, 448, 896, 1344, 2016, 3840]
    for ax in (ax1, ax2):
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
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
        print(describe(*size, models=models, **options))
    if args.plot is not None:
        print(f"plot: {plot(args.plot)}")
