"""Chinese complete: every zh text surface of the figures, the labs, `qkv tokens` and the cost
table holds no run of English words and no ASCII `,:;()` around Chinese.

Allowed in Chinese text: symbols and code (`d_k`, `max_pixels`, `<|vision_start|>`, `N=512`),
model and method names (`qwen2-vl`, `CLIP-L`, `sdpa`), units, and the terms of `ALLOWED`, each
of which may stand alone; what may never stand is two English words in a row. The checks
(`english_runs`, `ascii_punctuation`) are importable for other surfaces' tests.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from qkv.cli_zh import error as zh_error
from qkv.inspect import bench
from qkv.inspect.attend import AttentionMap
from qkv.inspect.text import columns
from qkv.labs import command, common, routing, scale
from qkv.vision import report

# terms Chinese text keeps in English: names, code, units (compared case-insensitively)
ALLOWED = {
    "softmax",
    "rnn",
    "lstm",
    "cnn",
    "qkv",
    "llm",
    "cpu",
    "flop",
    "flops",
    "nats",
    "eager",
    "default",
    "lse",
    "fp32",
    "mib",
    "gib",
    "kib",
    "ms",
    "naive",
    "sdpa",
    "tiled",
    "window",
    "ln",
    "var",
}
CJK = "\u3000-\u303f\u4e00-\u9fff\uff00-\uffef“”"
TOKEN = re.compile(r"[!-~]+")  # a run of printable ASCII: a word, a symbol, a name
WORD = re.compile(r"\(?([A-Za-z]{2,})[,.;:!?)']*")  # an English word, punctuation around it
PUNCT = re.compile(rf"[{CJK}] *[,:;]|[,:;] *[{CJK}]|\([^()]*[{CJK}][^()]*\)")


def english_runs(text: str) -> list[str]:
    """The runs of two or more English words in a row (only spaces between them) in `text`,
    words of `ALLOWED` and tokens holding digits or symbols not counted as words."""
    runs, run, end = [], [], None
    for m in TOKEN.finditer(text):
        word = WORD.fullmatch(m[0])
        is_word = word is not None and word[1].lower() not in ALLOWED
        joined = end is not None and text[end : m.start()].strip(" ") == ""
        if is_word and run and joined:
            run.append(m[0])
        else:
            if len(run) >= 2:
                runs.append(" ".join(run))
            run = [m[0]] if is_word else []
        end = m.end()
    if len(run) >= 2:
        runs.append(" ".join(run))
    return runs


def ascii_punctuation(text: str) -> list[str]:
    """ASCII `,`, `:` or `;` next to a Chinese character, or ASCII parentheses around Chinese
    (fullwidth ，：；（） belong there)."""
    return [m[0] for m in PUNCT.finditer(text)]


# a 0-based number (layer, head, word, row, split) said as an ordinal: "第 3 层", "第 {h} 个头"
ORDINAL = re.compile(r"第 ?(?:\d+|\{\w+\})(?:[–-]\d+)? ?(?:层|个头|个词|行|段)")
SPACED_QUOTE = re.compile(r"[\u4e00-\u9fff] “|” [\u4e00-\u9fff]")


def ordinals(text: str) -> list[str]:
    """0-based numbers written as ordinals (第 N 层/个头/个词/行/段): they are labels (层 3 头 1);
    `第 N` is for 1-based counts (第 3 步)."""
    return ORDINAL.findall(text)


def spaced_quotes(text: str) -> list[str]:
    """A space between Chinese quotes and a Chinese character (“it”把, not “it” 把)."""
    return SPACED_QUOTE.findall(text)


def assert_chinese(text: str, surface: str, names: tuple[str, ...] = ()) -> None:
    """`text` (one surface's Chinese) is Chinese through and through, but for `names` (proper
    names of several words, such as a font's)."""
    for name in names:
        text = text.replace(name, "")
    assert re.search(r"[\u4e00-\u9fff]", text), f"{surface}: no Chinese at all:\n{text}"
    bad = [line for line in text.splitlines() if english_runs(line) or ascii_punctuation(line)]
    found = [(english_runs(line), ascii_punctuation(line)) for line in bad]
    assert not bad, f"{surface}: English left or ASCII punctuation in Chinese: {found}\n" + (
        "\n".join(bad)
    )


def test_the_checks_catch_english_and_ascii_punctuation():
    assert english_runs("论断：the variance grows → 成立") == ["the variance grows"]
    assert english_runs("对 64 个键做 softmax，qwen2-vl 的 max_pixels，d_k=4") == []
    assert english_runs("图：figure") == [] and english_runs("sdpa tiled window") == []
    assert ascii_punctuation("最大权重, 不缩放") and ascii_punctuation("权重 ,不缩放")
    assert ascii_punctuation("图: 路径") and ascii_punctuation("熵 (nats，虚线)")
    assert ascii_punctuation("Var(q·k)，1,024 个，d_k: 64") == []


# --------------------------------------------------------------------------- the labs' text


def _scale_doc() -> dict:
    dks = (4, 64, 1024)
    return {
        "seconds": 12.0,
        "preset": {"samples": 20000, "keys": 64},
        "uniform_entropy": 4.16,
        "variance": [{"d_k": d, "unscaled": d * 1.01, "scaled": 1.01} for d in dks],
        "saturation": [
            {
                "d_k": d,
                "max_weight_unscaled": 0.3 + 0.2 * i,
                "max_weight_scaled": 0.2,
                "entropy_unscaled": 3.0 - i,
                "entropy_scaled": 3.2,
            }
            for i, d in enumerate(dks)
        ],
        "jacobian": [
            {"d_k": d, "norm_unscaled": 0.3 - 0.1 * i, "norm_scaled": 0.2}
            for i, d in enumerate(dks)
        ],
        "training": {
            "d_k": 128,
            "every": 10,
            "steps": 60,
            "initial_loss": 2.08,
            "scaled": [2.0, 1.0, 0.5, 0.1, 0.05, 0.01],
            "unscaled": [2.0, 2.0, 1.9, 1.9, 1.8, 1.8],
        },
    }


def _routing_doc() -> dict:
    n, layers = 12, (1, 2)
    reach = [
        {"model": m, "layers": k, "reach": k, "farthest_relative": 0.5}
        for m in routing.MODELS
        for k in layers
    ]
    grads = [
        {"model": m, "layers": k, "distance": d, "grad_norm": 1.0 / (1 + d)}
        for m in routing.MODELS
        for k in layers
        for d in range(n)
    ]
    weights = [1.0 / 8] * 8
    examples = [{"distance": d, "source": 7 - d, "weights": weights} for d in (1, 3, 5, 7)]
    return {
        "seconds": 3.0,
        "preset": {"length": n, "width": 8, "trials": 2, "layers": list(layers)},
        "reach": reach,
        "gradient_reach": grads,
        "routing": {
            "length": 8,
            "steps": 10,
            "accuracy": 0.5,
            "weight_on_source": 0.4,
            "samples": 32,
            "examples": examples,
        },
    }


def _rnn_doc() -> dict:
    par = [
        {
            "n": n,
            "threads": 2,
            "lstm_ms": n / 10,
            "attention_ms": n / 40,
            "lstm_ms_one_thread": n / 9,
            "attention_ms_one_thread": n / 30,
        }
        for n in (16, 32)
    ]
    rec = [
        {
            "distance": d,
            "lstm_acc": 0.9 - 0.1 * i,
            "attention_acc": 1.0,
            "lstm_acc_by_seed": [0.9, 0.8],
            "attention_acc_by_seed": [1.0, 1.0],
            "lstm_dependence": 0.3 / 10**i,
            "attention_dependence": 5.0,
        }
        for i, d in enumerate((1, 3, 7))
    ]
    return {
        "parallel": par,
        "recall": rec,
        "models": {"lstm": {"params": 1234}, "attention": {"params": 1200}},
        "task": {"chance": 0.125},
        "preset": {"steps": 12},
        "training": {"every": 4, "loss": {"lstm": [[2.0, 1.5, 1.2]], "attention": [[2.0, 1.0]]}},
    }


def test_the_labs_summaries_are_chinese():
    assert_chinese(scale.summary(_scale_doc(), "zh"), "qkv lab scale")
    assert_chinese(routing.summary(_routing_doc(), "zh"), "qkv lab routing")


def test_the_labs_shared_words_are_chinese():
    why = common.inconclusive("the rounds disagree", "各轮结果不一致")
    assert_chinese(common.verdict(why, "zh"), "an inconclusive verdict")
    assert [common.verdict(v, "zh") for v in (True, False)] == ["成立", "不成立"]
    assert common.verdict(why, "zh").startswith("无法判断（")
    assert_chinese(common.busy({"cpu_pressure": 35.0}, "zh"), "busy: CPU pressure")
    assert_chinese(common.busy({"load_1min": 9.5, "cores": 2}, "zh"), "busy: load")
    assert common.busy({"cpu_pressure": 35.0}) == "CPU pressure 35%"  # the English kept
    for key, line in command.SAID["zh"].items():
        assert_chinese(line.format(path="qkv-lab/x.png", note="没有字体"), f"qkv lab: {key}")


def test_the_routing_table_names_the_models_in_chinese_and_stays_aligned():
    from qkv.inspect.text import columns

    lines = routing.summary(_routing_doc(), "zh").splitlines()
    head = next(i for i, line in enumerate(lines) if "可达" in line and "模型" in line)
    table = lines[head : head + 1 + len(routing.MODELS) * 2]
    assert any("注意力" in line for line in table[1:])
    assert len({columns(line[: line.rindex("  ")]) for line in table}) == 1, table


# --------------------------------------------------------------------------- qkv tokens, bench


def test_qkv_tokens_answers_in_chinese(capsys):
    from qkv.cli import main

    assert main(["tokens", "--image", "1344x1344", "--lang", "zh"]) == 0
    assert_chinese(capsys.readouterr().out, "qkv tokens --lang zh")
    assert_chinese(report.describe(640, 480, models=("llava-next",), lang="zh"), "tokens llava")


@pytest.mark.parametrize(
    "message",
    [
        "width must be a positive number of pixels, got width=0",
        "absolute aspect ratio must be at most 200, got 300 for 10×3000",
        "min_pixels=3136 must be ≤ max_pixels=10",
    ],
)
def test_qkv_tokens_refusals_are_chinese(message):
    assert_chinese(zh_error(message), message)


def test_the_tokens_table_stays_aligned_in_chinese():
    from qkv.inspect.text import columns

    lines = report.describe(1344, 1344, lang="zh").splitlines()
    rows = [line for line in lines if "FLOP" in line and "FLOPs" not in line]
    assert len(rows) == 5 and len({columns(line) for line in rows}) == 1


def test_the_cost_table_is_chinese():
    records = [
        {"method": m, "pass": p, "n": n, "time_s": 1e-6 * n, "peak_mib": 0.1 * n, "note": ""}
        for p in bench.PASSES
        for m in ("sdpa", "window")
        for n in (512, 1024)
    ]
    records.append(
        {
            "method": "naive",
            "pass": "forward",
            "n": 4096,
            "time_s": None,
            "peak_mib": None,
            "note": "skipped: needs about 3,000 MiB, 1,000 MiB available",
        }
    )
    zh = bench.table(records, "zh")
    assert_chinese(zh, "the cost table")
    assert "已跳过：大约需要 3,000 MiB，可用 1,000 MiB" in zh and "斜率（时间）" in zh
    en = bench.table(records)
    assert "slope (time)" in en and "skipped: needs about 3,000 MiB" in en


# --------------------------------------------------------------------------- figures

WORDS = ["the", "cat", "sat", "down"]


def _map() -> AttentionMap:
    w = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0)).softmax(-1)
    return AttentionMap.from_weights(w, WORDS, text="the cat sat down", model="tiny")


