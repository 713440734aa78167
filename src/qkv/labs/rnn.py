"""`qkv lab rnn`: the two pains of RNNs that attention removes, measured.

1. Parallelism. Forward+backward time of a one-layer `torch.nn.LSTM` and of one qkv
   self-attention layer (`qkv.nn.SelfAttention`) of the same width, over N, on all of torch's
   threads and on one. The LSTM needs N sequential steps (h_t needs h_{t−1}); attention is a
   few matrix products over all positions at once, so more cores can share its work.
2. Long-range memory. A tiny LSTM and a tiny attention model (`recall.AttentionReader`) with
   about the same number of parameters, trained for the same steps on the same batches of the
   recall task (`qkv.labs.recall`), then tested at each distance d between the answer and the
   question, over several seeds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..inspect.text import row
from ..nn import SelfAttention
from . import fade, recall
from .common import Progress, busy, decided, inconclusive, machine, pick, threads, verdict


@dataclass(frozen=True)
class Preset:
    """How much `qkv lab rnn` measures."""

    ns: tuple[int, ...]  # sequence lengths timed
    width: int  # width of the timed LSTM and attention layer
    repeats: int  # timing: interleaved rounds per N after a warm-up (fewer past 8 s, ≥ 2)
    budget_s: float  # timing: no new N is started once the timing has taken this long
    distances: tuple[int, ...]  # recall: distances tested (training covers 1..max)
    seeds: int  # recall: independent trainings of each model
    steps: int  # recall: training steps of each model (batch 32)
    d_model: int  # recall: width of the attention model; the LSTM gets the same parameters
    samples: int  # recall: test sequences per distance


QUICK = Preset(
    ns=(64, 128, 256, 512, 1024, 2048, 4096),
    width=64,
    repeats=3,
    budget_s=20.0,
    distances=(4, 8, 16, 32, 64, 128, 256),
    seeds=2,
    steps=1000,
    d_model=64,
    samples=256,
)
FULL = Preset(
    ns=(64, 128, 256, 512, 1024, 2048, 4096, 8192),
    width=64,
    repeats=5,
    budget_s=120.0,
    distances=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    seeds=4,
    steps=4000,
    d_model=64,
    samples=1000,
)
TASK = recall.Task(keys=4, values=8)
# Adam's learning rate for each model: the LSTM learns faster with the larger one; attention
# trains in a few hundred steps at the smaller one and can diverge at the larger one.
LR = {"attention": 3e-3, "lstm": 1e-2}
LEARNED = 0.1  # a model "has learned" once its loss, averaged over 50 steps, falls below this
WINDOW = 50  # steps per point of the logged loss curves
DEPENDENCE_SAMPLES = 128  # test sequences per distance for fade.dependence


# --------------------------------------------------------------------------- parallelism


CALL_CAP_S = 8.0  # after this long on one N, no further rounds (at least two are run)


def time_layers(n: int, width: int, rounds: int, seed: int = 0) -> dict[str, list[float]]:
    """Forward+backward milliseconds of an LSTM and an attention layer on one sequence
    `(1, n, width)`, on all of torch's threads and on one, in interleaved rounds (each round
    times all four after one warm-up of each): `{"lstm": [...], "lstm_one_thread": [...],
    "attention": [...], "attention_one_thread": [...]}`, one entry per round. At least two
    rounds; no new one once `CALL_CAP_S` has passed (a busy machine can make a call take
    seconds)."""
    torch.manual_seed(seed)
    lstm = nn.LSTM(width, width, batch_first=True)
    attn = SelfAttention(width, width)
    x = torch.randn(1, n, width, requires_grad=True)
    calls = {
        "lstm": lambda: lstm(x)[0].sum().backward(),
        "attention": lambda: attn(x).sum().backward(),
    }
    every = torch.get_num_threads()
    out: dict[str, list[float]] = {}
    start = time.perf_counter()
    for r in range(-1, rounds):  # round −1 warms up
        if r >= 2 and time.perf_counter() - start > CALL_CAP_S:
            break
        for name, fn in calls.items():
            for key, nt in ((name, every), (f"{name}_one_thread", 1)):
                with threads(nt):
                    t0 = time.perf_counter()
                    fn()
                    ms = (time.perf_counter() - t0) * 1e3
                if r >= 0:
                    out.setdefault(key, []).append(ms)
    return out


def parallel(preset: Preset, bar: Progress) -> tuple[list[dict], list[int]]:
    """One record per N: the median time on all threads and on one, every round's times
    (`*_rounds`), and the sequential steps of each; and the lengths not started because the
    time budget was spent."""
    all_threads = torch.get_num_threads()
    rows: list[dict] = []
    skipped: list[int] = []
    start = time.perf_counter()
    for n in preset.ns:
        bar.step()
        if rows and time.perf_counter() - start > preset.budget_s:
            skipped.append(n)
            continue
        times = time_layers(n, preset.width, preset.repeats)
        rows.append(
            {
                "n": n,
                "lstm_ms": statistics.median(times["lstm"]),
                "attention_ms": statistics.median(times["attention"]),
                "lstm_steps": n,  # h_t needs h_{t-1}: one step per position
                "attention_steps": 1,  # every position at once
                "threads": all_threads,
                "lstm_ms_one_thread": statistics.median(times["lstm_one_thread"]),
                "attention_ms_one_thread": statistics.median(times["attention_one_thread"]),
                **{f"{key}_rounds": ms for key, ms in times.items()},
            }
        )
    return rows, skipped


def speedups(rec: dict) -> dict[str, list[float]]:
    """Per round, how many times as fast each model ran on all threads as on one."""
    out = {}
    for name in ("lstm", "attention"):
        pairs = zip(rec[f"{name}_one_thread_rounds"], rec[f"{name}_rounds"], strict=True)
        out[name] = [one / every for one, every in pairs]
    return out


# --------------------------------------------------------------------------- recall


def loss_curve(losses: list[float]) -> list[float]:
    """The mean loss of each run of `WINDOW` steps."""
    return [
        sum(losses[i : i + WINDOW]) / len(losses[i : i + WINDOW])
        for i in range(0, len(losses), WINDOW)
    ]


def learned_at(losses: list[float]) -> int | None:
    """The first step at which the mean loss of the last `WINDOW` steps is below `LEARNED`."""
    total = 0.0
    for i, loss in enumerate(losses):
        total += loss - (losses[i - WINDOW] if i >= WINDOW else 0.0)
        if i + 1 >= WINDOW and total / WINDOW < LEARNED:
            return i + 1
    return None


def recall_curves(preset: Preset, seed: int, bar: Progress) -> dict:
    """Accuracy against distance of both models, averaged over seeds (and per seed), with the
    models' sizes and each training's loss curve."""
    length = max(preset.distances) + 1
    acc: dict[str, list[list[float]]] = {"attention": [], "lstm": []}
    curves: dict[str, list[list[float]]] = {"attention": [], "lstm": []}
    learned: dict[str, list[int | None]] = {"attention": [], "lstm": []}
    dep: dict[str, list[list[float]]] = {"attention": [], "lstm": []}  # fade.dependence
    sizes: dict[str, dict] = {}
    for s in range(preset.seeds):
        torch.manual_seed(seed * 1000 + s)
        attention = recall.AttentionReader(TASK.width, preset.d_model, TASK.values)
        budget = recall.parameters(attention)
        hidden = recall.lstm_hidden_for(budget, TASK.width, TASK.values)
        lstm = recall.LSTMReader(TASK.width, hidden, TASK.values)
        sizes = {
            "attention": {"params": budget, "d_model": preset.d_model},
            "lstm": {"params": recall.parameters(lstm), "hidden": hidden},
        }
        for name, model in (("attention", attention), ("lstm", lstm)):
            data = torch.Generator().manual_seed(seed * 1000 + s)  # the same batches for both
            losses = recall.train(
                model,
                TASK,
                preset.steps,
                max_length=length,
                lr=LR[name],
                generator=data,
                on_step=lambda *_: bar.step(),
            )
            curves[name].append(loss_curve(losses))
            learned[name].append(learned_at(losses))
            test = torch.Generator().manual_seed(10**6 + seed * 1000 + s)
            acc[name].append(
                [
                    recall.accuracy(
                        model, TASK, d, length=length, samples=preset.samples, generator=test
                    )
                    for d in preset.distances
                ]
            )
            probe = torch.Generator().manual_seed(2 * 10**6 + seed * 1000 + s)
            dep[name].append(
                fade.dependence(
                    model,
                    TASK,
                    preset.distances,
                    length=length,
                    samples=min(preset.samples, DEPENDENCE_SAMPLES),
                    generator=probe,
                )
            )
    rows = []
    for i, d in enumerate(preset.distances):
        lstm_runs = [run[i] for run in acc["lstm"]]
        attn_runs = [run[i] for run in acc["attention"]]
        rows.append(
            {
                "distance": d,
                "lstm_acc": sum(lstm_runs) / len(lstm_runs),
                "attention_acc": sum(attn_runs) / len(attn_runs),
                "lstm_acc_by_seed": lstm_runs,
                "attention_acc_by_seed": attn_runs,
                # the answer's dependence on the pair d back (fade.dependence), seed mean
                "lstm_dependence": sum(r[i] for r in dep["lstm"]) / len(dep["lstm"]),
                "attention_dependence": sum(r[i] for r in dep["attention"]) / len(dep["attention"]),
            }
        )
    training = {"every": WINDOW, "learned_below": LEARNED, "loss": curves, "learned_at": learned}
    return {"recall": rows, "models": sizes, "training": training}


def run(preset: Preset = QUICK, *, seed: int = 0, progress: bool = True) -> dict:
    """Both measurements; returns the JSON document (see the module docstring)."""
    started, before = time.perf_counter(), machine()
    total = len(preset.ns) + 2 * preset.seeds * preset.steps
    bar = Progress(total, "qkv lab rnn", progress)
    try:
        rows, skipped = parallel(preset, bar)
        timed, after = time.perf_counter(), machine()
        with threads(1):
            memory = recall_curves(preset, seed, bar)
    finally:
        bar.close()
    done = time.perf_counter()
    length = max(preset.distances) + 1
    doc = {
        "lab": "rnn",
        # the load and CPU pressure once the timing was done (the verdict reads those before)
        "machine": {
            **before,
            "load_1min_after": after["load_1min"],
            "cpu_pressure_after": after["cpu_pressure"],
        },
        "preset": asdict(preset),
        "seed": seed,
        "parallel": rows,
        "parallel_skipped": skipped,  # lengths not timed: the time budget was spent
        **memory,
        "task": {
            **asdict(TASK),
            "chance": 1 / TASK.values,
            "test_length": length,
            "train_lengths": [min(8, length), length],
            "batch": 32,
            "lr": LR,
        },
        "seconds": done - started,
        "seconds_parallel": timed - started,
        "seconds_recall": done - timed,
    }
    doc["verdicts"] = claims(doc)  # each claim: holds, does not hold or inconclusive (why)
    return doc


# --------------------------------------------------------------------------- the answer

TEXT = {
    "en": {
        "title": "RNN vs attention ({seconds:.0f} s)",
        "par": "1. Parallelism: forward+backward of one layer of width {width}, one sequence",
        "par_threads": (
            "  on {threads} threads vs 1 at N={n}, median of {rounds} interleaved rounds: the "
            "LSTM ran {lstm:.2f}× as fast ({lstm_lo:.2f}–{lstm_hi:.2f}), attention {attn:.2f}× "
            "as fast ({attn_lo:.2f}–{attn_hi:.2f}) (load average {load} on {cores} cores)"
        ),
        "par_claim": (
            "  claim: an RNN cannot use parallel hardware, attention can → {verdict} "
            "(rule: attention ≥ {need}× as fast on all threads in every round, the LSTM less)"
        ),
        "par_why": (
            "  why the LSTM can still win on a few cores: each of its steps is a small product "
            "and attention does N² work; the claim is about the critical path, {n} sequential "
            "steps for the LSTM against 1 for attention (the last column), which is what lets "
            "many cores share attention's work"
        ),
        "par_one": "  (torch runs on 1 thread here: no parallel speed-up to compare)",
        "par_skipped": "  not timed: N = {ns} (the timing's budget of {budget:.0f} s was spent)",
        "rec": (
            "2. Recall at distance d: {keys} keys, {values} values (chance {chance:.0%}), "
            "{steps} training steps, {seeds} seed(s), {samples} test sequences of {length} "
            "positions per d"
        ),
        "rec_models": "  attention: {ap} parameters (d_model {dm}); LSTM: {lp} parameters "
        "(hidden {h})",
        "rec_learned": "  training step at which the loss fell below {below} (per seed; — never): "
        "attention {attn}; LSTM {lstm}",
        "rec_claim": (
            "  claim: the LSTM's accuracy falls with distance while attention stays near "
            "100% → {verdict} (LSTM {l0:.0%} at d={d0}, {l1:.0%} at d={d1}; attention "
            "{amin:.0%} at worst; rule: attention ≥ 95% everywhere, the LSTM ≥ 10 points lower "
            "at the longest distance than at the shortest)"
        ),
        "fade": (
            "3. Memory: how much the trained model's answer still depends on the pair d "
            "positions back (the gradient of the answer's logit with respect to that input, "
            "relative to d = the shortest)"
        ),
        "fade_claim": (
            "  claim: an RNN forgets with distance, attention does not → {verdict} (the LSTM "
            "keeps {lstm:.2g} of its dependence at d={d1}, attention {attn:.2g}; rule: the LSTM "
            "≤ {faded} at the longest distance, attention ≥ {kept})"
        ),
        "fade_why": (
            "  why accuracy alone cannot show it here: each step of the LSTM's recurrence "
            "shrinks the gradient, so the pair d steps back barely moves its answer and it "
            "cannot learn to use it in a short training; attention reaches every position in one "
            "step"
        ),
    },
    "zh": {
        "title": "RNN 与注意力（{seconds:.0f} 秒）",
        "par": "1. 并行性：宽度 {width} 的单层网络做一次前向+反向，输入一条序列",
        "par_threads": (
            "  N={n} 时，{threads} 个线程与 1 个线程相比（{rounds} 轮交替测量的中位数）："
            "LSTM 的速度是单线程的 {lstm:.2f} 倍（{lstm_lo:.2f}–{lstm_hi:.2f}），"
            "注意力的速度是单线程的 {attn:.2f} 倍（{attn_lo:.2f}–{attn_hi:.2f}）"
            "（{cores} 个核心上的平均负载为 {load}）"
        ),
        "par_claim": (
            "  论断：RNN 用不上并行硬件，注意力可以 → {verdict}"
            "（规则：每一轮中多线程下注意力的速度至少是单线程的 {need} 倍，且 LSTM 的加速比它小）"
        ),
        "par_why": (
            "  为什么在少数几个核上 LSTM 仍可能更快：它每一步只是一次小的矩阵乘法，"
            "而注意力要做 N² 的计算；论断说的是关键路径的长度：LSTM 要串行走 {n} 步，"
            "注意力只要 1 步（表的最后一列），正是这一点让多个核能分担注意力的计算"
        ),
        "par_one": "  （这里 torch 只用 1 个线程，无法比较并行加速）",
        "par_skipped": "  未计时：N = {ns}（计时预算 {budget:.0f} 秒已用完）",
        "rec": (
            "2. 距离 d 处的回忆：{keys} 个键，{values} 个值（随机猜对 {chance:.0%}），"
            "训练 {steps} 步，{seeds} 个随机种子，每个 d 测试 {samples} 条长度 {length} 的序列"
        ),
        "rec_models": "  注意力：{ap} 个参数（d_model {dm}）；LSTM：{lp} 个参数（隐藏维度 {h}）",
        "rec_learned": (
            "  损失降到 {below} 以下时的训练步数（每个随机种子一个值；— 表示始终没有降到）："
            "注意力 {attn}；LSTM {lstm}"
        ),
        "rec_claim": (
            "  论断：LSTM 的准确率随距离下降，注意力保持接近 100% → {verdict}"
            "（LSTM 在 d={d0} 为 {l0:.0%}，在 d={d1} 为 {l1:.0%}；注意力最低 {amin:.0%}；"
            "规则：注意力处处 ≥ 95%，LSTM 在最远距离比最近距离至少低 10 个百分点）"
        ),
        "fade": (
            "3. 记忆：训练好的模型给出答案时，还在多大程度上依赖 d 个位置之前的那一对"
            "（答案的 logit 对该输入的梯度，相对于最短距离）"
        ),
        "fade_claim": (
            "  论断：RNN 随距离遗忘，注意力不会 → {verdict}（在 d={d1} 处 LSTM 保留了 {lstm:.2g} "
            "的依赖，注意力保留了 {attn:.2g}；规则：最远距离处 LSTM ≤ {faded}，注意力 ≥ {kept}）"
        ),
        "fade_why": (
            "  为什么单看准确率在这里看不出来：LSTM 的每一步递推都会让梯度缩小，"
            "d 步之前的那一对几乎影响不了它的答案，短时间的训练里它也就学不会去用它；"
            "注意力一步就能到达任何位置"
        ),
    },
}

# The tables' column headers, by language.
COLUMNS = {
    "en": {
        "par": ("N", "LSTM", "attention", "steps LSTM/attn"),
        "rec": ("d", "LSTM", "attention"),
    },
    "zh": {
        "par": ("N", "LSTM", "注意力", "串行步数 LSTM/注意力"),
        "rec": ("d", "LSTM", "注意力"),
    },
}


SPEEDUP = 1.25  # "uses parallel hardware": at least this much faster on all threads than on one


LEARNED_OVER_CHANCE = 2.0  # the LSTM "learned the task" if it beat chance this many times


def claims(doc: dict) -> dict[str, dict]:
    """Each claim's verdict in this run (`common.decided` / `common.inconclusive`), by the
    rules the summary states.

    parallel, at the largest N: holds if in every round attention ran at least 1.25× as fast
    on all threads as on one and the LSTM gained less than attention's least; does not hold if
    in no round attention reached 1.25×, or the LSTM's least gain beat attention's best;
    inconclusive when the rounds disagree, on one thread, or on a machine too busy to time
    (`common.busy`). recall: holds if attention ≥ 95% at every distance and the LSTM lost at
    least 10 points from the shortest distance to the longest; inconclusive if either model did
    not learn the task even at the shortest distance (attention below 95%, the LSTM below
    twice chance: its fall with distance would mean nothing)."""
    last = doc["parallel"][-1]
    if last["threads"] == 1:
        par = inconclusive("torch runs on 1 thread here", "这里 torch 只用 1 个线程")
    # the machine as read just before the timing: once it runs, its own threads add to the
    # pressure; a neighbour that starts meanwhile shows as rounds that disagree
    elif reason := busy(doc.get("machine", {})):
        par = inconclusive(
            f"the machine was too busy to time: {reason}",
            f"机器太忙，计时不可信：{busy(doc.get('machine', {}), 'zh')}",
        )
    else:
        up = speedups(last)
        lo_a, hi_a = min(up["attention"]), max(up["attention"])
        lo_l, hi_l = min(up["lstm"]), max(up["lstm"])
        if lo_a >= SPEEDUP and hi_l < lo_a:
            par = decided(True)
        elif hi_a < SPEEDUP or lo_l >= hi_a:
            par = decided(False)
        else:
            par = inconclusive(
                f"the rounds disagree: attention {lo_a:.2f}–{hi_a:.2f}×, "
                f"LSTM {lo_l:.2f}–{hi_l:.2f}×",
                f"各轮结果不一致：注意力 {lo_a:.2f}–{hi_a:.2f} 倍，LSTM {lo_l:.2f}–{hi_l:.2f} 倍",
            )
    rec = doc["recall"]
    chance = doc["task"]["chance"]
    if rec[0]["attention_acc"] < 0.95 or rec[0]["lstm_acc"] < LEARNED_OVER_CHANCE * chance:
        who = "attention" if rec[0]["attention_acc"] < 0.95 else "the LSTM"
        who_zh = "注意力模型" if rec[0]["attention_acc"] < 0.95 else "LSTM "
        acc = rec[0]["attention_acc" if who == "attention" else "lstm_acc"]
        recall_verdict = inconclusive(
            f"{who} did not learn the task even at d={rec[0]['distance']}: {acc:.0%} against "
            f"{chance:.1%} chance, so its fall with distance cannot be judged (section 3 can)",
            f"{who_zh}在 d={rec[0]['distance']} 处也没学会这个任务：准确率 {acc:.0%}，"
            f"随机猜对为 {chance:.1%}，所以无法判断它是否随距离下降（第 3 部分可以）",
        )
    else:
        attn_ok = min(r["attention_acc"] for r in rec) >= 0.95
        lstm_falls = rec[0]["lstm_acc"] - rec[-1]["lstm_acc"] >= 0.10
        recall_verdict = decided(attn_ok and lstm_falls)
    return {"parallel": par, "recall": recall_verdict, "fade": _fade_verdict(doc)}


def _fade_verdict(doc: dict) -> dict:
    """The LSTM's dependence on the pair fades with distance, attention's does not."""
    rec = doc["recall"]
    if "lstm_dependence" not in rec[0]:  # a document from before the measure
        return inconclusive("not measured in this run", "这次运行没有测量")
    lstm = [r["lstm_dependence"] for r in rec]
    attn = [r["attention_dependence"] for r in rec]
    return decided(fade.holds(lstm, attn))


def summary(doc: dict, lang: str = "en") -> str:
    """The measurements and the chapter's claims, in English (`en`) or Chinese (`zh`)."""
    t = pick(TEXT, lang)
    held = claims(doc)
    p = doc["preset"]
    lines = [t("title", seconds=doc["seconds"]), t("par", width=p["width"])]
    widths = (6, 12, 14, 22)
    lines.append(row(COLUMNS[lang]["par"], widths))
    for r in doc["parallel"]:
        lines.append(
            row(
                (
                    r["n"],
                    f"{r['lstm_ms']:.1f} ms",
                    f"{r['attention_ms']:.1f} ms",
                    f"{r['lstm_steps']}/{r['attention_steps']}",
                ),
                widths,
            )
        )
    if doc["parallel_skipped"]:
        ns = ", ".join(str(n) for n in doc["parallel_skipped"])
        lines.append(t("par_skipped", ns=ns, budget=p["budget_s"]))
    last = doc["parallel"][-1]
    if last["threads"] == 1:
        lines.append(t("par_one"))
    else:
        up = speedups(last)
        lines.append(
            t(
                "par_threads",
                threads=last["threads"],
                n=last["n"],
                rounds=len(up["lstm"]),
                lstm=last["lstm_ms_one_thread"] / last["lstm_ms"],
                lstm_lo=min(up["lstm"]),
                lstm_hi=max(up["lstm"]),
                attn=last["attention_ms_one_thread"] / last["attention_ms"],
                attn_lo=min(up["attention"]),
                attn_hi=max(up["attention"]),
                load=doc["machine"]["load_1min"],
                cores=doc["machine"]["cores"],
            )
        )
        lines.append(t("par_claim", verdict=verdict(held["parallel"], lang), need=SPEEDUP))
        lines.append(t("par_why", n=last["n"]))
    task, m = doc["task"], doc["models"]
    lines.append(
        t(
            "rec",
            keys=task["keys"],
            values=task["values"],
            chance=task["chance"],
            steps=p["steps"],
            seeds=p["seeds"],
            samples=p["samples"],
            length=task["test_length"],
        )
    )
    lines.append(
        t(
            "rec_models",
            ap=m["attention"]["params"],
            dm=m["attention"]["d_model"],
            lp=m["lstm"]["params"],
            h=m["lstm"]["hidden"],
        )
    )
    lines.append(row(COLUMNS[lang]["rec"], (6, 8, 10)))
    for r in doc["recall"]:
        lines.append(f"  {r['distance']:>6} {r['lstm_acc']:>8.1%} {r['attention_acc']:>10.1%}")
    tr = doc["training"]

    def steps(runs: list[int | None]) -> str:
        return ", ".join("—" if x is None else str(x) for x in runs)

    lines.append(
        t(
            "rec_learned",
            below=tr["learned_below"],
            attn=steps(tr["learned_at"]["attention"]),
            lstm=steps(tr["learned_at"]["lstm"]),
        )
    )
    rec = doc["recall"]
    lines.append(
        t(
            "rec_claim",
            verdict=verdict(held["recall"], lang),
            d0=rec[0]["distance"],
            l0=rec[0]["lstm_acc"],
            d1=rec[-1]["distance"],
            l1=rec[-1]["lstm_acc"],
            amin=min(r["attention_acc"] for r in rec),
        )
    )
    return "\n".join(lines + _fade_lines(doc, held, lang))


