"""Validate a user's attention request once and carry it to a kernel as an `AttentionPlan`.

Everything a kernel needs to know about the problem lives in the plan; kernels trust it and do
not re-validate user input. Tensors themselves (q, k, v) travel beside the plan so that autograd
sees them as ordinary arguments. Past a custom op's boundary the plan travels as an `OpPlan`
(`AttentionPlan.op_plan`), its fields as the op's arguments, and is read back there.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .cache import handle, lookup
from .layout import BlockLayout
from .masks import Mask
from .pairs import Pairs
from .scores import ScoreMod

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class AttentionPlan:
    """A validated attention problem in the canonical `(B, H, N, D)` layout."""

    batch: int  # B
    heads: int  # H, query heads
    kv_heads: int  # Hkv, key/value heads; H % Hkv == 0
    q_len: int  # Nq
    kv_len: int  # Nk
    head_dim: int  # D, of q and k
    v_dim: int  # Dv, of v and of the output
    scale: float  # multiplies Q Kᵀ; default 1/√D
    pairs: Pairs  # which pairs may attend: causal, a Mask, a bool/float mask, a held layout
    score_mod: ScoreMod | None  # applied to the scaled scores before masking
    dropout_p: float  # probability of dropping an attention weight
    dropout_seed: int | torch.Tensor | None  # dropout mask's seed (an int64 0-dim tensor when
    # drawn from torch's RNG: no host sync); None when dropout_p == 0
    finite_inputs: bool  # the caller promises k and v hold no NaN/inf (see qkv.attention)
    return_lse: bool  # the caller wants lse
    return_weights: bool  # the caller wants the attention matrix A
    wants_grad: bool  # autograd will differentiate the result (grad mode, an input requires it)
    input_rank: int  # 2, 3 or 4: the rank the caller used, restored on the way out
    dtype: torch.dtype  # dtype of q, k, v and of the output
    device: torch.device  # device of every tensor in the problem

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1 for plain multi-head attention)."""
        return self.heads // self.kv_heads

    @property
    def compute_dtype(self) -> torch.dtype:
        """fp64 stays fp64; everything else accumulates in fp32."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def op_plan(self) -> OpPlan:
        """The plan as a custom op's arguments (`OpPlan`), made once per call by the backend."""
        seed = self.dropout_seed if self.dropout_p > 0 else None
        if seed is not None and not isinstance(seed, torch.Tensor):
            seed = torch.tensor(seed, dtype=torch.int64, device=self.device)
        p = self.pairs
        return OpPlan(
            p.mask, p.bias, seed, self.scale, p.causal, self.dropout_p, self.finite_inputs,
            self.wants_grad, handle(p.rule), handle(p.layout),
        )  # fmt: skip


class OpPlan(NamedTuple):
    """An `AttentionPlan` without a score modifier as a custom op's arguments: the one problem
    description both kernels' ops (`kernels/tiled/op.py`, `kernels/cpu/op.py`) take right after
    `(q, k, v)`, as `*op_plan`, and read back inside with `plan` or `pairs`. A custom op takes
    only tensors, numbers, bools, strings and lists of these (torch 2.4's `torch.library` has
    no opaque objects), so the plan crosses as these fields, in this order: the pairs' tensors
    and the dropout seed as tensors (a seed read inside the op: no host read in a graph), the
    structured Mask and a held BlockLayout as `qkv.cache.handle` numbers, so that a compiled
    graph specialises on them (a new Mask object means a new graph, as a new `BlockMask` does
    for FlexAttention). The shapes come from q, k and v."""

    mask: torch.Tensor | None  # the pairs' bool mask
    bias: torch.Tensor | None  # the pairs' float bias
    seed: torch.Tensor | None  # dropout's seed, int64 0-dim; None without dropout
    scale: float
    causal: bool
    dropout_p: float
    finite: bool  # the plan's finite_inputs
    want_grad: bool  # the plan's wants_grad
    rule: int  # the pairs' Mask, by its handle
    held: int  # the pairs' held BlockLayout, by its handle

    def pairs(self, q_len: int, kv_len: int) -> Pairs:
        """The pairs of an Nq × Nk problem this plan carries."""
        return Pairs(
            q_len, kv_len, self.causal, lookup(self.rule), self.mask, self.bias, lookup(self.held)
        )

    def plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AttentionPlan:
        """The plan of an op's 4-D q, k, v (validated once, by `make_plan`, before the op)."""
        B, H, Nq, D = q.shape
        return AttentionPlan(
            batch=B,
            heads=H,
            kv_heads=k.shape[1],
            q_len=Nq,
            kv_len=k.shape[2],
            head_dim=D,
            v_dim=v.shape[-1],
            scale=self.scale,
            pairs=self.pairs(Nq, k.shape[2]),
            score_mod=None,
            dropout_p=self.dropout_p,
            dropout_seed=self.seed,
            finite_inputs=self.finite,
            return_lse=True,
            return_weights=False,
            wants_grad=self.want_grad,
            input_rank=4,
            dtype=q.dtype,
            device=q.device,
        )

    def alive(self) -> tuple[object, object]:
        """The objects its handles name: an autograd context holds them until the backward
        (a compiled graph holds its own)."""
        return lookup(self.rule), lookup(self.held)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    return f"{type(x).__name__} {x!r}"


