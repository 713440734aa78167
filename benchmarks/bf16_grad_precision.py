"""The compiled CPU kernel's bfloat16 gradients against the error-ratio rule, on the path this CPU
runs (amx and avx512bf16 round the backward's P and dS to bfloat16 once: docs/cpu.md, *The
bfloat16 backward*).

Over a grid of requests (dense and causal N = 256 … 2048 at D = 64 and 128, D = 256, GQA,
Nq ≠ Nk, Dv ≠ D, a sliding window, documents, ALiBi, softcap, dropout, peaked rows) it prints
the share of the rule's allowance that dq, dk and dv use: max|cpu − golden| / (3·max|reference −
golden| + floor), the reference in bfloat16, the golden in float64, the floor the tests'
`floor_for`; 1 is the rule's limit. Then the worst share over the grid.
Run: `python -m benchmarks.bf16_grad_precision`.
"""

from __future__ import annotations

import torch

import qkv
from qkv import masks, scores

DOCS = torch.tensor([0] * 400 + [1] * 700 + [2] * 400)


def grid() -> list[tuple[str, dict, dict]]:
    """(name, shape, attention keywords): shape holds B, H, Nq, D and optionally Hkv, Nk, Dv and
    `amp` (queries × amp: peaked rows)."""
    cases = []
    for n in (256, 1024, 2048):
        for d in (64, 128):
            cases.append((f"dense N={n} D={d}", dict(B=1, H=2, Nq=n, D=d), {}))
            cases.append((f"causal N={n} D={d}", dict(B=1, H=2, Nq=n, D=d), dict(causal=True)))
    return [
        *cases,
        ("causal D=256", dict(B=1, H=2, Nq=512, D=256), dict(causal=True)),
        ("dense D=256", dict(B=1, H=2, Nq=512, D=256), {}),
        ("GQA 8:2 causal", dict(B=1, H=8, Hkv=2, Nq=512, D=64), dict(causal=True)),
        ("Nq<Nk causal", dict(B=1, H=2, Nq=300, Nk=1100, D=64), dict(causal=True)),
        ("Nq>Nk", dict(B=1, H=2, Nq=700, Nk=200, D=64), {}),
        ("Dv!=D", dict(B=1, H=2, Nq=600, D=64, Dv=32), {}),
        ("window 128", dict(B=1, H=2, Nq=2048, D=64), dict(mask=masks.sliding_window(128))),
        ("documents", dict(B=1, H=2, Nq=1500, D=64), dict(mask=masks.document(DOCS))),
        (
            "ALiBi causal",
            dict(B=1, H=4, Nq=1024, D=64),
            dict(causal=True, score_mod=scores.alibi(scores.alibi_slopes(4))),
        ),
        ("softcap 20", dict(B=1, H=2, Nq=1024, D=64), dict(score_mod=scores.softcap(20.0))),
        ("dropout 0.1", dict(B=1, H=2, Nq=1024, D=64), dict(dropout_p=0.1)),
        ("peaked (q × 4)", dict(B=1, H=2, Nq=1024, D=64, amp=4.0), {}),
        ("peaked (q × 8) causal", dict(B=1, H=2, Nq=1024, D=64, amp=8.0), dict(causal=True)),
    ]


def floor_for(g: torch.Tensor) -> float:
    """One bfloat16 rounding of the golden's magnitude (as the tests' `floor_for`)."""
    g = torch.nan_to_num(g.to(torch.bfloat16), nan=0.0, posinf=0.0, neginf=0.0)
    fa = 2 * ((g + 0.3 - 0.3) - g).abs().max().item()
    return max(fa, torch.finfo(torch.bfloat16).eps * (g.abs().max().item() + 0.3))


def grads(backend: str, inputs, dout, dtype, kw) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    torch.manual_seed(5)  # the same dropout for every run
    out = qkv.attention(*leaves, backend=backend, **kw)
    return torch.autograd.grad(out, leaves, dout.to(dtype))


def shares(shape: dict, kw: dict) -> list[float]:
    """dq, dk and dv's shares of the rule's allowance for one request."""
    g = torch.Generator().manual_seed(0)
    b, h, nq, d = shape["B"], shape["H"], shape["Nq"], shape["D"]
    hkv, nk, dv = shape.get("Hkv", h), shape.get("Nk", nq), shape.get("Dv", d)
    q = torch.randn(b, h, nq, d, generator=g) * shape.get("amp", 1.0)
    k = torch.randn(b, hkv, nk, d, generator=g)
    v = torch.randn(b, hkv, nk, dv, generator=g)
    inputs = [t.bfloat16().double() for t in (q, k, v)]  # values bfloat16 holds exactly
    dout = torch.randn(b, h, nq, dv, generator=g)
    gold = grads("reference", inputs, dout, torch.float64, kw)
    ref = grads("reference", inputs, dout, torch.bfloat16, kw)
    got = grads("cpu", inputs, dout, torch.bfloat16, kw)
    return [
        (a.double() - gl).abs().max().item()
        / (3 * (r.double() - gl).abs().max().item() + floor_for(gl))
        for a, r, gl in zip(got, ref, gold, strict=True)
    ]


def main() -> None:
    from qkv.kernels.cpu import isa
    from qkv.kernels.cpu.build import load

    print(f"path: {isa.choose(load())[0]}")
    worst = 0.0
    for name, shape, kw in grid():
        s = shares(shape, kw)
        worst = max(worst, *s)
        print(f"{name:24s} dq {s[0]:.3f}  dk {s[1]:.3f}  dv {s[2]:.3f}", flush=True)
    print(f"worst share of the allowance: {worst:.3f}")


if __name__ == "__main__":
    main()
