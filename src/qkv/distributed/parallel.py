"""Sequence parallelism for modules: `qkv.nn.MultiHeadAttention` on a sharded sequence.

    sp = qkv.distributed.SequenceParallel(layout="zigzag")        # the default process group
    block = qkv.nn.TransformerBlock(256, 8, rope=True)
    qkv.distributed.parallelize(block, sp)       # every MultiHeadAttention inside runs sharded
    x_local = qkv.distributed.shard(x, dim=1, layout="zigzag")   # (B, N/P, d_model)
    y_local = block(x_local, causal=True)        # this rank's shard of block(x)

Everything in a Transformer block but attention works token by token, so only attention needs
the other ranks; RoPE uses each token's global position (`qkv.distributed.positions`).
Parameter gradients are per-rank partial sums: all-reduce them (as DDP does) before stepping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..masks import Mask
from .ring import ring_attention
from .sharding import check_layout, positions
from .ulysses import ulysses_attention

METHODS = ("ring", "ulysses")


@dataclass(frozen=True)
class SequenceParallel:
    """How a module shards its attention over the sequence."""

    group: dist.ProcessGroup | None = None  # the process group; None is the default group
    layout: str = "zigzag"  # how the sequence is cut: "contiguous" or "zigzag"
    method: str = "ring"  # "ring" (ring_attention) or "ulysses" (ulysses_attention)
    head_chunks: int | str = "auto"  # ring only: passes over slices of the heads (ring_attention)

    def __post_init__(self):
        check_layout(self.layout)
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.group is not None and not isinstance(self.group, dist.ProcessGroup):
            raise TypeError(
                f"group must be a torch.distributed ProcessGroup or None, got "
                f"{type(self.group).__name__}"
            )

    @classmethod
    def of(cls, value: object) -> SequenceParallel | None:
        """None → None; a SequenceParallel as is; a ProcessGroup or True → defaults on it."""
        if value is None or value is False:
            return None
        if isinstance(value, SequenceParallel):
            return value
        if value is True:
            return cls()
        if isinstance(value, dist.ProcessGroup):
            return cls(group=value)
        raise TypeError(
            f"sequence_parallel must be None, True, a ProcessGroup or a "
            f"qkv.distributed.SequenceParallel, got {type(value).__name__}"
        )

    def positions(
        self, n_local: int, start: int = 0, device: torch.device | None = None
    ) -> torch.Tensor:
        """Global positions of this rank's n_local tokens (`start`: cached tokens, which a
        sharded sequence does not have)."""
        if start:
            raise NotImplementedError("sequence-parallel attention does not support a KVCache")
        return positions(n_local, self.layout, self.group, device)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        mask: Mask | None = None,
        backend: object = "auto",
        dropout_p: float = 0.0,
        return_weights: bool = False,
        cross: bool = False,
        cache: bool = False,
    ) -> torch.Tensor:
        """This rank's shard of attention over the whole sharded sequence (what
        `qkv.nn.MultiHeadAttention` calls; `backend` is the ring's per-block kernel choice,
        ignored here)."""
        unsupported = {
            "context (cross-attention)": cross,
            "a KVCache": cache,
            "return_weights": return_weights,
            "attention dropout in training mode": dropout_p > 0,
        }
        for what, used in unsupported.items():
            if used:
                raise NotImplementedError(f"sequence-parallel attention does not support {what}")
        if mask is not None and not isinstance(mask, Mask):
            raise TypeError(
                "with sequence_parallel, mask must be a structured qkv.masks.Mask over global "
                f"positions, got {type(mask).__name__}"
            )
        if self.method == "ring":
            return ring_attention(
                q,
                k,
                v,
                causal=causal,
                mask=mask,
                layout=self.layout,
                group=self.group,
                head_chunks=self.head_chunks,
            )
        return ulysses_attention(
            q, k, v, causal=causal, mask=mask, layout=self.layout, group=self.group
        )


def parallelize(module: torch.nn.Module, sequence_parallel: object = True) -> torch.nn.Module:
    """Make every `qkv.nn.MultiHeadAttention` in `module` run sharded (in place; returns
    `module`). `sequence_parallel`: a `SequenceParallel`, a ProcessGroup, True (defaults on
    the default group) or None (back to single-process)."""
    from ..nn.attention import MultiHeadAttention

    sp = SequenceParallel.of(sequence_parallel)
    found = 0
    for m in module.modules():
        if isinstance(m, MultiHeadAttention):
            m.sequence_parallel = sp
            found += 1
    if not found:
        raise ValueError(f"{type(module).__name__} holds no qkv.nn.MultiHeadAttention")
    return module
