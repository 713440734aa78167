"""`qkv lab scale`: why the scores are divided by √d_k, measured.

1. Variance. For q, k with independent unit-variance entries, q·k is a sum of d_k products of
   variance 1, so Var(q·k) = d_k (the closed form); Var(q·k/√d_k) = 1. Measured on samples.
2. Saturation. Softmax over 64 keys of such scores, through `qkv.attention(...,
   return_weights=True)` with `scale=1` and with the default 1/√d_k: the largest weight and
   the entropy of each row, against d_k.
3. Gradient. The softmax's Jacobian `J = diag(p) − p pᵀ` is the factor every gradient through
   the weights is multiplied by; its Frobenius norm `√(Σp² − 2Σp³ + (Σp²)²)` goes to 0 as one
   weight goes to 1.
4. Training. The same attention model (`recall.AttentionReader`, same initial weights, same
   batches of the recall task) trained at a large d_k with scale 1/√d_k and with scale 1.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..functional import attention
from ..inspect.text import row
from . import recall
from .common import Progress, as_verdict, machine, pick, threads, verdict


@dataclass(frozen=True)
class Preset:
    """How much `qkv lab scale` measures."""

    d_ks: tuple[int, ...]  # head widths measured
    samples: int  # variance: (q, k) pairs per d_k
    keys: int  # saturation: keys each softmax row spreads over
    rows: int  # saturation: softmax rows per d_k
    train_d_k: int  # training: the (large) head width
    steps: int  # training: steps of each run
    every: int  # training: steps averaged per logged loss


QUICK = Preset(
    d_ks=(4, 8, 16, 32, 64, 128, 256, 512, 1024),
    samples=20_000,
    keys=64,
    rows=2048,
    train_d_k=128,
    steps=600,
    every=10,
)
FULL = Preset(
    d_ks=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
    samples=200_000,
    keys=64,
    rows=16_384,
    train_d_k=512,
    steps=2000,
    every=20,
)
TASK = recall.Task(keys=4, values=8)
TRAIN_LENGTH = 64  # recall sequences of up to 64 positions
LR = 3e-3
CHUNK = 1 << 22  # sampled numbers per chunk, so that memory stays small at any d_k


def variance(d_k: int, samples: int, generator: torch.Generator) -> tuple[float, float]:
    """Sample variance of q·k and of q·k/√d_k over `samples` pairs of N(0, I) vectors."""
    dots = []
    per_chunk = max(1, CHUNK // d_k)
    for start in range(0, samples, per_chunk):
        m = min(per_chunk, samples - start)
        q = torch.randn(m, d_k, generator=generator, dtype=torch.float64)
        k = torch.randn(m, d_k, generator=generator, dtype=torch.float64)
        dots.append((q * k).sum(-1))
    s = torch.cat(dots)
    return s.var().item(), (s / math.sqrt(d_k)).var().item()


def jacobian_norm(p: torch.Tensor) -> torch.Tensor:
    """Frobenius norm of the softmax Jacobian `diag(p) − p pᵀ` of each row of `p (…, n)`:
    `√(Σp² − 2Σp³ + (Σp²)²)`, without building the n×n matrices."""
    s2, s3 = (p * p).sum(-1), (p**3).sum(-1)
    return (s2 - 2 * s3 + s2 * s2).clamp_min(0).sqrt()


def saturation(d_k: int, keys: int, rows: int, generator: torch.Generator) -> dict[str, float]:
    """Largest weight, entropy (nats) and Jacobian norm of softmax rows of unit-variance q·k,
    unscaled and scaled, each averaged over `rows` rows."""
    out: dict[str, float] = {}
    batch = max(1, min(rows, CHUNK // (d_k + keys)))
    sums = {k: 0.0 for k in ("max", "ent", "jac")}
    totals = {"unscaled": dict(sums), "scaled": dict(sums)}
    for start in range(0, rows, batch):
        m = min(batch, rows - start)
        q = torch.randn(m, 1, d_k, generator=generator)  # (m, 1, d_k): one query per row
        k = torch.randn(m, keys, d_k, generator=generator)  # (m, keys, d_k)
        v = torch.zeros(m, keys, 1)
        for name, scale in (("unscaled", 1.0), ("scaled", None)):
            _, w = attention(q, k, v, scale=scale, return_weights=True)  # w (m, 1, keys)
            p = w[:, 0].double()
            ent = -(p * p.clamp_min(1e-300).log()).sum(-1)
            totals[name]["max"] += p.amax(-1).sum().item()
            totals[name]["ent"] += ent.sum().item()
            totals[name]["jac"] += jacobian_norm(p).sum().item()
    for name in ("unscaled", "scaled"):
        out[f"max_weight_{name}"] = totals[name]["max"] / rows
        out[f"entropy_{name}"] = totals[name]["ent"] / rows
        out[f"jacobian_{name}"] = totals[name]["jac"] / rows
    return out


def training(preset: Preset, seed: int, bar: Progress) -> dict:
    """Loss curves of the same model trained with scale 1/√d_k and with scale 1."""
    curves = {}
    for name, scale in (("scaled", None), ("unscaled", 1.0)):
        torch.manual_seed(seed)  # the same initial weights for both runs
        model = recall.AttentionReader(
            TASK.width, 64, TASK.values, d_k=preset.train_d_k, scale=scale
        )
        losses = recall.train(
            model,
            TASK,
            preset.steps,
            max_length=TRAIN_LENGTH,
            lr=LR,
            generator=torch.Generator().manual_seed(seed),  # the same batches for both runs
            on_step=lambda *_: bar.step(),
        )
        e = preset.every
        curves[name] = [
            sum(losses[i : i + e]) / len(losses[i : i + e]) for i in range(0, len(losses), e)
        ]
    return {
        "d_k": preset.train_d_k,
        "every": preset.every,
        "steps": preset.steps,
        "lr": LR,
        "initial_loss": math.log(TASK.values),
        **curves,
    }


def run(preset: Preset = QUICK, *, seed: int = 0, progress: bool = True) -> dict:
    """All four measurements; returns the JSON document (see the module docstring)."""
    started, before = time.perf_counter(), machine()
    bar = Progress(2 * len(preset.d_ks) + 2 * preset.steps, "qkv lab scale", progress)
    g = torch.Generator().manual_seed(seed)
    try:
        var_rows, sat_rows, jac_rows = [], [], []
        for d_k in preset.d_ks:
            unscaled, scaled = variance(d_k, preset.samples, g)
            var_rows.append({"d_k": d_k, "unscaled": unscaled, "scaled": scaled})
            bar.step()
        for d_k in preset.d_ks:
            m = saturation(d_k, preset.keys, preset.rows, g)
            sat_rows.append(
                {
                    "d_k": d_k,
                    "max_weight_unscaled": m["max_weight_unscaled"],
                    "max_weight_scaled": m["max_weight_scaled"],
                    "entropy_unscaled": m["entropy_unscaled"],
                    "entropy_scaled": m["entropy_scaled"],
                }
            )
            jac_rows.append(
                {
                    "d_k": d_k,
                    "norm_unscaled": m["jacobian_unscaled"],
                    "norm_scaled": m["jacobian_scaled"],
                }
            )
            bar.step()
        with threads(1):
            train = training(preset, seed, bar)
    finally:
        bar.close()
    doc = {
        "lab": "scale",
        "machine": {**before, "load_1min_after": machine()["load_1min"]},
        "preset": asdict(preset),
        "seed": seed,
        "variance": var_rows,
        "saturation": sat_rows,
        "jacobian": jac_rows,
        "training": train,
        "uniform_entropy": math.log(preset.keys),
        "seconds": time.perf_counter() - started,
    }
    doc["verdicts"] = {k: as_verdict(v) for k, v in claims(doc).items()}  # JSON: holds or not
    return doc


# --------------------------------------------------------------------------- the answer

TEXT = {
    "en": {
        "title": "Why √d_k ({seconds:.0f} s)",
        "var": "1. Var(q·k) for unit-variance q, k ({samples:,} pairs per d_k; closed form: d_k "
        "unscaled, 1 scaled)",
        "var_claim": "  claim: the variance grows with d_k, the scale brings it back to 1 → "
        "{verdict} (every measurement within {tol:.0%} of the closed form)",
        "sat": "2. Softmax over {keys} keys: largest weight and entropy (uniform: {uni:.2f} nats); "
        "3. norm of its Jacobian",
        "sat_claim": "  claim: unscaled, the softmax saturates → {verdict} (largest weight at "
        "d_k={d0}→{d}: {a0:.3f}→{a1:.3f} unscaled, {b0:.3f}→{b1:.3f} scaled; rule: unscaled "
        "≥ 0.9 at the largest d_k, scaled within 0.05 of where it started)",
        "grad_claim": "  claim: unscaled, its gradient vanishes → {verdict} (‖J‖ from its peak "
        "{peak:.4f} to {j1:.4f} at d_k={d} unscaled; {s0:.4f}→{s1:.4f} scaled; rule: unscaled "
        "falls ≥ 2× from its peak, scaled within 10%)",
        "train": "4. Training the same model at d_k={d_k} ({steps} steps, the same batches and "
        "initial weights; loss at the start ln {values} = {init:.2f})",
        "train_row": "  loss after {step:>5} steps: 1/√d_k {a:.3f}   scale 1 {b:.3f}",
        "train_claim": "  claim: without the scale, training stalls → {verdict} (final loss "
        "{a:.3f} with 1/√d_k, {b:.3f} with scale 1; rule: ≥ 1.5× higher with scale 1)",
    },
    "zh": {
        "title": "为什么除以 √d_k（{seconds:.0f} 秒）",
        "var": "1. q、k 的分量方差为 1 时的 Var(q·k)（每个 d_k 取 {samples:,} 对；理论值："
        "不缩放时为 d_k，缩放后为 1）",
        "var_claim": "  论断：方差随 d_k 增长，缩放后回到 1 → {verdict}"
        "（每个测量值与理论值相差都不超过 {tol:.0%}）",
        "sat": "2. 对 {keys} 个键做 softmax：最大权重与熵（均匀分布的熵为 {uni:.2f} nats）；"
        "3. softmax 的雅可比矩阵的范数",
        "sat_claim": "  论断：不缩放时 softmax 会饱和 → {verdict}（d_k 从 {d0} 到 {d}，最大权重："
        "不缩放时 {a0:.3f}→{a1:.3f}，缩放时 {b0:.3f}→{b1:.3f}；规则：不缩放时在最大的 d_k 处 "
        "≥ 0.9，缩放时与起点相差不超过 0.05）",
        "grad_claim": "  论断：不缩放时梯度消失 → {verdict}（不缩放时 ‖J‖ 从峰值 {peak:.4f} "
        "降到 d_k={d} 处的 {j1:.4f}；缩放时 {s0:.4f}→{s1:.4f}；规则：不缩放时从峰值至少降到一半，"
        "缩放时变化不超过 10%）",
        "train": "4. 在 d_k={d_k} 时训练同一个模型（{steps} 步，相同的批次和初始权重；"
        "起始损失 ln {values} = {init:.2f}）",
        "train_row": "  训练 {step:>5} 步后的损失：1/√d_k {a:.3f}   不缩放 {b:.3f}",
        "train_claim": "  论断：不缩放时训练停滞 → {verdict}（最终损失：1/√d_k 为 {a:.3f}，"
        "不缩放为 {b:.3f}；规则：不缩放时的损失至少是缩放时的 1.5 倍）",
    },
}

# The tables' column headers, by language.
COLUMNS = {
    "en": {
        "var": ("d_k", "q·k", "q·k/√d_k"),
        "sat": (
            "d_k",
            "max w, scale 1",
            "max w, 1/√d_k",
            "entropy 1",
            "entropy 1/√d_k",
            "‖J‖ 1",
            "‖J‖ 1/√d_k",
        ),
    },
    "zh": {
        "var": ("d_k", "q·k", "q·k/√d_k"),
        "sat": (
            "d_k",
            "最大权重 不缩放",
            "最大权重 1/√d_k",
            "熵 不缩放",
            "熵 1/√d_k",
            "‖J‖ 不缩放",
            "‖J‖ 1/√d_k",
        ),
    },
}
VARIANCE_TOLERANCE = 0.10


def final_loss(curve: list[float]) -> float:
    """The mean of the last tenth of a loss curve (at least one point)."""
    tail = curve[-max(1, len(curve) // 10) :]
    return sum(tail) / len(tail)


def claims(doc: dict) -> dict[str, bool]:
    """Whether each claim held in this run, by the rules the summary states.

    variance: unscaled within 10% of d_k and scaled within 10% of 1, at every d_k.
    saturation: the unscaled largest weight reaches ≥ 0.9 at the largest d_k while the scaled
    one stays within 0.05 of its value at the smallest d_k.
    gradient: the unscaled Jacobian norm falls at least 2× from its peak to the largest d_k
    while the scaled one stays within 10% of its value at the smallest d_k.
    training: the final loss with scale 1 is at least 1.5× the final loss with 1/√d_k."""
    tol = VARIANCE_TOLERANCE
    var_ok = all(
        abs(r["unscaled"] / r["d_k"] - 1) <= tol and abs(r["scaled"] - 1) <= tol
        for r in doc["variance"]
    )
    sat, jac = doc["saturation"], doc["jacobian"]
    sat_ok = (
        sat[-1]["max_weight_unscaled"] >= 0.9
        and abs(sat[-1]["max_weight_scaled"] - sat[0]["max_weight_scaled"]) <= 0.05
    )
    peak = max(r["norm_unscaled"] for r in jac)
    grad_ok = (
        jac[-1]["norm_unscaled"] <= 0.5 * peak
        and abs(jac[-1]["norm_scaled"] / jac[0]["norm_scaled"] - 1) <= 0.1
    )
    tr = doc["training"]
    train_ok = final_loss(tr["unscaled"]) >= 1.5 * final_loss(tr["scaled"])
    return {"variance": var_ok, "saturation": sat_ok, "gradient": grad_ok, "training": train_ok}


def summary(doc: dict, lang: str = "en") -> str:
    """The measurements and the chapter's claims, in English (`en`) or Chinese (`zh`)."""
    t = pick(TEXT, lang)
    held = claims(doc)
    p = doc["preset"]
    lines = [t("title", seconds=doc["seconds"]), t("var", samples=p["samples"])]
    lines.append(row(COLUMNS[lang]["var"], (6, 12, 12)))
    for r in doc["variance"]:
        lines.append(f"  {r['d_k']:>6} {r['unscaled']:>12.3f} {r['scaled']:>12.4f}")
    lines.append(t("var_claim", verdict=verdict(held["variance"], lang), tol=VARIANCE_TOLERANCE))
    lines.append(t("sat", keys=p["keys"], uni=doc["uniform_entropy"]))
    cols = COLUMNS[lang]["sat"]
    lines.append(row(cols, (15,) * len(cols)))
    for s, j in zip(doc["saturation"], doc["jacobian"], strict=True):
        cells = (
            s["d_k"],
            f"{s['max_weight_unscaled']:.3f}",
            f"{s['max_weight_scaled']:.3f}",
            f"{s['entropy_unscaled']:.3f}",
            f"{s['entropy_scaled']:.3f}",
            f"{j['norm_unscaled']:.4f}",
            f"{j['norm_scaled']:.4f}",
        )
        lines.append(row(cells, (15,) * len(cells)))
    sat, jac = doc["saturation"], doc["jacobian"]
    lines.append(
        t(
            "sat_claim",
            verdict=verdict(held["saturation"], lang),
            d0=sat[0]["d_k"],
            d=sat[-1]["d_k"],
            a0=sat[0]["max_weight_unscaled"],
            a1=sat[-1]["max_weight_unscaled"],
            b0=sat[0]["max_weight_scaled"],
            b1=sat[-1]["max_weight_scaled"],
        )
    )
    lines.append(
        t(
            "grad_claim",
            verdict=verdict(held["gradient"], lang),
            peak=max(r["norm_unscaled"] for r in jac),
            j1=jac[-1]["norm_unscaled"],
            d=jac[-1]["d_k"],
            s0=jac[0]["norm_scaled"],
            s1=jac[-1]["norm_scaled"],
        )
    )
    tr = doc["training"]
    lines.append(
        t("train", d_k=tr["d_k"], steps=tr["steps"], values=TASK.values, init=tr["initial_loss"])
    )
    n = len(tr["scaled"])
    for i in sorted({0, n // 4, n // 2, 3 * n // 4, n - 1}):
        lines.append(
            t("train_row", step=(i + 1) * tr["every"], a=tr["scaled"][i], b=tr["unscaled"][i])
        )
    lines.append(
        t(
            "train_claim",
            verdict=verdict(held["training"], lang),
            a=final_loss(tr["scaled"]),
            b=final_loss(tr["unscaled"]),
        )
    )
    return "\n".join(lines)


def figure(doc: dict, path: str | Path | None = None, *, lang: str = "en"):
    """The lab's PNG (`qkv.labs.figures.scale`), its labels in `lang`; returns the matplotlib
    Figure."""
    from .figures import scale as draw

    return draw(doc, path, lang=lang)
