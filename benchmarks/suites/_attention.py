"""The attention problem several suites share: fp32 q, k, v of shape (B, H, N, D) on the CPU,
seeded, with a fixed upstream gradient, and FlashAttention's FLOP count."""

from __future__ import annotations

import torch

from ..suite import FWD, Inputs

BATCH, HEADS, HEAD_DIM = 1, 8, 64
SHAPE_TEXT = f"fp32, B={BATCH}, H={HEADS}, D={HEAD_DIM}, Nq = Nk = N, CPU"


def inputs(n: int, backward: bool, seed: int = 0) -> Inputs:
    """((q, k, v), grad): q, k, v require grad and `grad` is the output's gradient when
    `backward`; else ((q, k, v), None)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (BATCH, HEADS, n, HEAD_DIM)
    q, k, v, grad = (torch.randn(shape, generator=gen) for _ in range(4))
    if not backward:
        return (q, k, v), None
    return (q.requires_grad_(), k.requires_grad_(), v.requires_grad_()), grad


def flops(n: int, pass_: str, density: float = 1.0) -> float:
    """FlashAttention's count: forward 4·B·H·N²·D × the share of pairs computed (½ for causal);
    the backward is 2.5× the forward, so forward + backward is 3.5×."""
    forward = 4.0 * BATCH * HEADS * n * n * HEAD_DIM * density
    return forward if pass_ == FWD else 3.5 * forward


FLOPS_TEXT = (
    "GFLOP/s by FlashAttention's count: forward `4·B·H·N²·D`, halved for causal; backward 2.5× "
    "forward, so forward + backward is 3.5× forward."
)
