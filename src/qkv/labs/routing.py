"""`qkv lab routing`: attention as soft routing, against a CNN's window and an RNN's relay.

1. Gradient reach. For a 1-D CNN (kernel 3, tanh), an LSTM and self-attention
   (`qkv.nn.MultiHeadAttention`, tanh) of the same width, stacked 1, 2 and 4 deep, freshly
   initialised: the norm of the gradient of the last position's output with respect to each
   input position, against the distance between them, averaged over random weights and inputs.
   It says how much each input can change the output: a CNN sees exactly `layers` positions
   back, an LSTM's influence is relayed station by station, attention reaches every position
   in one layer. Computed in float64, so that a gradient that fades is measured, not rounded
   to zero.
2. Routing. The attention model of the recall task (`recall.AttentionReader`), trained, then
   asked on fresh sequences: where its query reads from. Each sequence has its answer at
   another position; a content-driven router follows it, a fixed window could not.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..inspect.text import row
from ..nn import MultiHeadAttention
from . import recall
from .common import Progress, as_verdict, machine, pick, threads, verdict

MODELS = ("cnn", "lstm", "attention")


@dataclass(frozen=True)
class Preset:
    """How much `qkv lab routing` measures."""

    length: int  # gradient reach: positions
    width: int  # gradient reach: width of every model
    layers: tuple[int, ...]  # gradient reach: depths
    trials: int  # gradient reach: random initialisations and inputs averaged
    route_length: int  # routing: positions of the recall sequences
    steps: int  # routing: training steps
    examples: int  # routing: test sequences drawn (answers spread evenly over the distances)
    samples: int  # routing: sequences for the accuracy and the mean weight on the answer


QUICK = Preset(
    length=128,
    width=32,
    layers=(1, 2, 4),
    trials=8,
    route_length=48,
    steps=600,
    examples=16,
    samples=512,
)
FULL = Preset(
    length=512,
    width=64,
    layers=(1, 2, 4, 8),
    trials=32,
    route_length=128,
    steps=2000,
    examples=32,
    samples=4096,
)
TASK = recall.Task(keys=4, values=8)
REACH = 0.01  # an input is "reached" while its gradient is at least 1% of the largest one


class _Conv(nn.Module):
    """`layers` × (Conv1d kernel 3, same padding, tanh) on `(B, N, width)`."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(width, width, 3, padding=1) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(1, 2)  # (B, width, N)
        for conv in self.convs:
            h = torch.tanh(conv(h))
        return h.transpose(1, 2)


