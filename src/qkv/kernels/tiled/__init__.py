"""qkv's tiled FlashAttention-2 in PyTorch operations: exact, O(N) memory, on any device.

- `backend.py`: `TiledBackend` (`backend="tiled"`), the online-softmax loop over the block layout;
- `steps.py`: the loop's steps, forward and backward, shared with the ring (`qkv.distributed`);
- `fused.py`: the fused strips, a faster path for runs of FULL tiles;
- `received.py`: received attention (the column sums of A), a band of query rows at a time;
- `op.py`: the custom ops that let torch.compile trace through it.
"""

from .backend import TiledBackend

__all__ = ["TiledBackend"]
