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
