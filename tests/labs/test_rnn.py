"""`qkv lab rnn` on tiny sizes: the documented JSON, equal parameter budgets, the summary's
claims by its stated rules, and the figure."""

from __future__ import annotations

import json

import pytest

from qkv.labs import rnn

TINY = rnn.Preset(
    ns=(16, 32),
    width=8,
    repeats=1,
    budget_s=60.0,
    distances=(1, 3, 7),
    seeds=2,
    steps=12,
    d_model=8,
    samples=16,
)


@pytest.fixture(scope="module")
def doc():
    return rnn.run(TINY, progress=False)


def test_json_has_the_documented_fields(doc):
    doc = json.loads(json.dumps(doc, allow_nan=False))
    assert [r["n"] for r in doc["parallel"]] == [16, 32] and doc["parallel_skipped"] == []
    for r in doc["parallel"]:
        assert r["lstm_steps"] == r["n"] and r["attention_steps"] == 1
        assert r["lstm_ms"] > 0 and r["attention_ms"] > 0
        assert r["lstm_ms_one_thread"] > 0 and r["attention_ms_one_thread"] > 0
    assert [r["distance"] for r in doc["recall"]] == [1, 3, 7]
    for r in doc["recall"]:
        for key in ("lstm_acc", "attention_acc"):
            assert 0.0 <= r[key] <= 1.0
            runs = r[f"{key}_by_seed"]
            assert len(runs) == 2 and r[key] == pytest.approx(sum(runs) / 2)
    assert set(doc["machine"]) >= {"cpu", "cores", "threads", "load_1min", "load_1min_after"}
    assert doc["task"]["test_length"] == 8 and doc["task"]["chance"] == 1 / rnn.TASK.values
    for name in ("attention", "lstm"):
        assert len(doc["training"]["loss"][name]) == 2  # one curve per seed


def test_the_lstm_gets_the_attention_models_parameter_budget(doc):
    m = doc["models"]
    assert m["lstm"]["params"] <= m["attention"]["params"]
    from qkv.labs import recall

    bigger = recall.parameters_of_lstm(m["lstm"]["hidden"] + 1, rnn.TASK.width, rnn.TASK.values)
    assert bigger > m["attention"]["params"]


def test_learned_at_is_the_first_window_below_the_threshold():
    w = rnn.WINDOW
    losses = [1.0] * w + [0.0] * w
    # the mean of the last WINDOW steps drops below LEARNED once enough zeros are in
    need = next(k for k in range(w + 1) if (w - k) / w < rnn.LEARNED)
    assert rnn.learned_at(losses) == w + need
    assert rnn.learned_at([1.0] * (3 * w)) is None


QUIET = {"cores": 2, "load_1min": 0.3, "cpu_pressure": 0.0, "load_1min_after": 2.0,
         "cpu_pressure_after": 1.0}  # fmt: skip
TASK = {"chance": 1 / 8}


