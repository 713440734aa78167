"""How a sequence of N tokens is cut across P ranks, and the helpers that cut and glue it.

Two layouts, both P equal shards of N/P tokens::

    contiguous (P=4):  rank   0     1     2     3
                       tokens [0:N/4)[N/4:N/2)…

    zigzag (P=4): cut the sequence into 2P = 8 chunks c0 … c7; rank r holds chunks r and 2P−1−r
                       rank 0: c0 c7   rank 1: c1 c6   rank 2: c2 c5   rank 3: c3 c4

Under causal attention the contiguous layout is unbalanced (the last rank's queries see every
key, the first rank's only its own), while in the zigzag layout every rank holds one early and
one late chunk, so every rank computes the same number of tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _comm

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Segment:
    """A run of consecutive tokens inside one rank's shard."""

    start: int  # global position of its first token
    length: int  # tokens
    local: int  # where it starts inside the rank's shard

    @property
    def stop(self) -> int:
        """One past the global position of its last token."""
        return self.start + self.length

    @property
    def rows(self) -> slice:
        """Its rows inside the rank's shard."""
        return slice(self.local, self.local + self.length)


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def pieces(layout: str) -> int:
    """Chunks per rank: 1 (contiguous) or 2 (zigzag)."""
    return 1 if check_layout(layout) == "contiguous" else 2


def segments(rank: int, world: int, n_local: int, layout: str) -> tuple[Segment, ...]:
    """The runs of global positions that rank `rank` holds, in shard order."""
    if check_layout(layout) == "contiguous":
        return (Segment(rank * n_local, n_local, 0),)
    c = n_local // 2
    return (Segment(rank * c, c, 0), Segment((2 * world - 1 - rank) * c, c, c))


def positions(
    n_local: int,
    layout: str = "contiguous",
    group: _comm.Group = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global positions `(n_local,)` int64 of this rank's shard (e.g. for RoPE)."""
    rank, world = _comm.rank_world(group)
    return positions_of(rank, world, n_local, layout, device)


def positions_of(
    rank: int, world: int, n_local: int, layout: str, device: torch.device | str | None = None
) -> torch.Tensor:
    parts = [
        torch.arange(s.start, s.stop, device=device) for s in segments(rank, world, n_local, layout)
    ]
    return torch.cat(parts)


def _dim(x: torch.Tensor, dim: object) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__} {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def shard(
    x: torch.Tensor, dim: int, layout: str = "contiguous", group: _comm.Group = None
) -> torch.Tensor:
    """This rank's shard of the full tensor `x` along `dim` (a copy, differentiable).

    `x.shape[dim]` must be divisible by the number of ranks P (by 2P for `"zigzag"`); every
    rank passes the same `x`. No communication."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    layout = check_layout(layout)
    dim = _dim(x, dim)
    rank, world = _comm.rank_world(group)
    n, parts = x.shape[dim], world * pieces(layout)
    if n % parts:
        raise ValueError(
            f"cannot shard a length of {n} (dim={dim}) over {world} ranks in layout "
            f"{layout!r}: it must be divisible by {parts}; pad the sequence"
        )
    n_local = n // world
    cut = [x.narrow(dim, s.start, s.length) for s in segments(rank, world, n_local, layout)]
    return torch.cat(cut, dim=dim) if len(cut) > 1 else cut[0].clone()


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, layout, group, rank, world):
        ctx.dim, ctx.layout, ctx.group, ctx.rank, ctx.world = dim, layout, group, rank, world
        return unshard_parts(_comm.all_gather(x, group, world), dim, layout)

    @staticmethod
    def backward(ctx, grad):
        # Every rank used the whole tensor: this shard's gradient is the sum over ranks.
        total = _comm.all_reduce(grad, ctx.group)
        n_local = total.shape[ctx.dim] // ctx.world
        cut = [
            total.narrow(ctx.dim, s.start, s.length)
            for s in segments(ctx.rank, ctx.world, n_local, ctx.layout)
        ]
        return torch.cat(cut, dim=ctx.dim), None, None, None, None, None


def unshard_parts(parts: list[torch.Tensor], dim: int, layout: str) -> torch.Tensor:
    """Glue the shards of every rank (`parts[r]` from rank r) into the full tensor."""
    world, n_local = len(parts), parts[0].shape[dim]
    chunks: dict[int, torch.Tensor] = {}
    for r, p in enumerate(parts):
        for s in segments(r, world, n_local, layout):
            chunks[s.start] = p.narrow(dim, s.local, s.length)
    return torch.cat([chunks[k] for k in sorted(chunks)], dim=dim)


def unshard(
    x_local: torch.Tensor, dim: int, layout: str = "contiguous", group: _comm.Group = None
) -> torch.Tensor:
    """The full tensor, gathered from every rank's shard along `dim` (collective: every rank
    calls it and gets the same result). Differentiable: the gradient of a shard is the sum over
    ranks of the gradients of its slice. Ranks whose shards differ in shape or dtype all raise
    the same ValueError."""
    error, fields = None, {}
    try:
        if not isinstance(x_local, torch.Tensor):
            raise TypeError(f"x_local must be a torch.Tensor, got {type(x_local).__name__}")
        layout = check_layout(layout)
        dim = _dim(x_local, dim)
        if layout == "zigzag" and x_local.shape[dim] % 2:
            raise ValueError(
                f"a zigzag shard holds two equal chunks, but its length along dim={dim} is "
                f"{x_local.shape[dim]} (odd)"
            )
    except (TypeError, ValueError) as e:
        error = e
    ok = error is None
    fields = {
        "x_local.dim()": (x_local.dim() if ok else -1,),
        "x_local.shape": tuple(x_local.shape) + (0,) * (8 - x_local.dim())
        if ok and x_local.dim() <= 8
        else (-1,) * 8,
        "x_local.dtype": (_comm.dtype_code(x_local) if ok else -1,),
        "dim": (dim if ok else -1,),
        "layout": (LAYOUTS.index(layout) if ok else -1,),
    }
    _comm.agree(group, "unshard", fields, error)
    rank, world = _comm.rank_world(group)
    if world == 1:
        return x_local
    return _Unshard.apply(x_local, dim, layout, group, rank, world)
