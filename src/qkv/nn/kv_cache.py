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

    def __repr__(self) -> str:
        b, h, slots, d = self.keys.shape
        return (
            f"KVCache(batch_size={b}, slots={slots}, n_kv_heads={h}, head_dim={d}, "
            f"window={self.window}, length={self.length})"
        )

    def reset(self) -> None:
        """Forget every position (the storage is kept)."""
        self.length = 0

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
