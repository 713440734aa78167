"""`python -m qkv`: the textbook walk-through (N=4, d=8, d_k=4) and the backends side by side."""

from __future__ import annotations

import torch

import qkv


def _show(name: str, t: torch.Tensor, meaning: str) -> None:
    print(f"\n{name}  shape {tuple(t.shape)}  — {meaning}")
    print(t.numpy().round(3) if t.dim() <= 2 else f"  {tuple(t.shape)} tensor")


def walkthrough(n: int = 4, d: int = 8, d_k: int = 4, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    Wq, Wk, Wv = (torch.randn(d, d_k, generator=g, dtype=torch.float64) for _ in range(3))
    Q, K, V = X @ Wq, X @ Wk, X @ Wv
    print(f"Self-attention on N={n} tokens of width d={d}, projected to d_k={d_k} (seed {seed}).")
    _show("X", X, "the input: one row per token")
    print(f"\nW^Q, W^K, W^V  shape {tuple(Wq.shape)} each — learned projections d → d_k")
    _show("Q = X W^Q", Q, "what each token is looking for")
    _show("K = X W^K", K, "what each token offers to be found by")
    _show("V = X W^V", V, "what each token hands over when attended to")
    st = qkv.reference.steps(Q, K, V)
    _show("S = Q Kᵀ", st.S, "raw similarity of every query with every key")
    _show("S / √d_k", st.S_scaled, f"scaled by 1/√{d_k} so the softmax does not saturate")
    _show("A = softmax(S / √d_k)", st.A, "each row is a distribution over keys")
    print(f"  row sums: {st.A.sum(-1).numpy().round(6)}")
    _show("Out = A V", st.out, "each token's new representation: a weighted mix of values")
    flops, score_bytes = 4 * n * n * d_k, 4 * n * n
    print(f"\nCost at N={n}: {flops} FLOPs for QKᵀ and AV, {score_bytes} bytes of fp32 scores.")


def backends(n: int = 2048) -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))
    gold = qkv.attention(q.double(), k.double(), v.double(), causal=True, backend="reference")
    print(
        f"\nCausal attention, B=1, H=8, N={n}, D=64, fp32 — every backend against the fp64 oracle:"
    )
    for name in ("reference", "sdpa", "tiled", "auto"):
        out = qkv.attention(q, k, v, causal=True, backend=name)
        print(f"  {name:<9} max |out − golden| = {(out.double() - gold).abs().max().item():.2e}")
    print("\nWhat `auto` picks and why (qkv.dispatch):")
    print("  " + str(qkv.dispatch(q, k, v, causal=True)).replace("\n", "\n  "))
    print("  with return_lse=True:")
    print("  " + str(qkv.dispatch(q, k, v, causal=True, return_lse=True)).replace("\n", "\n  "))


if __name__ == "__main__":
    walkthrough()
    backends()
