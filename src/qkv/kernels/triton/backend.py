"""`triton` backend: FlashAttention-2 forward and backward written in Triton, block-sparse aware.

The kernels live in `kernels.py` (imported lazily: `import qkv` never imports Triton);
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
  per Mask object. Blocks chosen per batch element and kv head (`qkv.sparse.select_blocks`)
  get lists per (b, h): each group's heads visit that group's own kept tiles, not the union
  over every head (`host.group_layout`), in the same launch;
- a float mask (bias) is read tile by tile with its broadcast strides;
- score modifiers from `qkv.scores`: `alibi`, `softcap` and `relative_bias` (its table gets a
  gradient, by atomic adds), alone or composed;
- dropout with `qkv.dropout`'s counter-based hash, bit for bit the reference's keep-mask;
- NaN/±inf in a masked-out key or value slot (a padded or unused KV-cache slot, a key behind
  the causal diagonal or a −inf bias column, a dropped weight) never reaches a row, with no
  `finite_inputs` promise and no host sync: the forward's P V skips zero weights in every
  tile that can hold one by structure when its V tile holds a non-finite value, and the
  backward reads k/v with non-finite values zeroed. A row that does attend to one gets
  NaN/±inf in that entry, as from the reference; gradients flow through the finite part;
- every offset in int64.

On CPU tensors it runs only in Triton's interpreter (`TRITON_INTERPRET=1`, set before
`qkv.kernels.triton.kernels` is first imported), which is how the tests check it without a GPU;
`auto` never picks it there.
"""

from __future__ import annotations

import torch

from ...plan import AttentionPlan
from ..base import Backend, Result
from .runtime import interpreting, triton_available

INSTALL_HINT = "pip install 'qkv[triton]' (or pip install triton)"
MAX_HEAD_DIM = 256


def _host():
    """The host side (`host.py`), imported on first use."""
    from . import host as triton_host

    return triton_host


class TritonBackend(Backend):
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

    def config(self, plan: AttentionPlan):
        """The launch configuration (`host.Config`) for a plan: defaults by head dim,
        then the overrides."""
        host = _host()
        base = host.default_config(max(host.pad_dim(plan.head_dim), host.pad_dim(plan.v_dim)))
        fm, fn = self.block_m or base.fwd_block[0], self.block_n or base.fwd_block[1]
        # Explicit forward tiles apply to the backward too, unless it gets its own.
        bwd = base.bwd_block if self.block_m is None and self.block_n is None else (fm, fn)
        bwd = (self.bwd_block_m or bwd[0], self.bwd_block_n or bwd[1])
        return host.Config(
            fwd_block=(fm, fn),
            bwd_block=bwd,
            fwd_warps=self.num_warps or base.fwd_warps,
            bwd_warps=self.num_warps or base.bwd_warps,
            fwd_stages=self.num_stages or base.fwd_stages,
            bwd_stages=self.num_stages or base.bwd_stages,
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
        if (
            plan.pairs.bias is not None
            and plan.pairs.bias.requires_grad
            and torch.is_grad_enabled()
        ):
            return "the triton backend does not differentiate a float mask (it requires grad)"
        if plan.score_mod is not None:
            why = _host().unsupported(plan.score_mod)
            if why is not None:
                return why
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
        host = _host()
        spec = host.mod_spec(plan.score_mod) if plan.score_mod is not None else None
        call = host.Call(plan, q, self.config(plan), spec)
        params = (spec.table,) if spec is not None and spec.table is not None else ()
        out, lse = host.TritonAttention.apply(q, k, v, call, *params)
        return out, lse, None


__all__ = ["TritonBackend", "interpreting", "triton_available"]
