"""Rotary position embedding (RoPE, Su et al. 2021), in the Llama layout."""

from __future__ import annotations

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotates pairs of features by position-dependent angles, so that the dot product of a
    rotated query at position p and a rotated key at position p' depends on p − p' only.

    Args:
        dim: how many leading features of each head to rotate (even; the head dim for full
            RoPE, less for partial rotary as in GPT-NeoX).
        base: the frequency base θ (10000 in Llama 1/2, 500000 in Llama 3).

    Feature i < dim/2 is paired with i + dim/2 (Llama's `rotate_half` layout) and rotated by
    `position · base^(−2i/dim)`.
    """

    inv_freq: torch.Tensor  # a buffer (nn.Module's attribute lookup types it loosely)

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 2:
            raise ValueError(f"dim must be a positive even int, got {dim!r}")
        if not base > 1:
            raise ValueError(f"base must be > 1, got {base!r}")
        self.dim, self.base = dim, float(base)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base:g}"

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate `x (…, N, head_dim)` for integer `positions` of shape `(N,)` or `(B, N)`
        (then x is `(B, H, N, head_dim)`)."""
        if x.shape[-1] < self.dim:
            raise ValueError(f"head dim {x.shape[-1]} is smaller than the rotary dim {self.dim}")
        angles = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(x.device)
        if positions.dim() == 2:  # (B, N, dim/2) → (B, 1, N, dim/2) to broadcast over heads
            angles = angles.unsqueeze(1)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        rotated = (rot.float() * cos + _rotate_half(rot.float()) * sin).to(x.dtype)
        return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated
