"""The contract every backend implements.

A backend receives a validated `AttentionPlan` and canonical 4-D tensors
`q: (B, H, Nq, D)`, `k: (B, Hkv, Nk, D)`, `v: (B, Hkv, Nk, Dv)` and returns
`(out, lse, weights)`: `out (B, H, Nq, Dv)` in the input dtype, `lse (B, H, Nq)` (float32, or
float64 for float64 inputs) or None when the plan does not ask for it and the backend cannot
produce it, and `weights (B, H, Nq, Nk)` only when the plan asks for them. The result is
differentiable with respect to q, k and v (and lse, for backends that return it).

`why_not` is the honest half of the contract: it returns None when the backend computes exactly
the requested semantics, otherwise one sentence a user can read saying why not.

A backend may also compute received attention, the column sums of A (`qkv.received_attention`):
it declares so with the two methods of `ReceivedBackend`, `why_not_received` and `received`.
Dispatch asks `received_refusal`, which gives a backend without them its reason.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..plan import AttentionPlan

Result = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class Backend(Protocol):
    name: str

    def why_not(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> str | None:
        """None if this backend can run the plan exactly, else the reason it cannot."""
        ...

    def forward(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> Result:
        """Compute `(out, lse, weights)` for a plan that `why_not` accepted."""
        ...


class ReceivedBackend(Protocol):
    """The received-attention operation, for a backend that computes it (the plan is the one
    `qkv.received_attention` makes: k stands in for v; the tensors are canonical 4-D)."""

    name: str

    def why_not_received(self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor) -> str | None:
        """None if this backend computes received attention for the plan, else why not."""
        ...

    def received(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor | None
    ) -> torch.Tensor:
        """`Σ_i A[b, h, i, j]`, `(B, H, Nk)` in the plan's compute dtype, not differentiable;
        given the `(B, H, Nq)` lse of the same problem, A = exp(S − lse), not normalised again.
        Rows that may attend nowhere add 0."""
        ...


def received_refusal(
    backend: Backend, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor
) -> str | None:
    """Why `backend` cannot compute received attention for the plan (None: it can); a backend
    without `ReceivedBackend`'s methods declines with its own sentence."""
    why_not = getattr(backend, "why_not_received", None)
    if not callable(why_not) or not callable(getattr(backend, "received", None)):
        return f"{backend.name} has no received-attention operation (the column sums of A)"
    return why_not(plan, q, k)
