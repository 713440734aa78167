"""`qkv explain --flash`: FlashAttention's walk over the walk-through's Q, K, V, as text.

Each step prints the tile of S the kernel computed (or that it skipped), the running max m, the
rescale factor α = exp(m_old − m), the running sum l and the output O of its query rows, from
`qkv.inspect.flash.flash_steps` (the `tiled` backend's own step functions). Then the textbook
softmax of one row beside the online one (equal), and the memory held against the N² scores
never held. English (`en`) or Chinese (`zh`).
"""

from __future__ import annotations

import torch

from .. import masks, reference
from .explain import ExplainError, human, walkthrough
from .flash import FlashStep, FlashSteps, flash_steps
from .text import columns, ljust

MAX_TEXT_STEPS = 1024  # tiles the text walk prints at most
BIG_N, BIG_DK, BIG_TILE = 1_048_576, 64, 128  # the long-document line (as `qkv explain`'s cost)

TEXT = {
    "en": {
        "title": (
            "FlashAttention on the walk-through's Q, K, V: N={n} tokens, d_k={dk}, tiles of "
            "{tq} queries × {tk} keys (seed {seed}{extra})."
        ),
        "causal": ", causal",
        "window": ", sliding window (w = {w} each side)",
        "intro": (
            "S = Q Kᵀ · 1/√d_k (= {scale:.4f}) is never held whole: each step computes one "
            "{tq}×{tk} tile of it, folds it into the running max m, sum l and output O of its "
            "query rows, and forgets it. When a tile raises a row's max, α = exp(m_old − m) < 1 "
            "shrinks the l and acc gathered so far, so that every term ends up as exp(s − final "
            "max): at the end O = acc / l is softmax(S) V exactly."
        ),
        "grid": (
            "The tiles of S (# full: computed as is, + partial: masked pair by pair, "
            ". skipped: never computed):"
        ),
        "qtile": "Query tile {r}: rows {rows}",
        "step": "step {i}  key tile {c}: keys {cols}, {status}",
        "status": {"full": "full", "partial": "partial", "skipped": "skipped"},
        "skipped": "nothing here may be seen, not computed",
        "sep": ": ",
        "split": "  (split {s})",
        "S": "S tile (−inf: masked)",
        "m": "m = max(m, rowmax S)",
        "alpha": "α = exp(m_old − m)",
        "alpha_first": "— (first tile: nothing to rescale)",
        "l": "l = α·l + rowsum exp(S − m)",
        "O": "O = (α·acc + exp(S − m) V) / l",
        "partials": "Split {s} (key tiles {tiles}): m = {m}  l = {l}",
        "merged": "Merged (m* = max m_s, l = Σ l_s·exp(m_s − m*)): m* = {m}  l = {l}",
        "none": "none",
        "row": "Row {i}, the textbook softmax beside the online one:",
        "textbook": "textbook",
        "online": "online",
        "equal": "equal: max |difference| {err:.1e} (rounding)",
        "differ": "DIFFERENT: max |difference| {err:.1e}",
        "masked": " ({allowed} allowed, {wasted} masked in partial tiles)",
        "every": "Every row: max |O_online − softmax(S) V| = {err:.1e}.",
        "work": (
            "Work: {done} of {total} q·k products computed{masked}; skipped tiles saved {saved}."
        ),
        "memory": (
            "Memory: held at any moment one {tq}×{tk} tile of S ({tile} numbers) and m, l, O "
            "of {rows} rows ({state} numbers); never held: the N×N = {full} scores of S (nor A)."
        ),
        "big": (
            "At N = {n:,} (d_k = {dk}, tiles of {t} × {t}, float32): held {tile} of scores + "
            "{state} of m, l, O, against {full} for S."
        ),
    },
    "zh": {
        "title": (
            "FlashAttention：用讲解示例的 Q、K、V，N={n} 个词元，d_k={dk}，"
            "每块 {tq} 个查询 × {tk} 个键（随机种子 {seed}{extra}）。"
        ),
        "causal": "，因果掩码",
        "window": "，滑动窗口每侧 {w} 个键",
        "intro": (
            "S = Q Kᵀ · 1/√d_k（= {scale:.4f}）从不完整保存：每一步只算出其中一块 {tq}×{tk}，"
            "把它并入这些查询行的滚动最大值 m、滚动和 l 与输出 O，然后丢弃。"
            "某一块抬高了一行的最大值时，α = exp(m_old − m) < 1 把之前累积的 l 和 acc 缩小，"
            "使每一项最终都等于 exp(s − m)，其中 m 是整行的最大值："
            "所以最后 O = acc / l 恰好等于 softmax(S) V。"
        ),
        "grid": "S 的分块（# 完整：直接计算；+ 部分：逐对加掩码；. 跳过：从不计算）：",
        "qtile": "查询块 {r}：行 {rows}",
        "step": "第 {i} 步  键块 {c}：键 {cols}，{status}",
        "status": {"full": "完整", "partial": "部分", "skipped": "跳过"},
        "skipped": "这里没有可见的键，不做任何计算",
        "sep": "：",
        "split": "  （段 {s}）",
        "S": "S 块（−inf：被掩盖）",
        "m": "m = max(m, rowmax S)",
        "alpha": "α = exp(m_old − m)",
        "alpha_first": "—（第一块：无需重新缩放）",
        "l": "l = α·l + rowsum exp(S − m)",
        "O": "O = (α·acc + exp(S − m) V) / l",
        "partials": "段 {s}（键块 {tiles}）：m = {m}  l = {l}",
        "merged": "合并（m* = max m_s，l = Σ l_s·exp(m_s − m*)）：m* = {m}  l = {l}",
        "none": "无",
        "row": "行 {i}：教科书的 softmax 与在线 softmax 并排：",
        "textbook": "教科书",
        "online": "在线",
        "equal": "相等：最大差值 {err:.1e}（舍入误差）",
        "differ": "不相等：最大差值 {err:.1e}",
        "masked": "（其中 {allowed} 个可见，{wasted} 个在部分块中被掩盖）",
        "every": "所有行：max |O_在线 − softmax(S) V| = {err:.1e}。",
        "work": (
            "计算量：共 {total} 个 q·k 乘积，算了 {done} 个{masked}；跳过的块省下 {saved} 个。"
        ),
        "memory": (
            "内存：任一时刻只保存 S 的一块 {tq}×{tk}（{tile} 个数）以及 {rows} 行的 m、l、O"
            "（{state} 个数）；从未保存：S 的全部 N×N = {full} 个分数（A 也没有）。"
        ),
        "big": (
            "当 N = {n:,}（d_k = {dk}，块 {t} × {t}，float32）：保存 {tile} 的分数 + {state} 的 "
            "m、l、O，而完整的 S 要 {full}。"
        ),
    },
}


