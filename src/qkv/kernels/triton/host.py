"""The triton backend's host side: the score modifiers the kernels understand (`mod_spec`), the
tile lists and mask bank they walk (`build_layout`, from the plan's `qkv.layout.BlockLayout`;
for blocks chosen per kv head, `group_layout`: each (batch element, kv head)'s heads walk that
group's own kept tiles, in one launch),
launch configurations, the launches (`Call`) and the `autograd.Function` that ties forward and
backward together. Imported on the backend's first use, so `import qkv` stays light; the
kernels themselves (`kernels.py`) import Triton.

Without the caller's `finite_inputs` promise, NaN/±inf in masked-out k/v slots is kept out of
every row here and in the kernels, never by reading values on the host: the forward launch sets
the kernel's GUARD_PART (PARTIAL tiles) and GUARD_FULL (FULL tiles too, under a float mask or
dropout) so that P V skips zero weights where V holds a non-finite value; the backward hands the
kernels k and v with NaN/±inf zeroed (copies, as tiled's backward) and dO zeroed where the
output is non-finite, so Δ and dP stay finite and the gradient flows through the output's finite
part, as in the reference's autograd. With the promise, both cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache import CACHE
from ...dropout import keep_scale
from ...layout import BlockLayout, allowed, layout_for
from ...numerics import once_differentiable, row_dot, two_float
from ...plan import AttentionPlan
from ..tiled.steps import Part, kv_parts
from .runtime import interpreting

BANK_CHUNK = 2048  # partial tiles evaluated per call of the mask rule (bounds host memory)


def _kernels():
    """The kernel module, imported on first use."""
    from . import kernels as triton_kernels

    return triton_kernels


# ---------------------------------------------------------------------------------------------
# Score modifiers the kernels understand
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModSpec:
    """A `qkv.scores` modifier as the kernel runs it: additive terms before/after one softcap.

    `alibi` and `rel` are 0 (absent), 1 (applied before the softcap, or with no softcap) or 2
    (after it)."""

    alibi: int  # where ALiBi applies
    slopes: torch.Tensor | None  # (H,) float64 slopes
    rel: int  # where the relative-position bias applies
    table: torch.Tensor | None  # (H|1, 2M + 1) learnable table
    max_distance: int  # M
    cap: float | None  # softcap, or None


class _Unsupported(Exception):
    pass


def _primitives(mod) -> tuple[tuple, ...]:
    """The modifier's `parts` (see `qkv.scores`): [("alibi", slopes) | ("softcap", cap) |
    ("rel", table, M)], left to right."""
    parts = getattr(mod, "parts", None)
    if parts is None:
        raise _Unsupported(
            f"score_mod {mod!r} is Python code that Triton cannot compile; the triton backend "
            "runs alibi, softcap and relative_bias from qkv.scores (use backend='tiled')"
        )
    return parts


def unsupported(mod) -> str | None:
    """Why the kernels cannot run a score modifier, or None."""
    try:
        mod_spec(mod)
    except _Unsupported as e:
        return str(e)
    return None


def mod_spec(mod) -> ModSpec:
    """The kernel's view of a modifier, or `_Unsupported` with the reason."""
    alibi = rel = 0
    slopes = table = None
    cap = None
    m = 0
    for prim in _primitives(mod):
        where = 2 if cap is not None else 1
        if prim[0] == "alibi":
            if alibi:
                raise _Unsupported("the triton backend runs at most one alibi modifier")
            alibi, slopes = where, prim[1]
        elif prim[0] == "rel":
            if rel:
                raise _Unsupported("the triton backend runs at most one relative_bias modifier")
            rel, table, m = where, prim[1], prim[2]
        else:
            if cap is not None:
                raise _Unsupported("the triton backend runs at most one softcap modifier")
            cap = prim[1]
    params = set(map(id, getattr(mod, "params", ())))
    if params - ({id(table)} if table is not None else set()):
        raise _Unsupported(f"score_mod {mod!r} has learnable params the kernel does not know")
    return ModSpec(alibi, slopes, rel, table, m, cap)


