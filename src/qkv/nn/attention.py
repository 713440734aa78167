"""Attention layers: the textbook single head and multi-head / grouped-query attention."""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from .. import masks
from ..functional import attention
from ..sparse import BlockSelector
from .kv_cache import KVCache
from .rope import RotaryEmbedding


def _check_input(name: str, x: object, d_model: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3) or x.shape[-1] != d_model:
        raise ValueError(
            f"{name} must have shape (N, d_model) or (B, N, d_model) with d_model={d_model}, "
            f"got {tuple(x.shape)}"
        )
    return x


class SelfAttention(nn.Module):
    """The single head of the textbook: `Q = X W_q`, `K = X W_k`, `V = X W_v`,
    `out = softmax(Q Kᵀ / √d_k) V`.

    Parameters `W_q, W_k (d_model, d_k)` and `W_v (d_model, d_v)` multiply X from the right,
    exactly as written in the formula (optional biases `b_q, b_k, b_v`).
    """

    def __init__(self, d_model: int, d_k: int, d_v: int | None = None, bias: bool = False):
        super().__init__()
        d_v = d_k if d_v is None else d_v
        for name, val in (("d_model", d_model), ("d_k", d_k), ("d_v", d_v)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        self.d_model, self.d_k, self.d_v = d_model, d_k, d_v
        self.W_q = nn.Parameter(torch.empty(d_model, d_k))
        self.W_k = nn.Parameter(torch.empty(d_model, d_k))
        self.W_v = nn.Parameter(torch.empty(d_model, d_v))
        if bias:
            self.b_q = nn.Parameter(torch.zeros(d_k))
            self.b_k = nn.Parameter(torch.zeros(d_k))
            self.b_v = nn.Parameter(torch.zeros(d_v))
        else:
            self.register_parameter("b_q", None)
            self.register_parameter("b_k", None)
            self.register_parameter("b_v", None)
        for w in (self.W_q, self.W_k, self.W_v):
            nn.init.xavier_uniform_(w)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, d_k={self.d_k}, d_v={self.d_v}, bias={self.b_q is not None}"
        )

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | masks.Mask | None = None,
        causal: bool = False,
        return_weights: bool = False,
    ):
        """`x (N, d_model)` or `(B, N, d_model)` → `out (…, N, d_v)` (and `A (…, N, N)`)."""
        x = _check_input("x", x, self.d_model)
        Q, K, V = x @ self.W_q, x @ self.W_k, x @ self.W_v  # (…, N, d_k), (…, N, d_k), (…, N, d_v)
        if self.b_q is not None:
            Q, K, V = Q + self.b_q, K + self.b_k, V + self.b_v
        if x.dim() == 3:  # one head: (B, N, d) → (B, 1, N, d)
            Q, K, V = Q.unsqueeze(1), K.unsqueeze(1), V.unsqueeze(1)
        res = attention(
            Q, K, V, mask=mask, causal=causal, return_weights=return_weights, finite_inputs=True
        )
        if not return_weights:
            return res.squeeze(1) if x.dim() == 3 else res
        out, weights = res
        return (out.squeeze(1), weights.squeeze(1)) if x.dim() == 3 else (out, weights)


class Local:
    """The strategy of a module that holds its whole sequence: positions from the cache's
    length, attention by `qkv.attention`. A sequence-parallel strategy
    (`qkv.distributed.SequenceParallel`) offers the same two methods over a sharded sequence."""

    def positions(self, n: int, start: int, device: torch.device) -> torch.Tensor:
        """Positions of n new tokens after `start` cached ones."""
        return torch.arange(start, start + n, device=device)

    def attention(self, q, k, v, *, cross: bool = False, cache: bool = False, **kwargs):
        """`qkv.attention(q, k, v, **kwargs)`; `cross`/`cache` say what the module is doing.
        The keys and values are the module's own projections (a KVCache's unused slots are
        zeros), so it promises `finite_inputs`: masked slots hold no garbage of their own."""
        return attention(q, k, v, finite_inputs=True, **kwargs)


LOCAL = Local()


class _Strategy(Protocol):
    """What a module calls on its strategy: `Local`'s two methods (a sequence-parallel strategy
    is checked for them when it is set)."""

    def positions(self, n: int, start: int, device: torch.device) -> torch.Tensor: ...

    def attention(self, q, k, v, *, cross: bool = False, cache: bool = False, **kwargs): ...


