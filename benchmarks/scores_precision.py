"""The compiled CPU kernel's error against the error-ratio rule, float32, at torch's two float32
matmul precisions: "highest" (scores in float chains of 32 products, 16 on the portable path,
summed in double) and "high" (scores as one float gemm).

Over random problems (5 shapes up to N = 200, causal on odd seeds, `--seeds` seeds each) it prints
the worst share of the rule's allowance used by the output and by dq, dk, dv: max|cpu − golden|
/ (f·max|reference − golden| + floor), f = 2 for outputs and 3 for gradients, the floor one
rounding of the golden's magnitude (the tests' `floor_for`); 1 is the rule's limit. Then, for two
larger dense problems (`LARGE`), the output's error as a multiple of the float32 reference's.
Run: `python -m benchmarks.scores_precision [--seeds 60]`.
"""

from __future__ import annotations

import argparse

import torch

import qkv

SHAPES = [  # (Nq, Nk, D), B = 1, H = 1 or 2
    (2, 2, 8),
    (17, 17, 40),
    (97, 97, 59),
    (5, 70, 16),
    (200, 200, 64),
]
LARGE = [(4096, 64), (2048, 128)]  # (N, D), B = 1, H = 2, dense


def floor(gold: torch.Tensor) -> float:
    """One float32 rounding of the golden's magnitude (as the tests' `floor_for`)."""
    g = gold.float()
    fa = 2 * ((g + 0.3 - 0.3) - g).abs().max().item()
    return max(fa, torch.finfo(torch.float32).eps * (g.abs().max().item() + 0.3))


def share(got: torch.Tensor, ref: torch.Tensor, gold: torch.Tensor, factor: float) -> float:
    err = (got.double() - gold).abs().max().item()
    return err / (factor * (ref.double() - gold).abs().max().item() + floor(gold))


def worst(precision: str, seeds: int) -> dict[str, float]:
    torch.set_float32_matmul_precision(precision)
    out: dict[str, float] = {}
    for nq, nk, d in SHAPES:
        for seed in range(seeds):
            g = torch.Generator().manual_seed(seed)
            q, k, v = (torch.randn(1, 2, n, d, generator=g).requires_grad_() for n in (nq, nk, nk))
            causal = seed % 2 == 1
            runs = {}
            for name, leaves in (("cpu", (q, k, v)), ("reference", (q, k, v))):
                runs[name] = qkv.attention(*leaves, backend=name, causal=causal)
            g64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
            gold = qkv.attention(*g64, backend="reference", causal=causal)
            dout = torch.randn(gold.shape, generator=g)
            grads = {n: torch.autograd.grad(o, (q, k, v), dout) for n, o in runs.items()}
            gold_grads = torch.autograd.grad(gold, g64, dout.double())
            figures = {"out": share(runs["cpu"], runs["reference"], gold, 2.0)}
            for i, name in enumerate(("dq", "dk", "dv")):
                figures[name] = share(grads["cpu"][i], grads["reference"][i], gold_grads[i], 3.0)
            for key, value in figures.items():
                out[key] = max(out.get(key, 0.0), value)
    return out


def large_ratios(precision: str) -> dict[str, float]:
    """max|cpu − golden| / max|reference − golden| of the output for the `LARGE` problems."""
    torch.set_float32_matmul_precision(precision)
    out: dict[str, float] = {}
    for n, d in LARGE:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, n, d, generator=g) for _ in range(3))
        gold = qkv.attention(q.double(), k.double(), v.double(), backend="reference")
        ref = (qkv.attention(q, k, v, backend="reference").double() - gold).abs().max().item()
        cpu = (qkv.attention(q, k, v, backend="cpu").double() - gold).abs().max().item()
        out[f"N={n} D={d}"] = cpu / ref
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    before = torch.get_float32_matmul_precision()
    try:
        for precision in ("highest", "high"):
            w = worst(precision, args.seeds)
            print(f"{precision:8s} " + "  ".join(f"{k} {v:.2f}" for k, v in w.items()))
        for precision in ("highest", "high"):
            r = large_ratios(precision)
            print(
                f"{precision:8s} output error / the reference's: "
                + "  ".join(f"{k} {v:.2f}" for k, v in r.items())
            )
    finally:
        torch.set_float32_matmul_precision(before)


if __name__ == "__main__":
    main()