def _records() -> list[dict]:
    return [
        {"method": m, "pass": p, "n": n, "time_s": 1e-9 * n * n, "peak_mib": 1e-6 * n * n}
        for m in ("sdpa", "window")
        for p in bench.PASSES
        for n in (256, 512, 1024)
    ]


def _figures(lang: str) -> dict:
    """Every figure qkv draws, in `lang`, by name."""
    from qkv.inspect import figures
    from qkv.labs import figures as labs

    amap = _map()
    return {
        "attention_grid": figures.attention_grid(amap, lang=lang),
        "token_heads": figures.token_heads(amap, "cat", lang=lang),
        "rollout_figure": figures.rollout_figure(amap, "cat", lang=lang),
        "cost_plot": figures.cost_plot(_records(), lang=lang),
        "lab rnn": labs.rnn(_rnn_doc(), lang=lang),
        "lab scale": labs.scale(_scale_doc(), lang=lang),
        "lab routing": labs.routing(_routing_doc(), lang=lang),
        "qkv tokens --plot": report.figure(report.PLOT_SIDES[:4], lang=lang),
    }


def _texts(fig) -> list[str]:
    """Every text drawn on `fig` (titles, axes, ticks, legends, colour bars, notes), the
    user's own words (the sentence, its tokens) left out."""
    from matplotlib.text import Text

    found = [t.get_text() for t in fig.findobj(Text)]
    out = []
    for text in found:
        text = text.replace("the cat sat down", "")
        if text.strip() and text not in WORDS:
            out.append(text)
    return out


