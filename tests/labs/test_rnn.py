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


def test_claim_rules():
    par = [
        {
            "n": 4096,
            "threads": 2,
            "lstm_ms": 100.0,
            "lstm_ms_one_thread": 110.0,
            "attention_ms": 100.0,
            "attention_ms_one_thread": 190.0,
        }
    ]
    rec = [
        {"distance": 4, "lstm_acc": 0.9, "attention_acc": 1.0},
        {"distance": 256, "lstm_acc": 0.5, "attention_acc": 0.97},
    ]
    assert rnn.claims({"parallel": par, "recall": rec}) == {"parallel": True, "recall": True}
    slower = {**par[0], "lstm_ms": 300.0, "attention_ms": 400.0}  # both slowed by threads
    assert rnn.claims({"parallel": [slower], "recall": rec})["parallel"] is False
    rec[-1]["lstm_acc"] = 0.85  # fell by only 5 points
    par[0]["threads"] = 1
    assert rnn.claims({"parallel": par, "recall": rec}) == {"parallel": None, "recall": False}


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
