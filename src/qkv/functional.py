"""`qkv.attention`: validate → plan → dispatch → kernel, and `qkv.dispatch` to see the choice
(for attention, or for received attention with `op="received"`)."""

from __future__ import annotations

import torch

from .dispatch import AUTO, Decision, choose, choose_received
from .masks import Mask
from .plan import from_4d, make_plan, to_4d
from .scores import ScoreMod


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | Mask | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: object = AUTO,
    return_lse: bool = False,
    return_weights: bool = False,
    score_mod: ScoreMod | None = None,
    finite_inputs: bool = False,
):
    """Exact scaled dot-product attention: `softmax(Q Kᵀ · scale + bias, masked) V`.

    Args:
        q: `(B, H, Nq, D)`, `(H, Nq, D)` or `(N, D)`.
        k: `(B, Hkv, Nk, D)` in the same layout; `H % Hkv == 0` (grouped-query attention:
            query head h reads key/value head `h // (H // Hkv)`; the repeat is never copied).
        v: `(B, Hkv, Nk, Dv)`; Dv may differ from D.
        mask: None; a bool tensor broadcastable to `(B, H, Nq, Nk)` where True = may attend;
            a float tensor of that shape added to the scaled scores (−inf excludes a pair); or
            a structured `qkv.masks.Mask` (sliding window, document, …), which the tiled
            backend turns into skipped tiles instead of an Nq×Nk tensor.
        causal: query i sees key j only when `j ≤ i + Nk − Nq` (bottom-right aligned, what
            KV-cache decoding needs)::

                Nq=2, Nk=4     keys 0 1 2 3
                  query 0           x x x .
                  query 1           x x x x

            Combined with `mask` by logical and.
        scale: multiplies Q Kᵀ; default `1/√D`. Must be finite and > 0.
        dropout_p: probability of dropping each attention weight (kept ones are scaled by
            `1/(1−p)`). The mask is drawn from torch's RNG, so `torch.manual_seed` repeats it,
            and the backward sees exactly the entries the forward dropped. Applied whenever
            > 0 (modules pass 0 in eval mode).
        backend: "auto" (the fastest backend whose semantics match exactly), "sdpa",
            "triton" (CUDA), "tiled", "reference", or a backend object such as
            `qkv.kernels.TiledBackend(64, 128)`. A named backend that cannot run the request
            raises `NotImplementedError`.
        return_lse: also return lse, the natural log of each row's softmax denominator,
            `(B, H, Nq)` float32 (float64 for float64 inputs); differentiable.
        return_weights: also return A `(B, H, Nq, Nk)` (before dropout); reference only.
        score_mod: a `qkv.scores.ScoreMod` applied to the scaled scores inside every tile
            (ALiBi, soft-capping, a learnable relative bias), before masking.
        finite_inputs: the caller's promise that k and v hold no NaN or inf. qkv never reads
            values to decide (no host sync, nothing that stops `torch.compile`), so without
            the promise `auto` keeps masked requests (causal included) on kernels that keep
            garbage in masked slots out of the result themselves (the compiled CPU kernel,
            triton, tiled), and passes over torch's SDPA, whose `0 · NaN` would let it
            through. `qkv.nn` and the transformers integration make the promise for the
            projections they compute.

    Returns:
        `out (B, H, Nq, Dv)` in the input dtype, or a tuple `(out, lse)`, `(out, weights)` or
        `(out, lse, weights)`, all in the caller's layout.

    If a row of the mask allows nothing, that row's output is 0, its lse is −inf and its
    gradients are 0. A NaN or inf in a key/value position that a row may not see does not reach
    that row. fp16/bf16 inputs are computed in fp32 and returned in the input dtype.
    """
    plan = make_plan(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        return_lse=return_lse,
        return_weights=return_weights,
        score_mod=score_mod,
        finite_inputs=finite_inputs,
    )
    q4, k4, v4 = to_4d(q), to_4d(k), to_4d(v)
    decision = choose(plan, q4, k4, v4, backend)
    out, lse, weights = decision.backend.forward(plan, q4, k4, v4)
    rank = plan.input_rank
    result = [from_4d(out, rank)]
    if return_lse:
        assert lse is not None  # a backend returns the lse a plan asks for
        result.append(from_4d(lse, rank))
    if return_weights:
        assert weights is not None  # and the weights
        result.append(from_4d(weights, rank))
    return result[0] if len(result) == 1 else tuple(result)


def dispatch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | Mask | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: object = AUTO,
    return_lse: bool = False,
    return_weights: bool = False,
    score_mod: ScoreMod | None = None,
    finite_inputs: bool = False,
    op: str = "attention",
) -> Decision:
    """Which backend `attention(q, k, v, **same_kwargs)` would run, and why not the others.

    `print(qkv.dispatch(q, k, v, causal=True))` shows the choice and one reason per backend
    passed over. Validates the arguments exactly as `attention` does.

    `op="received"` asks the same of received attention,
    `qkv.received_attention(q, k, mask=..., causal=..., scale=...)` (the column sums of A):
    `print(qkv.dispatch(q, k, causal=True, op="received"))`. It reads no v and takes only
    those arguments (and `backend`).
    """
    if op == "received":
        if v is not None:
            raise ValueError("received attention reads no v: qkv.dispatch(q, k, op='received')")
        if dropout_p or return_lse or return_weights or score_mod is not None or finite_inputs:
            raise ValueError(
                "op='received' takes q, k, mask, causal, scale and backend, as "
                "qkv.received_attention does"
            )
        # Validated exactly as received_attention does (k stands in for v).
        plan = make_plan(q, k, k, mask=mask, causal=causal, scale=scale)
        return choose_received(plan, to_4d(q), to_4d(k), backend)
    if op != "attention":
        raise ValueError(f"op must be 'attention' or 'received', got {op!r}")
    plan = make_plan(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        return_lse=return_lse,
        return_weights=return_weights,
        score_mod=score_mod,
        dropout_seed=0,
        finite_inputs=finite_inputs,
    )
    assert v is not None  # make_plan refuses a missing v
    return choose(plan, to_4d(q), to_4d(k), to_4d(v), backend)
