"""A preallocated key/value cache for one attention layer."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of the positions seen so far, for autoregressive decoding.

    Args:
        batch_size, max_len, n_kv_heads, head_dim: the storage `(B, Hkv, max_len, head_dim)`.
        window: keep only the last `window` positions, in a ring buffer of `window` slots (then
            `max_len` is not used and the sequence may grow without bound). Without a window,
            appending past `max_len` is an error.
        pool_block: also keep each block of `pool_block` positions' key sum and mean key
            (float32), updated as tokens arrive (only the blocks the new positions touch), so
            that `pooled_keys()` (the blocks' mean keys, what `qkv.sparse.select_blocks` scores
            a decoding query against: Quest-style decoding) costs no pass over the cache and no
            copy. Not with a window.

    `update(k, v)` appends the new positions and returns the keys/values to attend to, oldest
    first: everything cached (no window), or the last `window − 1` cached positions followed by
    the new ones (window), together with the position of the first returned key.
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        window: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        pool_block: int | None = None,
    ):
        for name, val in (
            ("batch_size", batch_size),
            ("max_len", max_len),
            ("n_kv_heads", n_kv_heads),
            ("head_dim", head_dim),
        ):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, int) or window < 1
        ):
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        self.window = window
        self.max_len = max_len
        slots = window if window is not None else max_len
        shape = (batch_size, n_kv_heads, slots, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # positions seen so far
        if pool_block is not None and (
            isinstance(pool_block, bool) or not isinstance(pool_block, int) or pool_block < 1
        ):
            raise ValueError(f"pool_block must be a positive int or None, got {pool_block!r}")
        if pool_block is not None and window is not None:
            raise ValueError("pool_block keeps blocks of the whole sequence; not with a window")
        self.pool_block = pool_block
        blocks = -(-max_len // pool_block) if pool_block else 0
        pooled = (batch_size, n_kv_heads, blocks, head_dim)
        self.key_sums = torch.zeros(pooled, dtype=torch.float32, device=device)
        self.key_means = torch.zeros(pooled, dtype=torch.float32, device=device)

    def __repr__(self) -> str:
        b, h, slots, d = self.keys.shape
        return (
            f"KVCache(batch_size={b}, slots={slots}, n_kv_heads={h}, head_dim={d}, "
            f"window={self.window}, length={self.length})"
        )

    def reset(self) -> None:
        """Forget every position (the storage is kept)."""
        self.length = 0
        self.key_sums.zero_()
        self.key_means.zero_()

    def pooled_keys(self) -> torch.Tensor:
        """float32 `(B, Hkv, ceil(length / pool_block), head_dim)`: the mean key of each block
        of cached positions (the last block's over the positions it holds so far). A view of
        the cache's storage: the next `update` changes the blocks it touches."""
        if self.pool_block is None:
            raise ValueError("this KVCache keeps no pooled keys: build it with pool_block=")
        return self.key_means.narrow(2, 0, -(-self.length // self.pool_block))

    def _pool(self, k: torch.Tensor, start: int, block: int) -> None:
        """Add `k`'s keys (positions `start …`) to their blocks' sums (blocks of `block`
        positions, `pool_block`); renew those blocks' means."""
        n = k.shape[2]
        blocks = torch.arange(start, start + n, device=k.device) // block
        self.key_sums.index_add_(2, blocks, k.detach().float())
        b0, b1 = start // block, (start + n - 1) // block + 1
        counts = torch.full((b1 - b0, 1), float(block), dtype=torch.float32, device=k.device)
        counts[-1] = start + n - (b1 - 1) * block  # the last block holds what has arrived
        self.key_means[:, :, b0:b1] = self.key_sums[:, :, b0:b1] / counts

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        b, h, _, d = self.keys.shape
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 4 or t.shape[0] != b or t.shape[1] != h or t.shape[3] != d:
                raise ValueError(
                    f"{name} must have shape (B={b}, Hkv={h}, n, head_dim={d}), got "
                    f"{tuple(t.shape)}"
                )
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"k and v hold {k.shape[2]} and {v.shape[2]} positions")

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Append `k, v (B, Hkv, n, head_dim)`; return `(keys, values, first_position)`."""
        self._check(k, v)
        n, start = k.shape[2], self.length
        if self.window is None:
            if start + n > self.max_len:
                raise ValueError(
                    f"KVCache overflow: {start} cached + {n} new positions exceed max_len="
                    f"{self.max_len}; allocate a larger cache or use window="
                )
            self.keys[:, :, start : start + n] = k
            self.values[:, :, start : start + n] = v
            if self.pool_block is not None and n:
                self._pool(k, start, self.pool_block)
            self.length += n
            return self.keys[:, :, : start + n], self.values[:, :, : start + n], 0
        slots = self.keys.shape[2]
        keep = min(start, self.window - 1)  # cached positions the new ones may still see
        idx = torch.arange(start - keep, start, device=k.device) % slots
        keys = torch.cat((self.keys[:, :, idx], k), dim=2)
        values = torch.cat((self.values[:, :, idx], v), dim=2)
        tail = min(n, slots)  # write the newest positions into the ring
        pos = torch.arange(start + n - tail, start + n, device=k.device) % slots
        self.keys[:, :, pos] = k[:, :, n - tail :]
        self.values[:, :, pos] = v[:, :, n - tail :]
        self.length += n
        return keys, values, start - keep
