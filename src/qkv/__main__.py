"""`python -m qkv`: the textbook walk-through (N=4, d=8, d_k=4) and the backends side by side."""

from __future__ import annotations

import torch

import qkv
from qkv.inspect import render, walkthrough


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
    print(render(walkthrough()))
    backends()
