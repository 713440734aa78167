"""A dense bool tensor as a Mask (`from_tensor`): the pattern qkv cannot say in fewer words."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .mask import Mask


@dataclass(frozen=True, eq=False)
class _FromTensor:
    """`from_tensor(mask)`: `m4` the held copy `(B, H, Nq, Nk)`."""

    m4: torch.Tensor

    def rule(self, b, h, q, kv, n):
        B, H, nq_t, nk_t = self.m4.shape
        t = self.m4.to(q.device)
        rows = q - (nk_t - nq_t)
        return t[b if B > 1 else 0, h if H > 1 else 0, rows.clamp(0, nq_t - 1), kv] & (rows >= 0)

    def check(self, nq, nk):
        nq_t, nk_t = self.m4.shape[2:]
        if (nq, nk) != (nq_t, nk_t):
            raise ValueError(
                f"mask from_tensor has shape (Nq, Nk)=({nq_t}, {nk_t}) but the problem is "
                f"({nq}, {nk})"
            )


def from_tensor(mask: torch.Tensor) -> Mask:
    """A dense bool tensor `(Nq, Nk)`, `(H, Nq, Nk)` or `(B, H, Nq, Nk)` as a Mask (True = may
    attend). Its size must match the problem it is used on.

    The Mask holds a copy of `mask` taken here, so the layouts qkv keeps for it stay true:
    changing `mask` in place afterwards does not change the Mask (build a new one)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"from_tensor needs a bool tensor, got {got}")
    if mask.dim() not in (2, 3, 4):
        raise ValueError(f"from_tensor needs 2 to 4 dims, got shape {tuple(mask.shape)}")
    m4 = mask.detach().clone().reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    B, H = m4.shape[:2]
    rule = _FromTensor(m4)
    return Mask(
        rule=rule.rule,
        name=f"from_tensor(shape={tuple(mask.shape)})",
        batch=B if B > 1 else None,
        heads=H if H > 1 else None,
        check=rule.check,
    )