def to_4d(x: torch.Tensor) -> torch.Tensor:
    """View a `(N, D)` or `(H, N, D)` tensor as `(1, 1, N, D)` / `(1, H, N, D)`."""
    while x.dim() < 4:
        x = x.unsqueeze(0)
    return x


def from_4d(x: torch.Tensor, rank: int) -> torch.Tensor:
    """Undo `to_4d` on an output that starts with `(B, H)`: drop the dims the caller omitted."""
    for _ in range(4 - rank):
        x = x.squeeze(0)
    return x


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {_describe(value)}")
    return float(value)


def _check_mask(
    mask: object, target: tuple[int, int, int, int], device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None, Mask | None]:
    """Return (bool_mask, float_bias, rule): tensors 4-D and broadcastable to `target`."""
    if mask is None:
        return None, None, None
    if isinstance(mask, Mask):
        B, H, Nq, Nk = target
        mask.check(Nq, Nk, batch=B, heads=H)
        return None, None, mask
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"mask must be a torch.Tensor (bool: True = may attend; float: added to the scores), "
            f"a qkv.masks.Mask, a qkv.layout.BlockLayout, or None, got {_describe(mask)}"
        )
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"mask must have dtype torch.bool (True = may attend) or a floating dtype "
            f"(additive bias), got dtype={mask.dtype}"
        )
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but q is on {device}; move it to {device}")
    if mask.dim() > 4:
        raise ValueError(
            f"mask must have at most 4 dims, broadcastable to (B, H, Nq, Nk)={target}, "
            f"got shape {tuple(mask.shape)}"
        )
    shape4 = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    for got, want in zip(shape4, target, strict=True):
        if got not in (1, want):
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} is not broadcastable to (B, H, Nq, Nk)={target}"
            )
    mask4 = mask.reshape(shape4)
    if mask.dtype == torch.bool:
        return mask4, None, None
    return None, mask4, None


