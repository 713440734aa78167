"""Small numerical pieces every backend shares: a NaN-safe `P @ V` and the float64 row terms of
the backward (a row dot product, two-float splits). Which pairs may attend (the causal rule
included) is `qkv.layout.allowed`'s."""

from __future__ import annotations

import torch


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


def row_dot(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, rows: int | None = None):
    """`(a ∘ b).sum(-1)` computed in `dtype`, a chunk of rows at a time: 8192 on the CPU
    (converting whole O(N·d) tensors to float64 at once costs far more, mostly in fresh pages),
    64 MiB of `dtype` per operand on a GPU (where each chunk's four launches cost more)."""
    if rows is None:
        rows = 8192 if a.device.type == "cpu" else max(1, (64 << 20) // (a.shape[-1] * 8))
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


def _double_backward_error(backend: str) -> NotImplementedError:
    return NotImplementedError(
        f"backend={backend!r} has a hand-written backward, which cannot itself be "
        f"differentiated (create_graph=True: double backward, gradient penalties, "
        f"gradgradcheck, torch.func.grad of a grad); use backend='reference', whose gradient "
        f"is autograd's"
    )


class _OnceDifferentiable(torch.autograd.Function):
    """Identity on gradients; differentiating them raises `_double_backward_error`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(backend, n, *tensors):
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.backend = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        raise _double_backward_error(ctx.backend)


def once_differentiable(backend: str, grads: tuple, inputs: tuple) -> tuple:
    """The gradients a hand-written backward computed (under `torch.no_grad()`), tied to the
    forward's `inputs` when autograd records the backward (`create_graph=True`, torch.func.grad),
    so that a single gradient works and differentiating it raises a clear error instead of
    silently giving zero."""
    if not torch.is_grad_enabled():
        return grads
    where = [i for i, g in enumerate(grads) if g is not None]
    linked = [x for x in inputs if isinstance(x, torch.Tensor)]
    tied = _OnceDifferentiable.apply(backend, len(where), *(grads[i] for i in where), *linked)
    out = list(grads)
    for i, g in zip(where, tied, strict=True):
        out[i] = g
    return tuple(out)


_COUNT = 256  # guarded columns per product: counts of NaN/+inf/−inf stay exact in float32


def guarded_pv(
    p: torch.Tensor, v: torch.Tensor, guarded: tuple[tuple[int, int], ...] | None
) -> torch.Tensor:
    """`p @ v` where, in the column ranges `guarded` (all columns when None), a value whose
    weight is exactly 0 (masked, dropped) never reaches the result through `0 · NaN`, without
    reading values to decide: those columns multiply v with its NaN/inf zeroed, and one more
    product counts, per output element, the NaN, +inf and −inf values seen with a positive
    weight, which are put back with IEEE semantics (any NaN, or +inf with −inf: NaN). Other
    columns are a plain product: every row sees every one of their keys, and a NaN there
    rightly reaches it.

    p: `(..., M, N)`, v: `(..., N, Dv)`; guarded: `(start, stop)` column ranges."""
    n = p.shape[-1]
    spans = [(0, n)] if guarded is None else [g for g in guarded if g[1] > g[0]]
    pieces, at = [], 0
    for a, b in spans:
        if a > at:
            pieces.append((at, a, False))
        for c in range(a, b, _COUNT - 1):
            pieces.append((c, min(c + _COUNT - 1, b), True))
        at = b
    if at < n:
        pieces.append((at, n, False))
    out = None
    for a, b, guard in pieces:
        pp, vv = p[..., a:b], v[..., a:b, :]
        if not guard:
            part = pp @ vv
        else:
            part = pp @ torch.nan_to_num(vv, nan=0.0, posinf=0.0, neginf=0.0)
            code = torch.isnan(vv).to(p.dtype)
            code += torch.isposinf(vv).to(p.dtype) * _COUNT
            code += torch.isneginf(vv).to(p.dtype) * _COUNT**2
            counts = (pp > 0).to(p.dtype) @ code  # exact: < 2**24 for ≤ 255 columns
            n_neg = torch.div(counts, _COUNT**2, rounding_mode="floor")
            n_pos = torch.div(counts - n_neg * _COUNT**2, _COUNT, rounding_mode="floor")
            n_nan = counts - n_neg * _COUNT**2 - n_pos * _COUNT
            part = torch.where(n_pos > 0, torch.inf, part)
            part = torch.where(n_neg > 0, -torch.inf, part)
            part = torch.where((n_nan > 0) | ((n_pos > 0) & (n_neg > 0)), torch.nan, part)
        out = part if out is None else out.add_(part)
    if out is None:
        return p.new_zeros((*p.shape[:-1], v.shape[-1]))
    return out
