"""The rest of the chapter as text for `qkv demo`: the answers to attention's O(N²) cost, what an
image costs in tokens, and the next chapter's Transformer block on the walk-through's example.

Each function returns the text a demo section prints; every number in it is computed here (the
kept tiles from `qkv.masks`, token counts from `qkv.vision`, shapes from running `qkv.nn`), or
read from the cost curve the demo measured just before (`records`)."""

from __future__ import annotations

import torch

from .. import masks
from ..nn import TransformerBlock
from .explain import cost, human
from .text import ljust, rjust

LONG_N = 1_048_576  # a long document
TILE_N, TILE = 2048, 128  # the pictures of kept tiles: 16 × 16 tiles
IMAGE_SIDES = (336, 672, 1344)
LANGS = ("en", "zh")

PATTERNS = (
    (
        "Sparse Transformer, strided (Child et al. 2019), causal",
        masks.causal() & masks.strided(128),
    ),
    (
        "Longformer: window 256 + 2 global tokens",
        masks.sliding_window(256) | masks.global_tokens([0, 1]),
    ),
    (
        "BigBird: window 1, 1 global, 2 random blocks of 128",
        masks.bigbird(window=1, n_global=1, n_random=2, block=128),
    ),
)
PATTERN_NAMES_ZH = (
    "Sparse Transformer：跨步模式（Child 等，2019），因果",
    "Longformer：窗口 256 + 2 个全局词元",
    "BigBird：窗口 1 块、1 个全局块、2 个随机块（每块 128）",
)

