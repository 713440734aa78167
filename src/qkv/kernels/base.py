"""The contract every backend implements.

A backend receives a validated `AttentionPlan` and canonical 4-D tensors
`q: (B, H, Nq, D)`, `k: (B, Hkv, Nk, D)`, `v: (B, Hkv, Nk, Dv)` and returns
`(out, lse, weights)`: `out (B, H, Nq, Dv)` in the input dtype, `lse (B, H, Nq)` (float32, or
float64 for float64 inputs) or None when the plan does not ask for it and the backend cannot
produce it, and `weights (B, H, Nq, Nk)` only when the plan asks for them. The result is
differentiable with respect to q, k and v (and lse, for backends that return it).

`why_not` is the honest half of the contract: it returns None when the backend computes exactly
the requested semantics, otherwise one sentence a user can read saying why not.

Every backend subclasses `Backend`: `why_not` and `forward` are its own; the other hooks have
defaults that decline, so dispatch calls every hook directly, never looks one up by name:
- `auto_skip`: a preference of `auto` (it passes a backend over for a request another runs
  better), not a limit; None by default;
- `crossover` / `crossover_basis`: what this backend measured against another one, for the
  choice between the two that `qkv.dispatch` makes (`dispatch.CROSSOVERS` names the pairs);
  None by default (nothing measured);
- `dispatch_state`: what, besides a request, this backend's answers depend on and may change
  in a process (settings it reads from the environment); empty by default;
- `why_not_received` / `received`: received attention, the column sums of A
  (`qkv.received_attention`); by default a backend has no such operation and says so.
"""

from __future__ import annotations

import torch

from ..plan import AttentionPlan

Result = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class Backend:
    """The contract (module docstring): subclass it, set `name`, write `why_not` and `forward`,
    and override the other hooks where the backend has something to say."""

    name: str = ""

    def why_not(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> str | None:
        """None if this backend can run the plan exactly, else the reason it cannot."""
        raise NotImplementedError(f"{type(self).__name__} does not say what it runs")

    def forward(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> Result:
        """Compute `(out, lse, weights)` for a plan that `why_not` accepted."""
        raise NotImplementedError(f"{type(self).__name__} computes no attention")

    def auto_skip(self, plan: AttentionPlan) -> str | None:
        """Why `auto` passes this backend over for a plan it runs exactly (None: it does not):
        a measured preference, not a limit."""
        return None

    def crossover(self, rival: str, plan: AttentionPlan) -> tuple[str, str] | None:
        """Which of this backend and the backend named `rival` was measured faster on requests
        of the plan's class and size, `(winner's name, why)`, for a plan both run exactly; None
        where this backend holds no such measurement. Dispatch decides with it (it asks only
        where `rival` would take the request); a backend never asks another one."""
        return None

    def crossover_basis(self, rival: str) -> str | None:
        """Where the measurements `crossover` reads against `rival` come from, in words (for
        `qkv.dispatch`; None: none)."""
        return None

    def dispatch_state(self) -> tuple:
        """What, besides a request, this backend's answers (`why_not`, `auto_skip`,
        `crossover`) depend on and may change in a process: part of the key under which
        dispatch remembers auto's choices. Empty when they depend on the request only."""
        return ()

    def why_not_received(self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor) -> str | None:
        """None if this backend computes received attention for the plan (the plan is the one
        `qkv.received_attention` makes: k stands in for v; the tensors are canonical 4-D), else
        why not."""
        return f"{self.name} has no received-attention operation (the column sums of A)"

    def received(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor | None
    ) -> torch.Tensor:
        """`Σ_i A[b, h, i, j]`, `(B, H, Nk)` in the plan's compute dtype, not differentiable;
        given the `(B, H, Nq)` lse of the same problem, A = exp(S − lse), not normalised again.
        Rows that may attend nowhere add 0."""
        raise NotImplementedError(self.why_not_received(plan, q, k))


def received_refusal(
    backend: Backend, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor
) -> str | None:
    """Why `backend` cannot compute received attention for the plan (None: it can)."""
    return backend.why_not_received(plan, q, k)
