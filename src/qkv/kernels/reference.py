"""`reference` backend: the step-by-step formula (`qkv.reference`), O(N²) memory.

The only backend that can return the attention weights; its gradient is autograd's derivative of
the formula, which makes it the oracle for every other backend's backward.
"""

from __future__ import annotations

import torch

from .. import reference
from ..plan import AttentionPlan
from .base import Backend, Result


class ReferenceBackend(Backend):
    name = "reference"

    def why_not(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> str | None:
        return None

    def forward(
        self, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> Result:
        return reference.forward(plan, q, k, v)