def _lang(lang: str) -> dict:
    if lang not in TEXT:
        raise ValueError(f"lang must be one of {sorted(TEXT)}, got {lang!r}")
    return TEXT[lang]


WIDTH = 96  # columns of a prose line
NO_BREAK_BEFORE = set("，。；：、）」》！？")  # fullwidth punctuation never starts a line
# a line had better end after one of these (not 。 or ：, after which the demo's page starts a
# new paragraph) ...
BREAK_AFTER = set("，；、")
BREAK_REACH = 16  # ... when one is within this many columns of where the line would end
# the walk's Chinese terms, never cut in two at the end of a line (滚动最 / 大值)
KEEP_TOGETHER = (
    "滚动最大值", "滚动和", "最大值", "累积", "查询行", "查询块", "键块", "词元", "分数",
    "随机种子", "缩放", "计算", "保存", "丢弃", "输出", "矩阵", "乘积", "掩码", "示例",
)  # fmt: skip


def _wrap(text: str) -> str:
    """Prose cut into lines of at most `WIDTH` terminal columns: at spaces, or before a wide
    (Chinese) character, never inside a number, never before fullwidth punctuation. In Chinese
    text, a formula or a name between Chinese characters is never cut at its spaces, a line
    ends after a fullwidth ，；、 when one is within its last `BREAK_REACH` columns (a break
    between phrases, not inside a word), and never inside one of the terms of
    `KEEP_TOGETHER`."""
    wide = any(columns(c) == 2 for c in text)
    tokens, word, k = [], "", 0
    while k < len(text):
        term = next((w for w in KEEP_TOGETHER if text.startswith(w, k)), None) if wide else None
        ch = term or text[k]
        if term or columns(ch) == 2 or (ch == " " and not wide):
            tokens += [word, ch] if word else [ch]
            word = ""
        else:
            word += ch
        k += len(ch)
    tokens.append(word)
    lines, line = [], ""
    for tok in tokens:
        fits = columns(line + tok) <= WIDTH or tok in NO_BREAK_BEFORE
        if line and not fits:
            cut = max((i for i, c in enumerate(line) if c in BREAK_AFTER), default=-1) + 1
            tail = line[cut:] if cut else ""
            if tail.strip() and columns(tail) <= BREAK_REACH:
                lines.append(line[:cut].rstrip())
                line = tail.lstrip() + tok
            else:
                lines.append(line.rstrip())
                line = tok.lstrip()
        else:
            line += tok
    return "\n".join([*lines, line.rstrip()])


