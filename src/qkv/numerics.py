"""Small numerical pieces every backend shares: the causal rule, a NaN-safe `P @ V`, and the
float64 row terms of the backward (a row dot product, two-float splits)."""

from __future__ import annotations

import torch


def causal_allowed(rows: torch.Tensor, cols: torch.Tensor, offset: int) -> torch.Tensor:
    """Bottom-right aligned causal rule: query i may see key j when j ≤ i + offset.

    `offset = Nk − Nq`. With Nq = 3, Nk = 5 (offset 2), x = may attend::

        keys →   0 1 2 3 4
        query 0  x x x . .
        query 1  x x x x .
        query 2  x x x x x

    rows: `(Nq, 1)` int64, cols: `(Nk,)` int64; returns bool `(Nq, Nk)`.
    """
    return cols <= rows + offset


def all_finite(t: torch.Tensor) -> bool:
    """True when `t` holds no NaN or ±inf. One reduction in the common case: a finite sum
    proves it (a NaN or inf anywhere makes the sum non-finite); only a non-finite sum, which
    huge finite values can also cause, pays for the element-wise check."""
    low = t.dtype in (torch.float16, torch.bfloat16)  # their sums overflow too easily
    if t.numel() == 0 or bool(torch.isfinite(t.sum(dtype=torch.float32 if low else None))):
        return True
    return bool(torch.isfinite(t).all())


def weighted_values(p: torch.Tensor, v: torch.Tensor, v_finite: bool) -> torch.Tensor:
    """`p @ v`, where a weight of exactly 0 never lets a NaN or ±inf in `v` through.

    Plain `p @ v` turns `0 · NaN` into NaN, so garbage in a masked-out value row (an unused
    KV-cache slot, a padding token) would leak into every output row. When `v` is all finite
    (`v_finite`, checked once per call by the caller) this is exactly `p @ v`. Otherwise the
    finite part goes through the matmul and the non-finite entries are added back with IEEE
    semantics only where their weight is positive: any NaN, or both +inf and −inf, gives NaN;
    otherwise +inf or −inf.

    p: `(..., M, N)`, v: `(..., N, Dv)` broadcastable batch dims; returns `(..., M, Dv)`.
    """
    if v_finite:
        return p @ v
    out = p @ torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    seen = (p > 0).to(p.dtype)
    n_nan = seen @ torch.isnan(v).to(p.dtype)
    n_pos = seen @ torch.isposinf(v).to(p.dtype)
    n_neg = seen @ torch.isneginf(v).to(p.dtype)
    out = torch.where(n_pos > 0, torch.inf, out)
    out = torch.where(n_neg > 0, -torch.inf, out)
    return torch.where((n_nan > 0) | ((n_pos > 0) & (n_neg > 0)), torch.nan, out)


def row_dot(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, rows: int = 8192):
    """`(a ∘ b).sum(-1)` computed in `dtype`, a few thousand rows at a time (converting
    whole O(N·d) tensors to float64 at once cost ~15× more, mostly in fresh pages)."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    out = torch.empty(a2.shape[0], dtype=dtype, device=a.device)
    for i in range(0, a2.shape[0], rows):
        out[i : i + rows] = (a2[i : i + rows].to(dtype) * b2[i : i + rows].to(dtype)).sum(-1)
    return out.view(a.shape[:-1])


def two_float(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`(hi, lo)` in `dtype` with hi + lo = x to about twice dtype's precision (x float64;
    ±inf stays in hi, lo 0)."""
    hi = x.to(dtype)
    return hi, torch.nan_to_num(x - hi.to(x.dtype), nan=0.0).to(dtype)


def no_double_backward(backend: str) -> None:
    """Raise, inside a hand-written backward, when autograd asks to differentiate it
    (`create_graph=True`: gradient penalties, `gradgradcheck`)."""
    if torch.is_grad_enabled():
        raise NotImplementedError(
            f"backend={backend!r} has a hand-written backward, which cannot itself be "
            f"differentiated (create_graph=True: double backward, gradient penalties, "
            f"gradgradcheck); use backend='reference', whose gradient is autograd's"
        )
