"""The next chapter of the story: attention + residual + normalisation + feed-forward."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from .. import masks
from .attention import MultiHeadAttention
from .kv_cache import KVCache
from .rope import RotaryEmbedding


class FeedForward(nn.Module):
    """Position-wise MLP: `gelu` (Linear → GELU → Linear) or `swiglu`
    (`W2 (silu(x W1) ⊙ x W3)`, as in Llama)."""

    def __init__(self, d_model: int, d_ff: int, kind: str = "gelu", bias: bool = True):
        super().__init__()
        if kind not in ("gelu", "swiglu"):
            raise ValueError(f"ffn must be 'gelu' or 'swiglu', got {kind!r}")
        self.kind = kind
        self.w1 = nn.Linear(d_model, d_ff, bias=bias)
        self.w2 = nn.Linear(d_ff, d_model, bias=bias)
        self.w3 = nn.Linear(d_model, d_ff, bias=bias) if kind == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _norm(kind: str, d_model: int) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(d_model)
    if kind == "rmsnorm":
        return nn.RMSNorm(d_model)
    raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {kind!r}")


class TransformerBlock(nn.Module):
    """Attention and feed-forward, each wrapped in a residual connection and a normalisation.

    pre-norm (GPT-2, Llama): `x + Attn(Norm(x))`, then `x + FFN(Norm(x))`;
    post-norm (the original Transformer, BERT): `Norm(x + Attn(x))`, then `Norm(x + FFN(x))`.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        ffn: str = "gelu",
        norm: str = "layernorm",
        pre_norm: bool = True,
        dropout: float = 0.0,
        d_ff: int | None = None,
        rope: bool | RotaryEmbedding | None = None,
        bias: bool = True,
        backend: object = "auto",
    ):
        super().__init__()
        if d_ff is None:  # 4·d, or 8/3·d rounded up to a multiple of 8 for SwiGLU
            d_ff = 4 * d_model if ffn == "gelu" else -(-(8 * d_model // 3) // 8) * 8
        self.pre_norm = pre_norm
        self.attn = MultiHeadAttention(
            d_model, n_heads, n_kv_heads, bias=bias, dropout=dropout, rope=rope, backend=backend
        )
        self.ffn = FeedForward(d_model, d_ff, ffn, bias=bias)
        self.norm1, self.norm2 = _norm(norm, d_model), _norm(norm, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | masks.Mask | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """`x (B, N, d_model)` → `(B, N, d_model)`."""
        kw = dict(mask=mask, causal=causal, cache=cache)
        if self.pre_norm:
            x = x + self.drop(self.attn(self.norm1(x), **kw))
            return x + self.drop(self.ffn(self.norm2(x)))
        x = self.norm1(x + self.drop(self.attn(x, **kw)))
        return self.norm2(x + self.drop(self.ffn(x)))


class Transformer(nn.Module):
    """Token embedding, positions, a stack of `TransformerBlock`s, a final norm and an LM head.

    `causal=True` is a GPT-style decoder (with `generate` through per-layer KV caches);
    `causal=False` a BERT-style encoder, whose `forward` takes a padding mask.
    `positions="learned"` adds a learned position embedding (up to `max_len`); `"rope"` rotates
    queries and keys in every layer instead.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        max_len: int = 1024,
        positions: str = "learned",
        causal: bool = True,
        ffn: str = "gelu",
        norm: str = "layernorm",
        pre_norm: bool = True,
        dropout: float = 0.0,
        backend: object = "auto",
    ):
        super().__init__()
        if positions not in ("learned", "rope"):
            raise ValueError(f"positions must be 'learned' or 'rope', got {positions!r}")
        self.causal, self.max_len = causal, max_len
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model) if positions == "learned" else None
        rope = RotaryEmbedding(d_model // n_heads) if positions == "rope" else None
        self.blocks = nn.ModuleList(
            TransformerBlock(
                d_model,
                n_heads,
                n_kv_heads,
                ffn=ffn,
                norm=norm,
                pre_norm=pre_norm,
                dropout=dropout,
                rope=rope,
                backend=backend,
            )
            for _ in range(n_layers)
        )
        self.norm = _norm(norm, d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        caches: list[KVCache] | None = None,
    ) -> torch.Tensor:
        """`ids (B, N)` → logits `(B, N, vocab)`. `attention_mask (B, N)` marks real tokens
        (True/1) against padding; `caches` (one per layer) continue a decoded sequence."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(f"ids must be a (B, N) tensor of token ids, got {ids!r:.80}")
        start = caches[0].length if caches else 0
        n = ids.shape[1]
        x = self.embed(ids)
        if self.pos is not None:
            if start + n > self.max_len:
                raise ValueError(f"sequence of {start + n} tokens exceeds max_len={self.max_len}")
            x = x + self.pos(torch.arange(start, start + n, device=ids.device))
        x = self.drop(x)
        mask = None
        if attention_mask is not None:
            if attention_mask.shape != ids.shape:
                raise ValueError(
                    f"attention_mask must have the shape of ids {tuple(ids.shape)}, got "
                    f"{tuple(attention_mask.shape)}"
                )
            if caches:
                raise ValueError("attention_mask with caches is not supported")
            mask = masks.key_mask(attention_mask.bool())
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(f"need one KVCache per layer ({len(self.blocks)}), got {len(caches)}")
        for i, block in enumerate(self.blocks):
            cache = caches[i] if caches else None
            x = block(x, mask=mask, causal=self.causal and cache is None, cache=cache)
        return self.lm_head(self.norm(x))

    def new_caches(self, batch_size: int, max_len: int) -> list[KVCache]:
        """One empty KVCache per layer, in the model's dtype and device."""
        p = next(self.parameters())
        attn = cast(TransformerBlock, self.blocks[0]).attn  # every block is one
        return [
            KVCache(
                batch_size, max_len, attn.n_kv_heads, attn.head_dim, dtype=p.dtype, device=p.device
            )
            for _ in self.blocks
        ]

    @torch.no_grad()
    def generate(
        self,
        ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue `ids (B, N)` by `max_new_tokens` tokens through per-layer KV caches.

        `temperature=0` is greedy decoding; otherwise logits are divided by `temperature` and,
        with `top_k`, restricted to the k most likely tokens before sampling."""
        if not self.causal:
            raise ValueError("generate needs a causal (decoder) model")
        if temperature < 0:
            raise ValueError(f"temperature must be ≥ 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be ≥ 1, got {top_k}")
        caches = self.new_caches(ids.shape[0], ids.shape[1] + max_new_tokens)
        logits = self(ids, caches=caches)[:, -1]
        out = [ids]
        for step in range(max_new_tokens):
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, -torch.inf)
                nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            out.append(nxt)
            if step + 1 < max_new_tokens:
                logits = self(nxt, caches=caches)[:, -1]
        return torch.cat(out, dim=1)
