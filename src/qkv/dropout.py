"""Counter-based attention dropout: whether weight (b, h, i, j) is kept is a pure function of
(seed, b, h, i, j).

Every backend that supports dropout (reference and tiled) draws the same mask for the same seed,
whatever its tiling, and a backward pass regenerates exactly the entries its forward dropped
without storing an N×N mask. The seed itself comes from torch's RNG (see `plan.make_plan`), so
`torch.manual_seed` makes dropout repeatable.

The hash is a 32-bit integer mixer (multiply / xor-shift rounds) evaluated in int64 with every
product kept below 2**63, so no step relies on integer overflow.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MUL1 = 0x7FEB352D  # odd multipliers below 2**31: products of 32-bit values stay below 2**63
_MUL2 = 0x6A09E667
_GOLDEN = 0x61C88647  # 2**32 / golden ratio, spreads consecutive indices


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Mix 32-bit values (held in int64, in [0, 2**32)) into well-spread 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    return x ^ (x >> 15)


def keep_mask(
    seed: int | torch.Tensor,
    p: float,
    bh: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
) -> torch.Tensor:
    """Bool tensor, True where the attention weight survives dropout with probability 1 − p.

    Args:
        seed: the plan's dropout seed (any non-negative int, or an int64 0-dim tensor).
        p: drop probability in [0, 1).
        bh: int64 `(B*H,)`-like index `b * H + h`, shaped to broadcast as `(..., 1, 1)`.
        rows: int64 query indices, shaped `(..., Nq, 1)`.
        cols: int64 key indices, shaped `(Nk,)`.
    Returns:
        bool tensor of the broadcast shape `(..., Nq, Nk)`.
    """
    s0, s1 = seed & _MASK32, (seed >> 32) & _MASK32
    head = _mix32((bh * _GOLDEN + s0) & _MASK32)
    row = _mix32(head ^ ((rows * _GOLDEN) & _MASK32))
    col = _mix32(((cols * _GOLDEN) & _MASK32) ^ s1)
    threshold = min(int(p * 2**32 + 0.5), 2**32)
    return _mix32(row ^ col) >= threshold


def keep_scale(p: float) -> float:
    """Factor applied to kept weights so the expectation is unchanged."""
    return 1.0 / (1.0 - p)