def _check_tensors(q: object, k: object, v: object) -> None:
    """q, k, v: tensors of one rank (2, 3 or 4), one supported dtype, one device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {_describe(t)}")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)  # for type checkers
    assert isinstance(v, torch.Tensor)
    if q.dim() not in (2, 3, 4):
        raise ValueError(
            f"q must have shape (B, H, N, D), (H, N, D) or (N, D), got {q.dim()} dims: "
            f"{tuple(q.shape)}"
        )
    for name, t in (("k", k), ("v", v)):
        if t.dim() != q.dim():
            raise ValueError(
                f"{name} must have the same number of dims as q ({q.dim()}), "
                f"got {name}.shape={tuple(t.shape)} and q.shape={tuple(q.shape)}"
            )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} must be float16, bfloat16, float32 or float64, got dtype={t.dtype}"
            )
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype={t.dtype} differs from q.dtype={q.dtype}; cast them")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; move it")


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """`(B, H, Hkv, Nq, Nk, D, Dv)` of q, k, v in 4-D form, which must agree (GQA: H a
    multiple of Hkv)."""
    B, H, Nq, D = to_4d(q).shape
    Bk, Hkv, Nk, Dk = to_4d(k).shape
    Bv, Hv, Nv, Dv = to_4d(v).shape
    if Dk != D:
        raise ValueError(
            f"k's head dim must equal q's: q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}"
        )
    if Bk != B or Bv != B:
        raise ValueError(f"batch sizes differ: q has B={B}, k has B={Bk}, v has B={Bv}")
    if Hv != Hkv or Nv != Nk:
        raise ValueError(
            f"k and v must share (B, Hkv, Nk): k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
        )
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(
            f"query heads H={H} must be a multiple of key/value heads Hkv={Hkv} "
            f"(grouped-query attention)"
        )
    return B, H, Hkv, Nq, Nk, D, Dv


def _check_scale(scale: object, D: int, dtype: torch.dtype) -> float:
    """The softmax scale: 1/√D by default, else a finite number > 0 in the normal range of the
    dtype the scores are computed in."""
    if scale is None:
        return 1.0 / math.sqrt(D) if D > 0 else 1.0
    scale_f = _check_number("scale", scale)
    # comparisons, not math.isfinite: under torch.compile a float is symbolic (dynamo
    # does not specialise floats) and a comparison is a guard, where isfinite breaks
    if not 0 < scale_f < math.inf:  # False for NaN too
        raise ValueError(f"scale must be a finite number > 0, got scale={scale!r}")
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    info = torch.finfo(cdt)
    if not info.tiny <= scale_f <= info.max:
        raise ValueError(
            f"scale={scale!r} is outside the normal range of {cdt}, the dtype scores are "
            f"computed in ([{info.tiny:.3g}, {info.max:.3g}]): it would round to 0 or inf"
        )
    return scale_f


def _check_held(mask: object, Nq: int, Nk: int, causal: bool) -> tuple[BlockLayout | None, object]:
    """`(held layout or None, the mask it stands for)`: a BlockLayout passed as the mask must
    be built for this (Nq, Nk) and causal flag."""
    if not isinstance(mask, BlockLayout):
        return None, mask
    held = mask
    if (held.q_len, held.kv_len) != (Nq, Nk):
        raise ValueError(
            f"mask is a BlockLayout built for (Nq, Nk)=({held.q_len}, {held.kv_len}), "
            f"but q and k give ({Nq}, {Nk})"
        )
    if held.causal != causal and Nq > 1:
        raise ValueError(
            f"mask is a BlockLayout built with causal={held.causal}; pass "
            f"causal={held.causal} (the layout holds its tiles for that)"
        )
    return held, held.mask


def _check_score_mod(score_mod: object, H: int) -> None:
    if score_mod is None:
        return
    if not isinstance(score_mod, ScoreMod):
        raise TypeError(
            f"score_mod must be a qkv.scores.ScoreMod or None, got {_describe(score_mod)}"
        )
    if score_mod.heads is not None and score_mod.heads != H:
        raise ValueError(
            f"score_mod {score_mod!r} is written for {score_mod.heads} heads, got H={H}"
        )


def _check_bool(name: str, flag: object) -> bool:
    if not isinstance(flag, bool):
        raise TypeError(f"{name} must be a bool, got {_describe(flag)}")
    return flag


def make_plan(
    q: object,
    k: object,
    v: object,
    *,
    mask: object = None,
    causal: object = False,
    scale: object = None,
    dropout_p: object = 0.0,
    return_lse: object = False,
    return_weights: object = False,
    score_mod: object = None,
    dropout_seed: int | torch.Tensor | None = None,
    finite_inputs: object = False,
) -> AttentionPlan:
    """Check every argument of `qkv.attention` and build the plan (see its docstring)."""
    _check_tensors(q, k, v)
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)  # for type checkers
    assert isinstance(v, torch.Tensor)
    B, H, Hkv, Nq, Nk, D, Dv = _check_shapes(q, k, v)
    _check_bool("causal", causal)
    assert isinstance(causal, bool)  # for type checkers
    scale_f = _check_scale(scale, D, q.dtype)
    p = _check_number("dropout_p", dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p={dropout_p!r} is out of range [0, 1)")
    return_lse = _check_bool("return_lse", return_lse)
    return_weights = _check_bool("return_weights", return_weights)
    held, mask = _check_held(mask, Nq, Nk, causal)
    bool_mask, bias, rule = _check_mask(mask, (B, H, Nq, Nk), q.device)
    _check_score_mod(score_mod, H)
    assert score_mod is None or isinstance(score_mod, ScoreMod)  # for type checkers
    if p > 0 and dropout_seed is None:
        # Drawn from torch's RNG on q's device, so torch.manual_seed makes dropout repeatable;
        # kept as a tensor, so drawing it needs no host sync (and no graph break).
        gen_device = q.device if q.device.type != "meta" else "cpu"
        dropout_seed = torch.randint(0, 2**62, (1,), device=gen_device)[0]
    _check_bool("finite_inputs", finite_inputs)
    assert isinstance(finite_inputs, bool)  # for type checkers
    return AttentionPlan(
        batch=B,
        heads=H,
        kv_heads=Hkv,
        q_len=Nq,
        kv_len=Nk,
        head_dim=D,
        v_dim=Dv,
        scale=scale_f,
        # A single query row (decoding) sees every key under bottom-right causality.
        pairs=Pairs(Nq, Nk, causal and Nq > 1, rule, bool_mask, bias, held),
        score_mod=score_mod,
        dropout_p=p,
        dropout_seed=dropout_seed if p > 0 else None,
        finite_inputs=finite_inputs,
        return_lse=return_lse,
        return_weights=return_weights,
        wants_grad=torch.is_grad_enabled()
        and any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for t in (q, k, v, bias, *(score_mod.params if score_mod is not None else ()))
        ),
        input_rank=q.dim(),
        dtype=q.dtype,
        device=q.device,
    )
