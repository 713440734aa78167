"""Shared helpers: inputs, the fp64 golden, and the error rule of docs/design.md (section 7)."""

from __future__ import annotations

import torch

import qkv
from qkv.kernels import TiledBackend

# Every backend the suite judges, with small tiles for `tiled` so that awkward sizes cross
# many tile boundaries (the default tiles are exercised by their own tests).
BACKENDS = {
    "reference": "reference",
    "sdpa": "sdpa",
    "tiled": "tiled",
    "tiled-small": TiledBackend(block_q=16, block_k=32, max_rows=32, max_cols=32),
    "auto": "auto",
}

LOW_PRECISION = [torch.bfloat16, torch.float16]


def cpu_kernel_or(name: str) -> str:
    """What `auto` picks for a CPU request that torch SDPA cannot run: "cpu" (qkv's compiled
    kernel) where it could be built, else `name`."""
    from qkv.kernels import cpu

    return "cpu" if cpu.status() is None else name


def make_qkv(
    B=2,
    H=4,
    Hkv=None,
    Nq=33,
    Nk=None,
    D=16,
    Dv=None,
    dtype=torch.float32,
    seed=0,
    requires_grad=False,
):
    """Random q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv)."""
    Hkv = H if Hkv is None else Hkv
    Nk = Nq if Nk is None else Nk
    Dv = D if Dv is None else Dv
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Nk, Dv, generator=g).to(dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def golden(q, k, v, **kwargs):
    """The oracle: the reference formula in float64 on the same (rounded) inputs."""
    return qkv.attention(
        q.detach().double(),
        k.detach().double(),
        v.detach().double(),
        backend="reference",
        **_double_masks(kwargs),
    )


def _double_masks(kwargs):
    m = kwargs.get("mask")
    if isinstance(m, torch.Tensor) and m.dtype.is_floating_point:
        kwargs = {**kwargs, "mask": m.double()}
    return kwargs


def floor_for(g: torch.Tensor, dtype: torch.dtype) -> float:
    """FlashAttention's floor: the rounding error of the golden's magnitude in `dtype`,
    `2·max|(g + 0.3 − 0.3) − g|`, but never below one rounding of the largest value,
    `eps·(max|g| + 0.3)`. On a tensor of a few elements FlashAttention's expression can be 0
    by luck (found by the fuzz: one output element, floor 0); on a large one it is the larger
    of the two, so the rule is unchanged there."""
    g = torch.nan_to_num(g.to(dtype), nan=0.0, posinf=0.0, neginf=0.0)
    if not g.numel():
        return 0.0
    fa = 2 * ((g + 0.3 - 0.3) - g).abs().max().item()
    return max(fa, torch.finfo(dtype).eps * (g.abs().max().item() + 0.3))


def assert_error_ratio(got, same_dtype_ref, gold, factor=2.0, what="output"):
    """max|got − gold| ≤ factor · max|ref_same_dtype − gold| + floor.

    Also: no NaN/inf where the golden is finite. fp64 results must agree to ~1e-10."""
    assert got.shape == gold.shape, (what, got.shape, gold.shape)
    finite = torch.isfinite(gold)
    assert torch.isfinite(got[finite]).all(), f"{what}: NaN/inf where the golden is finite"
    if not finite.any():
        return
    err = (got.double() - gold)[finite].abs().max().item()
    if got.dtype == torch.float64:  # our fp64 runs must agree with the golden to ~1e-10
        scale = max(1.0, gold[finite].abs().max().item())
        assert err <= 1e-10 * scale, f"{what}: fp64 error {err:.3g} vs golden"
        return
    ref_err = (same_dtype_ref.double() - gold)[finite].abs().max().item()
    floor = floor_for(gold, got.dtype)
    assert err <= factor * ref_err + floor, (
        f"{what}: error {err:.3g} > {factor}·{ref_err:.3g} (reference in {got.dtype}) + {floor:.3g}"
    )


def matmul_flops(fn) -> int:
    """FLOPs of the matrix products `fn` runs, with torch's FlopCounterMode. The mode sees a
    custom op as one call and cannot look inside; for qkv's tiled ops it runs their
    implementation under the mode, so that the products they really run are counted."""
    from torch.utils.flop_counter import FlopCounterMode

    from qkv.kernels.tiled import op as tiled_op

    def inside(impl):
        def rule(mode, func, types, args, kwargs):
            with mode:
                return impl(*args, **kwargs)

        return rule

    with FlopCounterMode(display=False) as counter:
        mode = type(counter.mode)  # the TorchDispatchMode it pushes
        tiled_op.tiled_forward.register_torch_dispatch(mode, inside(tiled_op.forward_impl))
        tiled_op.tiled_backward.register_torch_dispatch(mode, inside(tiled_op.backward_impl))
        fn()
    return counter.get_total_flops()
