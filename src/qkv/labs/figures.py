"""The labs' figures: each function takes a lab's JSON document and returns a matplotlib
`Figure`, saved as a PNG when `path` is given. matplotlib is imported only when a figure is
made (inside `qkv.inspect.figures.new_figure`), so importing this module costs nothing.

`lang` ("en" or "zh") is the language of the titles, axes and legends; Chinese without a CJK
font is drawn in English (`qkv.inspect.figures.figure_lang`)."""

from __future__ import annotations

from pathlib import Path

from ..inspect.figures import figure_lang, finish, labels, new_figure

RNN_TEXT = {
    "en": {
        "lstm": "LSTM",
        "attention": "attention",
        "threads": "{label}, {threads} threads",
        "one_thread": "{label}, 1 thread",
        "n": "sequence length N (LSTM: N sequential steps; attention: 1)",
        "time": "forward+backward time (ms)",
        "par_title": "parallelism: one layer, one sequence",
        "params": "{label} ({params:,} parameters)",
        "chance": "chance",
        "distance": "distance d between the answer and the question",
        "accuracy": "test accuracy (dots: seeds)",
        "rec_title": "recall after {steps} training steps",
        "step": "training step",
        "loss": "cross-entropy (mean of {every} steps)",
        "train_title": "training, same batches for both",
        "dependence": "‖∂ answer / ∂ pair‖, relative to d = {d0}",
        "dep_title": "memory: dependence on the pair d back",
        "faded": "rule: LSTM ≤ {v:g} at the longest d",
        "kept": "rule: attention ≥ {v:g}",
    },
    "zh": {
        "lstm": "LSTM",
        "attention": "注意力",
        "threads": "{label}，{threads} 个线程",
        "one_thread": "{label}，1 个线程",
        "n": "序列长度 N（LSTM：N 个串行步骤；注意力：1 步）",
        "time": "前向+反向时间（毫秒）",
        "par_title": "并行性：单层，一条序列",
        "params": "{label}（{params:,} 个参数）",
        "chance": "随机猜测",
        "distance": "答案与提问之间的距离 d",
        "accuracy": "测试准确率（散点：各个随机种子）",
        "rec_title": "训练 {steps} 步后的回忆准确率",
        "step": "训练步数",
        "loss": "交叉熵（每 {every} 步的平均）",
        "train_title": "训练过程，两个模型用相同的批次",
        "dependence": "‖∂ 答案 / ∂ 那一对‖，相对于 d = {d0}",
        "dep_title": "记忆：对 d 个位置之前那一对的依赖",
        "faded": "规则：最远处 LSTM ≤ {v:g}",
        "kept": "规则：注意力 ≥ {v:g}",
    },
}


