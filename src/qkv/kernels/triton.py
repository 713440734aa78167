"""`triton` backend: FlashAttention-2 forward and backward written in Triton, block-sparse aware.

The kernels live in `triton_kernels.py` (imported lazily: `import qkv` never imports Triton);
this file is the host side: which requests the kernels run exactly (`why_not`), the tile lists
they walk (built from the causal flag, a structured `qkv.masks.Mask` or a bool mask), the score
modifiers they understand, and the `autograd.Function` that ties forward and backward together.

What the kernels do, in one place:

- one program per (query tile, batch·head) forward; the backward is one program per (key tile,
  batch·kv-head) for dK/dV, looping over the G query heads of its group (grouped-query attention
  without repeating K/V, and without atomics), and one per (query tile, batch·head) for dQ;
- online softmax in log2 units (`exp2`); lse saved (natural log, float32) and used by the
  backward to recompute P;
- fp16, bf16 and fp32 inputs (fp32 matmuls in IEEE precision, never TF32); scores, softmax and
  accumulators in fp32; head dims padded to a power of two ≥ 16 (the extra lanes are masked);
- causal is bottom-right aligned (query i sees key j when j ≤ i + Nk − Nq), by arithmetic;
- a bool mask tensor or a `qkv.masks.Mask` becomes tile lists: EMPTY tiles are never visited,
  FULL tiles run with no mask arithmetic, PARTIAL tiles read one byte per pair from a *bank*
  that holds only the partial tiles' content, computed once on the host by the mask's rule
  (a Python rule cannot run inside a Triton kernel). Layouts of structured masks are cached
  per Mask object;
- a float mask (bias) is read tile by tile with its broadcast strides;
- score modifiers from `qkv.scores`: `alibi`, `softcap` and `relative_bias` (its table gets a
  gradient, by atomic adds), alone or composed;
- dropout with `qkv.dropout`'s counter-based hash, bit for bit the reference's keep-mask;
- every offset in int64.

On CPU tensors it runs only in Triton's interpreter (`TRITON_INTERPRET=1`, set before
`qkv.kernels.triton_kernels` is first imported), which is how the tests check it without a GPU;
`auto` never picks it there.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass

import torch

from ..cache import CACHE
from ..dropout import keep_scale
from ..masks import EMPTY, FULL, PARTIAL, Mask, causal, classify, tile_grid
from ..numerics import all_finite, no_double_backward, row_dot, two_float
from ..plan import AttentionPlan
from .base import Result

INSTALL_HINT = "pip install 'qkv[triton]' (or pip install triton)"
MAX_HEAD_DIM = 256
BANK_CHUNK = 2048  # partial tiles evaluated per call of the mask rule (bounds host memory)


def triton_available() -> bool:
    """True when `import triton` would succeed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when the kernels run in Triton's interpreter: once `triton_kernels` is imported,
    whether its kernels were decorated in interpreter mode (`triton.jit` reads the variable at
    decoration time); before that, whether `TRITON_INTERPRET=1` is set now."""
    kernels = sys.modules.get(f"{__package__}.triton_kernels")
    if kernels is not None:
        return kernels.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _kernels():
    """The kernel module, imported on first use."""
    from . import triton_kernels

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
    """Everything the kernels need to skip tiles, for one (block_m × block_n) tiling."""

    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    kind: torch.Tensor  # int8 (Bl, Hl, nqb, nkb) on the CPU: EMPTY/PARTIAL/FULL (bounds too)
    fwd: TileLists  # rows = query tiles
    bwd: TileLists  # rows = key tiles
    bank: torch.Tensor | None  # int8 (P, block_m, block_n): allowed pairs of partial tiles
    lay_b: int  # 1 when the layout depends on the batch element, else 0
    lay_h: int  # 1 when it depends on the head, else 0

    @property
    def heads(self) -> int:
        return self.kind.shape[1]


def _lists(kind: torch.Tensor, code: torch.Tensor, device: torch.device) -> TileLists:
    full, part = kind == FULL, kind == PARTIAL

    def compact(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True)  # kept first
        return sel.sum(-1).to(torch.int32), order

    full_num, full_order = compact(full)
    part_num, part_order = compact(part)
    return TileLists(
        full_num=full_num.contiguous().to(device),
        full_idx=full_order.to(torch.int32).contiguous().to(device),
        part_num=part_num.contiguous().to(device),
        part_idx=part_order.to(torch.int32).contiguous().to(device),
        part_code=code.gather(-1, part_order).to(torch.int32).contiguous().to(device),
    )


def _dense_mask_kinds(mask: torch.Tensor, nq: int, nk: int, bm: int, bn: int) -> torch.Tensor:
    """Tile kinds of a bool mask `(B|1, H|1, Nq|1, Nk|1)` per (b, h): `(B|1, H|1, nqb, nkb)`."""
    nqb, nkb = -(-nq // bm), -(-nk // bn)
    m = mask.expand(mask.shape[0], mask.shape[1], nq, nk)
    pad = (0, nkb * bn - nk, 0, nqb * bm - nq)
    t_any = torch.nn.functional.pad(m, pad, value=False)
    t_all = torch.nn.functional.pad(m, pad, value=True)
    shape = (m.shape[0], m.shape[1], nqb, bm, nkb, bn)
    maybe_any = t_any.reshape(shape).any(5).any(3)
    surely_all = t_all.reshape(shape).all(5).all(3)
    return classify(maybe_any.cpu(), surely_all.cpu())


def _bank(
    plan: AttentionPlan, sel: torch.Tensor, bm: int, bn: int, device: torch.device
) -> torch.Tensor:
    """Evaluate the rule and/or bool mask on the selected tiles `sel (Bl, Hl, nqb, nkb)`:
    int8 `(P, bm, bn)` in `nonzero` order. Rows/keys past the end are clamped (the kernel masks
    them by bounds)."""
    nq, nk = plan.q_len, plan.kv_len
    pos = sel.nonzero().to(device)  # (P, 4): b, h, tile row, tile col
    out = torch.empty(pos.shape[0], bm, bn, dtype=torch.int8, device=device)
    ar_m = torch.arange(bm, device=device)
    ar_n = torch.arange(bn, device=device)
    rule, mask = plan.mask_rule, plan.mask
    for c0 in range(0, pos.shape[0], BANK_CHUNK):
        p = pos[c0 : c0 + BANK_CHUNK]
        bi, hi = p[:, 0].view(-1, 1, 1), p[:, 1].view(-1, 1, 1)
        rows = (p[:, 2].view(-1, 1, 1) * bm + ar_m.view(1, -1, 1)).clamp(max=nq - 1)
        cols = (p[:, 3].view(-1, 1, 1) * bn + ar_n.view(1, 1, -1)).clamp(max=nk - 1)
        ok = torch.ones(p.shape[0], bm, bn, dtype=torch.bool, device=device)
        if rule is not None:
            rb = bi if rule.batch else torch.zeros_like(bi)
            rh = hi if rule.heads else torch.zeros_like(hi)
            ok = ok & rule.evaluate(rb, rh, rows, cols, nq, nk).to(device)
        if mask is not None:
            idx = [
                bi if mask.shape[0] > 1 else 0,
                hi if mask.shape[1] > 1 else 0,
                rows if mask.shape[2] > 1 else 0,
                cols if mask.shape[3] > 1 else 0,
            ]
            ok = ok & mask[tuple(idx)]
        out[c0 : c0 + BANK_CHUNK] = ok.to(torch.int8)
    return out


def build_layout(plan: AttentionPlan, bm: int, bn: int, device: torch.device) -> Layout:
    """The tile lists and bank of a plan for `bm × bn` tiles (see `Layout`)."""
    nq, nk = plan.q_len, plan.kv_len
    nqb, nkb = -(-nq // bm), -(-nk // bn)
    kind = torch.full((1, 1, nqb, nkb), FULL, dtype=torch.int8)
    if plan.causal:
        q_lo, q_hi, k_lo, k_hi = tile_grid(nq, nk, bm, bn)
        maybe_any, surely_all = causal()._bounds(None, None, q_lo, q_hi, k_lo, k_hi, nk)
        kind = classify(maybe_any, surely_all)
    mask_kind = torch.full((1, 1, nqb, nkb), FULL, dtype=torch.int8)
    if plan.mask_rule is not None:
        mask_kind = plan.mask_rule.blocks(nq, nk, bm, bn).kind
    if plan.mask is not None:
        mask_kind = torch.minimum(mask_kind, _dense_mask_kinds(plan.mask, nq, nk, bm, bn))
    kind = torch.minimum(kind, mask_kind)
    mask_kind = mask_kind.expand(kind.shape)
    if nk % bn and nkb:  # the last key tile runs past Nk: it needs the bounds check
        last = kind[..., -1]
        last[last == FULL] = PARTIAL
    needs_bank = (kind != EMPTY) & (mask_kind == PARTIAL)
    code = torch.full(kind.shape, -1, dtype=torch.int32)
    n_bank = int(needs_bank.sum())
    bank = None
    if n_bank:
        code[needs_bank] = torch.arange(n_bank, dtype=torch.int32)
        bank = _bank(plan, needs_bank, bm, bn, device)
    kind = kind.contiguous()
    return Layout(
        block_m=bm,
        block_n=bn,
        kind=kind,
        fwd=_lists(kind, code, device),
        bwd=_lists(kind.transpose(-1, -2), code.transpose(-1, -2), device),
        bank=bank,
        lay_b=int(kind.shape[0] > 1),
        lay_h=int(kind.shape[1] > 1),
    )


def layout_for(plan: AttentionPlan, bm: int, bn: int, device: torch.device) -> Layout:
    """`build_layout`, from qkv's cache: per Mask object (held weakly) for structured masks, by
    shape for plain/causal problems; never for bool mask tensors (their content may change)."""
    if plan.mask is not None:
        return build_layout(plan, bm, bn, device)
    key = ("triton-layout", plan.q_len, plan.kv_len, bm, bn, plan.causal, str(device))
    key += (plan.batch, plan.heads)
    return CACHE.get(key, lambda: build_layout(plan, bm, bn, device), owner=plan.mask_rule)


# ---------------------------------------------------------------------------------------------
# Launch configuration
# ---------------------------------------------------------------------------------------------


def _pad_dim(d: int) -> int:
    """Head dims run padded to a power of two ≥ 16 (tl.arange and tl.dot need it)."""
    return max(16, 1 << max(0, d - 1).bit_length())


@dataclass(frozen=True)
class Config:
    """Tile sizes and launch parameters. Defaults (by padded head dim) follow the Triton
    fused-attention tutorial's choices; they are not yet tuned on a GPU (benchmarks/gpu.py
    sweeps a few)."""

    fwd_block: tuple[int, int]  # (query rows, keys) per forward tile
    bwd_block: tuple[int, int]  # (query rows, keys) per backward tile (dK/dV and dQ)
    fwd_warps: int
    bwd_warps: int
    stages: int


def default_config(d_pad: int) -> Config:
    if d_pad <= 64:
        return Config((128, 64), (64, 64), 4, 4, 3)
    if d_pad <= 128:
        return Config((128, 64), (64, 64), 8, 8, 2)
    return Config((64, 32), (32, 32), 4, 4, 1)


# ---------------------------------------------------------------------------------------------
# The call: forward and backward launches
# ---------------------------------------------------------------------------------------------


class _Call:
    """Per-call state shared by forward and backward: plan, config, layouts, modifier."""

    def __init__(self, plan: AttentionPlan, q: torch.Tensor, config: Config, spec: ModSpec | None):
        self.plan, self.config, self.spec = plan, config, spec
        self.device = q.device
        self.d_pad, self.dv_pad = _pad_dim(plan.head_dim), _pad_dim(plan.v_dim)
        self.fwd_layout = layout_for(plan, *config.fwd_block, q.device)
        self._bwd_layout: Layout | None = None
        self.dummy = torch.zeros(1, dtype=torch.float32, device=q.device)
        self.bias = None
        if plan.bias is not None:
            self.bias = plan.bias.expand(plan.batch, plan.heads, plan.q_len, plan.kv_len)
        self.slopes = self.table = None
        if spec is not None and spec.slopes is not None:
            self.slopes = spec.slopes.to(device=q.device, dtype=torch.float32).contiguous()
        if spec is not None and spec.table is not None:
            self.table = spec.table.detach().to(q.device).contiguous()
        self.drop = None
        if plan.dropout_p > 0:
            seed = plan.dropout_seed
            thresh = min(int(plan.dropout_p * 2**32 + 0.5), 2**32)
            self.drop = torch.tensor(
                [seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, thresh],
                dtype=torch.int64,
                device=q.device,
            )

    @property
    def bwd_layout(self) -> Layout:
        if self._bwd_layout is None:
            bm, bn = self.config.bwd_block
            if (bm, bn) == self.config.fwd_block:
                self._bwd_layout = self.fwd_layout
            else:
                self._bwd_layout = layout_for(self.plan, bm, bn, self.device)
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
            CAUSAL=plan.causal,
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
            grid = (triton_cdiv(Nq, bm), B * H)
            K._attn_fwd[grid](
                q, k, v, out, m, l,
                *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                *common,
                *self._layout_args(layout, layout.fwd),
                *self._tail(),
                H, plan.groups, Nq, Nk, Nk - Nq, plan.scale,
                BLOCK_M=bm, BLOCK_N=bn, HAS_BANK=layout.bank is not None,
                num_warps=self.config.fwd_warps, num_stages=self.config.stages,
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
            num_stages=self.config.stages,
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


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call, *params):  # type: ignore[override]
        out, lse, lse64 = call.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse64)
        ctx.call = call
        ctx.n_params = len(params)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # type: ignore[override]
        no_double_backward("triton")
        q, k, v, out, lse64 = ctx.saved_tensors
        call: _Call = ctx.call
        want_table = ctx.n_params > 0 and any(ctx.needs_input_grad[4:])
        dq, dk, dv, dtable = call.backward(q, k, v, out, lse64, dout, dlse, want_table)
        dparams = [None] * ctx.n_params
        if dtable is not None:
            dparams[0] = dtable.to(call.spec.table.dtype)
        return dq, dk, dv, None, *dparams


# ---------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------


class TritonBackend:
    """FlashAttention-2 in Triton (see the module docstring).

    `TritonBackend()` picks tile sizes by head dim (`default_config`); pass `block_m`/`block_n`
    (and optionally `bwd_block_m`/`bwd_block_n`, `num_warps`, `num_stages`) to override, e.g.
    small tiles in tests so that awkward sizes cross many tile boundaries."""

    name = "triton"

    def __init__(
        self,
        block_m: int | None = None,
        block_n: int | None = None,
        *,
        bwd_block_m: int | None = None,
        bwd_block_n: int | None = None,
        num_warps: int | None = None,
        num_stages: int | None = None,
    ):
        for arg, value in (
            ("block_m", block_m),
            ("block_n", block_n),
            ("bwd_block_m", bwd_block_m),
            ("bwd_block_n", bwd_block_n),
        ):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 16:
                raise ValueError(f"{arg} must be an int ≥ 16 (a power of two), got {value!r}")
            if value & (value - 1):
                raise ValueError(f"{arg} must be a power of two (tl.arange needs it), got {value}")
        for arg, value in (("num_warps", num_warps), ("num_stages", num_stages)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        self.block_m, self.block_n = block_m, block_n
        self.bwd_block_m, self.bwd_block_n = bwd_block_m, bwd_block_n
        self.num_warps, self.num_stages = num_warps, num_stages

    def __repr__(self) -> str:
        parts = [
            f"{k}={v}"
            for k, v in (
                ("block_m", self.block_m),
                ("block_n", self.block_n),
                ("bwd_block_m", self.bwd_block_m),
                ("bwd_block_n", self.bwd_block_n),
                ("num_warps", self.num_warps),
                ("num_stages", self.num_stages),
            )
            if v is not None
        ]
        return f"TritonBackend({', '.join(parts)})"

    def config(self, plan: AttentionPlan) -> Config:
        """The launch configuration for a plan: defaults by head dim, then the overrides."""
        base = default_config(max(_pad_dim(plan.head_dim), _pad_dim(plan.v_dim)))
        fm, fn = self.block_m or base.fwd_block[0], self.block_n or base.fwd_block[1]
        # Explicit forward tiles apply to the backward too, unless it gets its own.
        bwd = base.bwd_block if self.block_m is None and self.block_n is None else (fm, fn)
        bwd = (self.bwd_block_m or bwd[0], self.bwd_block_n or bwd[1])
        return Config(
            fwd_block=(fm, fn),
            bwd_block=bwd,
            fwd_warps=self.num_warps or base.fwd_warps,
            bwd_warps=self.num_warps or base.bwd_warps,
            stages=self.num_stages or base.stages,
        )

    def why_not(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> str | None:
        if not triton_available():
            return f"triton is not installed; {INSTALL_HINT}"
        dev = plan.device.type
        if dev == "cpu" and not interpreting():
            return (
                "tensors are on the CPU; the triton backend runs on CUDA (set TRITON_INTERPRET=1 "
                "before qkv first uses it to run it in Triton's interpreter, slowly, for tests)"
            )
        if dev not in ("cpu", "cuda"):
            return f"tensors are on {plan.device}; the triton backend runs on CUDA"
        if dev == "cuda":
            cap = torch.cuda.get_device_capability(plan.device)
            if cap < (7, 5):
                return f"the triton backend needs compute capability ≥ 7.5, this GPU has {cap}"
            if plan.dtype == torch.bfloat16 and cap < (8, 0):
                return "bfloat16 needs a GPU of compute capability ≥ 8.0 (Ampere) in Triton"
        if plan.return_weights:
            return "triton never materialises the attention weights (use backend='reference')"
        if plan.dtype == torch.float64:
            return "the triton backend computes in fp32 (fp16/bf16/fp32 inputs); float64 is not"
        if max(plan.head_dim, plan.v_dim) > MAX_HEAD_DIM:
            return (
                f"head dims up to {MAX_HEAD_DIM} are supported, got D={plan.head_dim}, "
                f"Dv={plan.v_dim}"
            )
        if plan.bias is not None and plan.bias.requires_grad and torch.is_grad_enabled():
            return "the triton backend does not differentiate a float mask (it requires grad)"
        if plan.score_mod is not None:
            try:
                mod_spec(plan.score_mod)
            except _Unsupported as e:
                return str(e)
        if plan.has_masking and not (all_finite(k) and all_finite(v)):
            return (
                "k or v holds NaN/inf and some positions are masked: a masked value would reach "
                "the output through 0 · NaN inside the kernel's matmul"
            )
        return None

    def auto_skip(self, plan: AttentionPlan) -> str | None:
        """`auto` runs triton only on CUDA: the interpreter is a correctness tool, not a path."""
        if plan.device.type != "cuda":
            return (
                "on CPU tensors triton runs only in Triton's interpreter (slow, for tests); "
                "auto never picks it there"
            )
        return None

    def forward(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> Result:
        spec = mod_spec(plan.score_mod) if plan.score_mod is not None else None
        call = _Call(plan, q, self.config(plan), spec)
        params = (spec.table,) if spec is not None and spec.table is not None else ()
        out, lse = _TritonAttention.apply(q, k, v, call, *params)
        return out, lse, None


__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "Config",
    "Layout",
    "Mask",
    "TritonBackend",
    "build_layout",
    "interpreting",
    "mod_spec",
    "triton_available",
]
