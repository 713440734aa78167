"""Modules built on `qkv.attention`: the textbook head, multi-head/grouped-query attention with
RoPE and a KV cache, and Transformer blocks and models."""

from .attention import MultiHeadAttention, SelfAttention
from .kv_cache import KVCache
from .rope import RotaryEmbedding
from .transformer import FeedForward, Transformer, TransformerBlock

__all__ = [
    "FeedForward",
    "KVCache",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "SelfAttention",
    "Transformer",
    "TransformerBlock",
]