def _within_window(
    window: masks.Mask, mask: torch.Tensor | masks.Mask | None
) -> torch.Tensor | masks.Mask:
    """A windowed cache's window and the caller's mask, combined by "and": a bool tensor over
    the cache's keys becomes a Mask (`masks.from_tensor`); a float mask cannot join a Mask."""
    if mask is None:
        return window
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            raise ValueError(
                "a KVCache with a window takes a bool mask or a qkv Mask, not a float mask "
                f"({mask.dtype}): pass the allowed pairs as a bool mask (True = may attend)"
            )
        mask = masks.from_tensor(mask)
    return window & mask


class MultiHeadAttention(nn.Module):
    """Multi-head attention with grouped-query heads, RoPE and a KV cache.

    Args:
        d_model: model width.
        n_heads: query heads H.
        n_kv_heads: key/value heads Hkv (H % Hkv == 0); None means H (multi-head), 1 is
            multi-query attention.
        head_dim: width of each head; default `d_model // n_heads`.
        bias: biases in the four projections.
        dropout: attention dropout probability, applied in training mode only.
        rope: None, True (RoPE over the whole head) or a `RotaryEmbedding`.
        backend: passed to `qkv.attention`.
        sequence_parallel: None (one process), or a strategy that runs attention over a
            sequence sharded across processes, `qkv.distributed.SequenceParallel(...)` (group,
            layout, ring/ulysses): then `x` is this rank's shard `(B, N/P, d_model)` (see
            `qkv.distributed.shard`), RoPE uses global positions, `mask` must be a structured
            `qkv.masks.Mask` over global positions, and the output is this rank's shard.
            `qkv.distributed.parallelize(model, sp)` sets it on every MultiHeadAttention of a
            model. (The module calls the strategy's `positions` and `attention`; it never
            imports `qkv.distributed`.)
        select: None, or a `qkv.sparse.BlockSelector`: self-attention then reads, per query
            block and kv head, only the key blocks it chooses from the content (MoBA / Quest;
            exact over the chosen pairs). With a `KVCache(pool_block=select.block)` a decoding
            step scores the cache's pooled keys instead of re-pooling it. Not with a `mask`,
            a windowed cache or a sharded sequence.

    `forward(x, context=None, mask=None, causal=False, cache=None, return_weights=False)`:
    self-attention on `x (B, N, d_model)` (or `(N, d_model)`), or cross-attention from `x` to
    `context (B, M, d_model)`. With a `KVCache`, the new keys/values are appended, queries
    attend causally to everything cached (RoPE positions continue from the cache length; a
    windowed cache attends to the last `window` positions) and only the new positions return.
    """

    strategy: _Strategy  # LOCAL, or the sequence-parallel strategy set

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        rope: bool | RotaryEmbedding | None = None,
        backend: object = "auto",
        sequence_parallel: object = None,
        select: BlockSelector | None = None,
    ):
        super().__init__()
        if select is not None and not isinstance(select, BlockSelector):
            raise TypeError(f"select must be a qkv.sparse.BlockSelector, got {select!r}")
        self.select = select
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        for name, val in (("d_model", d_model), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(
                    f"d_model={d_model} is not divisible by n_heads={n_heads}; pass head_dim"
                )
            head_dim = d_model // n_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout!r} is out of range [0, 1)")
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = (
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
        )
        self.dropout, self.backend = dropout, backend
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.rope = RotaryEmbedding(head_dim) if rope is True else (rope or None)
        self.sequence_parallel = sequence_parallel  # checked by its setter

    @property
    def sequence_parallel(self) -> object:
        """The strategy that runs attention over a sharded sequence (e.g.
        `qkv.distributed.SequenceParallel`), or None: this process holds the whole sequence."""
        return None if self.strategy is LOCAL else self.strategy

    @sequence_parallel.setter
    def sequence_parallel(self, value: object) -> None:
        if value is None:
            self.strategy = LOCAL
        elif callable(getattr(value, "attention", None)) and callable(
            getattr(value, "positions", None)
        ):
            self.strategy = cast(_Strategy, value)  # it has both methods
        else:
            raise TypeError(
                "sequence_parallel must be None or a strategy with attention(q, k, v, ...) and "
                f"positions(n, start, device), such as qkv.distributed.SequenceParallel(...), "
                f"got {type(value).__name__}"
            )

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
            f"head_dim={self.head_dim}, dropout={self.dropout}"
        )

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        B, N, _ = t.shape
        return t.view(B, N, n, self.head_dim).transpose(1, 2)  # (B, n, N, head_dim)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        mask: torch.Tensor | masks.Mask | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        return_weights: bool = False,
    ):
        x = _check_input("x", x, self.d_model)
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(0)
        src = x
        if context is not None:
            src = _check_input("context", context, self.d_model)
            src = src.unsqueeze(0) if src.dim() == 2 else src
            if src.shape[0] != x.shape[0]:
                raise ValueError(f"context has batch {src.shape[0]}, x has {x.shape[0]}")
        B, N, _ = x.shape
        q = self._heads(self.q_proj(x), self.n_heads)  # (B, H, N, hd)
        k = self._heads(self.k_proj(src), self.n_kv_heads)  # (B, Hkv, M, hd)
        v = self._heads(self.v_proj(src), self.n_kv_heads)
        start = cache.length if cache is not None else 0
        if self.rope is not None:  # positions of these tokens (global ones, when sharded)
            q = self.rope(q, self.strategy.positions(N, start, x.device))
            k = self.rope(k, self.strategy.positions(k.shape[2], start, x.device))
        if cache is not None:
            if context is not None:
                raise ValueError("a KVCache holds self-attention keys; do not pass context with it")
            if cache.window is not None:  # the last `window` positions, oldest first
                mask = _within_window(masks.sliding_window(cache.window - 1, 0), mask)
            causal = cache.window is None
            k, v, _ = cache.update(k, v)  # after every check: a refused call caches nothing
        if self.select is not None and context is None:
            mask = self._chosen(self.select, q, k, mask, causal, cache)
        res = self.strategy.attention(
            q,
            k,
            v,
            mask=mask,
            causal=causal,
            backend=self.backend,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=return_weights,
            cross=context is not None,
            cache=cache is not None,
        )
        out, weights = res if return_weights else (res, None)
        out = self.o_proj(out.transpose(1, 2).reshape(B, N, self.n_heads * self.head_dim))
        if unbatched:
            out = out[0]
            weights = weights[0] if weights is not None else None
        return (out, weights) if return_weights else out

    def _chosen(
        self, select: BlockSelector, q, k, mask, causal: bool, cache: KVCache | None
    ) -> masks.Mask:
        """The blocks `select` (the module's) chooses for this call (the forward's mask)."""
        if cache is not None and cache.window is not None:
            raise ValueError("select chooses among all cached blocks; not with a windowed cache")
        if mask is not None:
            raise ValueError("select chooses the mask itself; do not pass mask= with it")
        if self.sequence_parallel is not None:
            raise ValueError("select needs the whole sequence; not with sequence_parallel")
        pooled = None
        if cache is not None and cache.pool_block == select.block:
            pooled = cache.pooled_keys()
        return select(q, k, causal=causal, pooled_k=pooled)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention) -> MultiHeadAttention:
        """A `MultiHeadAttention` with the weights of a `torch.nn.MultiheadAttention` (same
        outputs for `batch_first` inputs: feed `(B, N, d)`; transpose if it is not)."""
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(
                f"from_torch needs a torch.nn.MultiheadAttention, got {type(mha).__name__}"
            )
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn have no equivalent in qkv")
        if not mha._qkv_same_embed_dim:
            raise ValueError("kdim/vdim different from embed_dim are not supported")
        E, H = mha.embed_dim, mha.num_heads
        bias = mha.in_proj_bias is not None
        layer = cls(E, H, bias=bias, dropout=mha.dropout)
        wq, wk, wv = mha.in_proj_weight.detach().chunk(3)
        with torch.no_grad():
            layer.q_proj.weight.copy_(wq)
            layer.k_proj.weight.copy_(wk)
            layer.v_proj.weight.copy_(wv)
            layer.o_proj.weight.copy_(mha.out_proj.weight)
            if bias:
                bq, bk, bv = mha.in_proj_bias.detach().chunk(3)
                layer.q_proj.bias.copy_(bq)
                layer.k_proj.bias.copy_(bk)
                layer.v_proj.bias.copy_(bv)
                layer.o_proj.bias.copy_(mha.out_proj.bias)
        return layer.to(mha.in_proj_weight.dtype)