@pytest.fixture
def cjk(monkeypatch):
    """A CJK font, as far as the figures can tell (none needs to be installed to read labels)."""
    pytest.importorskip("matplotlib")
    from qkv.inspect import figures

    monkeypatch.setattr(figures, "cjk_font", lambda: "Noto Sans CJK SC")
    figures._families.cache_clear()
    yield "Noto Sans CJK SC"
    figures._families.cache_clear()


def test_every_figure_is_labelled_in_chinese(cjk):
    from matplotlib.text import Text

    for name, fig in _figures("zh").items():
        texts = _texts(fig)
        assert_chinese("\n".join(texts), f"figure {name}")
        assert not re.search(r"第 ?\d+ ?(层|个头)", "\n".join(texts)), name  # 0-based: no ordinals
        assert all(cjk in t.get_fontfamily() for t in fig.findobj(Text)), name


def test_english_figures_hold_no_chinese(cjk):
    for name, fig in _figures("en").items():
        text = "\n".join(_texts(fig))
        assert not re.search(r"[\u4e00-\u9fff]", text), (name, text)


def test_without_a_cjk_font_chinese_figures_fall_back_to_english_with_one_warning(
    monkeypatch, tmp_path
):
    pytest.importorskip("matplotlib")
    from qkv.inspect import figures

    monkeypatch.setattr(figures, "cjk_font", lambda: None)
    figures._families.cache_clear()
    figures._warn_no_cjk_font.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            zh = {name: _texts(fig) for name, fig in _figures("zh").items()}
            figures.token_heads(_map(), "cat", tmp_path / "zh.png", lang="zh")
        en = {name: _texts(fig) for name, fig in _figures("en").items()}
    finally:
        figures._warn_no_cjk_font.cache_clear()
        figures._families.cache_clear()
    assert zh == en  # English labels, never boxes
    fonts = [w for w in seen if issubclass(w.category, figures.FontWarning)]
    assert len(fonts) == 1, [str(w.message) for w in seen]
    assert "fonts-noto-cjk" in str(fonts[0].message) and "Noto Sans CJK SC" in str(fonts[0].message)
    assert not [w for w in seen if "Glyph" in str(w.message)]
    note = figures.font_note("zh")
    assert note is not None and "fonts-noto-cjk" in note and figures.font_note("en") is None
    assert_chinese(note, "the missing-font note", names=figures.CJK_FONTS)


