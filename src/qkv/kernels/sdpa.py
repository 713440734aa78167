"""`sdpa` backend: torch's `scaled_dot_product_attention`, only where its semantics equal ours.

Differences it cannot hide, each a reason `why_not` gives:
- its public API returns no lse and no weights;
- it draws its own dropout mask from torch's RNG, not qkv's counter-based mask, so its dropout
  is a different (if equally distributed) random function;
- a NaN or ±inf in a masked-out key or value leaks into the output (0 · NaN inside its kernel);
- a float mask must have q's dtype.
Its `is_causal` is top-left aligned. Bottom-right causality with Nq > Nk is exact without a
mask: the first Nq − Nk rows see nothing (output 0) and the last Nk rows are a square causal
problem. With Nq < Nk it needs an explicit Nq × Nk mask, so `auto` passes such requests to a
backend that skips the tiles instead; asked for by name, sdpa builds the mask.
On the CPU with fewer than 16 keys, torch's fused kernel drops a NaN of q (the row comes back
as zeros), so those calls run torch's math kernel, which does not.
Grouped heads with a few query rows (decoding) run as one head of G·Nq rows per kv head
(`_packed`), which torch's kernel runs twice as fast as `enable_gqa`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..plan import AttentionPlan
from .base import Backend, Result

_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def refusal(plan: AttentionPlan) -> str | None:
    """Why torch SDPA cannot run this request (None: it can): metadata only."""
    if plan.return_weights:
        return "torch SDPA cannot return the attention weights"
    if plan.return_lse:
        return "torch SDPA's public API returns no lse"
    if plan.dropout_p > 0:
        return (
            "torch SDPA draws its own dropout mask; qkv's dropout mask is a function of "
            "(seed, b, h, i, j) shared by the reference and tiled backends"
        )
    if plan.score_mod is not None:
        return "torch SDPA has no score modifiers"
    if plan.groups > 1 and not _HAS_GQA:
        return f"this torch ({torch.__version__}) SDPA has no enable_gqa"
    if plan.pairs.bias is not None and plan.pairs.bias.dtype != plan.dtype:
        return (
            f"torch SDPA needs a float mask of q's dtype {plan.dtype}, got {plan.pairs.bias.dtype}"
        )
    if plan.pairs.restricted and not plan.finite_inputs:
        return (
            "some pairs are masked and k/v may hold NaN/inf there, which torch SDPA would "
            "let through (0 · NaN); pass finite_inputs=True if they cannot"
        )
    return None


def _tiles_skipped_elsewhere(plan: AttentionPlan) -> bool:
    """Is a compiled kernel there to skip the empty tiles of this request? On the CPU qkv's own
    kernel (or, without a compiler, tiled) is; on CUDA only triton, where it can run."""
    if plan.device.type != "cuda":
        return True
    from .triton.backend import (
        TritonBackend,  # imported here: triton's module never imports this one
    )

    # why_not reads the plan (metadata) only; the tensors are not at hand here
    return TritonBackend().why_not(plan, None, None, None) is None  # type: ignore[arg-type]


def auto_passes_over(plan: AttentionPlan) -> str | None:
    """Why `auto` passes sdpa over a request it could run (None: it doesn't). Structured masks
    and causal with Nq < Nk go to a kernel that skips the empty tiles where there is one; on
    CUDA without triton they stay with SDPA, faster than the tiled loop."""
    if plan.dtype == torch.float32 and plan.wants_grad:
        return (
            "float32 gradients: torch SDPA's backward is not within qkv's error bound on "
            "every input; tiled's backward is"
        )
    if not _tiles_skipped_elsewhere(plan):
        return None
    if plan.pairs.rule is not None:
        return (
            "a structured qkv.masks.Mask would reach torch SDPA only as a dense Nq×Nk mask; "
            "tiled skips the empty tiles"
        )
    if plan.pairs.causal and plan.q_len < plan.kv_len:
        return (
            "causal with Nq < Nk is bottom-right aligned, which torch SDPA could only take as "
            "a dense Nq×Nk mask; tiled skips the tiles above the diagonal instead"
        )
    return None


class SdpaBackend(Backend):
    name = "sdpa"

    def why_not(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> str | None:
        return refusal(plan)

    def auto_skip(self, plan: AttentionPlan) -> str | None:
        """Why `auto` passes sdpa over although it could run the request (None: it doesn't)."""
        return auto_passes_over(plan)

    def forward(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> Result:
        pairs = plan.pairs
        if pairs.causal_only and plan.q_len > plan.kv_len:
            # Rows 0 … Nq−Nk−1 see no key (output 0); the last Nk rows are square causal.
            skip = plan.q_len - plan.kv_len
            out = torch.zeros(*q.shape[:-1], plan.v_dim, dtype=q.dtype, device=q.device)
            out[..., skip:, :] = _call(q[..., skip:, :], k, v, None, True, plan)
            return out, None, None
        if pairs.causal_only and plan.q_len == plan.kv_len:
            # top-left equals bottom-right when Nq == Nk: no mask tensor at all
            return _call(q, k, v, None, True, plan), None, None
        # The caller's tensor as it is, or one dense mask (a structured mask asked for by name,
        # causal with Nq < Nk or with a mask to combine): what `Pairs.attn_mask` gives.
        return _call(q, k, v, pairs.attn_mask(q.device), False, plan), None, None


@functools.cache
def _fused_16bit_breaks() -> bool:
    """Whether torch's fused CPU kernel fails on 16-bit inputs here: on a CPU with AMX tiles
    whose ATen kernels run narrower than AVX-512 (`ATEN_CPU_CAPABILITY=avx2` or `default`),
    torch 2.13's flash kernel still packs for the tiles and raises "pack_vnni2 is only
    supported when avx512 is supported" (seen on an Intel Xeon with AMX, bf16, D = 59)."""
    narrow = torch.backends.cpu.get_cpu_capability() not in ("AVX512",)
    return narrow and bool(torch.cpu._is_amx_tile_supported())


# Query rows up to which grouped heads are packed (_packed): decoding and speculative steps.
PACK_ROWS = 16


def _packed(q, attn_mask, is_causal: bool, groups: int):
    """`(q, mask)` with the G query heads of each kv head laid out as G·Nq rows of one head,
    `(B, Hkv, G·Nq, D)`, or None where that is not the same problem. torch's CPU kernel runs a
    few query rows against a long K/V far faster as one head of G·Nq rows, each key block read
    once for the group, than with `enable_gqa` (docs/cpu.md, Measurements behind the code);
    transformers' own sdpa attention does the same.
    Causal masks depend on the row (not packed); a mask that varies by query row but not by
    head would have to be copied G times (not packed either)."""
    nq = q.shape[-2]
    if groups <= 1 or is_causal or nq > PACK_ROWS:
        return None
    if attn_mask is not None:
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        if attn_mask.shape[1] == 1 and attn_mask.shape[2] == 1:
            pass  # one row of keys per batch element: it broadcasts over the packed rows
        elif attn_mask.shape[1] == q.shape[1]:  # per head: the heads of a group become rows
            attn_mask = attn_mask.expand(-1, -1, nq, -1).reshape(
                attn_mask.shape[0], -1, groups * nq, attn_mask.shape[-1]
            )
        else:
            return None
    B, H, _, D = q.shape
    return q.reshape(B, H // groups, groups * nq, D), attn_mask


def _call(q, k, v, attn_mask, is_causal: bool, plan: AttentionPlan) -> torch.Tensor:
    """torch SDPA with qkv's scale and grouped heads (packed as rows where that is faster:
    _packed); its math kernel on the CPU for fewer than 16 keys, where the fused kernel loses a
    NaN of q, and for 16-bit inputs where the fused kernel fails (_fused_16bit_breaks)."""
    packed = _packed(q, attn_mask, is_causal, plan.groups)
    if packed is not None:
        B, H, nq, _ = q.shape
        out = _sdpa(packed[0], k, v, packed[1], False, plan.scale, {})
        return out.reshape(B, H, nq, out.shape[-1])
    extra = {"enable_gqa": True} if plan.groups > 1 else {}
    return _sdpa(q, k, v, attn_mask, is_causal, plan.scale, extra)


def _sdpa(q, k, v, attn_mask, is_causal: bool, scale: float, extra: dict) -> torch.Tensor:
    low = q.dtype in (torch.bfloat16, torch.float16)
    if q.device.type == "cpu" and (k.shape[-2] < 16 or (low and _fused_16bit_breaks())):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, **extra
            )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, **extra
    )
