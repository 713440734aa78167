"""Packed vision attention: images (or windows) of different sizes in ONE qkv call.

A vision encoder packs the patches of all its images end to end, `(N, H, D)`, and attention runs
within each image (or window) only, as `cu_seqlens` delimits them. transformers runs that as one
attention call per segment in a Python loop unless the backend is flash attention. Here it is
one `qkv.attention` call, forward and backward, in one of two layouts:

- **padded** (many segments of similar length, such as 112-pixel windows): the segments become
  the batch of a `(S, H, L, D)` problem, L the longest segment, gathered from the packed rows
  (no copy at all when every segment has length L), with a key-padding mask `(S, 1, 1, L)`:
  O(S·L), never N². Padded query rows are computed and dropped. `auto` runs it on torch SDPA.
  Without autograd the gathers go to buffers kept per thread between calls (three, the size
  of q, k, v padded; `release_workspace()` frees them): an encoder gathers the same sizes in
  every block, and fresh memory of that size costs more in page faults than the copy.
- **varlen** (a few segments of very different lengths, such as whole images): the packed
  sequence as one `(1, H, N, D)` problem under `qkv.masks.varlen(cu_seqlens, cu_seqlens)`, whose
  tile layout is block diagonal: the tiled kernel computes only the tiles of each segment.

`layout="auto"` takes varlen wherever `qkv.dispatch` says `auto` runs the varlen request on
qkv's compiled CPU kernel (`cpu`): it skips the other segments' tiles at its matmul rate, which
beats the padded layout on SDPA for windows too (the vision section of docs/benchmarks.md).
Otherwise padded when padding adds at most `PADDED_WASTE` (12.5%) to the work Σ L_s², else
varlen. Either is exact: it equals running every segment alone (the tests compare forward and
gradients with the per-segment reference).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch

from .. import masks
from ..cache import CACHE
from ..functional import attention, dispatch

LAYOUTS = ("auto", "padded", "varlen")
PADDED_WASTE = 1.125  # padded when S·L² ≤ this × Σ L_s²


@dataclass(frozen=True)
class PackedLayout:
    """How packed segments are laid out for one call (a function of the lengths only)."""

    layout: str  # "padded" or "varlen"
    lengths: tuple[int, ...]  # non-empty segment lengths, in order
    total: int  # N
    longest: int  # L

    @property
    def work(self) -> int:
        """Σ L_s²: the (query, key) pairs the segments hold."""
        return sum(n * n for n in self.lengths)

    @property
    def padded_work(self) -> int:
        """S · L²: the pairs the padded layout computes."""
        return len(self.lengths) * self.longest**2


def _check_cu(cu_seqlens: object, total: int) -> list[int]:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise TypeError(f"cu_seqlens must be an int32/int64 tensor, got {cu_seqlens!r}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with ≥ 1 entry, got {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {cu[:8]}")
    if cu[-1] != total:
        raise ValueError(f"cu_seqlens ends at {cu[-1]}, but the packed tensors hold {total} rows")
    return [b - a for a, b in itertools.pairwise(cu)]


def plan_layout(
    cu_seqlens: torch.Tensor, total: int, layout: str = "auto", compiled: bool = False
) -> PackedLayout:
    """Choose the layout for segments delimited by `cu_seqlens` (see the module docstring);
    `compiled`: the compiled CPU kernel will run the call."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    lengths = tuple(n for n in _check_cu(cu_seqlens, total) if n > 0)
    longest = max(lengths, default=0)
    plan = PackedLayout("padded", lengths, total, longest)
    if layout == "auto" and compiled:
        layout = "varlen"
    elif layout == "auto":
        layout = "padded" if plan.padded_work <= PADDED_WASTE * plan.work else "varlen"
    return PackedLayout(layout, lengths, total, longest)


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    layout: str = "auto",
    backend: object = "auto",
    finite_inputs: bool = False,
) -> torch.Tensor:
    """Attention within each packed segment, in one `qkv.attention` call.

    Args:
        q: `(N, H, D)`, the tokens of all segments end to end (FlashAttention's varlen layout,
            what a vision encoder's attention holds); k: `(N, Hkv, D)`; v: `(N, Hkv, Dv)`.
        cu_seqlens: int `(S + 1,)`: segment s owns rows `cu_seqlens[s] … cu_seqlens[s+1]`
            (transformers' `cu_seqlens` of a Qwen2-VL / Qwen2.5-VL vision block).
        scale: multiplies Q Kᵀ (default 1/√D).
        layout: "auto", "padded" or "varlen" (module docstring).
        backend: passed to `qkv.attention` ("auto": for varlen qkv's auto, which picks the
            compiled CPU kernel, or else the tiled backend, whose fused strips span whole
            segments (`TiledBackend.strips_for`); for padded qkv's auto, SDPA on these sizes).
        finite_inputs: as in `qkv.attention` (the varlen layout hides the other segments' keys;
            the padded one hides only copies of a segment's own keys, which needs no promise).

    Returns:
        `(N, H, Dv)`, each row attending to the keys of its own segment; differentiable.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape (total_tokens, heads, dim), got {got}")
    N = q.shape[0]
    if k.shape[0] != N or v.shape[0] != N:
        raise ValueError(
            f"q, k and v must hold the same tokens, got {N}, {k.shape[0]} and {v.shape[0]} rows"
        )
    plan, runs_on = plan_call(
        q, k, v, cu_seqlens, scale=scale, layout=layout, backend=backend,
        finite_inputs=finite_inputs,
    )  # fmt: skip
    if N == 0:
        return q.new_zeros(0, q.shape[1], v.shape[2])
    if plan.layout == "varlen":
        out = attention(
            *_as_one_sequence(q, k, v),
            mask=_varlen_mask(tuple(cu_seqlens.tolist())),
            scale=scale,
            backend=runs_on,
            finite_inputs=finite_inputs,
        )
        return out[0].transpose(0, 1)
    return _padded(q, k, v, plan, scale, runs_on)


def plan_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    layout: str = "auto",
    backend: object = "auto",
    finite_inputs: bool = False,
) -> tuple[PackedLayout, object]:
    """The layout `packed_attention` takes for these arguments and the backend its
    `qkv.attention` call gets. With backend "auto" and a layout that may be varlen, the varlen
    request goes to `qkv.dispatch`: where auto would run it on the compiled CPU kernel (`cpu`),
    that backend runs it as it is (and layout "auto" becomes varlen); any other choice runs
    varlen on `tiled` (a kernel that skips the other segments' tiles, with strips sized for
    packed segments), and padded on qkv's auto."""
    plan = plan_layout(cu_seqlens, q.shape[0], layout)  # checks cu_seqlens and layout
    if backend != "auto" or layout == "padded" or plan.total == 0:
        return plan, backend
    mask = _varlen_mask(tuple(cu_seqlens.tolist()))
    decision = dispatch(
        *_as_one_sequence(q, k, v), mask=mask, scale=scale, finite_inputs=finite_inputs
    )
    if decision.name == "cpu":
        return plan_layout(cu_seqlens, plan.total, layout, compiled=True), decision.backend
    return plan, "tiled" if plan.layout == "varlen" else backend


