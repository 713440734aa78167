"""`qkv lab sparse`: blocks chosen by the content keep a far answer that a window of the same
budget loses.

The task (long-range retrieval, as in the passkey test): N positions of filler hold `PAIRS`
key–value pairs at random places, each pair one position; the question, one of those keys,
fills the last block of positions; the answer is the value paired with it.

    position   0 …       p …          …  N − block … N − 1
    token      filler    (key, value)     question (the key), `block` times   → its value

Each position is `one_hot(key, K) ⊕ one_hot(value, V) ⊕ [is the question]` (a filler is all
zeros). The question fills a whole block because `qkv.sparse.select_blocks` chooses per query
block, by the block's mean query: so its choice is the question's.

Three copies of one small model (one attention layer, no positional encoding, the answer read
out of the last position) are trained from the same weights on the same batches, each with its
own attention, all reading at most the same number of keys per query, `(topk + 1) × block`:

- `full`: causal attention over every earlier position (no budget: the reference);
- `window`: a causal sliding window of the budget's keys (`qkv.masks.sliding_window`);
- `selected`: the query's own block and the `topk` blocks whose mean key best matches its
  block's mean query (`qkv.sparse.select_blocks`, the choice not differentiated, as in MoBA).

They are tested at growing N with the pairs anywhere: once N outgrows the window, the answer
is mostly out of its reach, while the selected blocks follow it. The cost of one training step
(time, peak memory, keys read per query) is measured for each at each N, and the figure shows
which key blocks each query block of the trained model chose on one sequence.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from ..functional import attention
from ..inspect.bench import peak_rss_mib, release_freed_memory, reset_peak_rss
from ..inspect.text import row
from ..masks import sliding_window
from ..sparse import select_blocks
from .common import Progress, decided, inconclusive, machine, pick, threads, verdict

VARIANTS = ("full", "window", "selected")
KEYS, VALUES, PAIRS = 8, 8, 4  # K keys, V values (chance 1/V), pairs per sequence
WIDTH = KEYS + VALUES + 1  # features per position
LOCAL = 1  # blocks every query block reads: its own
LR, WARMUP = 1e-2, 50  # Adam's peak learning rate, its linear warm-up (then a cosine decay)
BATCH = 32
WINDOW = 25  # steps per point of the logged loss curves


@dataclass(frozen=True)
class Preset:
    """How much `qkv lab sparse` measures."""

    block: int  # positions per block (the question fills the last one)
    topk: int  # blocks chosen by content; the budget is (topk + 1) × block keys per query
    d_model: int  # width of the attention layer
    steps: int  # training steps of each variant (batch 32)
    train_ns: tuple[int, ...]  # each training batch has one of these lengths
    seeds: int  # independent trainings of each variant
    ns: tuple[int, ...]  # test lengths (the first: the budget, all within the window's reach)
    samples: int  # test sequences per N
    time_batch: int  # sequences of the timed training step
    repeats: int  # timed steps after a warm-up (the median is shown)
    picture_n: int  # the length of the sequence whose chosen blocks are drawn


QUICK = Preset(
    block=16,
    topk=3,
    d_model=32,
    steps=400,
    train_ns=(64, 128, 256),
    seeds=1,
    ns=(64, 256, 1024, 2048),
    samples=256,
    time_batch=4,
    repeats=3,
    picture_n=512,
)
FULL = Preset(
    block=16,
    topk=3,
    d_model=32,
    steps=1000,
    train_ns=(64, 128, 256),
    seeds=3,
    ns=(64, 256, 1024, 4096, 8192),
    samples=1024,
    time_batch=4,
    repeats=5,
    picture_n=1024,
)
LEARNED = 0.9  # full attention "learned the task": at least this at the shortest N
KEPT = 0.9  # the selected blocks "keep" the answer: at least this at every N
LOST = 0.3  # the window "loses" it: at most this at the longest N
CHUNK = 64  # test sequences per forward pass


def budget(preset: Preset) -> int:
    """Keys a query reads at most in `window` and `selected`: (topk + 1) × block."""
    return (preset.topk + LOCAL) * preset.block


@dataclass(frozen=True)
class Batch:
    x: torch.Tensor  # (B, n, WIDTH) the encoded sequences
    answer: torch.Tensor  # (B,) the value asked for
    source: torch.Tensor  # (B,) the position of the pair that holds it
    pairs: torch.Tensor  # (B, PAIRS) the positions of every pair (the asked one first)


def make_batch(size: int, n: int, block: int, generator: torch.Generator) -> Batch:
    """`size` sequences of `n` positions (a multiple of `block`, at least two blocks): `PAIRS`
    pairs of distinct keys at distinct random places among the first n − block positions,
    the question (the first pair's key) over the last `block`."""
    if n % block or n < 2 * block:
        raise ValueError(f"n must be a multiple of block={block}, at least {2 * block}, got {n}")
    context = n - block
    keys = torch.rand(size, KEYS, generator=generator).argsort(-1)[:, :PAIRS]
    values = torch.randint(0, VALUES, (size, PAIRS), generator=generator)
    where = torch.rand(size, context, generator=generator).argsort(-1)[:, :PAIRS]
    x = torch.zeros(size, n, WIDTH)
    rows = torch.arange(size)[:, None]
    x[rows, where, keys] = 1.0
    x[rows, where, KEYS + values] = 1.0
    x[:, context:, :] = F.one_hot(keys[:, :1], WIDTH).float()  # the asked key …
    x[:, context:, -1] = 1.0  # … flagged as the question
    return Batch(x, values[:, 0], where[:, 0], where)


class Reader(nn.Module):
    """One attention layer answering from the last position: `h = LayerNorm(x W_in)`,
    `q, k, v = h W_q, h W_k, h W_v`, attention by `kind` (`VARIANTS`), a linear read-out."""

    def __init__(self, kind: str, d_model: int, block: int, topk: int):
        super().__init__()
        if kind not in VARIANTS:
            raise ValueError(f"kind must be one of {', '.join(VARIANTS)}, got {kind!r}")
        self.kind, self.block, self.topk = kind, block, topk
        self.inp = nn.Linear(WIDTH, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, d_model, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.out = nn.Linear(d_model, VALUES)

    def project(self, x: torch.Tensor, rows: int | None = None):
        """`q (B, 1, rows, d)` for the last `rows` positions (all by default), `k`, `v`
        `(B, 1, n, d)`."""
        h = self.norm(self.inp(x))
        hq = h if rows is None else h[:, -rows:]
        return self.W_q(hq).unsqueeze(1), self.W_k(h).unsqueeze(1), self.W_v(h).unsqueeze(1)

    def choose(self, q: torch.Tensor, k: torch.Tensor):
        """The key blocks each query block reads (`qkv.masks.ChosenBlocks`)."""
        return select_blocks(q, k, block=self.block, topk=self.topk, local=LOCAL, sink=0)

    def forward(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """`x (B, n, WIDTH)` → logits `(B, VALUES)`. With one layer only the last position's
        output is read, so `rows=block` (only the last block's queries) gives the same answer
        for less work: the tests use it."""
        q, k, v = self.project(x, rows)
        if self.kind == "full":
            o = attention(q, k, v, causal=True)
        elif self.kind == "window":
            reach = (self.topk + LOCAL) * self.block
            o = attention(q, k, v, mask=sliding_window(reach - 1, 0), causal=True)
        else:
            o = attention(q, k, v, mask=self.choose(q, k))
        return self.out(o[:, 0, -1])


def train(
    model: nn.Module,
    preset: Preset,
    generator: torch.Generator,
    on_step: Callable[[], None] | None = None,
) -> list[float]:
    """Adam with a warm-up and a cosine decay on fresh batches; returns every step's loss. Each
    step's length is one of `preset.train_ns`, drawn from `generator`."""
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    model.train()
    for step in range(preset.steps):
        warm = min(1.0, (step + 1) / WARMUP)
        for group in opt.param_groups:
            group["lr"] = LR * warm * 0.5 * (1 + math.cos(math.pi * step / preset.steps))
        pick_n = int(torch.randint(len(preset.train_ns), (), generator=generator))
        b = make_batch(BATCH, preset.train_ns[pick_n], preset.block, generator)
        loss = F.cross_entropy(model(b.x), b.answer)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step()
    model.eval()
    return losses


@torch.no_grad()
def accuracy(model: Reader, preset: Preset, n: int, generator: torch.Generator) -> dict:
    """The share of `preset.samples` fresh sequences of `n` answered right, and the share whose
    answer lies within the window's reach (the last `budget` positions)."""
    right = reach = 0
    for start in range(0, preset.samples, CHUNK):
        b = make_batch(min(CHUNK, preset.samples - start), n, preset.block, generator)
        right += int((model(b.x, rows=preset.block).argmax(-1) == b.answer).sum())
        reach += int((b.source >= n - budget(preset)).sum())
    return {"accuracy": right / preset.samples, "in_reach": reach / preset.samples}


def keys_per_query(model: Reader, preset: Preset, n: int, q=None, k=None) -> float:
    """How many keys a query reads, on average over the n positions: `full` (n + 1) / 2,
    `window` at most the budget, `selected` from the blocks chosen for `q`, `k` (its own block
    causally, the others whole)."""
    if model.kind == "full":
        return (n + 1) / 2
    w = budget(preset)
    if model.kind == "window":
        return sum(min(i + 1, w) for i in range(n)) / n
    index = model.choose(q, k).index[0, 0]  # (query blocks, kmax)
    bs = preset.block
    own = torch.arange(index.shape[0])[:, None]
    whole = ((index >= 0) & (index < own)).sum().item() * bs * bs
    diagonal = index.shape[0] * bs * (bs + 1) / 2
    return (whole + diagonal) / n


def step_cost(model: Reader, preset: Preset, n: int, generator: torch.Generator) -> dict:
    """One training step's forward+backward on `preset.time_batch` sequences of `n`: the median
    time of `preset.repeats` after a warm-up, the rise of the process's peak resident memory
    during one more (`qkv.inspect.bench`'s measure; None where Linux does not say), and the
    keys read per query."""
    b = make_batch(preset.time_batch, n, preset.block, generator)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(b.x), b.answer).backward()

    step()  # warm-up
    times = []
    for _ in range(preset.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    release_freed_memory()
    base = reset_peak_rss()
    step()
    peak = peak_rss_mib()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        q, k, _ = model.project(b.x[:1])
    return {
        "n": n,
        "variant": model.kind,
        "ms": statistics.median(times) * 1e3,
        "peak_mib": None if base is None or peak is None else max(peak - base, 0.0),
        "keys_per_query": keys_per_query(model, preset, n, q, k),
    }


@torch.no_grad()
def picture(model: Reader, preset: Preset, generator: torch.Generator) -> dict:
    """The key blocks each query block of the trained `selected` model chose on one sequence
    of `preset.picture_n` whose answer lies beyond the window's reach."""
    n, bs = preset.picture_n, preset.block
    b = make_batch(64, n, bs, generator)
    far = (b.source < n - budget(preset)).nonzero()
    i = int(far[0, 0]) if len(far) else 0
    q, k, _ = model.project(b.x[i : i + 1])
    index = model.choose(q, k).index[0, 0]
    right = int(model(b.x[i : i + 1], rows=bs).argmax(-1)) == int(b.answer[i])
    return {
        "n": n,
        "block": bs,
        "chosen": [[j for j in r if j >= 0] for r in index.tolist()],
        "answer_block": int(b.source[i]) // bs,
        "pair_blocks": sorted({int(p) // bs for p in b.pairs[i]}),
        "question_block": n // bs - 1,
        "window_blocks": budget(preset) // bs,
        "answered_right": right,
    }


def train_all(preset: Preset, seed: int, bar: Progress) -> tuple[dict, dict, list[Reader]]:
    """Every variant, every seed: trained, then tested at each N. Returns the accuracy per
    variant and N (per seed), the loss curves, and seed 0's models."""
    acc: dict[str, list[list[dict]]] = {v: [] for v in VARIANTS}
    curves: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    first: list[Reader] = []
    for s in range(preset.seeds):
        for kind in VARIANTS:
            torch.manual_seed(seed * 1000 + s)  # the same initial weights for every variant
            model = Reader(kind, preset.d_model, preset.block, preset.topk)
            data = torch.Generator().manual_seed(seed * 1000 + s)  # the same batches
            losses = train(model, preset, data, bar.step)
            curves[kind].append(
                [statistics.fmean(losses[i : i + WINDOW]) for i in range(0, len(losses), WINDOW)]
            )
            runs = []
            for n in preset.ns:
                test = torch.Generator().manual_seed(10**7 + (seed * 1000 + s) * 10**5 + n)
                runs.append(accuracy(model, preset, n, test))
                bar.step()
            acc[kind].append(runs)
            if s == 0:
                first.append(model)
    return acc, curves, first


def run(preset: Preset = QUICK, *, seed: int = 0, progress: bool = True) -> dict:
    """Train, test, time and draw the chosen blocks; returns the JSON document."""
    started, before = time.perf_counter(), machine()
    units = len(VARIANTS) * (preset.seeds * (preset.steps + len(preset.ns)) + len(preset.ns))
    bar = Progress(units, "qkv lab sparse", progress)
    try:
        with threads(1):
            acc, curves, models = train_all(preset, seed, bar)
            cost = []
            for n in preset.ns:
                for model in models:  # the same batch for each
                    timing = torch.Generator().manual_seed(2 * 10**7 + seed * 10**5 + n)
                    cost.append(step_cost(model, preset, n, timing))
                    bar.step()
            shown = picture(models[-1], preset, torch.Generator().manual_seed(3 * 10**7 + seed))
    finally:
        bar.close()
    rows = []
    for i, n in enumerate(preset.ns):
        r: dict = {"n": n, "in_reach": acc["full"][0][i]["in_reach"]}
        for kind in VARIANTS:
            runs = [a[i]["accuracy"] for a in acc[kind]]
            r[kind] = statistics.fmean(runs)
            r[f"{kind}_by_seed"] = runs
        rows.append(r)
    doc = {
        "lab": "sparse",
        "machine": {**before, "load_1min_after": machine()["load_1min"]},
        "preset": asdict(preset),
        "seed": seed,
        "task": {
            "keys": KEYS,
            "values": VALUES,
            "pairs": PAIRS,
            "chance": 1 / VALUES,
            "question_length": preset.block,
            "batch": BATCH,
            "lr": LR,
            "warmup": WARMUP,
        },
        "budget": {
            "keys": budget(preset),
            "block": preset.block,
            "topk": preset.topk,
            "local": LOCAL,
            "sink": 0,
        },
        "accuracy": rows,
        "cost": cost,
        "training": {"every": WINDOW, "loss": curves},
        "picture": shown,
        "seconds": time.perf_counter() - started,
    }
    doc["verdicts"] = claims(doc)  # each claim: holds, does not hold or inconclusive (why)
    return doc


# --------------------------------------------------------------------------- the answer

TEXT = {
    "en": {
        "title": "Sparse attention chosen by the content ({seconds:.0f} s)",
        "task": "The task: {pairs} key–value pairs ({keys} keys, {values} values) at random places "
        "among N positions of filler, the question (one of their keys) over the last {block}; the "
        "answer is its value (chance {chance:.1%})",
        "models": "One attention layer (d_model {d}) per variant, trained {steps} steps from the "
        "same weights on the same batches (N = {train}), {seeds} seed(s); {samples} test "
        "sequences per N",
        "budget": "The budget: a query reads at most {keys} keys. window: the {keys} positions up "
        "to it; selected: its own block of {block} and the {topk} blocks whose mean key best "
        "matches its block's mean query (qkv.sparse.select_blocks); full: every position up to it",
        "acc": "1. Accuracy (in reach: the answers within the window's {keys} positions)",
        "cost": "2. One training step (forward+backward, {batch} sequences, 1 thread): median "
        "time, peak memory (rise of the resident set), keys read per query (mean)",
        "claim_window": "  claim: a window of the budget loses the answer once it leaves its reach "
        "→ {verdict} (window {a0:.0%} at N={n0}, where it reaches every position; {a1:.0%} at "
        "N={n1}, chance {chance:.1%}; rule: ≥ {learned:.0%} at the shortest N, ≤ {lost:.0%} at "
        "the longest)",
        "claim_selected": "  claim: blocks chosen by the content keep it, at the same budget → "
        "{verdict} (selected {s1:.0%} at N={n1} where the window has {w1:.0%} and full attention "
        "{f1:.0%}, chance {chance:.1%}; worst selected {smin:.0%}; rule: ≥ {kept:.0%} at every N)",
        "why": "  why: the window reads the last {keys} positions whatever they hold; the chooser "
        "scores every block by its mean key against the question and reads the {topk} best, "
        "wherever they are. Full attention reads every position: its keys per query, and its "
        "time, grow with N",
        "picture": "3. The figure's right panel: the blocks each query block of the trained "
        "selected model chose on one sequence of N={n}; the question (block {q}) chose blocks "
        "{chosen}, the answer is in block {a} ({right})",
        "right": "answered right",
        "wrong": "answered wrong",
    },
    "zh": {
        "title": "按内容选块的稀疏注意力（{seconds:.0f} 秒）",
        "task": "任务：N 个填充位置中随机放着 {pairs} 对键值（{keys} 个键，{values} 个值），"
        "最后 {block} 个位置是提问（其中一个键）；答案是与它配对的值（随机猜对 {chance:.1%}）",
        "models": "每种注意力各训练一个单层注意力模型（d_model {d}），{steps} 步，"
        "初始权重和批次都相同（N = {train}），{seeds} 个随机种子；每个 N 测试 {samples} 条序列",
        "budget": "预算：每个查询最多读 {keys} 个键。滑动窗口：读到它为止的 {keys} 个位置；"
        "按内容选块：它自己所在的块（每块 {block} 个位置），加上平均键与本块平均查询最匹配的 "
        "{topk} 个块（qkv.sparse.select_blocks）；完整注意力：读到它为止的每个位置",
        "acc": "1. 准确率（在窗口内：答案落在窗口的 {keys} 个位置之内的比例）",
        "cost": "2. 一个训练步（前向+反向，{batch} 条序列，1 个线程）：时间的中位数、"
        "内存峰值（常驻内存的增量）、每个查询平均读的键数",
        "claim_window": "  论断：同样预算的滑动窗口，一旦答案超出它的范围就找不到答案 → {verdict}"
        "（窗口在 N={n0} 时为 {a0:.0%}，此时它能看到每个位置；在 N={n1} 时为 {a1:.0%}，"
        "随机猜对 {chance:.1%}；规则：最短的 N 处 ≥ {learned:.0%}，最长的 N 处 ≤ {lost:.0%}）",
        "claim_selected": "  论断：同样的预算下，按内容选出的块能留住答案 → {verdict}"
        "（N={n1} 时按内容选块为 {s1:.0%}，滑动窗口为 {w1:.0%}，完整注意力为 {f1:.0%}，"
        "随机猜对 {chance:.1%}；按内容选块最低 {smin:.0%}；规则：每个 N 处都 ≥ {kept:.0%}）",
        "why": "  原因：滑动窗口不管内容，只读最后 {keys} 个位置；"
        "选块器用每个块的平均键与提问打分，读得分最高的 {topk} 个块，不管它们在哪里。"
        "完整注意力读每个位置：每个查询读的键数和时间都随 N 增长",
        "picture": "3. 图的右侧：训练好的按内容选块模型在一条 N={n} 的序列上，"
        "每个查询块选了哪些键块；提问（块 {q}）选了块 {chosen}，答案在块 {a}（{right}）",
        "right": "答对了",
        "wrong": "答错了",
    },
}

# The tables' column headers, by language.
COLUMNS = {
    "en": {
        "acc": ("N", "in reach", "full", "window", "selected"),
        "cost": ("N", "variant", "ms", "peak MiB", "keys/query"),
    },
    "zh": {
        "acc": ("N", "在窗口内", "完整注意力", "滑动窗口", "按内容选块"),
        "cost": ("N", "注意力", "毫秒", "峰值 MiB", "键数/查询"),
    },
}
# The variants' names in the cost table, by language.
NAMES = {
    "en": {"full": "full", "window": "window", "selected": "selected"},
    "zh": {"full": "完整注意力", "window": "滑动窗口", "selected": "按内容选块"},
}


def claims(doc: dict) -> dict[str, dict]:
    """Each claim's verdict in this run (`common.decided` / `common.inconclusive`), by the
    rules the summary states.

    window: holds if the window model answers ≥ 90% at the shortest N (where it reaches every
    position) and ≤ 30% at the longest; inconclusive if it is below 90% at the shortest N (it
    did not learn the lookup, so its fall says nothing). selected: holds if the selected model
    answers ≥ 90% at every N. Both are inconclusive when full attention, which reads
    everything, did not reach 90% at the shortest N: the task was not learned."""
    rows, chance = doc["accuracy"], doc["task"]["chance"]
    first, last = rows[0], rows[-1]
    if first["full"] < LEARNED:
        why = inconclusive(
            f"full attention did not learn the task: {first['full']:.0%} at N={first['n']} "
            f"against {chance:.1%} chance",
            f"完整注意力没有学会这个任务：N={first['n']} 时为 {first['full']:.0%}，"
            f"随机猜对为 {chance:.1%}",
        )
        return {"window": why, "selected": why}
    if first["window"] < LEARNED:
        window = inconclusive(
            f"the window model did not learn the lookup even at N={first['n']}, where it "
            f"reaches every position: {first['window']:.0%}",
            f"滑动窗口模型在 N={first['n']} 时（此时它能看到每个位置）也没有学会查找："
            f"{first['window']:.0%}",
        )
    else:
        window = decided(last["window"] <= LOST)
    return {"window": window, "selected": decided(min(r["selected"] for r in rows) >= KEPT)}


def summary(doc: dict, lang: str = "en") -> str:
    """The measurements and the claims, in English (`en`) or Chinese (`zh`)."""
    t = pick(TEXT, lang)
    held = claims(doc)
    p, task, bud = doc["preset"], doc["task"], doc["budget"]
    chance = task["chance"]
    lines = [
        t("title", seconds=doc["seconds"]),
        t(
            "task",
            pairs=task["pairs"],
            keys=task["keys"],
            values=task["values"],
            block=bud["block"],
            chance=chance,
        ),
        t(
            "models",
            d=p["d_model"],
            steps=p["steps"],
            seeds=p["seeds"],
            samples=p["samples"],
            train="/".join(str(n) for n in p["train_ns"]),
        ),
        t("budget", keys=bud["keys"], block=bud["block"], topk=bud["topk"]),
        t("acc", keys=bud["keys"]),
    ]
    widths = (6, 10, 12, 12, 12)
    lines.append(row(COLUMNS[lang]["acc"], widths))
    for r in doc["accuracy"]:
        cells = (r["n"], f"{r['in_reach']:.1%}", *(f"{r[v]:.1%}" for v in VARIANTS))
        lines.append(row(cells, widths))
    lines.append(t("cost", batch=p["time_batch"]))
    widths = (6, 12, 10, 10, 11)
    lines.append(row(COLUMNS[lang]["cost"], widths))
    names = NAMES[lang]
    for c in doc["cost"]:
        mib = "—" if c["peak_mib"] is None else f"{c['peak_mib']:.1f}"
        n = c["n"] if c["variant"] == VARIANTS[0] else ""
        cells = (n, names[c["variant"]], f"{c['ms']:.1f}", mib, f"{c['keys_per_query']:.1f}")
        lines.append(row(cells, widths))
    rows = doc["accuracy"]
    first, last = rows[0], rows[-1]
    lines.append(
        t(
            "claim_window",
            verdict=verdict(held["window"], lang),
            a0=first["window"],
            n0=first["n"],
            a1=last["window"],
            n1=last["n"],
            chance=chance,
            learned=LEARNED,
            lost=LOST,
        )
    )
    lines.append(
        t(
            "claim_selected",
            verdict=verdict(held["selected"], lang),
            s1=last["selected"],
            n1=last["n"],
            w1=last["window"],
            f1=last["full"],
            chance=chance,
            kept=KEPT,
            smin=min(r["selected"] for r in rows),
        )
    )
    if held["selected"]["verdict"] == "holds":
        lines.append(t("why", keys=bud["keys"], topk=bud["topk"]))
    pic = doc["picture"]
    lines.append(
        t(
            "picture",
            n=pic["n"],
            q=pic["question_block"],
            a=pic["answer_block"],
            chosen=("、" if lang == "zh" else ", ").join(str(j) for j in pic["chosen"][-1]),
            right=t("right" if pic["answered_right"] else "wrong"),
        )
    )
    return "\n".join(lines)


def figure(doc: dict, path: str | Path | None = None, *, lang: str = "en"):
    """The lab's PNG (`qkv.labs.figures.sparse`), its labels in `lang`; returns the
    matplotlib Figure."""
    from .figures import sparse as draw

    return draw(doc, path, lang=lang)