def _num(x: float) -> str:
    return f"{x:8.3f}" if x != float("-inf") else "    -inf"


def _vec(t: torch.Tensor) -> str:
    return "[" + " ".join(_num(x) for x in t.tolist()) + "]"


def _span(a: int, b: int) -> str:
    return str(a) if b - a == 1 else f"{a}–{b - 1}"


def _matrix(t: torch.Tensor, indent: str) -> list[str]:
    return [indent + _vec(row) for row in t]


def _step_lines(s: FlashStep, t: dict, splits: int) -> list[str]:
    head = t["step"].format(
        i=s.index + 1, c=s.k_tile, cols=_span(*s.cols), status=t["status"][s.status]
    )
    if splits > 1:
        head += t["split"].format(s=s.split)
    if s.scores is None:
        return [f"  {head}{t['sep']}{t['skipped']}"]
    pad = " " * 4
    width = max(len(t[key]) for key in ("m", "alpha", "l")) + 2  # ASCII formulas
    lines = [f"  {head}", f"{pad}{t['S']}", *_matrix(s.scores, pad + "  ")]
    lines.append(f"{pad}{t['m']:<{width}}{_vec(s.m)}")
    alpha = t["alpha_first"] if s.alpha is None else _vec(s.alpha)
    lines.append(f"{pad}{t['alpha']:<{width}}{alpha}")
    lines.append(f"{pad}{t['l']:<{width}}{_vec(s.l)}")
    lines.append(f"{pad}{t['O']}")
    lines += _matrix(s.o, pad + "  ")
    return lines


def render_steps(fs: FlashSteps, lang: str = "en") -> str:
    """A `FlashSteps` as text: its tile grid, every step (S tile, m, α, l, O), each query tile's
    splits and their merge (when split), the work done and the memory held."""
    t = _lang(lang)
    out = [_wrap(t["grid"]), *("  " + line for line in fs.layout.show().splitlines())]
    for r in range(len(fs.kinds)):
        steps = [s for s in fs.steps if s.q_tile == r]
        out.append("\n" + t["qtile"].format(r=r, rows=_span(*steps[0].rows)))
        for s in steps:
            out += _step_lines(s, t, fs.n_splits)
        if fs.n_splits > 1:
            for p in fs.splits[r]:
                tiles = ", ".join(map(str, p.k_tiles)) or t["none"]
                out.append(
                    "  " + t["partials"].format(s=p.split, tiles=tiles, m=_vec(p.m), l=_vec(p.l))
                )
            mg = fs.merged[r]
            out.append("  " + t["merged"].format(m=_vec(mg.m), l=_vec(mg.l)))
            out += _matrix(mg.o, "    ")
    out.append("")
    wasted = fs.products - fs.allowed
    masked = t["masked"].format(allowed=fs.allowed, wasted=wasted) if wasted else ""
    out.append(
        _wrap(
            t["work"].format(
                done=fs.products, total=fs.not_held, masked=masked, saved=fs.products_saved
            )
        )
    )
    out.append(
        _wrap(
            t["memory"].format(
                tq=fs.tile_q,
                tk=fs.tile_k,
                tile=fs.scores_held,
                rows=min(fs.tile_q, fs.shape[0]),
                state=fs.state_held,
                full=fs.not_held,
            )
        )
    )
    return "\n".join(out)


