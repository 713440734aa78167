"""qkv's Triton GPU kernel: block-sparse FlashAttention-2, forward and backward.

- `backend.py`: `TritonBackend` (`backend="triton"`): what it accepts, and why not;
- `host.py`: the host side (grids, the block layout's tables, the custom ops);
- `kernels.py`: the Triton kernels themselves, the only module that imports Triton.

Importing this package does not import Triton.
"""

from .backend import TritonBackend

__all__ = ["TritonBackend"]
