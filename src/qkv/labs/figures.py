"""The labs' figures: each function takes a lab's JSON document and returns a matplotlib
`Figure`, saved as a PNG when `path` is given. matplotlib is imported only when a figure is
made (inside `qkv.inspect.figures.new_figure`), so importing this module costs nothing."""

from __future__ import annotations

from pathlib import Path

from ..inspect.figures import new_figure, save


def rnn(doc: dict, path: str | Path | None = None):
    """Time against N (log-log, all threads and one), accuracy against distance, and the
    training loss of both models."""
    fig = new_figure(15.0, 4.2)
    left, mid, right = fig.subplots(1, 3)
    models = (("lstm", "LSTM", "C3"), ("attention", "attention", "C0"))
    par = doc["parallel"]
    ns = [r["n"] for r in par]
    for key, label, color in models:
        many = f"{label}, {par[0]['threads']} threads"
        left.loglog(ns, [r[f"{key}_ms"] for r in par], "o-", color=color, base=2, label=many)
        one = [r[f"{key}_ms_one_thread"] for r in par]
        left.loglog(ns, one, "o--", color=color, alpha=0.5, base=2, label=f"{label}, 1 thread")
    left.set_xlabel("sequence length N (LSTM: N sequential steps; attention: 1)")
    left.set_ylabel("forward+backward time (ms)")
    left.set_title("parallelism: one layer, one sequence")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    ds = [r["distance"] for r in doc["recall"]]
    for key, label, color in models:
        params = doc["models"][key]["params"]
        accs = [r[f"{key}_acc"] for r in doc["recall"]]
        mid.plot(ds, accs, "o-", color=color, label=f"{label} ({params:,} parameters)")
        for r in doc["recall"]:
            runs = r[f"{key}_acc_by_seed"]
            mid.plot([r["distance"]] * len(runs), runs, ".", color=color, alpha=0.35)
    mid.axhline(doc["task"]["chance"], color="gray", linestyle=":", label="chance")
    mid.set_xscale("log", base=2)
    mid.set_ylim(0, 1.05)
    mid.set_xlabel("distance d between the answer and the question")
    mid.set_ylabel("test accuracy (dots: seeds)")
    mid.set_title(f"recall after {doc['preset']['steps']} training steps")
    mid.grid(True, alpha=0.3)
    mid.legend(fontsize=8)
    tr = doc["training"]
    for key, label, color in models:
        for i, curve in enumerate(tr["loss"][key]):
            xs = [tr["every"] * (j + 1) for j in range(len(curve))]
            right.plot(xs, curve, color=color, alpha=0.8, label=label if i == 0 else None)
    right.set_yscale("log")
    right.set_xlabel("training step")
    right.set_ylabel(f"cross-entropy (mean of {tr['every']} steps)")
    right.set_title("training, same batches for both")
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)
    return save(fig, path)


def scale(doc: dict, path: str | Path | None = None):
    """Variance, saturation, Jacobian norm against d_k, and the two training curves."""
    fig = new_figure(15.0, 4.0)
    a, b, c, d = fig.subplots(1, 4)
    dks = [r["d_k"] for r in doc["variance"]]
    a.loglog(
        dks, [r["unscaled"] for r in doc["variance"]], "o", color="C3", base=2, label="q·k measured"
    )
    a.loglog(dks, dks, "-", color="C3", alpha=0.5, base=2, label="closed form d_k")
    a.loglog(
        dks,
        [r["scaled"] for r in doc["variance"]],
        "o",
        color="C0",
        base=2,
        label="q·k/√d_k measured",
    )
    a.loglog(dks, [1.0] * len(dks), "-", color="C0", alpha=0.5, base=2, label="closed form 1")
    a.set_xlabel("d_k")
    a.set_ylabel("variance of the score")
    a.set_title("1. the scores' variance")
    a.legend(fontsize=8)
    sat = doc["saturation"]
    b.semilogx(
        dks,
        [r["max_weight_unscaled"] for r in sat],
        "o-",
        color="C3",
        base=2,
        label="largest weight, scale 1",
    )
    b.semilogx(
        dks,
        [r["max_weight_scaled"] for r in sat],
        "o-",
        color="C0",
        base=2,
        label="largest weight, 1/√d_k",
    )
    b.set_ylim(0, 1.02)
    b.set_xlabel("d_k")
    b.set_ylabel("largest softmax weight")
    ent = b.twinx()
    ent.semilogx(
        dks,
        [r["entropy_unscaled"] for r in sat],
        "s--",
        color="C3",
        alpha=0.5,
        base=2,
        label="entropy, scale 1",
    )
    ent.semilogx(
        dks,
        [r["entropy_scaled"] for r in sat],
        "s--",
        color="C0",
        alpha=0.5,
        base=2,
        label="entropy, 1/√d_k",
    )
    ent.set_ylabel("entropy (nats), dashed")
    b.set_title(f"2. softmax over {doc['preset']['keys']} keys")
    b.legend(fontsize=7, loc="center left")
    jac = doc["jacobian"]
    c.loglog(dks, [r["norm_unscaled"] for r in jac], "o-", color="C3", base=2, label="scale 1")
    c.loglog(dks, [r["norm_scaled"] for r in jac], "o-", color="C0", base=2, label="1/√d_k")
    c.set_xlabel("d_k")
    c.set_ylabel("‖diag(p) − p pᵀ‖_F (mean)")
    c.set_title("3. gradient through the softmax")
    c.legend(fontsize=8)
    tr = doc["training"]
    xs = [tr["every"] * (i + 1) for i in range(len(tr["scaled"]))]
    d.plot(xs, tr["scaled"], color="C0", label="1/√d_k")
    d.plot(xs, tr["unscaled"], color="C3", label="scale 1")
    d.set_xlabel("training step")
    d.set_ylabel(f"cross-entropy (mean of {tr['every']} steps)")
    d.set_title(f"4. training at d_k = {tr['d_k']}")
    d.legend(fontsize=8)
    for ax in (a, c, d):
        ax.grid(True, which="both", alpha=0.3)
    b.grid(True, alpha=0.3)
    return save(fig, path)


def routing(doc: dict, path: str | Path | None = None):
    """Gradient against distance per model and depth, and the trained model's routes."""
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
                ax.semilogy(*zip(*pts, strict=True), ".-", color=colors[kind], label=kind)
        ax.set_xlabel("distance from the last position")
        ax.set_ylabel("‖∂ output_last / ∂ input‖ (mean)")
        ax.set_title(f"{layers} layer{'s' if layers > 1 else ''}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[-1]
    r = doc["routing"]
    n = r["length"]
    rows = [list(reversed(ex["weights"])) for ex in r["examples"]]  # column = distance back
    image = ax.imshow(rows, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.plot(
        [ex["distance"] for ex in r["examples"]],
        range(len(rows)),
        "o",
        mfc="none",
        mec="red",
        ms=7,
        label="the answer's position",
    )
    ax.set_xlabel(f"distance back from the query (0 = the query, {n} positions)")
    ax.set_ylabel("test sequence")
    ax.set_title(f"where the trained model reads ({r['weight_on_source']:.0%} on the answer)")
    ax.legend(fontsize=8, loc="lower right")
    fig.colorbar(image, ax=ax, label="attention weight")
    return save(fig, path)
