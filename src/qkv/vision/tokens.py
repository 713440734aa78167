"""How many tokens an image costs: Qwen2-VL's dynamic resolution and LLaVA-NeXT's AnyRes tiles.

Both counts follow transformers' own processors (the tests compare them over a grid of sizes):

- **Qwen2-VL** (`Qwen2VLImageProcessor` + `Qwen2VLProcessor`): `smart_resize` rounds the image to
  multiples of `patch · merge` = 28 pixels, scaling it into `[min_pixels, max_pixels]` (56·56 and
  14·14·4·1280 by default) while keeping the aspect ratio; the vision encoder cuts it into 14×14
  patches (a still image is one temporal patch), and a 2×2 merge hands the language model one
  token per 28×28 pixels. A 224×224 image: 16×16 patches → 8×8 = 64 tokens.
- **LLaVA-NeXT** (llava-v1.6, `LlavaNextProcessor._get_number_of_features`): the image is fitted
  to the best of the grid pinpoints (336×672, 672×336, 672×672, 1008×336, 336×1008), cut into
  336×336 tiles of 24×24 = 576 CLIP-L/14 features each, the padding the fit added is cut off
  again ("unpadding", per the aspect ratio), one newline token ends every feature row, and a
  576-token base image (the whole picture at 336×336) comes first. The "default" feature
  strategy drops the CLS token; "full" keeps it (one more token).

The counts exclude special tokens (`<|vision_start|>`, `<|vision_end|>`). `attention_cost` turns
segment lengths into FLOPs and memory for one attention layer, dense or windowed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

MODELS = ("qwen2-vl", "llava-next")

# Qwen2-VL's image processor defaults.
QWEN_PATCH = 14
QWEN_MERGE = 2
QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 14 * 14 * 4 * 1280
QWEN_MAX_ASPECT = 200
# Qwen2.5-VL's vision encoder attends within windows of 112×112 pixels in most layers.
QWEN25_WINDOW = 112

# llava-v1.6's processor settings.
LLAVA_CROP = 336
LLAVA_PATCH = 14
LLAVA_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))  # (height, width)
LLAVA_STRATEGIES = ("default", "full")


@dataclass(frozen=True)
class Heads:
    """The attention shape of a model part: `heads` query heads of width `head_dim`."""

    heads: int
    head_dim: int


# The attention shapes of the 7B checkpoints, for the cost figures.
ENCODER_HEADS = {"qwen2-vl": Heads(16, 80), "llava-next": Heads(16, 64)}  # ViT (CLIP-L for LLaVA)
LLM_HEADS = {
    "qwen2-vl": Heads(28, 128),
    "llava-next": Heads(32, 128),
}  # Qwen2-7B, Mistral/Vicuna-7B


@dataclass(frozen=True)
class ImageTokens:
    """What one image becomes for a model.

    `tokens` is the number of image tokens the language model sees. `grid` is `(rows, cols)` of
    the token grid: Qwen2-VL's merged patches; for LLaVA-NeXT the unpadded AnyRes feature grid
    (each row also ends with a newline token; the 24×24 base image is counted in `parts`).
    `encoder_segments` are the lengths of the sequences the vision encoder attends within (one
    per image for Qwen2-VL; one per 336 tile, CLS included, for LLaVA-NeXT's CLIP)."""

    model: str
    width: int  # the input image
    height: int
    resized: tuple[int, int]  # (width, height) the encoder works at
    patch_grid: tuple[int, int]  # (rows, cols) of encoder patches (LLaVA-NeXT: the AnyRes grid)
    grid: tuple[int, int]  # (rows, cols) of language-model tokens (see above)
    tokens: int  # image tokens in the language model's sequence
    encoder_segments: tuple[int, ...]  # lengths the vision encoder's attention runs within
    parts: dict[str, int] = field(default_factory=dict)  # a breakdown of `tokens`


# --------------------------------------------------------------------------------- checks


def _size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int number of pixels, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive number of pixels, got {name}={value}")
    return value


def _model(model: object) -> str:
    if not isinstance(model, str) or model.lower() not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    return model.lower()


def _no_options(model: str, options: dict) -> None:
    if options:
        raise TypeError(f"unknown option(s) for {model}: {', '.join(sorted(options))}")


# --------------------------------------------------------------------------------- Qwen2-VL


def smart_resize(
    height: int,
    width: int,
    factor: int = QWEN_PATCH * QWEN_MERGE,
    min_pixels: int = QWEN_MIN_PIXELS,
    max_pixels: int = QWEN_MAX_PIXELS,
) -> tuple[int, int]:
    """Qwen2-VL's resize rule: `(height, width)` rounded to multiples of `factor`, scaled (keeping
    the aspect ratio) so that height·width lies in `[min_pixels, max_pixels]`.

    Raises ValueError for an aspect ratio above 200 (as transformers does)."""
    height, width = _size("height", height), _size("width", width)
    if max(height, width) / min(height, width) > QWEN_MAX_ASPECT:
        raise ValueError(
            f"absolute aspect ratio must be at most {QWEN_MAX_ASPECT}, got "
            f"{max(height, width) / min(height, width):g} for {width}×{height}"
        )
    h_bar = round(height / factor) * factor  # Python's round: halves go to the even neighbour
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _qwen2_vl(
    width: int,
    height: int,
    min_pixels: int = QWEN_MIN_PIXELS,
    max_pixels: int = QWEN_MAX_PIXELS,
    patch_size: int = QWEN_PATCH,
    merge_size: int = QWEN_MERGE,
    **options,
) -> ImageTokens:
    _no_options("qwen2-vl", options)
    patch_size, merge_size = _size("patch_size", patch_size), _size("merge_size", merge_size)
    min_pixels, max_pixels = _size("min_pixels", min_pixels), _size("max_pixels", max_pixels)
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels={min_pixels} must be ≤ max_pixels={max_pixels}")
    h, w = smart_resize(height, width, patch_size * merge_size, min_pixels, max_pixels)
    rows, cols = h // patch_size, w // patch_size  # encoder patches
    grid = (rows // merge_size, cols // merge_size)
    tokens = grid[0] * grid[1]
    return ImageTokens(
        model="qwen2-vl",
        width=width,
        height=height,
        resized=(w, h),
        patch_grid=(rows, cols),
        grid=grid,
        tokens=tokens,
        encoder_segments=(rows * cols,),
        parts={"merged patches": tokens},
    )


# --------------------------------------------------------------------------------- LLaVA-NeXT


def select_best_resolution(
    height: int, width: int, pinpoints: Sequence[tuple[int, int]] = LLAVA_PINPOINTS
) -> tuple[int, int]:
    """LLaVA-NeXT's choice of grid resolution `(height, width)`: the pinpoint that keeps the most
    of the image's pixels when it is scaled to fit, and among those the one wasting the least."""
    best, best_effective, best_waste = None, 0, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        down_w, down_h = int(width * scale), int(height * scale)
        effective = min(down_w * down_h, width * height)
        waste = pw * ph - effective
        if effective > best_effective or (effective == best_effective and waste < best_waste):
            best, best_effective, best_waste = (ph, pw), effective, waste
    if best is None:
        raise ValueError(f"no grid pinpoint fits a {width}×{height} image: {list(pinpoints)}")
    return best


def _pinpoints(pinpoints: object, crop: int) -> tuple[tuple[int, int], ...]:
    if not isinstance(pinpoints, Sequence) or not pinpoints:
        raise ValueError(
            f"grid_pinpoints must be a non-empty list of (height, width), got {pinpoints}"
        )
    out = []
    for p in pinpoints:
        if not isinstance(p, Sequence) or len(p) != 2:
            raise ValueError(f"grid_pinpoints entries must be (height, width) pairs, got {p!r}")
        ph, pw = _size("pinpoint height", p[0]), _size("pinpoint width", p[1])
        if ph % crop or pw % crop:
            raise ValueError(
                f"grid pinpoint {ph}×{pw} (height×width) does not divide into {crop}-pixel crops"
            )
        out.append((ph, pw))
    return tuple(out)


def _llava_next(
    width: int,
    height: int,
    crop_size: int = LLAVA_CROP,
    patch_size: int = LLAVA_PATCH,
    grid_pinpoints: Sequence[tuple[int, int]] = LLAVA_PINPOINTS,
    vision_feature_select_strategy: str = "default",
    **options,
) -> ImageTokens:
    _no_options("llava-next", options)
    crop, patch = _size("crop_size", crop_size), _size("patch_size", patch_size)
    if crop % patch:
        raise ValueError(f"crop_size={crop} does not divide into patches of {patch} pixels")
    if vision_feature_select_strategy not in LLAVA_STRATEGIES:
        raise ValueError(
            f"vision_feature_select_strategy must be one of {LLAVA_STRATEGIES}, got "
            f"{vision_feature_select_strategy!r}"
        )
    pins = _pinpoints(grid_pinpoints, crop)
    best_h, best_w = select_best_resolution(height, width, pins)
    tiles_h, tiles_w = best_h // crop, best_w // crop
    side = crop // patch  # features per tile side: 24
    rows, cols = side * tiles_h, side * tiles_w  # the AnyRes feature grid before unpadding
    # Unpadding (transformers' _get_unpadded_features): the fit left bands of padding on the
    # short side; their feature rows (or columns) are dropped again.
    if width / height > cols / rows:
        new_rows = int(round(height * (cols / width), 7))
        rows -= ((rows - new_rows) // 2) * 2
    else:
        new_cols = int(round(width * (rows / height), 7))
        cols -= ((cols - new_cols) // 2) * 2
    base = side * side + (1 if vision_feature_select_strategy == "full" else 0)
    tokens = rows * cols + rows + base
    return ImageTokens(
        model="llava-next",
        width=width,
        height=height,
        resized=(best_w, best_h),
        patch_grid=(side * tiles_h, side * tiles_w),
        grid=(rows, cols),
        tokens=tokens,
        encoder_segments=(side * side + 1,) * (tiles_h * tiles_w + 1),
        parts={"unpadded features": rows * cols, "newlines": rows, "base image": base},
    )


# --------------------------------------------------------------------------------- the API


def image_tokens(model: str, width: int, height: int, **options) -> ImageTokens:
    """What a `width × height` image becomes for `model` ("qwen2-vl" or "llava-next").

    Options: Qwen2-VL `min_pixels`, `max_pixels`, `patch_size`, `merge_size`; LLaVA-NeXT
    `crop_size`, `patch_size`, `grid_pinpoints` (a list of (height, width)),
    `vision_feature_select_strategy` ("default" drops the CLS token, "full" keeps it)."""
    model = _model(model)
    width, height = _size("width", width), _size("height", height)
    if model == "qwen2-vl":
        return _qwen2_vl(width, height, **options)
    return _llava_next(width, height, **options)


def token_count(model: str, width: int, height: int, **options) -> int:
    """The number of image tokens the language model sees for one `width × height` image, equal
    to what transformers' processor inserts (special tokens not counted). See `image_tokens`
    for the options."""
    return image_tokens(model, width, height, **options).tokens


# --------------------------------------------------------------------------------- the cost


@dataclass(frozen=True)
class AttentionCost:
    """One attention layer's forward over block-diagonal segments (each segment attends to
    itself only): FLOPs as FlashAttention counts them and the memory of its weights."""

    tokens: int  # N, the sum of the segment lengths
    pairs: int  # (query, key) pairs computed: Σ L²
    flops: int  # 4 · pairs · heads · head_dim
    weights_bytes: int  # the attention weights if materialised: pairs · heads · bytes
    tiled_bytes: int  # what an O(N) kernel keeps beyond its inputs: out and lse, N·heads·(D+1)


def attention_cost(
    lengths: Sequence[int], heads: int, head_dim: int, bytes_per_value: int = 4
) -> AttentionCost:
    """Cost of one attention layer whose queries attend within segments of `lengths` tokens:
    `[N]` is dense attention over N tokens, a list of window lengths windowed attention."""
    heads, head_dim = _size("heads", heads), _size("head_dim", head_dim)
    lens = [int(x) for x in lengths]
    if any(x < 0 for x in lens):
        raise ValueError(f"segment lengths must be ≥ 0, got {lens[:8]}")
    n, pairs = sum(lens), sum(x * x for x in lens)
    return AttentionCost(
        tokens=n,
        pairs=pairs,
        flops=4 * pairs * heads * head_dim,
        weights_bytes=pairs * heads * bytes_per_value,
        tiled_bytes=n * heads * (head_dim + 1) * bytes_per_value,
    )


def window_lengths(
    patch_grid: tuple[int, int],
    window: int = QWEN25_WINDOW,
    patch_size: int = QWEN_PATCH,
    merge_size: int = QWEN_MERGE,
) -> list[int]:
    """Lengths (in patches) of Qwen2.5-VL's attention windows over an image of `patch_grid`
    (rows, cols) patches: windows of `window` pixels square, cut at whole merged units, the last
    row and column of windows smaller when the grid does not divide."""
    rows, cols = patch_grid
    unit = window // merge_size // patch_size  # merged units per window side (4)
    if unit < 1:
        raise ValueError(f"window={window} is smaller than one merged unit of {merge_size} patches")
    mr, mc = rows // merge_size, cols // merge_size

    def cuts(n: int) -> list[int]:
        return [min(unit, n - i) for i in range(0, n, unit)]

    return [a * b * merge_size**2 for a in cuts(mr) for b in cuts(mc)]