def _fade_lines(doc: dict, held: dict, lang: str) -> list[str]:
    """Section 3: how much the answer depends on the pair d back, relative to the shortest d."""
    rec = doc["recall"]
    if "lstm_dependence" not in rec[0]:
        return []
    t = pick(TEXT, lang)
    lstm = fade.relative([r["lstm_dependence"] for r in rec])
    attn = fade.relative([r["attention_dependence"] for r in rec])
    lines = [t("fade"), row(COLUMNS[lang]["rec"], (6, 10, 12))]
    for r, lo, at in zip(rec, lstm, attn, strict=True):
        lines.append(f"  {r['distance']:>6} {lo:>10.2g} {at:>12.2g}")
    lines.append(
        t(
            "fade_claim",
            verdict=verdict(held["fade"], lang),
            d0=rec[0]["distance"],
            d1=rec[-1]["distance"],
            lstm=lstm[-1],
            attn=attn[-1],
            faded=fade.FADED,
            kept=fade.KEPT,
        )
    )
    if held["fade"]["verdict"] == "holds" and held["recall"]["verdict"] != "holds":
        lines.append(t("fade_why"))
    return lines


def figure(doc: dict, path: str | Path | None = None, *, lang: str = "en"):
    """The lab's PNG (`qkv.labs.figures.rnn`), its labels in `lang`; returns the matplotlib
    Figure."""
    from .figures import rnn as draw

    return draw(doc, path, lang=lang)