# ---------------------------------------------------------------------------------------------
# Tile lists: which key tiles each query tile visits (and, transposed, the backward's lists)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileLists:
    """Per row of tiles (forward: query tiles; transposed: key tiles) and per (b, h) of the
    layout, the FULL and PARTIAL tiles it keeps, like FlexAttention's kv_num_blocks/kv_indices.
    Entries past `*_num` are padding and never read."""

    full_num: torch.Tensor  # int32 (Bl, Hl, R)
    full_idx: torch.Tensor  # int32 (Bl, Hl, R, C): column-tile indices, FULL first
    part_num: torch.Tensor  # int32 (Bl, Hl, R)
    part_idx: torch.Tensor  # int32 (Bl, Hl, R, C)
    part_code: torch.Tensor  # int32 (Bl, Hl, R, C): bank index of the tile, or −1


@dataclass(frozen=True)
class Layout:
    """Everything the kernels need to skip tiles, for one (block_m × block_n) tiling: the
    plan's `qkv.layout.BlockLayout` as padded per-row lists (FULL first), and the bank."""

    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    tiles: BlockLayout | None  # the kept tiles (EMPTY ones are in no list); None: per group
    fwd: TileLists  # rows = query tiles
    bwd: TileLists  # rows = key tiles
    bank: torch.Tensor | None  # int8 (P, block_m, block_n): allowed pairs of partial tiles
    lay_b: int  # 1 when the lists or bank depend on the batch element, else 0
    lay_h: int  # 1 when they depend on the head, else 0
    heads: int  # Hl: heads the lists are laid out for (1 or H)
    groups: tuple[BlockLayout, ...] = ()  # per (b, kv head), b-major, when each has its own


