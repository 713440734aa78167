"""The textbook walk-through on real numbers: X → Q, K, V → S → S/√d_k → A → Out."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

import torch

from .. import reference
from .seeds import SEED_MAX
from .text import ljust

# One line of meaning per step, in each language the walk-through speaks.
TEXT = {
    "en": {
        "title": (
            "Self-attention on N={n} tokens of width d={d}, projected to d_k={dk} "
            "(seed {seed}{causal})."
        ),
        "causal": ", causal",
        "X": "the input: one row per token",
        "W": "learned projections d → d_k (W^V: d → d_v), drawn as layers are initialised: "
        "N(0, 1/d)",
        "Q": "queries: what each token is looking for",
        "K": "keys: what each token offers to be found by",
        "V": "values: what each token hands over when attended to",
        "S": "raw similarity of every query with every key",
        "S_scaled": "scaled by 1/√d_k = {inv:.4f}: QKᵀ sums d_k products, so its spread grows "
        "as √d_k; the scale brings it back to about 1",
        "A": "softmax by rows: each row is a distribution over keys",
        "rows": "row sums (each must be 1): {sums} → {ok}",
        "ok": "ok",
        "bad": "NOT 1",
        "peak": "how peaked A's rows are (entropy, of a possible {most:.2f} for an even row): "
        "{scaled:.2f} scaled, {raw:.2f} without the scale (row maxima {smax} scaled, {rmax} "
        "without)",
        "saturated": "  → without 1/√d_k the softmax saturates: nearly all of each row's "
        "weight goes to one key, and its gradient vanishes; scaled, the rows stay spread.",
        "little": "  → at d_k = {dk} the scale changes little ({raw:.2f} vs {scaled:.2f}); the "
        "unscaled rows sharpen as d_k grows (try --dk 64).",
        "Out": "each token's new representation: a weighted mix of the values",
        "cost": "Cost of one head (FLOPs = 4·N²·d_k for QKᵀ and AV; scores stored as fp32):",
        "shape": "shape",
        "corners": "  ({nr}×{nc}: corners shown; --full prints it whole)",
    },
    "zh": {
        "title": (
            "缩放点积自注意力：N={n} 个词元，宽度 d={d}，投影到 d_k={dk}"
            "（随机种子 {seed}{causal}）。"
        ),
        "causal": "，因果掩码",
        "X": "输入：每行是一个词元",
        "W": "可学习的投影矩阵 d → d_k（W^V：d → d_v），按神经网络层的初始化方式抽取：N(0, 1/d)",
        "Q": "查询：每个词元在寻找什么",
        "K": "键：每个词元凭什么被找到",
        "V": "值：每个词元被关注时交出的内容",
        "S": "每个查询与每个键的原始相似度",
        "S_scaled": "缩放：除以 √d_k（即乘以 {inv:.4f}）。QKᵀ 是 d_k 个乘积之和，离散程度随 √d_k "
        "增长；缩放后回到 1 左右",
        "A": "按行做 softmax：每一行是对所有键的概率分布",
        "rows": "每行之和（应为 1）：{sums} → {ok}",
        "ok": "正确",
        "bad": "不等于 1",
        "peak": "A 的各行有多集中（熵，完全均匀的一行为 {most:.2f}）：缩放后 {scaled:.2f}，"
        "不缩放 {raw:.2f}（各行最大值：缩放后 {smax}，不缩放 {rmax}）",
        "saturated": "  → 不除以 √d_k，softmax 就会饱和：每行几乎全部权重落在一个键上，"
        "梯度随之消失；缩放后各行保持分散。",
        "little": "  → d_k = {dk} 时缩放的作用还不大（不缩放 {raw:.2f}，缩放后 {scaled:.2f}）；"
        "d_k 越大，不缩放的行越尖锐（试试 --dk 64）。",
        "Out": "每个词元的新表示：值向量的加权平均",
        "cost": "单个注意力头的开销（FLOPs = 4·N²·d_k，含 QKᵀ 与 AV；分数矩阵按 fp32 存储）：",
        "shape": "形状",
        "corners": "  （{nr}×{nc}：只显示四角；--full 可完整打印）",
    },
}
# The sizes the cost table names, by language.
CASES = {
    "en": {4: "this example", 512: "BERT", 2048: "GPT-3", 1_048_576: "long document"},
    "zh": {4: "本例", 512: "BERT", 2048: "GPT-3", 1_048_576: "长文档"},
}
COST_SIZES = (512, 2048, 1_048_576)
# A's mean row entropy as a share of log N (an even row): below SATURATED the softmax has
# saturated (the rows are nearly one-hot); at or above SPREAD the rows are spread.
SATURATED = 0.5
SPREAD = 0.6
SHOWN = 16  # rows and columns of a matrix printed whole (more: its corners, unless full)
BYTES_PER_SHOWN = 64  # a float64 entry, its Python float while printed, and its text


class ExplainError(ValueError):
    """A walk-through this machine cannot hold, or a seed torch cannot take."""


@dataclass(frozen=True)
class Walkthrough:
    """Every matrix of the walk-through (float64), as `qkv.reference.steps` computes them."""

    X: torch.Tensor  # (N, d) the input
    W_q: torch.Tensor  # (d, d_k)
    W_k: torch.Tensor  # (d, d_k)
    W_v: torch.Tensor  # (d, d_k)
    Q: torch.Tensor  # (N, d_k)
    K: torch.Tensor  # (N, d_k)
    V: torch.Tensor  # (N, d_k)
    S: torch.Tensor  # (N, N) Q Kᵀ
    S_scaled: torch.Tensor  # (N, N) S / √d_k (−inf where causal hides a key)
    A: torch.Tensor  # (N, N) row softmax
    Out: torch.Tensor  # (N, d_k) A V
    causal: bool
    seed: int

    def _repr_html_(self) -> str:
        """In a notebook: every step as a heatmap table with its shape and meaning."""
        from .notebook import matrix_table

        t = TEXT["en"]
        d_k = self.Q.shape[1]
        steps = (
            ("X", self.X, t["X"], False),
            ("W^Q", self.W_q, t["W"], False),
            ("Q = X W^Q", self.Q, t["Q"], False),
            ("K = X W^K", self.K, t["K"], False),
            ("V = X W^V", self.V, t["V"], False),
            ("S = Q Kᵀ", self.S, t["S"], False),
            ("S / √d_k", self.S_scaled, t["S_scaled"].format(inv=d_k**-0.5), False),
            ("A = softmax(S / √d_k)", self.A, t["A"], True),
            ("Out = A V", self.Out, t["Out"], False),
        )
        n, d = self.X.shape
        title = t["title"].format(
            n=n, d=d, dk=d_k, seed=self.seed, causal=t["causal"] if self.causal else ""
        )
        tables = [matrix_table(m, name, meaning, prob) for name, m, meaning, prob in steps]
        lesson = "".join(f"<p>{html.escape(line.strip())}</p>" for line in _peak_lines(self, t))
        tables.insert(-1, lesson)  # after A, the √d_k lesson on these numbers
        return f"<div><p>{html.escape(title)}</p>{''.join(tables)}</div>"


def walkthrough(
    n: int = 4, d: int = 8, d_k: int = 4, seed: int = 0, causal: bool = False
) -> Walkthrough:
    """Random X and projections (fixed seed), then the formula step by step."""
    for name, val in (("n", n), ("d", d), ("d_k", d_k)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ExplainError(f"the seed must be an int in 0..2**64-1, got {seed!r}")
    _check_memory(n, d, d_k)
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    # As nn.Linear-style layers are initialised (std 1/√d): Q and K entries then have variance
    # about 1, and S = QKᵀ's spread grows as √d_k, which is what the scale undoes. (Drawn from
    # N(0, 1), Q and K would have variance d and even the scaled softmax would saturate.)
    W_q, W_k, W_v = (
        torch.randn(d, d_k, generator=g, dtype=torch.float64) / math.sqrt(d) for _ in range(3)
    )
    Q, K, V = X @ W_q, X @ W_k, X @ W_v
    st = reference.steps(Q, K, V, causal=causal)
    return Walkthrough(X, W_q, W_k, W_v, Q, K, V, st.S, st.S_scaled, st.A, st.out, causal, seed)


@dataclass(frozen=True)
class Peak:
    """How peaked the walk-through's softmax rows are, with the scale and without it."""

    scaled: float  # mean row entropy of A = softmax(S/√d_k), in nats
    raw: float  # the same of softmax(S), the scores unscaled
    most: float  # the mean of log(keys a row sees): an even row's entropy
    scaled_max: list[float]  # each row's largest weight, scaled
    raw_max: list[float]  # each row's largest weight, unscaled

    def share(self, entropy: float) -> float:
        """`entropy` as a share of an even row's (1: even; 0: one-hot)."""
        return entropy / self.most if self.most > 0 else 1.0

    @property
    def saturates_unscaled(self) -> bool:
        """The lesson holds on these numbers: unscaled rows saturated, scaled ones spread."""
        return self.share(self.raw) < SATURATED and self.share(self.scaled) >= SPREAD