def _timed(lstm: list[float], attn: list[float], threads: int = 2) -> dict:
    """A largest-N record whose rounds ran `lstm` / `attn` times as fast on all threads."""
    return {
        "n": 4096,
        "threads": threads,
        "lstm_ms": 100.0,
        "attention_ms": 100.0,
        "lstm_ms_one_thread": 100.0 * sorted(lstm)[len(lstm) // 2],
        "attention_ms_one_thread": 100.0 * sorted(attn)[len(attn) // 2],
        "lstm_rounds": [100.0] * len(lstm),
        "attention_rounds": [100.0] * len(attn),
        "lstm_one_thread_rounds": [100.0 * x for x in lstm],
        "attention_one_thread_rounds": [100.0 * x for x in attn],
    }


def _verdicts(par: dict, rec: list[dict], machine: dict = QUIET) -> dict[str, str]:
    got = rnn.claims({"parallel": [par], "recall": rec, "machine": machine, "task": TASK})
    return {k: v["verdict"] for k, v in got.items() if k != "fade"}


REC = [
    {"distance": 4, "lstm_acc": 0.9, "attention_acc": 1.0},
    {"distance": 256, "lstm_acc": 0.5, "attention_acc": 0.97},
]


def test_claim_rules():
    assert _verdicts(_timed([1.1, 1.0, 1.05], [1.9, 1.7, 1.8]), REC) == {
        "parallel": "holds",
        "recall": "holds",
    }
    assert _verdicts(_timed([0.8, 0.7, 0.75], [0.6, 0.5, 0.55]), REC)["parallel"] == "does not hold"
    rec = [dict(r) for r in REC]
    rec[-1]["lstm_acc"] = 0.85  # fell by only 5 points
    assert _verdicts(_timed([1.0] * 3, [1.8] * 3, threads=1), rec) == {
        "parallel": "inconclusive",
        "recall": "does not hold",
    }


def test_rounds_that_straddle_the_rule_are_inconclusive():
    got = rnn.claims(
        {"parallel": [_timed([1.0, 1.0], [1.1, 1.6])], "recall": REC, "machine": QUIET,
         "task": TASK}
    )  # fmt: skip
    assert got["parallel"]["verdict"] == "inconclusive"
    assert "the rounds disagree: attention 1.10–1.60×" in got["parallel"]["why"]["en"]


@pytest.mark.parametrize(
    "machine,why",
    [
        ({**QUIET, "cpu_pressure": 35.0}, "CPU pressure 35%"),
        ({**QUIET, "cpu_pressure": None, "cpu_pressure_after": None, "load_1min": 3.4},
         "load average 3.4 on 2 cores"),
    ],
)  # fmt: skip
def test_a_busy_machine_makes_the_timed_claim_inconclusive(machine, why):
    got = rnn.claims(
        {"parallel": [_timed([1.0] * 3, [1.9] * 3)], "recall": REC, "machine": machine,
         "task": TASK}
    )  # fmt: skip
    assert got["parallel"]["verdict"] == "inconclusive"
    assert got["parallel"]["why"]["en"] == f"the machine was too busy to time: {why}"


def test_an_lstm_that_never_learned_makes_the_memory_claim_inconclusive():
    # the quick run's table that read "holds": 23.6% at d=4 falling to 11.1%, chance 12.5%
    rec = [
        {"distance": 4, "lstm_acc": 0.236, "attention_acc": 1.0},
        {"distance": 256, "lstm_acc": 0.111, "attention_acc": 0.99},
    ]
    got = rnn.claims(
        {"parallel": [_timed([1.0] * 3, [1.9] * 3)], "recall": rec, "machine": QUIET,
         "task": TASK}
    )  # fmt: skip
    assert got["recall"]["verdict"] == "inconclusive"
    assert got["recall"]["why"]["en"] == (
        "the LSTM did not learn the task even at d=4: 24% against 12.5% chance, so its fall "
        "with distance cannot be judged (section 3 can)"
    )


def test_summary_in_both_languages_and_the_figure(doc, tmp_path):
    en, zh = rnn.summary(doc, "en"), rnn.summary(doc, "zh")
    assert "1. Parallelism" in en and "2. Recall at distance d" in en
    assert "并行性" in zh and "回忆" in zh
    last = doc["recall"][-1]
    assert f"{last['distance']:>6} {last['lstm_acc']:>8.1%} {last['attention_acc']:>10.1%}" in en
    pytest.importorskip("matplotlib")
    rnn.figure(doc, tmp_path / "rnn.png")
    assert (tmp_path / "rnn.png").stat().st_size > 0


def test_the_timing_stops_starting_new_lengths_once_its_budget_is_spent():
    from dataclasses import replace

    bar = rnn.Progress(3, "test", enabled=False)
    rows, skipped = rnn.parallel(replace(TINY, ns=(8, 16, 32), budget_s=0.0), bar)
    assert [r["n"] for r in rows] == [8] and skipped == [16, 32]  # the first is always timed


def test_chinese_ratios_say_as_fast_not_faster_and_keep_the_rule(doc):
    slow = {**doc["parallel"][-1], "threads": 2, "lstm_ms_one_thread": 17.0, "lstm_ms": 100.0}
    slow |= {"attention_ms_one_thread": 150.0, "attention_ms": 100.0}
    zh = rnn.summary({**doc, "parallel": [slow]}, "zh")
    en = rnn.summary({**doc, "parallel": [slow]}, "en")
    assert "the LSTM ran 0.17× as fast" in en
    assert "LSTM 的速度是单线程的 0.17 倍" in zh and "注意力的速度是单线程的 1.50 倍" in zh
    assert "快了" not in zh  # "0.17 倍 faster" reverses the meaning
    assert f"至少是单线程的 {rnn.SPEEDUP} 倍" in zh  # the verdict's rule, as in the English
    assert "隐藏维度" in zh and "隐藏层" not in zh  # hidden size, not "hidden layers"


def test_chinese_tables_line_up_in_terminal_columns(doc):
    from qkv.inspect.text import columns

    zh = rnn.summary(doc, "zh").splitlines()
    head = next(i for i, line in enumerate(zh) if "串行步数" in line)
    widths = {columns(line) for line in zh[head : head + 1 + len(doc["parallel"])]}
    assert len(widths) == 1, zh[head : head + 3]


def test_verdicts_are_in_the_json_and_say_why_in_both_languages(doc):
    assert set(doc["verdicts"]) == {"parallel", "recall", "fade"}
    for v in doc["verdicts"].values():
        assert v["verdict"] in ("holds", "does not hold", "inconclusive")
        assert (v["why"] is None) == (v["verdict"] != "inconclusive")
    untrained = [dict(r, lstm_acc=0.2, attention_acc=1.0) for r in doc["recall"]]
    zh = rnn.summary({**doc, "recall": untrained}, "zh")
    en = rnn.summary({**doc, "recall": untrained}, "en")
    assert "→ inconclusive (the LSTM did not learn the task even at d=" in en
    assert "→ 无法判断（LSTM 在 d=" in zh
    assert "critical path" in en and "关键路径" in zh


def test_dependence_is_the_gradient_at_the_pairs_position():
    """fade.dependence against a brute-force finite difference on a tiny LSTM."""
    import torch

    from qkv.labs import fade, recall

    torch.manual_seed(0)
    task = recall.Task(keys=3, values=4)
    model = recall.LSTMReader(task.width, 6, task.values).double().eval()
    g = torch.Generator().manual_seed(1)
    got = fade.dependence(model.float(), task, (1, 4), length=6, samples=1, generator=g)
    g = torch.Generator().manual_seed(1)
    for d, value in zip((1, 4), got, strict=True):
        b = recall.make_batch(task, 1, 6, d, g)
        x = b.x.double()
        grad = torch.zeros(task.width, dtype=torch.float64)
        for c in range(task.width):  # central differences, one input coordinate at a time
            e = torch.zeros_like(x)
            e[0, 6 - 1 - d, c] = 1e-6
            up, down = model.double()(x + e), model.double()(x - e)
            grad[c] = (up[0, b.answer[0]] - down[0, b.answer[0]]) / 2e-6
        model.float()
        assert value == pytest.approx(grad.norm().item(), rel=1e-3)


def test_the_memory_claim_reads_the_dependence_by_its_rule(doc):
    from qkv.labs import fade

    for r in doc["recall"]:
        assert r["lstm_dependence"] >= 0 and r["attention_dependence"] >= 0
    rec = [
        {"distance": 4, "lstm_acc": 0.236, "attention_acc": 1.0, "lstm_dependence": 0.24,
         "attention_dependence": 7.3},
        {"distance": 256, "lstm_acc": 0.111, "attention_acc": 0.99, "lstm_dependence": 0.001,
         "attention_dependence": 7.4},
    ]  # fmt: skip
    base = {"parallel": [_timed([1.0] * 3, [1.9] * 3)], "machine": QUIET, "task": TASK}
    assert rnn.claims({**base, "recall": rec})["fade"]["verdict"] == "holds"
    kept = [{**rec[0]}, {**rec[1], "lstm_dependence": 0.24 * (fade.FADED + 0.01)}]
    assert rnn.claims({**base, "recall": kept})["fade"]["verdict"] == "does not hold"
    text = rnn.summary(doc, "en")
    assert "3. Memory" in text and "claim: an RNN forgets with distance" in text
    assert "3. 记忆" in rnn.summary(doc, "zh")


def _busy_doc(doc: dict, machine: dict) -> dict:
    """`doc` as if timed on `machine` with 2 threads (the timed claim then reads the machine)."""
    par = [{**r, "threads": 2} for r in doc["parallel"]]
    return {**doc, "parallel": par, "machine": {**doc["machine"], **machine}}


def test_the_chinese_answer_holds_no_english_even_on_a_busy_machine(doc):
    from tests.inspect.test_zh_complete import assert_chinese

    pressure = _busy_doc(doc, {"cpu_pressure": 35.0})
    zh = rnn.summary(pressure, "zh")
    assert "机器太忙，计时不可信：CPU 压力 35%" in zh
    assert_chinese(zh, "qkv lab rnn --lang zh, CPU pressure")
    assert "the machine was too busy to time: CPU pressure 35%" in rnn.summary(pressure, "en")
    load = _busy_doc(doc, {"cpu_pressure": None, "load_1min": 9.5, "cores": 2})
    zh = rnn.summary(load, "zh")
    assert "机器太忙，计时不可信：2 个核心上的平均负载为 9.5" in zh
    assert_chinese(zh, "qkv lab rnn --lang zh, load")


def test_the_chinese_answer_reads_as_chinese(doc):
    zh = rnn.summary(doc, "zh")
    assert f"1. 并行性：宽度 {TINY.width} 的单层网络做一次前向+反向，输入一条序列" in zh
    assert "（每个随机种子一个值；— 表示始终没有降到）" in zh
    assert "3. 记忆：训练好的模型给出答案时，还在多大程度上依赖 d 个位置之前的那一对" in zh
    quiet = _busy_doc(doc, {"cpu_pressure": 0.0, "load_1min": 0.3, "cores": 2})
    assert "（2 个核心上的平均负载为 0.3）" in rnn.summary(quiet, "zh")
    en = rnn.summary(quiet, "en")
    assert "(load average 0.3 on 2 cores)" in en
    assert f"1. Parallelism: forward+backward of one layer of width {TINY.width}, one " in en


def test_the_figure_draws_the_answers_dependence_on_the_pair(doc):
    pytest.importorskip("matplotlib")
    from qkv.labs import fade

    fig = rnn.figure(doc)
    assert len(fig.axes) == 4
    dep = fig.axes[3]
    assert dep.get_yscale() == "log" and "dependence" in dep.get_title()
    lines = {line.get_label(): line for line in dep.get_lines()}
    ds = [r["distance"] for r in doc["recall"]]
    for key in ("lstm", "attention"):
        (line,) = [v for k, v in lines.items() if k.lower().startswith(key)]
        want = fade.relative([r[f"{key}_dependence"] for r in doc["recall"]])
        kept = [(d, y) for d, y in zip(ds, want, strict=True) if y > 0]
        assert list(line.get_xdata()) == [d for d, _ in kept]
        assert list(line.get_ydata()) == pytest.approx([y for _, y in kept])
    zh = rnn.figure(doc, lang="zh")
    assert "依赖" in zh.axes[3].get_title()
    older = {**doc, "recall": [
        {k: v for k, v in r.items() if not k.endswith("_dependence")} for r in doc["recall"]
    ]}  # fmt: skip
    assert len(rnn.figure(older).axes) == 3  # a document from before the measure
    assert all(t.get_text() for t in (dep.xaxis.label, dep.yaxis.label))
