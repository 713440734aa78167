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

LONG_N = 1_048_576  # a long document
TILE_N, TILE = 2048, 128  # the pictures of kept tiles: 16 × 16 tiles
IMAGE_SIDES = (336, 672, 1344)

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


def _pictures() -> list[str]:
    """The patterns' kept tiles side by side: '#' full, '+' partial, '.' skipped."""
    grids, heads = [], []
    for name, rule in PATTERNS:
        lay = rule.blocks(TILE_N, TILE_N, TILE, TILE)
        grids.append(lay.show().splitlines())
        heads.append(f"{name}: {lay.kept_fraction:.0%} of tiles kept")
    lines = [f"  {i + 1}. {h}" for i, h in enumerate(heads)]
    width = len(grids[0][0])
    lines.append("     " + "".join(f"{i + 1}.".ljust(width + 6) for i in range(len(grids))))
    for row in zip(*grids, strict=True):
        lines.append("     " + "".join(r.ljust(width + 6) for r in row))
    return lines


def _measured(records: list[dict] | None) -> list[str]:
    """What the demo's cost curve measured at its largest N, forward."""
    fwd = [r for r in records or [] if r["pass"] == "forward" and r["time_s"] is not None]
    by = {(r["method"], r["n"]): r for r in fwd}
    ns = sorted({n for m, n in by if m == "naive"} & {n for m, n in by if m == "tiled"})
    if not ns:
        return ["  (the cost curve above was not measured, so there is nothing to compare here)"]
    n = ns[-1]
    naive, tiled = by[("naive", n)], by[("tiled", n)]
    out = [f"  Measured above, forward at N = {n}:"]
    if naive["peak_mib"] and tiled["peak_mib"]:
        out.append(
            f"    memory: the naive formula peaked at {naive['peak_mib']:,.0f} MiB, the tiled "
            f"kernel at {tiled['peak_mib']:,.0f} MiB ({naive['peak_mib'] / tiled['peak_mib']:.1f}× "
            "less: it never holds the N × N matrix)"
        )
    dense, window = by.get(("sdpa", n)), by.get(("window", n))
    if dense and window:
        out.append(
            f"    time: dense attention (torch SDPA) {dense['time_s'] * 1e3:.1f} ms, the sliding "
            f"window {window['time_s'] * 1e3:.1f} ms ({dense['time_s'] / window['time_s']:.1f}× "
            "faster: its empty tiles are never computed)"
        )
    return out


def long_context(records: list[dict] | None = None) -> str:
    flops, nbytes = cost(LONG_N, 64)
    return "\n".join(
        [
            f"One head with d_k = 64 at N = {LONG_N:,} tokens: QKᵀ and AV cost "
            f"{human(flops, 'FLOP')}, and the score matrix alone is {human(nbytes, 'B')} "
            "in fp32.",
            "The chapter's two answers:",
            "- Sparse attention lets each token see only some others. Tiles of "
            f"{TILE} × {TILE} at N = {TILE_N} ('#' computed whole, '+' computed with a mask, "
            "'.' never computed):",
            *_pictures(),
            "- FlashAttention computes dense attention exactly, tile by tile, with an online "
            "softmax (a running max and sum per row), so it never holds the N × N matrix: memory "
            "O(N) instead of O(N²), forward and backward (qkv's `tiled` backend and its compiled "
            "kernels).",
            *_measured(records),
        ]
    )


def visual_tokens() -> str:
    from ..vision.tokens import image_tokens

    rows = [
        "An image enters the model as a sequence of tokens, and attention's cost grows with its",
        "square. Qwen2-VL cuts it into 14-px patches and merges 2 × 2 of them into one token:",
        "⌈H/28⌉ · ⌈W/28⌉ tokens (after resizing within its pixel limits). LLaVA-NeXT covers it",
        "with 336-px tiles of 24 × 24 features, adds a 24 × 24 base image and one newline token",
        "per feature row.",
        "",
        f"  {'image':>11} {'Qwen2-VL':>10} {'LLaVA-NeXT':>11}   "
        "dense attention over them (Qwen2-VL)",
    ]
    for side in IMAGE_SIDES:
        q = image_tokens("qwen2-vl", side, side).tokens
        ll = image_tokens("llava-next", side, side).tokens
        rows.append(
            f"  {f'{side}×{side}':>11} {q:>10,} {ll:>11,}   {q * q:,} scores per head and layer"
        )
    rows.append("`qkv tokens --image WxH` gives the details for any size.")
    return "\n".join(rows)


def transformer_block(seed: int = 0) -> str:
    """The next chapter's block on the walk-through's N = 4, d = 8 example, two heads of 4."""
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
    mu, sd = h.mean(-1), h.std(-1, unbiased=False)
    return "\n".join(
        [
            "The next chapter stacks attention into a Transformer block (pre-norm, as GPT-2 and "
            "Llama): x + Attn(LN(x)), then + FFN(LN(·)). On N = 4 tokens of width d = 8, 2 heads:",
            f"  x                         {tuple(x.shape)}",
            f"  LN(x)                     {tuple(h.shape)}   every token to mean "
            f"{mu.abs().max().item():.0e}, std {sd.mean().item():.3f} "
            "(then a learned scale and shift)",
            f"  Q split into 2 heads      {tuple(q.shape)}   (batch, head, token, d_k = 8 / 2)",
            f"  multi-head attention      {tuple(a.shape)}   each head attends on its own; "
            "joined and projected back",
            f"  x + Attn(LN(x))           {tuple(x1.shape)}   the residual: the input is kept, "
            "attention adds to it",
            f"  FFN: Linear 8 → 32, GELU  {tuple(hidden.shape)}   "
            "per token, no mixing across tokens",
            f"       Linear 32 → 8        {tuple(f.shape)}",
            f"  + residual: the block     {tuple(out.shape)}   "
            "same shape as its input: blocks stack",
            f"  (equal to qkv.nn.TransformerBlock(8, 2)(x): max difference "
            f"{(out - whole).abs().max().item():.1e})",
        ]
    )