def peak(w: Walkthrough) -> Peak:
    """A's row entropies and maxima with the scale and without (the same mask)."""
    d_k = w.Q.shape[1]
    raw = torch.softmax(w.S_scaled * math.sqrt(d_k), dim=-1)  # −inf stays −inf
    seen = torch.isfinite(w.S_scaled).sum(-1).double()  # keys each row sees
    rows = seen > 1  # a row with one key has nothing to spread over

    def entropy(a: torch.Tensor) -> float:
        h = -(a * torch.log(a.clamp_min(1e-300))).sum(-1)
        return h[rows].mean().item() if rows.any() else 0.0

    most = torch.log(seen[rows]).mean().item() if rows.any() else 0.0
    rounded = lambda a: [round(x, 2) for x in a.max(-1).values.tolist()]  # noqa: E731
    return Peak(entropy(w.A), entropy(raw), most, rounded(w.A), rounded(raw))


def memory_needed(n: int, d: int, d_k: int) -> int:
    """Bytes a walk-through of this size needs to compute and print (a generous estimate).

    Every shown matrix (X, Q, K, V, S, S/√d_k, A, Out) costs its float64 entries, their Python
    floats while printed and their text; the softmax adds two N×N temporaries."""
    shown = n * d + 4 * n * d_k + 3 * n * n
    return BYTES_PER_SHOWN * shown + 8 * (3 * d * d_k + 2 * n * n)


