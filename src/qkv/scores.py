"""Score modifiers: functions applied to the scaled scores inside every tile, before masking.

A `ScoreMod` wraps `fn(score, b, h, q, kv) -> score` where `score` holds scaled scores
(`Q Kᵀ · scale`, plus any float mask) and `b, h, q, kv` are broadcastable int64 index tensors;
`q` is the query's position in key coordinates (bottom-right aligned, as in `qkv.masks`). It
must be differentiable and must not modify `score` in place. Learnable tensors it reads are
listed in `params` so that their gradients flow through the tiled kernel's explicit backward::

    mod = scores.compose(scores.alibi(slopes), scores.softcap(50.0))
    qkv.attention(q, k, v, causal=True, score_mod=mod)

Masked pairs are excluded after the modifier runs, so a modifier never un-masks a pair.

The built-in modifiers also describe themselves in `parts`, left to right:
`("alibi", slopes)`, `("softcap", cap)`, `("rel", table, max_distance)`; a compiled kernel
(the triton backend) reads that instead of running Python. A custom modifier has `parts=None`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

ScoreFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


class ScoreMod:
    """A named score modifier; see the module docstring."""

    def __init__(
        self,
        fn: ScoreFn,
        name: str = "custom",
        params: Sequence[torch.Tensor] = (),
        heads: int | None = None,
        parts: tuple[tuple, ...] | None = None,
    ):
        if not callable(fn):
            raise TypeError(f"fn must be callable as fn(score, b, h, q, kv), got {fn!r}")
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params must be tensors, got {type(p).__name__}")
        self.fn = fn
        self.name = name
        self.params = tuple(params)  # tensors whose gradients flow through attention
        self.heads = heads  # the query-head count the modifier is written for, or None
        self.parts = parts  # what it computes, for kernels that compile it (module docstring)

    def __call__(self, score, b, h, q, kv):
        return self.fn(score, b, h, q, kv)

    def __repr__(self) -> str:
        return self.name


def compose(*mods: ScoreMod) -> ScoreMod:
    """Apply `mods` left to right: `compose(f, g)` computes `g(f(score))`.

    The order matters when modifiers do not commute. FlashAttention caps the score first and
    adds ALiBi after, `cap · tanh(s / cap) − slope · |q − kv|`; in qkv that is
    `compose(softcap(cap), alibi(slopes))`. `compose(alibi(slopes), softcap(cap))` caps the
    biased score instead, `cap · tanh((s − slope · |q − kv|) / cap)`. The name reads as
    function composition, right to left: `alibi(H heads) ∘ softcap(cap)` for the first.
    """
    for m in mods:
        if not isinstance(m, ScoreMod):
            raise TypeError(f"compose takes ScoreMod objects, got {type(m).__name__}")

    fn = _Composed(tuple(mods))
    params = tuple(p for m in mods for p in m.params)
    heads = {m.heads for m in mods} - {None}
    if len(heads) > 1:
        raise ValueError(f"cannot compose modifiers written for different head counts {heads}")
    name = " ∘ ".join(repr(m) for m in reversed(mods))
    known = [m.parts for m in mods if m.parts is not None]
    parts = tuple(p for ps in known for p in ps) if len(known) == len(mods) else None
    return ScoreMod(fn, name, params, heads.pop() if heads else None, parts)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """The geometric slopes of Press et al. (2022): 2^(−8h/H) for h = 1 … H (power-of-two H;
    otherwise the paper's interleaving)."""
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")

    def pow2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(pow2(n_heads))
    closest = 2 ** math.floor(math.log2(n_heads))
    extra = pow2(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(pow2(closest) + extra)


def alibi(slopes: torch.Tensor | Sequence[float]) -> ScoreMod:
    """ALiBi: `score − slope[h] · |q − kv|` (for causal attention this is the paper's
    `slope · (kv − q)`). `slopes` has one entry per query head (see `alibi_slopes`)."""
    t = torch.as_tensor(slopes, dtype=torch.float64).flatten()
    if t.numel() == 0 or not torch.isfinite(t).all():
        raise ValueError(f"slopes must be a non-empty tensor of finite numbers, got {slopes!r}")

    return ScoreMod(_Alibi(t), f"alibi({t.numel()} heads)", heads=t.numel(), parts=(("alibi", t),))


def softcap(cap: float) -> ScoreMod:
    """Gemma 2's logit soft-capping: `cap · tanh(score / cap)`."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise ValueError(f"cap must be a number > 0, got {cap!r}")
    if not math.isfinite(cap):
        raise ValueError(f"cap must be finite, got {cap!r}")
    cap = float(cap)
    return ScoreMod(
        _Softcap(cap),
        f"softcap({cap})",
        parts=(("softcap", cap),),
    )


def relative_bias(table: torch.Tensor, max_distance: int) -> ScoreMod:
    """A learnable bias by clipped relative position: `score + table[h, clip(kv − q) + M]`
    with M = `max_distance`; `table` is `(H, 2M + 1)` (or `(1, 2M + 1)` shared by all heads)
    and receives gradients."""
    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance < 0:
        raise ValueError(f"max_distance must be an int ≥ 0, got {max_distance!r}")
    if not isinstance(table, torch.Tensor) or not table.dtype.is_floating_point:
        raise TypeError(f"table must be a floating tensor, got {table!r}")
    if table.dim() != 2 or table.shape[1] != 2 * max_distance + 1:
        raise ValueError(
            f"table must have shape (H, 2·max_distance + 1) = (H, {2 * max_distance + 1}), "
            f"got {tuple(table.shape)}"
        )
    M = max_distance

    fn = _RelativeBias(table, M)
    heads = table.shape[0] if table.shape[0] > 1 else None
    name = f"relative_bias(H={table.shape[0]}, max_distance={M})"
    return ScoreMod(fn, name, (table,), heads, parts=(("rel", table, M),))


# The built-in modifiers' functions: module-level classes (never closures), so that a ScoreMod
# pickles (spawn workers, object collectives, torch.save) by value, its tensors with it.


@dataclass(frozen=True, eq=False)
class _Composed:
    """`compose(*mods)`: each modifier in turn, left to right."""

    mods: tuple[ScoreMod, ...]

    def __call__(self, score, b, h, q, kv):
        for m in self.mods:
            score = m(score, b, h, q, kv)
        return score


@dataclass(frozen=True, eq=False)
class _Alibi:
    """`alibi(slopes)`: `score − slopes[h] · |q − kv|`."""

    slopes: torch.Tensor  # float64, one per query head

    def __call__(self, score, b, h, q, kv):
        return score - self.slopes.to(score)[h] * (q - kv).abs().to(score.dtype)


@dataclass(frozen=True)
class _Softcap:
    """`softcap(cap)`: `cap · tanh(score / cap)`."""

    cap: float

    def __call__(self, score, b, h, q, kv):
        return torch.tanh(score / self.cap) * self.cap


@dataclass(frozen=True, eq=False)
class _RelativeBias:
    """`relative_bias(table, max_distance)`: `score + table[h, clip(kv − q) + M]`; `table` is
    the caller's tensor itself (its gradients flow)."""

    table: torch.Tensor
    max_distance: int

    def __call__(self, score, b, h, q, kv):
        M, table = self.max_distance, self.table
        rel = (kv - q).clamp(-M, M) + M
        rows = h if table.shape[0] > 1 else torch.zeros_like(h)
        return score + table.to(score.dtype)[rows, rel]