def _as_one_sequence(q, k, v) -> tuple[torch.Tensor, ...]:
    """The packed `(N, ·, ·)` tensors as one `(1, ·, N, ·)` sequence (views)."""
    return tuple(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))


def _varlen_mask(cu: tuple[int, ...]) -> masks.Mask:
    """One Mask object per distinct `cu_seqlens` (kept in `qkv.cache`), so that the layouts and
    schedules cached per Mask serve every block of an encoder that reuses the same segments."""

    def build() -> masks.Mask:
        t = torch.tensor(cu, dtype=torch.long)
        return masks.varlen(t, t)

    return CACHE.get(("vision.varlen_mask", cu), build)


def _padded(q, k, v, plan: PackedLayout, scale, backend) -> torch.Tensor:
    S, L, H, Dv = len(plan.lengths), plan.longest, q.shape[1], v.shape[2]
    # q, k, v (N, ·, ·) → (S, ·, L, ·): segment s in batch row s, padded to L
    lengths = torch.tensor(plan.lengths, device=q.device)
    if plan.total == S * L:  # every segment has length L: a view, no copy
        qb, kb, vb = (t.view(S, L, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        out = attention(qb, kb, vb, scale=scale, backend=backend)  # (S, H, L, Dv)
        return out.transpose(1, 2).reshape(plan.total, H, Dv)  # SDPA's out is (S, L, H, Dv)
    starts = torch.cumsum(lengths, 0) - lengths
    j = torch.arange(L, device=q.device)
    real = j < lengths[:, None]  # (S, L)
    # padded slots read their segment's first row: finite, and masked out as keys
    rows = torch.where(real, starts[:, None] + j, starts[:, None]).reshape(-1)
    reuse = not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
    qb, kb, vb = (
        _gather(t, rows, name if reuse else None).view(S, L, *t.shape[1:]).transpose(1, 2)
        for name, t in (("q", q), ("k", k), ("v", v))
    )
    # The masked slots hold copies of a visible key/value of the same segment: nothing hidden
    # there that the segment does not see anyway, so the promise of finite_inputs holds.
    out = attention(
        qb, kb, vb, mask=real[:, None, None, :], scale=scale, backend=backend, finite_inputs=True
    )
    # (S, L, H, Dv) view → its real rows, which are in packed order: one gather, no other copy
    return out.transpose(1, 2)[real]


_workspace = threading.local()


def _gather(t: torch.Tensor, rows: torch.Tensor, slot: str | None) -> torch.Tensor:
    """`t.index_select(0, rows)`; without autograd into a buffer kept per thread and `slot`
    between calls. A vision encoder gathers the same sizes in every block, and a fresh buffer
    of that size costs more in page faults than the copy into it."""
    if slot is None:
        return t.index_select(0, rows)
    shape = (rows.numel(), *t.shape[1:])
    buffers = _workspace.__dict__.setdefault("buffers", {})
    buf = buffers.get(slot)
    if buf is None or buf.shape != shape or buf.dtype != t.dtype or buf.device != t.device:
        buf = buffers[slot] = torch.empty(shape, dtype=t.dtype, device=t.device)
    return torch.index_select(t, 0, rows, out=buf)


def release_workspace() -> None:
    """Free the gather buffers `packed_attention` keeps for this thread between calls."""
    _workspace.__dict__.pop("buffers", None)