def _textbook(fs: FlashSteps, st, i: int, t: dict) -> list[str]:
    """Row i: the textbook's m, l, A and O from the whole row of S, beside the walk's."""
    row = st.S_scaled[i]
    m = row.max()
    l_true = torch.exp(row - m).sum() if torch.isfinite(m) else torch.zeros(())
    last = [s for s in fs.steps if s.rows[0] <= i < s.rows[1]][-1]
    r = i - last.rows[0]
    m_on, l_on, o_on = last.m[r], last.l[r], fs.out[i]
    err = (o_on.double() - st.out[i]).abs().max().item()
    width = max(columns(t["textbook"]), columns(t["online"])) + 2
    a, b = ljust(t["textbook"], width), ljust(t["online"], width)
    pad = " " * (width + 2)
    lines = [
        "\n" + t["row"].format(i=i),
        f"  {a}m = max_j S[{i}, j] = {m.item():.6g}   "
        f"l = Σ_j exp(S[{i}, j] − m) = {l_true.item():.6g}",
        f"{pad}A[{i}] = softmax(S[{i}]) = {_vec(st.A[i])}",
        f"{pad}O[{i}] = A[{i}] V = {_vec(st.out[i])}",
        f"  {b}m = {m_on.item():.6g}   l = {l_on.item():.6g}",
        f"{pad}O[{i}] = acc / l = {_vec(o_on)}",
        "  " + (t["equal"] if err <= 1e-10 else t["differ"]).format(err=err),
    ]
    return lines


def _mask(window: int | None) -> masks.Mask | None:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ExplainError(f"window must be an int ≥ 0 (keys each side) or None, got {window!r}")
    return masks.sliding_window(window)


def render_walk(
    n: int = 4,
    d: int = 8,
    d_k: int = 4,
    tile: int = 2,
    causal: bool = False,
    window: int | None = None,
    seed: int = 0,
    lang: str = "en",
) -> str:
    """FlashAttention's walk on the walk-through's Q, K, V (`walkthrough(n, d, d_k, seed)`),
    tiles of `tile × tile`, `causal` and/or a sliding `window` (keys each side), as text in
    English (`en`) or Chinese (`zh`)."""
    t = _lang(lang)
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ExplainError(f"tile must be a positive int, got {tile!r}")
    steps = (-(-n // tile)) ** 2 if isinstance(n, int) else 0
    if steps > MAX_TEXT_STEPS:
        raise ExplainError(
            f"the walk prints every tile: N={n} with tiles of {tile} makes {steps:,} steps "
            f"(at most {MAX_TEXT_STEPS:,}); use a larger --tile or a smaller --n"
        )
    mask = _mask(window)
    w = walkthrough(n=n, d=d, d_k=d_k, seed=seed, causal=causal)
    fs = flash_steps(w.Q, w.K, w.V, tile_q=tile, tile_k=tile, causal=causal, mask=mask)
    st = reference.steps(w.Q, w.K, w.V, causal=causal, mask=mask)
    extra = (t["causal"] if causal else "") + (
        t["window"].format(w=window) if window is not None else ""
    )
    out = [
        _wrap(t["title"].format(n=n, dk=d_k, tq=tile, tk=tile, seed=seed, extra=extra)),
        _wrap(t["intro"].format(scale=fs.scale, tq=tile, tk=tile)),
        "",
        render_steps(fs, lang),
    ]
    out += _textbook(fs, st, n - 1, t)
    err = (fs.out - st.out).abs().max().item()
    out.append(t["every"].format(err=err))
    scores, state = 4 * BIG_TILE * BIG_TILE, 4 * BIG_TILE * (2 + BIG_DK)
    out.append(
        _wrap(
            t["big"].format(
                n=BIG_N,
                dk=BIG_DK,
                t=BIG_TILE,
                tile=human(scores, "B"),
                state=human(state, "B"),
                full=human(4 * BIG_N * BIG_N, "B"),
            )
        )
    )
    return "\n".join(out)
