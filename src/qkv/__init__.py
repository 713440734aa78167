"""qkv: self-attention from the textbook formula to production.

out = qkv.attention(q, k, v, causal=True)          # exact, fastest matching backend
print(qkv.dispatch(q, k, v, causal=True))          # which backend, and why
st = qkv.reference.steps(q, k, v)                  # S, S_scaled, A, out, lse
out = qkv.attention(q, k, v, mask=qkv.masks.sliding_window(256))   # block-sparse
"""

from . import kernels, masks, reference, scores
from .dispatch import Decision
from .functional import attention, dispatch
from .masks import Mask
from .plan import AttentionPlan
from .scores import ScoreMod
from .varlen import attention_varlen
from .vision.received import received_attention

__version__ = "0.1.0"

__all__ = [
    "AttentionPlan",
    "Decision",
    "Mask",
    "ScoreMod",
    "__version__",
    "attention",
    "attention_varlen",
    "dispatch",
    "kernels",
    "masks",
    "received_attention",
    "reference",
    "scores",
]
