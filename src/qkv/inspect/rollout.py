"""Attention rollout (Abnar & Zuidema, 2020): where information ends up after all layers.

One head's weights say where a position looks in one layer; but what it reads is itself a
mixture made by the layers below, and the residual connection carries each position's own
value forward. Rollout models both: each layer becomes `Â = rownorm(0.5·A + 0.5·I)` with `A`
the mean of its heads' weights, and the layers are multiplied in order,

    R_1 = Â_1,   R_l = Â_l · R_{l−1}      R_l[i, j]: how much of input j reaches i after layer l

so every row of every `R_l` is a distribution over the input positions.
"""

from __future__ import annotations

import torch


def rollout(weights: torch.Tensor, residual: float = 0.5) -> torch.Tensor:
    """Rollout through each layer: `weights (L, H, N, N)` (rows sum to 1) → `(L, N, N)`, where
    `[l]` is the rollout through layers 0..l. `residual` is the identity's share (0.5 in the
    paper); rows are renormalised so any non-negative input gives distributions."""
    if weights.dim() != 4 or weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"weights must be (L, H, N, N), got {tuple(weights.shape)}")
    if not 0.0 <= residual <= 1.0:
        raise ValueError(f"residual={residual!r} is out of range [0, 1]")
    n = weights.shape[-1]
    eye = torch.eye(n, dtype=weights.dtype, device=weights.device)
    layers = (1 - residual) * weights.mean(dim=1) + residual * eye  # (L, N, N)
    layers = layers / layers.sum(-1, keepdim=True)
    out = torch.empty_like(layers)
    acc = eye
    for layer in range(layers.shape[0]):
        acc = layers[layer] @ acc  # (N, N)
        out[layer] = acc
    return out
