"""The `qkv` command: explain prints the reference numbers; bad input exits non-zero cleanly."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from qkv.cli import main
from qkv.inspect import walkthrough
from qkv.inspect.specific import specific_head


def test_explain_prints_the_reference_matrices(capsys):
    assert main(["explain", "--n", "3", "--d", "5", "--dk", "2", "--seed", "7"]) == 0
    text = capsys.readouterr().out
    w = walkthrough(n=3, d=5, d_k=2, seed=7)
    a = w.A.tolist()
    assert f"{a[1][0]:8.3f}" in text and "shape (3, 3)" in text
    torch.testing.assert_close(w.A.sum(-1), torch.ones(3, dtype=torch.float64))


def test_explain_in_chinese_and_causal(capsys):
    assert main(["explain", "--lang", "zh", "--causal"]) == 0
    text = capsys.readouterr().out
    assert "因果掩码" in text and "-inf" in text


@pytest.mark.parametrize(
    "argv,message",
    [
        (["explain", "--n", "0"], "expected a positive integer, got 0"),
        (["explain", "--dk", "x"], "expected a positive integer, got 'x'"),
        (["explain", "--lang", "fr"], "invalid choice: 'fr'"),
        (["nosuch"], "invalid choice: 'nosuch'"),
    ],
)
def test_bad_input_is_a_clear_message_and_exit_code(argv, message):
    res = subprocess.run(
        [sys.executable, "-m", "qkv.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2
    assert message in res.stderr and "Traceback" not in res.stderr


# --------------------------------------------------------------------------- attend


@pytest.mark.slow
def test_attend_reports_the_models_weight(minilm, cat_map, capsys, tmp_path):
    out = tmp_path / "attend"
    argv = ["attend", "--token", "it", "--out", str(out), "--json", str(tmp_path / "w.json")]
    assert main(argv) == 0
    text = capsys.readouterr().out
    best = specific_head(cat_map, "it", "cat")
    # the line for "cat" names the head and the weight computed from the model's own weights
    assert f"cat      layer {best.layer} head {best.head:<2}  {best.weight:.3f}" in text
    data = json.loads((tmp_path / "w.json").read_text())
    assert torch.tensor(data["weights"]).shape == (6, 12, 12, 12)
    torch.testing.assert_close(
        torch.tensor(data["weights"], dtype=torch.float64), cat_map.weights.round(decimals=6)
    )
    for name in ("attention-grid.png", "attention-it.png", "viewer.html"):
        assert (out / name).stat().st_size > 0


def test_attend_one_head_in_full(minilm, cat_map, capsys):
    assert main(["attend", "--layer", "5", "--head", "11", "--no-files"]) == 0
    text = capsys.readouterr().out
    for j, word in enumerate(cat_map.words):
        assert f"{word:<7}{cat_map.weights[5, 11, 8, j].item():9.3f}" in text


@pytest.mark.parametrize(
    "argv,message",
    [
        (["attend", "--token", "dog"], "the word 'dog' is not in the text"),
        (["attend", "--layer", "6"], "layer 6 is out of range; the model has layers 0..5"),
        (["attend", "--layer", "0", "--head", "12"], "head 12 is out of range"),
        (["attend", "--head", "1"], "--head needs --layer"),
    ],
)
def test_attend_bad_requests_exit_2_with_a_message(minilm, argv, message, capsys):
    assert main([*argv, "--no-files"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv attend: error: ") and message in err


def test_attend_empty_text_in_a_real_process():
    res = subprocess.run(
        [sys.executable, "-m", "qkv", "attend", ""], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "qkv attend: error: the text is empty" in res.stderr


def test_a_missing_package_is_exit_1_with_the_install_hint(monkeypatch, capsys):
    import qkv.inspect.attend as attend

    def missing(*_):
        raise ImportError("`qkv attend` needs transformers; install them with: pip install x")

    monkeypatch.setattr(attend, "model_attention", missing)
    assert main(["attend", "some text", "--no-files"]) == 1
    assert "install them with" in capsys.readouterr().err


# --------------------------------------------------------------------------- bench and demo


def test_bench_writes_table_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    argv = ["bench", "--quick", "--sizes", "64,128", "--window", "16", "--no-progress"]
    argv += [
        "--passes",
        "forward",
        "--json",
        str(tmp_path / "b.json"),
        "--png",
        str(tmp_path / "b.png"),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    report = json.loads((tmp_path / "b.json").read_text())
    for r in report["records"]:
        assert r["pass"] == "forward" and r["time_s"] > 0
    naive = next(r for r in report["records"] if r["method"] == "naive" and r["n"] == 128)
    assert f"{naive['time_s'] * 1e3:.1f} ms" in text
    assert (tmp_path / "b.png").stat().st_size > 0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["bench", "--methods", "naive,fast"], "unknown method ['fast']"),
        (["bench", "--sizes", "512,x"], "expected sizes separated by commas"),
    ],
)
def test_bench_bad_input(argv, message):
    res = subprocess.run(
        [sys.executable, "-m", "qkv", *argv], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr


def tiny_labs(monkeypatch) -> None:
    """The labs' quick presets shrunk to seconds (the demo's wiring is what is tested)."""
    from qkv.labs import rnn, routing, scale, sparse

    monkeypatch.setattr(
        rnn,
        "QUICK",
        rnn.Preset(
            ns=(16,),
            width=8,
            repeats=1,
            budget_s=60.0,
            distances=(1, 3),
            seeds=1,
            steps=5,
            d_model=8,
            samples=8,
        ),
    )
    monkeypatch.setattr(
        scale,
        "QUICK",
        scale.Preset(d_ks=(4, 16), samples=500, keys=8, rows=16, train_d_k=16, steps=10, every=5),
    )
    monkeypatch.setattr(
        routing,
        "QUICK",
        routing.Preset(
            length=8, width=8, layers=(1,), trials=1, route_length=8, steps=5, examples=3, samples=8
        ),
    )
    monkeypatch.setattr(
        sparse,
        "QUICK",
        sparse.Preset(
            block=4,
            topk=1,
            d_model=8,
            steps=3,
            train_ns=(8,),
            seeds=1,
            ns=(8, 16),
            samples=8,
            time_batch=2,
            repeats=1,
            picture_n=16,
        ),
    )


@pytest.mark.slow
def test_demo_writes_its_report(minilm, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from qkv.inspect import bench, demo

    tiny_labs(monkeypatch)
    tiny = bench.Sizes(ns=(64, 128), heads=2, window=16, repeats=1, dim=16)
    lines = []
    index = demo.run(tmp_path / "demo", tiny, progress=False, echo=lines.append)
    page = index.read_text()
    for link in re.findall(r'(?:href|src)="([^"#][^"]*)"', page):
        assert (index.parent / link).stat().st_size > 0, link
    assert "viewer.html" in page and "cost.png" in page and "explain.html" in page
    for title in ("Past O(N²)", "Visual tokens", "The next chapter: the Transformer block"):
        assert title in page
    for name in ("rnn", "scale", "routing", "sparse"):
        assert f"lab-{name}.png" in page and f"qkv lab {name}" in page
        doc = json.loads((index.parent / f"lab-{name}.json").read_text())
        assert doc["lab"] == name
    assert "self-attention" in (index.parent / "explain.txt").read_text().lower()
    assert "因果" not in (index.parent / "explain-zh.txt").read_text()  # not causal by default
    assert lines[-1].strip().startswith("qkv demo finished in")


def test_explain_html_writes_the_page_you_can_touch(tmp_path, capsys):
    page = tmp_path / "f.html"
    assert main(["explain", "--html", str(page), "--dk", "16", "--seed", "3", "--lang", "zh"]) == 0
    assert f"网页：{page}（用浏览器打开）" in capsys.readouterr().out
    text = page.read_text(encoding="utf-8")
    assert "window.qkvFormulaReady" in text and '"dk": 16' in text and '"seed": 3' in text
    assert main(["explain", "--html", str(tmp_path / "no" / "f.html")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["explain", "--n", "40", "--html", str(page)]) == 2
    assert "the page shows up to 12 tokens" in capsys.readouterr().err
    assert main(["explain", "--dk", "5", "--html", str(page)]) == 2
    assert "d_k is one of 1, 2, 4, 8, 16, 64" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_in_chinese_writes_its_report_and_pages_in_chinese(minilm, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from qkv.inspect import bench, demo

    tiny_labs(monkeypatch)
    tiny = bench.Sizes(ns=(64, 128), heads=2, window=16, repeats=1, dim=16)
    lines = []
    index = demo.run(tmp_path / "demo", tiny, progress=False, echo=lines.append, lang="zh")
    page = index.read_text(encoding="utf-8")
    assert page.startswith('<!DOCTYPE html>\n<html lang="zh">') and "qkv 演示" in page
    titles = re.findall(r"<h2>\d+\. (.+?)</h2>", page)
    assert len(titles) == len(demo.SECTIONS)
    assert all(re.search(r"[\u4e00-\u9fff]", t) for t in titles), titles
    printed = "\n".join(lines)
    assert "缩放点积自注意力" in printed and "因果注意力，B=1" in printed
    assert "下一章把注意力堆叠成 Transformer 块" in printed and "本章给出的两个答案" in printed
    assert printed.count("成立") + printed.count("无法判断") >= 3  # the labs' verdicts, in zh
    for name in ("viewer.html", "explain.html"):
        assert '"lang": "zh"' in (index.parent / name).read_text(encoding="utf-8"), name
    for link in re.findall(r'(?:href|src)="([^"#][^"]*)"', page):
        assert (index.parent / link).stat().st_size > 0, link


# --------------------------------------------------------------------------- in a language


def _opening(path) -> dict:
    from .test_viewer import _embedded

    return _embedded(path.read_text(encoding="utf-8"))["open"]


def test_attend_opens_the_viewer_on_the_question(minilm, cat_map, tmp_path, capsys, monkeypatch):
    from qkv.inspect import figures
    from qkv.inspect.viewer import opening

    for name in ("attention_grid", "token_heads", "rollout_figure"):  # the viewer is tested
        monkeypatch.setattr(figures, name, lambda *_, **__: None)
    out = tmp_path / "a"
    assert main(["attend", "--token", "it", "--target", "cat", "--out", str(out)]) == 0
    best = specific_head(cat_map, "it", "cat")
    assert _opening(out / "viewer.html") == opening(cat_map, "it", best.layer, best.head)
    assert main(["attend", "--word", "it", "--out", str(out), "--lang", "zh"]) == 0
    (top, _), *_ = cat_map.focused_heads("it", 1)  # the first of "the most focused heads"
    assert _opening(out / "viewer.html") == opening(cat_map, "it", top.layer, top.head)
    assert '"lang": "zh"' in (out / "viewer.html").read_text(encoding="utf-8")
    capsys.readouterr()


RECORDS = [
    {"method": m, "pass": p, "n": n, "time_s": 1e-9 * n * n, "peak_mib": 1e-6 * n * n, "note": ""}
    for m in ("naive", "tiled", "sdpa", "window")
    for p in ("forward", "forward+backward")
    for n in (64, 128)
]


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_demo_draws_its_figures_and_table_in_its_language(minilm, tmp_path, monkeypatch, lang):
    pytest.importorskip("matplotlib")
    import warnings

    from qkv.inspect import bench, demo, figures
    from qkv.labs import rnn

    tiny_labs(monkeypatch)
    drawn, tables = [], []

    def recorder(name):
        def draw(*_, lang="en", **__):
            drawn.append((name, lang))
            warnings.warn("no CJK font", figures.FontWarning, stacklevel=2)

        return draw

    for name in ("attention_grid", "token_heads", "cost_plot"):
        monkeypatch.setattr(demo, name, recorder(name))
    monkeypatch.setattr(rnn, "figure", recorder("lab rnn"))
    table = bench.table
    monkeypatch.setattr(
        bench, "table", lambda recs, lang="en": tables.append(lang) or table(recs, lang)
    )
    monkeypatch.setattr(bench, "iter_measure", lambda *_, **__: iter(RECORDS))
    note = "没有找到 CJK 字体，所以要求用中文的图改用英文标注"
    monkeypatch.setattr(demo, "font_note", lambda lang: note if lang == "zh" else None)
    lines: list[str] = []
    r = demo.Report(tmp_path, bench.QUICK, False, lines.append, lang=lang)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        demo._attend(r)
        demo._cost(r)
        demo._lab("rnn")(r)
    page = demo.page(r, 1.0)
    assert sorted(drawn) == sorted(
        (name, lang) for name in ("attention_grid", "token_heads", "cost_plot", "lab rnn")
    )
    assert tables == [lang]
    assert not [w for w in seen if issubclass(w.category, figures.FontWarning)]
    said = [line for line in lines if note in line]
    assert len(said) == (1 if lang == "zh" else 0) and (note in page) == (lang == "zh")
