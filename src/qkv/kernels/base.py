"""The contract every backend implements.

A backend receives a validated `AttentionPlan` and canonical 4-D tensors
`q: (B, H, Nq, D)`, `k: (B, Hkv, Nk, D)`, `v: (B, Hkv, Nk, Dv)` and returns
`(out, lse, weights)`: `out (B, H, Nq, Dv)` in the input dtype, `lse (B, H, Nq)` (float32, or
float64 for float64 inputs) or None when the plan does not ask for it and the backend cannot
produce it, and `weights (B, H, Nq, Nk)` only when the plan asks for them. The result is
differentiable with respect to q, k and v (and lse, for backends that return it).

`why_not` is the honest half of the contract: it returns None when the backend computes exactly
the requested semantics, otherwise one sentence a user can read saying why not.
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
