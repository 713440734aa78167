"""qkv: self-attention from the textbook formula to production.

out = qkv.attention(q, k, v, causal=True)          # exact, fastest matching backend
print(qkv.dispatch(q, k, v, causal=True))          # which backend, and why
st = qkv.reference.steps(q, k, v)                  # S, S_scaled, A, out, lse
out = qkv.attention(q, k, v, mask=qkv.masks.sliding_window(256))   # block-sparse
"""

import importlib

from . import kernels, layout, masks, reference, scores, sparse
from .cache import cache_info, clear_caches
from .dispatch import Decision
from .functional import attention, dispatch
from .layout import BlockLayout, block_layout
from .masks import Mask
from .plan import AttentionPlan
from .scores import ScoreMod
from .varlen import attention_varlen

__version__ = "0.1.0"

# Submodules loaded on first use, as `torch.nn` is after `import torch`: `import qkv` pulls in
# torch and nothing heavy, and `qkv.nn.TransformerBlock` still works without an import.
_LAZY = ("nn", "distributed", "inspect", "integrations", "labs", "vision", "examples")


_LAZY_NAMES = {"received_attention": "vision.received"}  # names from a lazy submodule


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(f".{_LAZY_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY, *_LAZY_NAMES])


__all__ = [
    "AttentionPlan",
    "BlockLayout",
    "Decision",
    "Mask",
    "ScoreMod",
    "__version__",
    "attention",
    "attention_varlen",
    "block_layout",
    "cache_info",
    "clear_caches",
    "dispatch",
    "kernels",
    "layout",
    "masks",
    "received_attention",
    "reference",
    "scores",
    "sparse",
]