def rnn(doc: dict, path: str | Path | None = None, *, lang: str = "en"):
    """Time against N (log-log, all threads and one), accuracy against distance, the training
    loss of both models and, when the run measured it (`lstm_dependence` and
    `attention_dependence` in its recall rows), how much the answer still depends on the pair
    d back, relative to the shortest d (`qkv.labs.fade`)."""
    lang = figure_lang(lang)
    t = labels(RNN_TEXT, lang)
    measured = all("lstm_dependence" in r for r in doc["recall"])
    fig = new_figure(20.0 if measured else 15.0, 4.2)
    left, mid, right, *dep = fig.subplots(1, 4 if measured else 3)
    models = (("lstm", t("lstm"), "C3"), ("attention", t("attention"), "C0"))
    par = doc["parallel"]
    ns = [r["n"] for r in par]
    for key, label, color in models:
        many = t("threads", label=label, threads=par[0]["threads"])
        left.loglog(ns, [r[f"{key}_ms"] for r in par], "o-", color=color, base=2, label=many)
        one = [r[f"{key}_ms_one_thread"] for r in par]
        left.loglog(
            ns, one, "o--", color=color, alpha=0.5, base=2, label=t("one_thread", label=label)
        )
    left.set_xlabel(t("n"))
    left.set_ylabel(t("time"))
    left.set_title(t("par_title"))
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    ds = [r["distance"] for r in doc["recall"]]
    for key, label, color in models:
        params = doc["models"][key]["params"]
        accs = [r[f"{key}_acc"] for r in doc["recall"]]
        mid.plot(ds, accs, "o-", color=color, label=t("params", label=label, params=params))
        for r in doc["recall"]:
            runs = r[f"{key}_acc_by_seed"]
            mid.plot([r["distance"]] * len(runs), runs, ".", color=color, alpha=0.35)
    mid.axhline(doc["task"]["chance"], color="gray", linestyle=":", label=t("chance"))
    mid.set_xscale("log", base=2)
    mid.set_ylim(0, 1.05)
    mid.set_xlabel(t("distance"))
    mid.set_ylabel(t("accuracy"))
    mid.set_title(t("rec_title", steps=doc["preset"]["steps"]))
    mid.grid(True, alpha=0.3)
    mid.legend(fontsize=8)
    tr = doc["training"]
    for key, label, color in models:
        for i, curve in enumerate(tr["loss"][key]):
            xs = [tr["every"] * (j + 1) for j in range(len(curve))]
            right.plot(xs, curve, color=color, alpha=0.8, label=label if i == 0 else None)
    right.set_yscale("log")
    right.set_xlabel(t("step"))
    right.set_ylabel(t("loss", every=tr["every"]))
    right.set_title(t("train_title"))
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)
    if measured:
        _dependence(dep[0], doc, models, t)
    return finish(fig, path, lang)