def _check_memory(n: int, d: int, d_k: int) -> None:
    from .bench import available_mib

    free = available_mib()
    need = memory_needed(n, d, d_k)
    if free is None or need <= 0.5 * free * 2**20:
        return
    raise ExplainError(
        f"a walk-through with N={n}, d={d}, d_k={d_k} needs about {human(need, 'B')} "
        f"(each N×N matrix holds {human(8 * n * n, 'B')} in float64, and every matrix is "
        f"printed), but only {human(free * 2**20, 'B')} of memory is available; the walk-through "
        f"is meant for a small N such as --n 8 (its last lines give the cost at large N)"
    )


def cost(n: int, d_k: int) -> tuple[int, int]:
    """(FLOPs of one head's QKᵀ and AV, bytes of its fp32 score matrix) at sequence length n."""
    return 4 * n * n * d_k, 4 * n * n


def human(x: float, unit: str) -> str:
    """`x` with an SI prefix and `unit`, three significant digits: 281 TFLOP, 4.4 TB."""
    for prefix in ("", "K", "M", "G", "T", "P"):
        if abs(x) < 1000:
            return f"{x:.3g} {prefix}{unit}"
        x /= 1000
    return f"{x:.3g} E{unit}"


def _cell(v: float) -> str:
    return f"{v:8.3f}" if v != float("-inf") else "    -inf"


