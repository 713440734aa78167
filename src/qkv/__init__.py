"""qkv: self-attention from the textbook formula to production.

out = qkv.attention(q, k, v, causal=True)          # exact, fastest matching backend
print(qkv.dispatch(q, k, v, causal=True))          # which backend, and why
st = qkv.reference.steps(q, k, v)                  # S, S_scaled, A, out, lse
"""

from . import kernels, reference
from .dispatch import Decision
from .functional import attention, dispatch
from .plan import AttentionPlan

__version__ = "0.1.0"

__all__ = [
    "AttentionPlan",
    "Decision",
    "__version__",
    "attention",
    "dispatch",
    "kernels",
    "reference",
]