def test_a_figure_refuses_an_unknown_language():
    pytest.importorskip("matplotlib")
    from qkv.inspect import figures

    with pytest.raises(ValueError, match="lang must be one of en, zh"):
        figures.token_heads(_map(), "cat", lang="fr")


def test_qkv_tokens_plot_says_a_missing_font_once_as_a_note(monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from qkv.cli import main
    from qkv.inspect import figures

    monkeypatch.setattr(figures, "cjk_font", lambda: None)
    figures._warn_no_cjk_font.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert main(["tokens", "--plot", str(tmp_path / "t.png"), "--lang", "zh"]) == 0
    finally:
        figures._warn_no_cjk_font.cache_clear()
        figures._families.cache_clear()
    out = capsys.readouterr().out
    assert out.startswith("图：") and out.count("注意：没有找到 CJK 字体") == 1, out
    assert not seen, [str(w.message) for w in seen]


# --------------------------------------------------------------------------- the inspection
# surfaces: qkv explain (and --flash), the demo's sentences, qkv attend, the pages' strings


def assert_zh(text: str, surface: str, names: tuple[str, ...] = ()) -> None:
    """`assert_chinese`, and 0-based numbers as labels, and no space around Chinese quotes."""
    assert_chinese(text, surface, names)
    assert not ordinals(text), f"{surface}: 0-based numbers as ordinals: {ordinals(text)}"
    assert not spaced_quotes(text), f"{surface}: spaces around quotes: {spaced_quotes(text)}"


def test_the_checks_catch_ordinals_and_spaced_quotes():
    assert ordinals("第 3 层第 1 个头，查询块 0：第 0–1 行（第 2 段）") == [
        "第 3 层",
        "第 1 个头",
        "第 0–1 行",
        "第 2 段",
    ]
    assert ordinals("第 {h} 个头") and not ordinals("第 3 步，排第 2 位；层 3 头 1")
    assert spaced_quotes("句子 “the cat”。") and spaced_quotes("“it” 把")
    assert not spaced_quotes("“it”把注意力放在“cat”上；“it” → “cat” 0.49")


def test_qkv_explain_in_chinese_holds_no_english(capsys):
    from qkv.cli import main

    assert main(["explain", "--lang", "zh", "--n", "20", "--dk", "64"]) == 0
    out = capsys.readouterr().out
    assert "（20×64：只显示四角；--full 可完整打印）" in out  # the corners note, in Chinese
    assert "单个注意力头的开销" in out
    assert_zh(out, "qkv explain --lang zh --dk 64")
    assert main(["explain", "--lang", "zh", "--causal"]) == 0
    assert_zh(capsys.readouterr().out, "qkv explain --lang zh --causal")


@pytest.mark.parametrize(
    "options",
    [{}, {"causal": True}, {"window": 1, "n": 6}, {"n": 6, "tile": 3}],
    ids=["dense", "causal", "window", "tile3"],
)
def test_qkv_explain_flash_in_chinese_says_0_based_rows_as_labels(options):
    from qkv.inspect.flash_text import render_walk

    zh = render_walk(lang="zh", **options)
    assert_zh(zh, f"qkv explain --flash --lang zh {options}")
    assert "查询块 0：行 0–1" in zh or "查询块 0：行 0–2" in zh
    assert "第 1 步" in zh  # steps count from 1: an ordinal


def test_the_flash_walks_splits_are_labels_in_chinese():
    from qkv.inspect.explain import walkthrough
    from qkv.inspect.flash import flash_steps
    from qkv.inspect.flash_text import render_steps

    w = walkthrough(n=8)
    fs = flash_steps(w.Q, w.K, w.V, tile_q=2, tile_k=2, splits=2)
    zh = render_steps(fs, "zh")
    assert_zh(zh, "the flash walk with splits")
    assert "（段 0）" in zh and "段 1（键块" in zh


def test_the_flash_walks_chinese_lines_break_after_punctuation():
    from qkv.inspect.flash_text import WIDTH, _wrap, render_walk

    text = "甲" * 44 + "，" + "乙" * 10 + "。"  # the comma ends at column 90 of 96
    lines = _wrap(text).splitlines()
    assert lines == ["甲" * 44 + "，", "乙" * 10 + "。"]
    for line in render_walk(lang="zh").splitlines():
        assert columns(line) <= WIDTH or "[" in line, line
        assert not line.endswith(("滚动最", "累")), line  # never inside a word


def _demo_sentences(lang: str) -> str:
    """Every sentence of the demo's report in `lang`, its values filled in."""
    from qkv.inspect import demo

    values = {
        "text": "the cat sat on the mat because it was tired",
        "layer": 3,
        "head": 1,
        "weight": 0.49,
        "others": 0.12,
        "command": "qkv lab rnn",
        "json": "lab-rnn.json",
        "state": demo.TEXT[lang]["state_done"],
        "took": 95.0,
        "machine": "x86_64",
        "torch": "2.5.1",
        "threads": 2,
        "index": "/tmp/qkv-demo/index.html",
        "label": "",
        "note": "没有找到 CJK 字体",
    }
    texts = [v.format(**values) for v in demo.TEXT[lang].values()]
    texts += [demo.CHECK[lang][k].format(n=1024, label="") for k in ("head", "picks")]
    return re.sub(r"<[^>]+>", "", "\n".join(texts))


def test_the_demos_sentences_are_chinese():
    from qkv.inspect import chapter, demo

    zh = _demo_sentences("zh")
    names = ("Sparse Transformer", "qkv lab rnn", "qkv lab scale", "qkv lab routing")
    names += ("qkv lab sparse",)
    names += ("the cat sat on the mat because it was tired",)  # the example, quoted
    assert_zh(zh, "the demo's sentences", names)
    assert "层 3 头 1（层和头都从 0 开始编号" in zh
    assert "（下面的理由来自 qkv.dispatch，只有英文）" in zh
    assert "滚动最大值 m、滚动和 l" in zh and "运行中" not in zh
    assert "逐步演算公式" in zh and "逐步看 FlashAttention" in zh
    assert "在 x86_64 上生成" in zh
    for text in (chapter.long_context([], "zh"), chapter.visual_tokens("zh")):
        assert_zh(text, "the chapter's texts", names)
        assert "运行中" not in text
    assert "每行维护滚动最大值和滚动和" in chapter.long_context([], "zh")
    assert "2 个随机块（每块 128）" in chapter.long_context([], "zh")
    assert_zh(chapter.transformer_block(lang="zh"), "the next chapter's block")
    # the backends check, but for the dispatch's reasons (indented), English and said to be
    check = demo.backends_check(n=32, lang="zh").splitlines()
    said = [line for line in check if not line.startswith("  ") or "|out − golden|" in line]
    assert len(said) == 7 and "  sdpa      最大误差 |out − golden| = " in said[2]
    assert_zh("\n".join(said), "the backends check")


def test_the_english_demo_sentences_are_unchanged():
    en = _demo_sentences("en")
    assert "layer 3 head 1 (numbered from 0, as printed below)" in en
    assert "The formula, step by step" in en and "a running maximum m, a running sum l" in en
    assert "Made by qkv demo in 95 s on x86_64, torch 2.5.1, 2 threads." in en


def test_qkv_attends_answer_is_chinese(cat_map):
    from qkv.inspect.attend import summary
    from qkv.inspect.specific import question_lines

    contrast = _contrast_map()
    zh = "\n".join(
        [
            summary(cat_map, "it", lang="zh"),
            *question_lines(
                cat_map, "it", "cat", contrast=contrast, contrast_target="mat", lang="zh"
            ),
            summary(cat_map, "it", 5, 11, lang="zh"),
        ]
    )
    sentences = (cat_map.text, contrast.text)  # quoted, as the user wrote them
    names = (cat_map.model, *sentences, "attention sink")
    assert_zh(zh, "qkv attend --lang zh", names)
    assert "展开后 " in zh and "最集中的头（以及各自指向其他词的最强连接）" in zh


def _contrast_map():
    from qkv.inspect.attend import model_attention

    return model_attention("The cat sat on the mat because it was dirty")


def test_a_map_without_a_model_name_is_named_in_chinese():
    from qkv.inspect.attend import summary

    amap = _map()
    amap = type(amap).from_weights(amap.weights, WORDS, text="the cat sat down", model="")
    assert summary(amap, "cat", lang="zh").startswith("注意力（2 层 × 3 个头）")
    assert summary(amap, "cat").startswith("attention (2 layers × 3 heads)")


@pytest.mark.slow
def test_qkv_attend_says_its_files_in_chinese(minilm, tmp_path, capsys):
    from qkv.cli import main

    out = tmp_path / "a"
    argv = ["attend", "--lang", "zh", "--out", str(out), "--json", str(tmp_path / "w.json")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    said = printed.split("\n权重：", 1)[1]  # the lines after the answer
    assert said.startswith(str(tmp_path / "w.json"))
    assert "\n图：" in said and "\n查看器：" in said and "（用浏览器打开）" in said
    assert_zh(said.replace(str(tmp_path), ""), "qkv attend --lang zh: its files")


def _js_strings(page: str, lang: str) -> str:
    """The strings of one language's table (`T.zh`) of a page's script, one a line."""
    start = page.index(f"\n  {lang}: {{")
    end = page.index("\n  },", start)
    block = page[start:end]
    strings = re.findall(r'\w+: "((?:[^"\\]|\\.)*)"', block)
    return "\n".join(re.sub(r"\{\w+\}", "3", s) for s in strings)


@pytest.mark.parametrize("name", ["viewer.html", "flash.html", "formula.html"])
def test_the_pages_chinese_strings(name):
    from importlib import resources

    page = resources.files("qkv.inspect").joinpath(name).read_text(encoding="utf-8")
    raw = page[page.index("\n  zh: {") : page.index("\n  },", page.index("\n  zh: {"))]
    assert not ordinals(raw), ordinals(raw)  # placeholders too: 第 {h} 个头
    zh = _js_strings(page, "zh")
    names = ("Flash-Decoding",)
    assert_zh(zh, f"{name}: its Chinese", names)
    assert "一步一步" not in zh


def test_the_cost_commands_lines_are_chinese(monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from qkv.cli import main

    def measured(*_, **__):
        yield from ({**r, "note": ""} for r in _records())
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "iter_measure", measured)
    argv = ["bench", "--json", str(tmp_path / "b.json"), "--png", str(tmp_path / "b.png")]
    assert main([*argv, "--lang", "zh"]) == 130
    zh = capsys.readouterr().out
    assert zh.startswith("（已中断：Ctrl-C 之前测完的 12 次运行已保留）")
    assert "\n测量结果：" in zh and "\n图：" in zh and "斜率（时间）" in zh
    assert_zh(zh.replace(str(tmp_path), ""), "qkv bench --lang zh")
    assert main(argv) == 130
    en = capsys.readouterr().out
    assert en.startswith("(interrupted: 12 runs measured before Ctrl-C; they are kept)")
    assert "\nmeasurements: " in en and "\nplot: " in en


def test_qkv_explain_html_says_its_page_in_chinese(tmp_path, capsys):
    from qkv.cli import main

    page = tmp_path / "f.html"
    assert main(["explain", "--html", str(page), "--lang", "zh"]) == 0
    assert f"\n网页：{page}（用浏览器打开）" in capsys.readouterr().out
    assert main(["explain", "--flash", "--html", str(page), "--lang", "zh"]) == 0
    assert f"\n网页：{page}（用浏览器打开）" in capsys.readouterr().out
    assert main(["explain", "--html", str(page)]) == 0
    assert f"\npage: {page} (open it in a browser)" in capsys.readouterr().out