TEXT = {
    "en": {
        "kept": "{name}: {share:.0%} of tiles kept",
        "none": "  (the cost curve above was not measured, so there is nothing to compare here)",
        "at": "  Measured above, forward at N = {n}:",
        "memory": "    memory: the naive formula peaked at {naive:,.0f} MiB, the tiled kernel at "
        "{tiled:,.0f} MiB",
        "less": " ({ratio:.1f}× less: it never holds the N × N matrix)",
        "not_less": " (no less at this N: the N × N matrix is still small beside the inputs)",
        "time": "    time: dense attention (torch SDPA) {dense:.1f} ms, the sliding window "
        "{window:.1f} ms",
        "faster": " ({ratio:.1f}× faster: its empty tiles are never computed)",
        "slower": " ({ratio:.1f}× slower at this N: dense time grows as N², the window's as N)",
        "slower_why": "    (at the sizes measured here dense SDPA's fast kernel still wins; the "
        "window's advantage is its growth, linear in N: see the slopes of the curve above)",
        "even": " (the same time, within {pct:.0%}: at this N the window keeps most tiles)",
        "cost": "One head with d_k = 64 at N = {n:,} tokens: QKᵀ and AV cost {flops}, and the "
        "score matrix alone is {nbytes} in fp32.",
        "answers": "The chapter's two answers:",
        "sparse": "- Sparse attention lets each token see only some others. Tiles of {t} × {t} at "
        "N = {n} ('#' computed whole, '+' computed with a mask, '.' never computed):",
        "flash": "- FlashAttention computes dense attention exactly, tile by tile, with an online "
        "softmax (a running max and sum per row), so it never holds the N × N matrix: memory "
        "O(N) instead of O(N²), forward and backward (qkv's `tiled` backend and its compiled "
        "kernels).",
        "visual": [
            "An image enters the model as a sequence of tokens, and attention's cost grows with "
            "its",
            "square. Qwen2-VL cuts it into 14-px patches and merges 2 × 2 of them into one token:",
            "⌈H/28⌉ · ⌈W/28⌉ tokens (after resizing within its pixel limits). LLaVA-NeXT covers it",
            "with 336-px tiles of 24 × 24 features, adds a 24 × 24 base image and one newline "
            "token",
            "per feature row.",
        ],
        "visual_cols": ("image", "Qwen2-VL", "LLaVA-NeXT", "dense attention over them (Qwen2-VL)"),
        "scores": "{scores:,} scores per head and layer",
        "visual_more": "`qkv tokens --image WxH` gives the details for any size.",
        "block": [
            "The next chapter stacks attention into a Transformer block (pre-norm, as GPT-2 and "
            "Llama): x + Attn(LN(x)), then + FFN(LN(·)), where LN is LayerNorm (each token "
            "normalised to mean 0 and std 1 across its d features). On N = 4 tokens of width "
            "d = 8, 2 heads:",
            ("x", ""),
            (
                "LN(x)",
                "every token to mean {mu:.0e}, std {sd:.3f} (then a learned scale and shift)",
            ),
            ("Q split into 2 heads", "(batch, head, token, d_k = 8 / 2)"),
            ("multi-head attention", "each head attends on its own; joined and projected back"),
            ("x + Attn(LN(x))", "the residual: the input is kept, attention adds to it"),
            ("FFN: Linear 8 → 32, GELU", "per token, no mixing across tokens"),
            ("     Linear 32 → 8", ""),
            ("+ residual: the block", "same shape as its input: blocks stack"),
            "(equal to qkv.nn.TransformerBlock(8, 2)(x): max difference {diff:.1e})",
        ],
    },
    "zh": {
        "kept": "{name}：保留了 {share:.0%} 的块",
        "none": "  （上面没有测出开销曲线，所以这里没有可比较的数据）",
        "at": "  上面测得的结果，前向，N = {n}：",
        "memory": "    内存：朴素公式的峰值为 {naive:,.0f} MiB，分块内核为 {tiled:,.0f} MiB",
        "less": "（仅为前者的 1/{ratio:.1f}：它从不保存 N × N 矩阵）",
        "not_less": "（在这个 N 下并不更少：N × N 矩阵与输入相比还很小）",
        "time": "    时间：稠密注意力（torch SDPA）{dense:.1f} ms，滑动窗口 {window:.1f} ms",
        "faster": "（快 {ratio:.1f} 倍：空块从不计算）",
        "slower": "（在这个 N 下慢 {ratio:.1f} 倍：稠密注意力的时间随 N² 增长，窗口的随 N 增长）",
        "slower_why": "    （在这里测过的长度上，SDPA 的高速稠密内核仍然更快；窗口的优势在于它的"
        "增长只与 N 成正比：看上面曲线的斜率）",
        "even": "（用时相同，相差不到 {pct:.0%}：在这个 N 下窗口保留了大部分块）",
        "cost": "一个 d_k = 64 的头在 N = {n:,} 个词元时：QKᵀ 和 AV 要 {flops}，"
        "仅分数矩阵在 fp32 下就有 {nbytes}。",
        "answers": "本章给出的两个答案：",
        "sparse": "- 稀疏注意力让每个词元只看其中一部分词元。N = {n} 时 {t} × {t} 的块"
        "（'#' 整块计算，'+' 带掩码计算，'.' 从不计算）：",
        "flash": "- FlashAttention 逐块、精确地计算稠密注意力，用在线 softmax"
        "（每行维护滚动最大值和滚动和），因此从不保存 N × N 矩阵："
        "内存为 O(N) 而不是 O(N²)，前向和反向都是如此（qkv 的 `tiled` 后端及其编译内核）。",
        "visual": [
            "图像以一串词元的形式进入模型，注意力的开销随词元数的平方增长。",
            "Qwen2-VL 把图像切成 14 像素的小块，再把 2 × 2 个小块合并成一个词元：",
            "⌈H/28⌉ · ⌈W/28⌉ 个词元（先在其像素上下限内缩放）。LLaVA-NeXT 用 336 像素的",
            "图块覆盖图像，每块 24 × 24 个特征，另加一张 24 × 24 的整体缩略图，",
            "并在每行特征后加一个换行词元。",
        ],
        "visual_cols": ("图像", "Qwen2-VL", "LLaVA-NeXT", "在这些词元上做稠密注意力（Qwen2-VL）"),
        "scores": "每个头、每一层 {scores:,} 个分数",
        "visual_more": "`qkv tokens --image 宽x高` 可给出任意尺寸的详细数字。",
        "block": [
            "下一章把注意力堆叠成 Transformer 块（前置归一化，如 GPT-2 和 Llama）："
            "x + Attn(LN(x))，再 + FFN(LN(·))，其中 LN 是层归一化（LayerNorm：每个词元的 d 个"
            "特征归一化为均值 0、标准差 1）。在 N = 4 个宽度 d = 8 的词元上，2 个头：",
            ("x", ""),
            ("LN(x)", "每个词元的均值变为 {mu:.0e}，标准差 {sd:.3f}（再乘以学到的缩放、加上偏移）"),
            ("Q 拆成 2 个头", "（批，头，词元，d_k = 8 / 2）"),
            ("多头注意力", "每个头各自计算注意力；拼接后投影回原宽度"),
            ("x + Attn(LN(x))", "残差：保留输入，注意力的结果加在上面"),
            ("FFN：线性 8 → 32，GELU", "逐词元计算，词元之间不混合"),
            ("     线性 32 → 8", ""),
            ("+ 残差：整个块", "形状与输入相同：块可以层层堆叠"),
            "（与 qkv.nn.TransformerBlock(8, 2)(x) 的结果相同：最大差值 {diff:.1e}）",
        ],
    },
}


def _text(lang: str) -> dict:
    if lang not in LANGS:
        raise ValueError(f"lang must be en or zh, got {lang!r}")
    return TEXT[lang]