def _dependence(ax, doc: dict, models, t) -> None:
    """The answer's dependence on the pair d back against d, relative to the shortest d (log
    y; a zero, which a log axis cannot show, is left out), with the rule's two thresholds."""
    from .fade import FADED, KEPT, relative

    rec = doc["recall"]
    ds = [r["distance"] for r in rec]
    for key, label, color in models:
        pts = [
            (d, y)
            for d, y in zip(ds, relative([r[f"{key}_dependence"] for r in rec]), strict=True)
            if y > 0
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-", color=color, label=label)
    ax.axhline(FADED, color="C3", linestyle=":", alpha=0.6, label=t("faded", v=FADED))
    ax.axhline(KEPT, color="C0", linestyle=":", alpha=0.6, label=t("kept", v=KEPT))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(t("distance"))
    ax.set_ylabel(t("dependence", d0=ds[0]))
    ax.set_title(t("dep_title"))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


SCALE_TEXT = {
    "en": {
        "measured": "q·k measured",
        "closed_dk": "closed form d_k",
        "measured_scaled": "q·k/√d_k measured",
        "closed_1": "closed form 1",
        "variance": "variance of the score",
        "var_title": "1. the scores' variance",
        "max_unscaled": "largest weight, scale 1",
        "max_scaled": "largest weight, 1/√d_k",
        "largest": "largest softmax weight",
        "ent_unscaled": "entropy, scale 1",
        "ent_scaled": "entropy, 1/√d_k",
        "entropy": "entropy (nats), dashed",
        "sat_title": "2. softmax over {keys} keys",
        "unscaled": "scale 1",
        "scaled": "1/√d_k",
        "jacobian": "‖diag(p) − p pᵀ‖_F (mean)",
        "jac_title": "3. gradient through the softmax",
        "step": "training step",
        "loss": "cross-entropy (mean of {every} steps)",
        "train_title": "4. training at d_k = {d_k}",
    },
    "zh": {
        "measured": "q·k 实测",
        "closed_dk": "理论值 d_k",
        "measured_scaled": "q·k/√d_k 实测",
        "closed_1": "理论值 1",
        "variance": "分数的方差",
        "var_title": "1. 分数的方差",
        "max_unscaled": "最大权重，不缩放",
        "max_scaled": "最大权重，1/√d_k",
        "largest": "softmax 的最大权重",
        "ent_unscaled": "熵，不缩放",
        "ent_scaled": "熵，1/√d_k",
        "entropy": "熵（nats，虚线）",
        "sat_title": "2. 对 {keys} 个键做 softmax",
        "unscaled": "不缩放",
        "scaled": "1/√d_k",
        "jacobian": "‖diag(p) − p pᵀ‖_F（平均）",
        "jac_title": "3. 经过 softmax 的梯度",
        "step": "训练步数",
        "loss": "交叉熵（每 {every} 步的平均）",
        "train_title": "4. 在 d_k = {d_k} 时训练",
    },
}


def scale(doc: dict, path: str | Path | None = None, *, lang: str = "en"):
    """Variance, saturation, Jacobian norm against d_k, and the two training curves."""
    lang = figure_lang(lang)
    t = labels(SCALE_TEXT, lang)
    fig = new_figure(15.0, 4.0)
    a, b, c, d = fig.subplots(1, 4)
    dks = [r["d_k"] for r in doc["variance"]]
    var = doc["variance"]
    a.loglog(dks, [r["unscaled"] for r in var], "o", color="C3", base=2, label=t("measured"))
    a.loglog(dks, dks, "-", color="C3", alpha=0.5, base=2, label=t("closed_dk"))
    a.loglog(dks, [r["scaled"] for r in var], "o", color="C0", base=2, label=t("measured_scaled"))
    a.loglog(dks, [1.0] * len(dks), "-", color="C0", alpha=0.5, base=2, label=t("closed_1"))
    a.set_xlabel("d_k")
    a.set_ylabel(t("variance"))
    a.set_title(t("var_title"))
    a.legend(fontsize=8)
    sat = doc["saturation"]
    for name, color in (("unscaled", "C3"), ("scaled", "C0")):
        ys = [r[f"max_weight_{name}"] for r in sat]
        b.semilogx(dks, ys, "o-", color=color, base=2, label=t(f"max_{name}"))
    b.set_ylim(0, 1.02)
    b.set_xlabel("d_k")
    b.set_ylabel(t("largest"))
    ent = b.twinx()
    for name, color in (("unscaled", "C3"), ("scaled", "C0")):
        ys = [r[f"entropy_{name}"] for r in sat]
        ent.semilogx(dks, ys, "s--", color=color, alpha=0.5, base=2, label=t(f"ent_{name}"))
    ent.set_ylabel(t("entropy"))
    b.set_title(t("sat_title", keys=doc["preset"]["keys"]))
    b.legend(fontsize=7, loc="center left")
    jac = doc["jacobian"]
    for name, color in (("unscaled", "C3"), ("scaled", "C0")):
        ys = [r[f"norm_{name}"] for r in jac]
        c.loglog(dks, ys, "o-", color=color, base=2, label=t(name))
    c.set_xlabel("d_k")
    c.set_ylabel(t("jacobian"))
    c.set_title(t("jac_title"))
    c.legend(fontsize=8)
    tr = doc["training"]
    xs = [tr["every"] * (i + 1) for i in range(len(tr["scaled"]))]
    d.plot(xs, tr["scaled"], color="C0", label=t("scaled"))
    d.plot(xs, tr["unscaled"], color="C3", label=t("unscaled"))
    d.set_xlabel(t("step"))
    d.set_ylabel(t("loss", every=tr["every"]))
    d.set_title(t("train_title", d_k=tr["d_k"]))
    d.legend(fontsize=8)
    for ax in (a, c, d):
        ax.grid(True, which="both", alpha=0.3)
    b.grid(True, alpha=0.3)
    return finish(fig, path, lang)


ROUTING_TEXT = {
    "en": {
        "cnn": "cnn",
        "lstm": "lstm",
        "attention": "attention",
        "distance": "distance from the last position",
        "gradient": "‖∂ output_last / ∂ input‖ (mean)",
        "layers": "{layers} layer{s}",
        "answer": "the answer's position",
        "back": "distance back from the query (0 = the query, {n} positions)",
        "sequence": "test sequence",
        "reads": "where the trained model reads ({w:.0%} on the answer)",
        "weight": "attention weight",
    },
    "zh": {
        "cnn": "CNN",
        "lstm": "LSTM",
        "attention": "注意力",
        "distance": "与最后一个位置的距离",
        "gradient": "‖∂ 最后位置的输出 / ∂ 输入‖（平均）",
        "layers": "{layers} 层",
        "answer": "答案所在的位置",
        "back": "从提问处往前的距离（0 = 提问处，共 {n} 个位置）",
        "sequence": "测试序列",
        "reads": "训练后的模型读哪里（{w:.0%} 的权重落在答案上）",
        "weight": "注意力权重",
    },
}


def routing(doc: dict, path: str | Path | None = None, *, lang: str = "en"):
    """Gradient against distance per model and depth, and the trained model's routes."""
    lang = figure_lang(lang)
    t = labels(ROUTING_TEXT, lang)
    depths = doc["preset"]["layers"]
    fig = new_figure(4.2 * len(depths) + 5.5, 4.2)
    axes = fig.subplots(1, len(depths) + 1)
    colors = {"cnn": "C2", "lstm": "C3", "attention": "C0"}
    models = dict.fromkeys(r["model"] for r in doc["gradient_reach"])  # the run's, in its order
    for ax, layers in zip(axes, depths, strict=False):
        for kind in models:
            pts = [
                (r["distance"], r["grad_norm"])
                for r in doc["gradient_reach"]
                if r["model"] == kind and r["layers"] == layers and r["grad_norm"] > 0
            ]
            if pts:
                ax.semilogy(*zip(*pts, strict=True), ".-", color=colors[kind], label=t(kind))
        ax.set_xlabel(t("distance"))
        ax.set_ylabel(t("gradient"))
        ax.set_title(t("layers", layers=layers, s="s" if layers > 1 else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[-1]
    r = doc["routing"]
    n = r["length"]
    rows = [list(reversed(ex["weights"])) for ex in r["examples"]]  # column = distance back
    image = ax.imshow(rows, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    answers = [ex["distance"] for ex in r["examples"]]
    ax.plot(answers, range(len(rows)), "o", mfc="none", mec="red", ms=7, label=t("answer"))
    ax.set_xlabel(t("back", n=n))
    ax.set_ylabel(t("sequence"))
    ax.set_title(t("reads", w=r["weight_on_source"]))
    ax.legend(fontsize=8, loc="lower right")
    fig.colorbar(image, ax=ax, label=t("weight"))
    return finish(fig, path, lang)


SPARSE_TEXT = {
    "en": {
        "full": "full attention",
        "window": "window, {keys} keys",
        "selected": "selected blocks, {keys} keys",
        "chance": "chance",
        "reach": "window: in reach + chance",
        "n": "sequence length N",
        "accuracy": "test accuracy",
        "acc_title": "the far answer, same budget",
        "time": "forward+backward per step (ms)",
        "time_title": "time per training step ({batch} sequences)",
        "memory": "peak memory per step (MiB)",
        "mem_title": "memory per training step",
        "key_block": "key block ({block} positions each)",
        "query_block": "query block (the question: the last)",
        "chosen_title": "blocks the trained model chose, one sequence of N={n}",
        "answer": "the answer's block",
        "pairs": "the other pairs' blocks",
        "reach_blocks": "the window's {keys} keys",
    },
    "zh": {
        "full": "完整注意力",
        "window": "滑动窗口，{keys} 个键",
        "selected": "按内容选块，{keys} 个键",
        "chance": "随机猜测",
        "reach": "滑动窗口：在窗口内的比例 + 随机猜对",
        "n": "序列长度 N",
        "accuracy": "测试准确率",
        "acc_title": "远处的答案，同样的预算",
        "time": "每步前向+反向（毫秒）",
        "time_title": "每个训练步的时间（{batch} 条序列）",
        "memory": "每步的内存峰值（MiB）",
        "mem_title": "每个训练步的内存",
        "key_block": "键块（每块 {block} 个位置）",
        "query_block": "查询块（最后一块是提问）",
        "chosen_title": "训练好的模型在一条 N={n} 的序列上选的块",
        "answer": "答案所在的块",
        "pairs": "其他键值对所在的块",
        "reach_blocks": "滑动窗口的 {keys} 个键",
    },
}
SPARSE_COLORS = {"full": "C0", "window": "C3", "selected": "C2"}


def sparse(doc: dict, path: str | Path | None = None, *, lang: str = "en"):
    """Accuracy against N per variant (with chance, and what the window's reach alone gives),
    time and peak memory of a training step against N, and the key blocks each query block
    of the trained `selected` model chose on one sequence (the answer's block marked)."""
    lang = figure_lang(lang)
    t = labels(SPARSE_TEXT, lang)
    fig = new_figure(20.0, 4.4)
    acc, tim, mem, pic = fig.subplots(1, 4, width_ratios=(1, 1, 1, 1.15))
    keys = doc["budget"]["keys"]
    variants = list(SPARSE_COLORS)
    rows = doc["accuracy"]
    ns = [r["n"] for r in rows]
    chance = doc["task"]["chance"]
    for v in variants:
        acc.plot(ns, [r[v] for r in rows], "o-", color=SPARSE_COLORS[v], label=t(v, keys=keys))
    reach = [r["in_reach"] + (1 - r["in_reach"]) * chance for r in rows]
    acc.plot(ns, reach, ":", color=SPARSE_COLORS["window"], alpha=0.6, label=t("reach"))
    acc.axhline(chance, color="gray", linestyle="--", label=t("chance"))
    acc.set_xscale("log", base=2)
    acc.set_ylim(0, 1.05)
    acc.set_xlabel(t("n"))
    acc.set_ylabel(t("accuracy"))
    acc.set_title(t("acc_title"))
    acc.legend(fontsize=8)
    for ax, key, log in ((tim, "ms", True), (mem, "peak_mib", False)):
        for v in variants:
            pts = [
                (c["n"], c[key]) for c in doc["cost"] if c["variant"] == v and c[key] is not None
            ]
            if pts:
                ax.plot(
                    *zip(*pts, strict=True), "o-", color=SPARSE_COLORS[v], label=t(v, keys=keys)
                )
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel(t("n"))
        ax.legend(fontsize=8)
    batch = doc["preset"]["time_batch"]
    tim.set_ylabel(t("time"))
    tim.set_title(t("time_title", batch=batch))
    mem.set_ylabel(t("memory"))
    mem.set_title(t("mem_title"))
    for ax in (acc, tim, mem):
        ax.grid(True, which="both", alpha=0.3)
    _chosen(pic, doc["picture"], t)
    return finish(fig, path, lang)


def _chosen(ax, p: dict, t) -> None:
    """Query blocks (rows) against key blocks (columns): chosen dark, not chosen white, after
    the query block (never readable) grey; on the question's row, the answer's block, the other
    pairs' and the window's reach."""
    import numpy as np
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Rectangle

    nb = p["n"] // p["block"]
    image = np.ones((nb, nb, 3))
    image[np.triu_indices(nb, 1)] = 0.88  # blocks after the query block
    for r, picks in enumerate(p["chosen"]):
        image[r, picks] = to_rgb(SPARSE_COLORS["selected"])
    ax.imshow(image, interpolation="nearest", aspect="auto")
    q, reach = p["question_block"], p["window_blocks"]
    window = Rectangle((q - reach + 0.5, q - 0.5), reach, 1, fill=False, ec="C3", ls="--", lw=1.5)
    ax.add_patch(window)
    window.set_label(t("reach_blocks", keys=reach * p["block"]))
    others = [j for j in p["pair_blocks"] if j != p["answer_block"]]
    ax.plot(others, [q] * len(others), "^", mfc="none", mec="C1", ms=8, mew=1.5, label=t("pairs"))
    ax.plot([p["answer_block"]], [q], "s", mfc="none", mec="red", ms=10, mew=2, label=t("answer"))
    ax.set_ylim(nb - 0.3, -0.5)  # room for the markers on the last row
    ax.set_xlabel(t("key_block", block=p["block"]))
    ax.set_ylabel(t("query_block"))
    ax.set_title(t("chosen_title", n=p["n"]))
    ax.legend(fontsize=8, loc="upper right")
