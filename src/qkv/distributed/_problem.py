"""Validate a sharded attention call on every rank at once (one small all-gather)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..masks import Mask
from ..pairs import Pairs
from ..plan import make_plan, to_4d
from . import _comm
from .sharding import LAYOUTS, check_layout, pieces

_SHAPE_HINT = (
    "Every rank must pass its shard of the same problem: shards of N/P tokens each, cut from a "
    "sequence of N tokens with N divisible by the number of ranks P (by 2P for "
    "layout='zigzag'); pad the sequence if it does not divide."
)


@dataclass(frozen=True)
class Problem:
    """A validated sharded attention call, the same on every rank but `rank`."""

    group: _comm.Group  # the process group (None: the default group)
    rank: int  # this process's rank in the group
    world: int  # P, ranks in the group
    layout: str  # "contiguous" or "zigzag"
    # which pairs of the whole N×N problem may attend, at global positions: the causal flag and
    # a structured Mask; every block's and every rank's pairs are derived from it
    # (`_blocks.block_pairs`)
    pairs: Pairs
    scale: float  # multiplies Q Kᵀ
    return_lse: bool  # the caller wants lse
    input_rank: int  # 2, 3 or 4: the caller's layout, restored on the way out
    batch: int  # B
    heads: int  # H
    kv_heads: int  # Hkv
    n_local: int  # tokens per rank
    head_dim: int  # D
    v_dim: int  # Dv

    @property
    def n_global(self) -> int:
        return self.n_local * self.world


def validate(
    what: str,
    q: object,
    k: object,
    v: object,
    *,
    causal: object,
    mask: object,
    scale: object,
    layout: object,
    group: _comm.Group,
    return_lse: object,
    extra: Callable[[int, int, int, int], None] | None = None,
    extra_fields: dict[str, tuple[int, ...]] | None = None,
) -> Problem:
    """Check the arguments locally, then agree with every other rank (see `_comm.agree`).

    `extra(world, heads, kv_heads, n_local)` adds a method's own checks (raising ValueError)."""
    rank, world = _comm.rank_world(group)
    error = None
    plan = None
    try:
        plan = make_plan(q, k, v, causal=causal, scale=scale, return_lse=return_lse)
        check_layout(layout)
        if mask is not None and not isinstance(mask, Mask):
            raise TypeError(
                f"mask must be a structured qkv.masks.Mask (sliding_window, document, …) over "
                f"global positions, or None; got {type(mask).__name__} (a dense tensor cannot be "
                f"split across ranks here)"
            )
        if plan.kv_len != plan.q_len:
            raise ValueError(
                f"q and k must hold shards of the same sequence: q has {plan.q_len} tokens, k "
                f"has {plan.kv_len}"
            )
        if plan.q_len % pieces(str(layout)):
            raise ValueError(
                f"a zigzag shard holds two equal chunks, so its length must be even, got "
                f"{plan.q_len}; the full length must be divisible by 2P = {2 * world}"
            )
        if mask is not None:
            n = plan.q_len * world
            mask.check(n, n, batch=plan.batch, heads=plan.heads)
        if extra is not None:
            extra(world, plan.heads, plan.kv_heads, plan.q_len)
    except (TypeError, ValueError) as e:
        error = e
    fields = {
        "input dims": (q.dim() if isinstance(q, torch.Tensor) else -1,),
        "q.shape": _comm.shape4(q),
        "k.shape": _comm.shape4(k),
        "v.shape": _comm.shape4(v),
        "q/k/v dtype": tuple(_comm.dtype_code(t) for t in (q, k, v)),
        "device type": (_device_code(q),),
        "causal": (int(causal) if isinstance(causal, bool) else -1,),
        "layout": (LAYOUTS.index(layout) if layout in LAYOUTS else -1,),
        "scale": (_comm.float_bits(plan.scale if plan is not None else None),),
        "mask": (0 if mask is None else _comm.text_code(repr(mask)),),
        "return_lse": (int(return_lse) if isinstance(return_lse, bool) else -1,),
        "needs gradients": (int(_needs_grad(q, k, v)),),
        **(extra_fields or {}),
    }
    hint = {name: _SHAPE_HINT for name in ("q.shape", "k.shape", "v.shape", "input dims")}
    hint["needs gradients"] = (
        "Every rank must run with the same torch.is_grad_enabled() and requires_grad, or the "
        "backward ring would wait forever."
    )
    _comm.agree(group, what, fields, error, hint)
    assert plan is not None  # no error anywhere
    # what make_plan and the mask check accepted on every rank
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    assert mask is None or isinstance(mask, Mask)
    q4, k4 = to_4d(q), to_4d(k)
    n = q4.shape[2] * world
    return Problem(
        group=group,
        rank=rank,
        world=world,
        layout=str(layout),
        pairs=Pairs(n, n, causal=bool(causal), rule=mask),
        scale=plan.scale,
        return_lse=bool(return_lse),
        input_rank=plan.input_rank,
        batch=q4.shape[0],
        heads=q4.shape[1],
        kv_heads=k4.shape[1],
        n_local=q4.shape[2],
        head_dim=q4.shape[3],
        v_dim=plan.v_dim,
    )


def _device_code(x: object) -> int:
    if not isinstance(x, torch.Tensor):
        return -1
    return {"cpu": 0, "cuda": 1}.get(x.device.type, 2)


def _needs_grad(*ts: object) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in ts
    )
