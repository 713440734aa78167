"""Packed variable-length sequences: `qkv.attention_varlen`, FlashAttention's varlen layout."""

from __future__ import annotations

import torch

from . import masks
from .functional import attention
from .scores import ScoreMod


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: object = "auto",
    return_lse: bool = False,
    score_mod: ScoreMod | None = None,
):
    """Attention over sequences packed end to end, with no padding and no N×N mask.

    Args:
        q: `(total_q, H, D)`, the query tokens of every sequence, one after another.
        k: `(total_k, Hkv, D)`; v: `(total_k, Hkv, Dv)`.
        cu_seqlens_q: int `(S + 1,)`, cumulative query lengths: sequence s owns rows
            `cu_seqlens_q[s] … cu_seqlens_q[s+1]` (starts at 0, ends at total_q).
        cu_seqlens_k: the same for keys/values.
        causal: bottom-right aligned within each sequence.
        Other arguments as in `qkv.attention`.

    Returns:
        `out (total_q, H, Dv)`, or `(out, lse)` with lse `(H, total_q)` as FlashAttention
        returns it. Runs as a document mask: the tiled backend computes only the tiles on the
        block diagonal.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape (total_tokens, heads, dim), got {shape}")
    rule = masks.varlen(cu_seqlens_q, cu_seqlens_k, causal=causal)
    # (total, H, D) → (1, H, total, D): views, no copy.
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    result = attention(
        q4,
        k4,
        v4,
        mask=rule,
        scale=scale,
        dropout_p=dropout_p,
        backend=backend,
        return_lse=return_lse,
        score_mod=score_mod,
    )
    if return_lse:
        out, lse = result
        return out[0].transpose(0, 1), lse[0]
    return result[0].transpose(0, 1)