def _pictures(lang: str = "en") -> list[str]:
    """The patterns' kept tiles side by side: '#' full, '+' partial, '.' skipped."""
    grids, heads = [], []
    names = [n for n, _ in PATTERNS] if lang == "en" else PATTERN_NAMES_ZH
    for name, (_, rule) in zip(names, PATTERNS, strict=True):
        lay = rule.blocks(TILE_N, TILE_N, TILE, TILE)
        grids.append(lay.show().splitlines())
        heads.append(_text(lang)["kept"].format(name=name, share=lay.kept_fraction))
    lines = [f"  {i + 1}. {h}" for i, h in enumerate(heads)]
    width = len(grids[0][0])
    lines.append("     " + "".join(f"{i + 1}.".ljust(width + 6) for i in range(len(grids))))
    for row in zip(*grids, strict=True):
        lines.append("     " + "".join(r.ljust(width + 6) for r in row))
    return lines


def _measured(records: list[dict] | None, lang: str = "en") -> list[str]:
    """What the demo's cost curve measured at its largest N, forward."""
    t = _text(lang)
    fwd = [r for r in records or [] if r["pass"] == "forward" and r["time_s"] is not None]
    by = {(r["method"], r["n"]): r for r in fwd}
    ns = sorted({n for m, n in by if m == "naive"} & {n for m, n in by if m == "tiled"})
    if not ns:
        return [t["none"]]
    n = ns[-1]
    naive, tiled = by[("naive", n)], by[("tiled", n)]
    out = [t["at"].format(n=n)]
    if naive["peak_mib"] and tiled["peak_mib"]:
        a, b = naive["peak_mib"], tiled["peak_mib"]
        less = a > b * (1 + EVEN)
        tail = t["less"].format(ratio=a / b) if less else t["not_less"]
        out.append(t["memory"].format(naive=a, tiled=b) + tail)
    dense, window = by.get(("sdpa", n)), by.get(("window", n))
    if dense and window:
        a, b = dense["time_s"], window["time_s"]
        out.append(t["time"].format(dense=a * 1e3, window=b * 1e3) + _ratio(a, b, t))
        if b > a * (1 + EVEN):
            out.append(t["slower_why"])
    return out


EVEN = 0.05  # two times within 5% of each other are "the same"


def _ratio(dense: float, window: float, t: dict) -> str:
    """Whether the window was faster or slower than dense attention, said as it was."""
    if abs(dense / window - 1) <= EVEN:
        return t["even"].format(pct=EVEN)
    if window < dense:
        return t["faster"].format(ratio=dense / window)
    return t["slower"].format(ratio=window / dense)


def long_context(records: list[dict] | None = None, lang: str = "en") -> str:
    t = _text(lang)
    flops, nbytes = cost(LONG_N, 64)
    return "\n".join(
        [
            t["cost"].format(n=LONG_N, flops=human(flops, "FLOP"), nbytes=human(nbytes, "B")),
            t["answers"],
            t["sparse"].format(t=TILE, n=TILE_N),
            *_pictures(lang),
            t["flash"],
            *_measured(records, lang),
        ]
    )


def visual_tokens(lang: str = "en") -> str:
    from ..vision.tokens import image_tokens

    t = _text(lang)
    cols = t["visual_cols"]
    rows = [
        *t["visual"],
        "",
        f"  {rjust(cols[0], 11)} {rjust(cols[1], 10)} {rjust(cols[2], 11)}   {cols[3]}",
    ]
    for side in IMAGE_SIDES:
        q = image_tokens("qwen2-vl", side, side).tokens
        ll = image_tokens("llava-next", side, side).tokens
        scores = t["scores"].format(scores=q * q)
        rows.append(f"  {f'{side}×{side}':>11} {q:>10,} {ll:>11,}   {scores}")
    rows.append(t["visual_more"])
    return "\n".join(rows)


def transformer_block(seed: int = 0, lang: str = "en") -> str:
    """The next chapter's block on the walk-through's N = 4, d = 8 example, two heads of 4."""
    t = _text(lang)
    torch.manual_seed(seed)
    block = TransformerBlock(d_model=8, n_heads=2, norm="layernorm", pre_norm=True).double()
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    with torch.no_grad():
        h = block.norm1(x)
        att = block.attn
        q = att._heads(att.q_proj(h), att.n_heads)
        a = block.attn(h)
        x1 = x + a
        h2 = block.norm2(x1)
        hidden = block.ffn.w1(h2)
        f = block.ffn(h2)
        out = x1 + f
        whole = block(x)
    mu, sd = h.mean(-1).abs().max().item(), h.std(-1, unbiased=False).mean().item()
    shapes = (x, h, q, a, x1, hidden, f, out)
    intro, *steps, last = t["block"]
    lines = [intro]
    for (name, note), value in zip(steps, shapes, strict=True):
        shown = ljust(name, 26) + str(tuple(value.shape))
        note = note.format(mu=mu, sd=sd)
        lines.append(f"  {ljust(shown, 41)}{note}".rstrip() if note else f"  {shown}")
    lines.append("  " + last.format(diff=(out - whole).abs().max().item()))
    return "\n".join(lines)