def _matrix(t: torch.Tensor, full: bool = False, lang: str = "en") -> str:
    """The matrix's rows; beyond `SHOWN` rows or columns (unless `full`), its first and last
    `SHOWN // 2` of each with ⋯ / ⋮ between and a line saying what was left out (in `lang`)."""
    nr, nc = t.shape
    half = SHOWN // 2
    rows_at = range(nr) if full or nr <= SHOWN else [*range(half), None, *range(nr - half, nr)]
    cols_at = range(nc) if full or nc <= SHOWN else [*range(half), None, *range(nc - half, nc)]
    lines = []
    for i in rows_at:
        if i is None:
            lines.append("   " + " ".join(f"{'⋮':>8}" for _ in cols_at))
            continue
        row = t[i].tolist()
        lines.append(
            "  [" + " ".join(f"{'⋯':>8}" if j is None else _cell(row[j]) for j in cols_at) + "]"
        )
    if len(rows_at) < nr or len(cols_at) < nc:
        lines.append(TEXT[lang]["corners"].format(nr=nr, nc=nc))
    return "\n".join(lines)


def _peak_lines(w: Walkthrough, t: dict) -> list[str]:
    """The √d_k lesson, said as these numbers show it."""
    p = peak(w)
    if p.most == 0:  # every row sees one key (N = 1, or a causal first row alone)
        return []
    values = {"most": p.most, "scaled": p.scaled, "raw": p.raw, "dk": w.Q.shape[1]}
    lines = ["  " + t["peak"].format(**values, smax=p.scaled_max, rmax=p.raw_max)]
    if p.saturates_unscaled:
        lines.append(t["saturated"])
    elif p.share(p.raw) >= SATURATED and p.share(p.scaled) >= SPREAD:
        lines.append(t["little"].format(**values))
    return lines


def render(w: Walkthrough, lang: str = "en", full: bool = False) -> str:
    """The walk-through as text, in English (`en`) or Chinese (`zh`); matrices beyond `SHOWN`
    rows or columns show their corners unless `full`."""
    if lang not in TEXT:
        raise ValueError(f"lang must be one of {sorted(TEXT)}, got {lang!r}")
    t = TEXT[lang]
    n, d = w.X.shape
    dk = w.Q.shape[1]
    out = [t["title"].format(n=n, d=d, dk=dk, seed=w.seed, causal=t["causal"] if w.causal else "")]

    def step(name: str, m: torch.Tensor, meaning: str) -> None:
        out.append(f"\n{name}  {t['shape']} {tuple(m.shape)} — {meaning}")
        out.append(_matrix(m, full, lang))

    step("X", w.X, t["X"])
    out.append(f"\nW^Q, W^K, W^V  {t['shape']} {tuple(w.W_q.shape)} — {t['W']}")
    step("Q = X W^Q", w.Q, t["Q"])
    step("K = X W^K", w.K, t["K"])
    step("V = X W^V", w.V, t["V"])
    step("S = Q Kᵀ", w.S, t["S"])
    step("S / √d_k", w.S_scaled, t["S_scaled"].format(inv=dk**-0.5))
    step("A = softmax(S / √d_k)", w.A, t["A"])
    sums = w.A.sum(-1)
    ok = bool(torch.allclose(sums, torch.ones_like(sums), atol=1e-12))
    out.append(
        "  "
        + t["rows"].format(
            sums=[round(x, 6) for x in sums.tolist()], ok=t["ok"] if ok else t["bad"]
        )
    )
    out.extend(_peak_lines(w, t))
    step("Out = A V", w.Out, t["Out"])
    out.append("\n" + t["cost"])
    for size in (n, *COST_SIZES):
        flops, nbytes = cost(size, dk)
        label = CASES[lang].get(size, "")
        out.append(
            f"  N = {size:>9,}  {ljust(label, 14)} {human(flops, 'FLOP'):>12}  "
            f"{human(nbytes, 'B'):>10}"
        )
    return "\n".join(out)