def _lists(lay: BlockLayout, full: torch.Tensor, code: torch.Tensor, device) -> TileLists:
    """Padded lists `(Bl, Hl, R, C)` of a layout's rows: FULL tiles first, then PARTIAL ones
    with their bank codes `code (Bl, Hl, nnz)` (forward order of `lay`)."""
    R = lay.shape[0]
    rows = lay.tile_rows()
    C = int(lay.row_ptr.diff().max()) if lay.nnz else 1
    Bl, Hl = code.shape[:2]

    def table(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r, c = rows[sel], lay.col[sel]
        num = torch.bincount(r, minlength=R)
        start = torch.cumsum(num, 0) - num
        slot = torch.arange(r.numel()) - start[r]
        idx = torch.zeros(R, max(C, 1), dtype=torch.int32)
        idx[r, slot] = c.to(torch.int32)
        return num.to(torch.int32), idx, slot

    full_num, full_idx, _ = table(full)
    part_num, part_idx, slot = table(~full)
    part_code = torch.full((Bl, Hl, R, max(C, 1)), -1, dtype=torch.int32)
    part_code[:, :, rows[~full], slot] = code[:, :, ~full]

    def out(t: torch.Tensor) -> torch.Tensor:
        return t.expand(Bl, Hl, *t.shape[-(t.dim()) :]).contiguous().to(device)

    return TileLists(
        full_num=out(full_num),
        full_idx=out(full_idx),
        part_num=out(part_num),
        part_idx=out(part_idx),
        part_code=part_code.contiguous().to(device),
    )


def _bank(
    plan: AttentionPlan, lay: BlockLayout, tiles: torch.Tensor, Bl: int, Hl: int, bm, bn, device
) -> torch.Tensor:
    """The allowed pairs of the kept tiles `tiles` (forward indices) for every (b, h) of the
    lists: int8 `(Bl·Hl·P, bm, bn)`, (b, h)-major. Rows/keys past the end are clamped (the
    kernel masks them by bounds)."""
    nq, nk = plan.q_len, plan.kv_len
    rows_t, cols_t = lay.tile_rows()[tiles], lay.col[tiles]
    out = torch.empty(Bl, Hl, tiles.numel(), bm, bn, dtype=torch.int8, device=device)
    ar_m, ar_n = torch.arange(bm), torch.arange(bn)
    bi = torch.arange(Bl).view(-1, 1, 1, 1, 1)
    hi = torch.arange(Hl).view(1, -1, 1, 1, 1)
    per = max(1, BANK_CHUNK // (Bl * Hl))
    for c0 in range(0, tiles.numel(), per):
        r = (rows_t[c0 : c0 + per].view(-1, 1, 1) * bm + ar_m.view(1, -1, 1)).clamp(max=nq - 1)
        c = (cols_t[c0 : c0 + per].view(-1, 1, 1) * bn + ar_n.view(1, 1, -1)).clamp(max=nk - 1)
        ok = allowed(bi, hi, r[None, None], c[None, None], q_len=nq, kv_len=nk,
                     causal=plan.pairs.causal, rule=plan.pairs.rule,
                     mask=None if plan.pairs.mask is None else plan.pairs.mask.cpu())  # fmt: skip
        ok = torch.ones((), dtype=torch.bool) if ok is None else ok
        out[:, :, c0 : c0 + per] = torch.broadcast_to(ok, (Bl, Hl, r.shape[0], bm, bn)).to(
            device, torch.int8
        )
    return out.view(-1, bm, bn)


def _full(lay: BlockLayout, nk: int, bn: int) -> torch.Tensor:
    """Which kept tiles the kernels run as FULL: the layout's, but for the last key tile when
    it runs past Nk (it needs the bounds check)."""
    nkb = lay.shape[1]
    full = lay.full.clone()
    if nk % bn and nkb:
        full[lay.col == nkb - 1] = False
    return full


def build_layout(plan: AttentionPlan, bm: int, bn: int, device: torch.device) -> Layout:
    """The tile lists and bank of a plan for `bm × bn` tiles (see `Layout`); per (batch
    element, kv head) for blocks chosen per kv head (`group_layout`)."""
    parts = kv_parts(plan)
    if parts is not None:
        return group_layout(plan, parts, bm, bn, device)
    lay = layout_for(plan.pairs, bm, bn)
    full = _full(lay, plan.kv_len, bn)
    rule, mask = plan.pairs.rule, plan.pairs.mask
    Bl = max(rule.batch or 1 if rule is not None else 1, mask.shape[0] if mask is not None else 1)
    Hl = max(rule.heads or 1 if rule is not None else 1, mask.shape[1] if mask is not None else 1)
    code = torch.full((Bl, Hl, lay.nnz), -1, dtype=torch.int32)
    bank = None
    partial = (~full).nonzero().view(-1)
    if (rule is not None or mask is not None) and partial.numel():
        P = partial.numel()
        base = (torch.arange(Bl).view(-1, 1) * Hl + torch.arange(Hl).view(1, -1)) * P
        code[:, :, partial] = (base[..., None] + torch.arange(P)).to(torch.int32)
        bank = _bank(plan, lay, partial, Bl, Hl, bm, bn, device)
    t = lay.transposed
    return Layout(
        block_m=bm,
        block_n=bn,
        tiles=lay,
        fwd=_lists(lay, full, code, device),
        bwd=_lists(t, full[lay.by_col], code[:, :, lay.by_col], device),
        bank=bank,
        lay_b=int(Bl > 1),
        lay_h=int(Hl > 1),
        heads=Hl,
    )


def group_layout(
    plan: AttentionPlan, parts: list[Part], bm: int, bn: int, device: torch.device
) -> Layout:
    """Tile lists `(B, H, …)` in which the G query heads of each (batch element, kv head) walk
    that group's own kept tiles (`Part.plan`'s layout), not the union over every head; the
    group's partial tiles get their bank tiles once, shared by its heads. One launch runs every
    group, with the whole problem's (b, h) (dropout's counter, a modifier's head)."""
    layouts, fwd, bwd, banks = [], [], [], []
    at = 0
    for p in parts:
        lay = layout_for(p.plan.pairs, bm, bn)
        full = _full(lay, plan.kv_len, bn)
        code = torch.full((1, 1, lay.nnz), -1, dtype=torch.int32)
        partial = (~full).nonzero().view(-1)
        if partial.numel():
            code[0, 0, partial] = torch.arange(at, at + partial.numel(), dtype=torch.int32)
            banks.append(_bank(p.plan, lay, partial, 1, 1, bm, bn, device))
            at += partial.numel()
        layouts.append(lay)
        fwd.append(_lists(lay, full, code, torch.device("cpu")))
        bwd.append(_lists(lay.transposed, full[lay.by_col], code[:, :, lay.by_col],
                          torch.device("cpu")))  # fmt: skip
    return Layout(
        block_m=bm,
        block_n=bn,
        tiles=None,
        fwd=_stack(fwd, plan, device),
        bwd=_stack(bwd, plan, device),
        bank=torch.cat(banks) if banks else None,
        lay_b=1,
        lay_h=1,
        heads=plan.heads,
        groups=tuple(layouts),
    )


def _stack(lists: list[TileLists], plan: AttentionPlan, device: torch.device) -> TileLists:
    """The `(1, 1, R, C_i)` lists of each (b, kv head), b-major, as `(B, H, R, C)` lists:
    padded to the longest row, each group's repeated over its G query heads."""
    B, Hkv, G = plan.batch, plan.kv_heads, plan.groups
    C = max(t.full_idx.shape[-1] for t in lists)

    def join(name: str, pad: int) -> torch.Tensor:
        parts = [getattr(t, name) for t in lists]
        if parts[0].dim() == 4:  # (1, 1, R, C_i): pad the columns
            parts = [torch.nn.functional.pad(x, (0, C - x.shape[-1]), value=pad) for x in parts]
        x = torch.cat(parts).view(B, Hkv, 1, *parts[0].shape[2:])
        return x.expand(B, Hkv, G, *x.shape[3:]).reshape(B, Hkv * G, *x.shape[3:])

    return TileLists(
        **{f: join(f, -1 if f == "part_code" else 0).contiguous().to(device)
           for f in ("full_num", "full_idx", "part_num", "part_idx", "part_code")}
    )  # fmt: skip


def layout_for_device(plan: AttentionPlan, bm: int, bn: int, device: torch.device) -> Layout:
    """`build_layout`, from qkv's cache: per Mask object (held weakly) for structured masks, by
    shape for plain/causal problems; never for bool mask tensors (their content may change)."""
    if plan.pairs.mask is not None:
        return build_layout(plan, bm, bn, device)
    shape = (plan.batch, plan.heads, plan.kv_heads, plan.q_len, plan.kv_len)
    key = ("triton-layout", *shape, bm, bn, plan.pairs.causal, str(device))
    return CACHE.get(key, lambda: build_layout(plan, bm, bn, device), owner=plan.pairs.rule)


# ---------------------------------------------------------------------------------------------
# Launch configuration
# ---------------------------------------------------------------------------------------------


def pad_dim(d: int) -> int:
    """Head dims run padded to a power of two ≥ 16 (tl.arange and tl.dot need it)."""
    return max(16, 1 << max(0, d - 1).bit_length())


@dataclass(frozen=True)
class Config:
    """Tile sizes and launch parameters. Defaults by padded head dim: D ≤ 64 follows the Triton
    fused-attention tutorial; D = 128 is the fastest forward and the fastest backward of the
    gpu benchmark suite's tile sweep on an H200 (docs/benchmarks.md, section gpu)."""

    fwd_block: tuple[int, int]  # (query rows, keys) per forward tile
    bwd_block: tuple[int, int]  # (query rows, keys) per backward tile (dK/dV and dQ)
    fwd_warps: int
    bwd_warps: int
    fwd_stages: int
    bwd_stages: int


def default_config(d_pad: int) -> Config:
    if d_pad <= 64:
        return Config((128, 64), (64, 64), 4, 4, 3, 3)
    if d_pad <= 128:
        return Config((128, 128), (64, 64), 8, 4, 2, 3)
    return Config((64, 32), (32, 32), 4, 4, 1, 1)


# ---------------------------------------------------------------------------------------------
# The call: forward and backward launches
# ---------------------------------------------------------------------------------------------


class Call:
    """Per-call state shared by forward and backward: plan, config, layouts, modifier."""

    def __init__(self, plan: AttentionPlan, q: torch.Tensor, config: Config, spec: ModSpec | None):
        self.plan, self.config, self.spec = plan, config, spec
        self.device = q.device
        self.d_pad, self.dv_pad = pad_dim(plan.head_dim), pad_dim(plan.v_dim)
        self.fwd_layout = layout_for_device(plan, *config.fwd_block, q.device)
        self._bwd_layout: Layout | None = None
        self.dummy = torch.zeros(1, dtype=torch.float32, device=q.device)
        self.bias = None
        if plan.pairs.bias is not None:
            self.bias = plan.pairs.bias.expand(plan.batch, plan.heads, plan.q_len, plan.kv_len)
        self.slopes = self.table = None
        if spec is not None and spec.slopes is not None:
            self.slopes = spec.slopes.to(device=q.device, dtype=torch.float32).contiguous()
        if spec is not None and spec.table is not None:
            self.table = spec.table.detach().to(q.device).contiguous()
        self.drop = None
        if plan.dropout_p > 0:
            # [seed & 0xFFFFFFFF, seed >> 32, threshold], built on the device from the seed
            # (a tensor when drawn from torch's RNG: no host sync)
            seed = torch.as_tensor(plan.dropout_seed, dtype=torch.int64, device=q.device)
            thresh = min(int(plan.dropout_p * 2**32 + 0.5), 2**32)
            self.drop = torch.stack(
                [seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, torch.full_like(seed, thresh)]
            )

    @property
    def bwd_layout(self) -> Layout:
        if self._bwd_layout is None:
            bm, bn = self.config.bwd_block
            if (bm, bn) == self.config.fwd_block:
                self._bwd_layout = self.fwd_layout
            else:
                self._bwd_layout = layout_for_device(self.plan, bm, bn, self.device)
        return self._bwd_layout

    def _common(self) -> tuple[list, dict]:
        """Arguments shared by all kernels: bias, modifier tables, and constexprs."""
        plan, spec = self.plan, self.spec
        bias = self.bias if self.bias is not None else self.dummy
        bias_strides = list(self.bias.stride()) if self.bias is not None else [0, 0, 0, 0]
        table = self.table if self.table is not None else self.dummy
        srh = self.table.stride(0) if self.table is not None and self.table.shape[0] > 1 else 0
        args = [
            bias,
            *bias_strides,
            self.slopes if self.slopes is not None else self.dummy,
            table,
            srh,
            spec.max_distance if spec is not None else 0,
            float(spec.cap) if spec is not None and spec.cap is not None else 1.0,
        ]
        meta = dict(
            D=plan.head_dim,
            D_PAD=self.d_pad,
            DV=plan.v_dim,
            DV_PAD=self.dv_pad,
            CAUSAL=plan.pairs.causal,
            HAS_BIAS=self.bias is not None,
            ALIBI=spec.alibi if spec is not None else 0,
            REL_POS=spec.rel if spec is not None else 0,
            SOFTCAP=spec is not None and spec.cap is not None,
            DROPOUT=self.drop is not None,
            PREC="ieee" if plan.dtype == torch.float32 else "tf32",
            UPCAST=plan.dtype == torch.bfloat16 and interpreting(),
        )
        return args, meta

    def _layout_args(self, layout: Layout, lists: TileLists) -> list:
        return [
            lists.full_num,
            lists.full_idx,
            lists.part_num,
            lists.part_idx,
            lists.part_code,
            layout.bank if layout.bank is not None else self.dummy,
            layout.lay_b,
            layout.lay_h,
            layout.heads,
            lists.full_idx.shape[2],
            lists.full_idx.shape[3],
        ]

    def _tail(self) -> list:
        return [
            self.drop if self.drop is not None else self.dummy,
            keep_scale(self.plan.dropout_p),
        ]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(out, lse float32, lse float64)`: the kernel stores each row's max m and sum l; lse
        = m + log l is formed here in float64, and the backward subtracts that as a two-float."""
        plan, K = self.plan, _kernels()
        B, H, Nq, Nk = plan.batch, plan.heads, plan.q_len, plan.kv_len
        out = torch.zeros(B, H, Nq, plan.v_dim, dtype=plan.dtype, device=q.device)
        m = torch.full((B, H, Nq), -torch.inf, dtype=torch.float32, device=q.device)
        l = torch.zeros((B, H, Nq), dtype=torch.float32, device=q.device)
        if out.numel() and Nk:
            layout = self.fwd_layout
            bm, bn = layout.block_m, layout.block_n
            common, meta = self._common()
            # Without the finite_inputs promise, every tile where a weight can be exactly 0
            # by structure (PARTIAL tiles; all tiles under a float mask or dropout) runs the
            # guarded P V: NaN/inf in a masked slot of V never reaches a row.
            guard = not plan.finite_inputs
            grid = (triton_cdiv(Nq, bm), B * H)
            K._attn_fwd[grid](
                q, k, v, out, m, l,
                *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                *common,
                *self._layout_args(layout, layout.fwd),
                *self._tail(),
                H, plan.groups, Nq, Nk, Nk - Nq, plan.scale,
                BLOCK_M=bm, BLOCK_N=bn, HAS_BANK=layout.bank is not None,
                GUARD_FULL=guard and (self.bias is not None or self.drop is not None),
                GUARD_PART=guard,
                num_warps=self.config.fwd_warps, num_stages=self.config.fwd_stages,
                **meta,
            )  # fmt: skip
        empty = l == 0
        lse64 = torch.where(empty, -torch.inf, m.double() + torch.log(l.double()))
        return out, lse64.float(), lse64

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse64: torch.Tensor,
        dout: torch.Tensor | None,
        dlse: torch.Tensor | None,
        want_table_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(dq, dk, dv, dtable). Without the finite_inputs promise, k/v are read with NaN/±inf
        zeroed and dO with the entries of a non-finite output zeroed (see below)."""
        plan, K = self.plan, _kernels()
        B, H, Hkv, Nq, Nk = plan.batch, plan.heads, plan.kv_heads, plan.q_len, plan.kv_len
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dtable = None
        if want_table_grad and self.table is not None:
            dtable = torch.zeros(self.table.shape, dtype=torch.float32, device=q.device)
        if dq.numel() + dk.numel() + dv.numel() == 0 or Nq == 0 or Nk == 0:
            return dq, dk, dv, dtable
        if dout is None:
            dout = torch.zeros_like(out)
        if not plan.finite_inputs:
            # NaN/inf in k or v (masked slots, or values some row attends to): the backward
            # reads k and v with them zeroed (a copy, as tiled's backward; it never reads values
            # to decide), so a weight or dS of 0 never multiplies one (0 · NaN). As in the
            # reference's autograd, the gradient flows through the finite part of the output
            # only: dO is zeroed where out is NaN/inf, which also keeps Δ finite there.
            k, v = (torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in (k, v))
            finite = torch.isfinite(out)
            dout = torch.where(finite, dout, 0.0)
            out = torch.where(finite, out, 0.0)
        # Δ_i = rowsum(dO ∘ O) − dlse_i  (∂lse_i/∂S_ij = P_ij), in float64; Δ and lse reach
        # the kernels as two-floats (hi + lo)
        delta = row_dot(dout, out, torch.float64)
        if dlse is not None:
            delta = delta - dlse.double()
        d_hi, d_lo = (t.contiguous() for t in two_float(delta, torch.float32))
        lse_hi, lse_lo = two_float(lse64, torch.float32)
        lse_hi = torch.where(torch.isneginf(lse_hi), torch.inf, lse_hi).contiguous()
        lse_lo = lse_lo.contiguous()
        layout = self.bwd_layout
        bm, bn = layout.block_m, layout.block_n
        common, meta = self._common()
        scalars = [plan.scale]
        launch = dict(
            BLOCK_M=bm,
            BLOCK_N=bn,
            HAS_BANK=layout.bank is not None,
            num_warps=self.config.bwd_warps,
            num_stages=self.config.bwd_stages,
            **meta,
        )
        K._attn_bwd_dkdv[(triton_cdiv(Nk, bn), B * Hkv)](
            q, k, v, dout, lse_hi, lse_lo, d_hi, d_lo, dk, dv,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
            *common,
            *self._layout_args(layout, layout.bwd),
            *self._tail(),
            H, plan.groups, Hkv, Nq, Nk, Nk - Nq, *scalars,
            **launch,
        )  # fmt: skip
        K._attn_bwd_dq[(triton_cdiv(Nq, bm), B * H)](
            q, k, v, dout, lse_hi, lse_lo, d_hi, d_lo, dq,
            dtable if dtable is not None else self.dummy,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(),
            *common,
            *self._layout_args(layout, layout.fwd),
            *self._tail(),
            H, plan.groups, Nq, Nk, Nk - Nq, *scalars,
            REL_GRAD=dtable is not None,
            **launch,
        )  # fmt: skip
        return dq, dk, dv, dtable


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call, *params):
        out, lse, lse64 = call.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse64)
        ctx.call = call
        ctx.n_params = len(params)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse64 = ctx.saved_tensors
        call: Call = ctx.call
        want_table = ctx.n_params > 0 and any(ctx.needs_input_grad[4:])
        with torch.no_grad():
            dq, dk, dv, dtable = call.backward(q, k, v, out, lse64, dout, dlse, want_table)
        dparams: list[torch.Tensor | None] = [None] * ctx.n_params
        if dtable is not None:  # computed only for a modifier's table
            assert call.spec is not None and call.spec.table is not None
            dparams[0] = dtable.to(call.spec.table.dtype)
        grads = once_differentiable("triton", (dq, dk, dv, *dparams), (q, k, v))
        return *grads[:3], None, *grads[3:]


# ---------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------