class _Attention(nn.Module):
    """`layers` × (multi-head self-attention over all positions, tanh) on `(B, N, width)`."""

    def __init__(self, width: int, layers: int, heads: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(MultiHeadAttention(width, heads) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _LSTM(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.rnn = nn.LSTM(width, width, num_layers=layers, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def make_model(kind: str, width: int, layers: int) -> nn.Module:
    """A freshly initialised `cnn`, `lstm` or `attention` stack mapping `(B, N, width)` to
    `(B, N, width)`."""
    if kind == "cnn":
        return _Conv(width, layers)
    if kind == "lstm":
        return _LSTM(width, layers)
    if kind == "attention":
        return _Attention(width, layers)
    raise ValueError(f"model must be one of {', '.join(MODELS)}, got {kind!r}")


def gradient_reach(model: nn.Module, x: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """`‖∂(y_last · direction)/∂x_j‖` for every input position j: `x (N, width)` → `(N,)`."""
    x = x.detach().clone().requires_grad_(True)
    y = model(x.unsqueeze(0))[0, -1]  # (width,) the last position's output
    (grad,) = torch.autograd.grad((y * direction).sum(), x)
    return grad.norm(dim=-1)


def reach_rows(preset: Preset, seed: int, bar: Progress) -> list[dict]:
    """Mean gradient norm against distance for every model and depth."""
    rows = []
    for kind in MODELS:
        for layers in preset.layers:
            total = torch.zeros(preset.length, dtype=torch.float64)
            for trial in range(preset.trials):
                torch.manual_seed(seed * 1000 + trial)
                # float64: an LSTM's gradient fades below float32's range within ~100 steps
                model = make_model(kind, preset.width, layers).double()
                x = torch.randn(preset.length, preset.width, dtype=torch.float64)
                direction = torch.randn(preset.width, dtype=torch.float64)
                direction /= direction.norm()
                total += gradient_reach(model, x, direction).double()
            mean = (total / preset.trials).flip(0)  # index = distance from the last position
            rows += [
                {"model": kind, "layers": layers, "distance": d, "grad_norm": g}
                for d, g in enumerate(mean.tolist())
            ]
            bar.step()
    return rows


def routes(preset: Preset, seed: int, bar: Progress) -> dict:
    """Train the recall attention model, then record where its query reads from."""
    torch.manual_seed(seed)
    model = recall.AttentionReader(TASK.width, 64, TASK.values)
    recall.train(
        model,
        TASK,
        preset.steps,
        max_length=preset.route_length,
        generator=torch.Generator().manual_seed(seed),
        on_step=lambda *_: bar.step(),
    )
    test = torch.Generator().manual_seed(10**6 + seed)
    n = preset.route_length
    with torch.no_grad():
        d = torch.randint(1, n, (preset.samples,), generator=test)
        b = recall.make_batch(TASK, preset.samples, n, d, test)
        logits, w = model(b.x, return_weights=True)  # w (samples, n)
        acc = (logits.argmax(-1) == b.answer).float().mean().item()
        on_source = w[torch.arange(preset.samples), b.source].mean().item()
        d = torch.linspace(1, n - 1, preset.examples).round().long()  # evenly spread answers
        ex = recall.make_batch(TASK, preset.examples, n, d, test)
        _, w = model(ex.x, return_weights=True)
    examples = [
        {"distance": int(dist), "source": int(src), "weights": row}
        for dist, src, row in zip(d.tolist(), ex.source.tolist(), w.tolist(), strict=True)
    ]
    return {
        "length": n,
        "steps": preset.steps,
        "accuracy": acc,
        "weight_on_source": on_source,
        "samples": preset.samples,
        "examples": examples,
    }


def run(preset: Preset = QUICK, *, seed: int = 0, progress: bool = True) -> dict:
    """Both measurements; returns the JSON document (see the module docstring)."""
    started, before = time.perf_counter(), machine()
    bar = Progress(len(MODELS) * len(preset.layers) + preset.steps, "qkv lab routing", progress)
    try:
        with threads(1):
            reach = reach_rows(preset, seed, bar)
            routing = routes(preset, seed, bar)
    finally:
        bar.close()
    doc = {
        "lab": "routing",
        "machine": {**before, "load_1min_after": machine()["load_1min"]},
        "preset": asdict(preset),
        "seed": seed,
        "gradient_reach": reach,
        "reach": reach_summary(reach),
        "routing": routing,
        "seconds": time.perf_counter() - started,
    }
    doc["verdicts"] = {k: as_verdict(v) for k, v in claims(doc).items()}  # JSON: holds or not
    return doc


def reach_summary(rows: list[dict]) -> list[dict]:
    """Per model and depth: the farthest distance whose gradient is ≥ 1% of the largest, and
    the gradient at the farthest distance relative to the largest."""
    out = []
    for kind in dict.fromkeys(r["model"] for r in rows):
        for layers in dict.fromkeys(r["layers"] for r in rows if r["model"] == kind):
            curve = [r["grad_norm"] for r in rows if r["model"] == kind and r["layers"] == layers]
            top = max(curve)
            reached = [d for d, g in enumerate(curve) if g >= REACH * top]
            out.append(
                {
                    "model": kind,
                    "layers": layers,
                    "reach": max(reached),
                    "farthest_relative": curve[-1] / top if top > 0 else 0.0,
                }
            )
    return out


# --------------------------------------------------------------------------- the answer

TEXT = {
    "en": {
        "title": "Soft routing ({seconds:.0f} s)",
        "reach": "1. Gradient reach over {n} positions, width {w}, fresh weights ({trials} "
        "trials): the farthest distance whose gradient is ≥ 1% of the largest",
        "claim_cnn": "  claim: a CNN sees a fixed local window → {verdict} (reach = number of "
        "layers: {got})",
        "claim_lstm": "  claim: an RNN relays station by station, fading → {verdict} (at "
        "d={far} its gradient is {rel} of the largest; rule: below 1%)",
        "claim_attn": "  claim: attention reaches every position in one layer → {verdict} (at "
        "d={far} its gradient is {rel} of the largest; rule: at least 10%)",
        "route": "2. Routing of the trained recall model ({steps} steps, {n} positions): "
        "accuracy {acc:.1%}, mean weight on the answer's position {w:.1%} ({samples} sequences)",
        "route_ex": "  answer {d:>2} back: weight {w:.2f} there, largest weight {m:.2f} at "
        "{where} back",
        "claim_route": "  claim: the routing is content-driven (it follows the answer wherever "
        "it is) → {verdict} (mean weight on the answer ≥ 50%)",
    },
    "zh": {
        "title": "软路由（{seconds:.0f} 秒）",
        "reach": "1. 梯度能传多远：{n} 个位置，宽度 {w}，刚初始化的权重（{trials} 次试验）；"
        "“可达”是梯度不小于最大值 1% 的最远距离",
        "claim_cnn": "  论断：CNN 只看固定的局部窗口 → {verdict}（可达距离 = 层数：{got}）",
        "claim_lstm": "  论断：RNN 逐站接力，信号逐渐衰减 → {verdict}（d={far} 处的梯度是最大值的 "
        "{rel}；规则：低于 1%）",
        "claim_attn": "  论断：注意力一层就能到达每个位置 → {verdict}（d={far} 处的梯度是最大值的 "
        "{rel}；规则：至少 10%）",
        "route": "2. 训练好的回忆模型如何路由（训练 {steps} 步，序列长 {n}）：准确率 {acc:.1%}，"
        "落在答案位置上的平均权重 {w:.1%}（{samples} 条序列）",
        "route_ex": "  答案在往前 {d:>2} 个位置处：那里的权重 {w:.2f}；最大权重 {m:.2f} 在往前 "
        "{where} 个位置处",
        "claim_route": "  论断：路由由内容决定（答案在哪里就读哪里） → {verdict}"
        "（规则：答案位置上的平均权重 ≥ 50%）",
    },
}

# The reach table's column headers, and the models' names where they are not English.
COLUMNS = {
    "en": ("model", "layers", "reach", "grad at d={far} / max"),
    "zh": ("模型", "层数", "可达", "d={far} 处的梯度/最大值"),
}
MODEL_NAMES = {"zh": {"cnn": "CNN", "lstm": "LSTM", "attention": "注意力"}}


def claims(doc: dict) -> dict[str, bool]:
    """Whether each claim held in this run, by the rules the summary states.

    cnn: its reach equals its number of layers at every depth. lstm: at the farthest distance
    its gradient is below 1% of its largest, at every depth. attention: at the farthest
    distance its gradient is at least 10% of its largest, at every depth. routing: the trained
    model puts on average at least half of its weight on the answer's position."""
    reach = doc["reach"]

    def every(kind, test):
        return all(test(r) for r in reach if r["model"] == kind)

    return {
        "cnn": every("cnn", lambda r: r["reach"] == r["layers"]),
        "lstm": every("lstm", lambda r: r["farthest_relative"] < REACH),
        "attention": every("attention", lambda r: r["farthest_relative"] >= 0.1),
        "routing": doc["routing"]["weight_on_source"] >= 0.5,
    }


def summary(doc: dict, lang: str = "en") -> str:
    """The measurements and the chapter's claims, in English (`en`) or Chinese (`zh`)."""
    t = pick(TEXT, lang)
    held = claims(doc)
    p = doc["preset"]
    far = p["length"] - 1
    lines = [t("title", seconds=doc["seconds"])]
    lines.append(t("reach", n=p["length"], w=p["width"], trials=p["trials"]))
    cols = COLUMNS[lang]
    lines.append(row(cols[:3], (10, 6, 6)) + f"  {cols[3].format(far=far)}")
    names = MODEL_NAMES.get(lang, {})
    for r in doc["reach"]:
        cells = (names.get(r["model"], r["model"]), r["layers"], r["reach"])
        lines.append(row(cells, (10, 6, 6)) + f"  {r['farthest_relative']:.2e}")

    sep = "、" if lang == "zh" else ", "

    def rel(kind: str) -> str:
        return sep.join(f"{r['farthest_relative']:.1e}" for r in doc["reach"] if r["model"] == kind)

    got = sep.join(f"{r['layers']}→{r['reach']}" for r in doc["reach"] if r["model"] == "cnn")
    lines.append(t("claim_cnn", verdict=verdict(held["cnn"], lang), got=got))
    lines.append(t("claim_lstm", verdict=verdict(held["lstm"], lang), far=far, rel=rel("lstm")))
    lines.append(
        t("claim_attn", verdict=verdict(held["attention"], lang), far=far, rel=rel("attention"))
    )
    r = doc["routing"]
    lines.append(
        t(
            "route",
            steps=r["steps"],
            n=r["length"],
            acc=r["accuracy"],
            w=r["weight_on_source"],
            samples=r["samples"],
        )
    )
    n = r["length"]
    for ex in r["examples"][:: max(1, len(r["examples"]) // 4)]:
        w = ex["weights"]
        top = max(range(n), key=w.__getitem__)
        lines.append(
            t("route_ex", d=ex["distance"], w=w[ex["source"]], m=w[top], where=n - 1 - top)
        )
    lines.append(t("claim_route", verdict=verdict(held["routing"], lang)))
    return "\n".join(lines)


def figure(doc: dict, path: str | Path | None = None, *, lang: str = "en"):
    """The lab's PNG (`qkv.labs.figures.routing`), its labels in `lang`; returns the
    matplotlib Figure."""
    from .figures import routing as draw

    return draw(doc, path, lang=lang)
