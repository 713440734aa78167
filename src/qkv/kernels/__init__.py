"""Backends, one file each, all implementing the contract in `base.py`.

`BACKENDS` lists them in the order `auto` prefers them (fastest exact first). `triton` comes
after `sdpa`: torch's own flash/cuDNN kernels keep what they can run exactly, and triton takes
the rest on CUDA (lse, qkv's dropout, score modifiers, structured masks whose empty tiles it
skips). `auto` never picks triton on CPU tensors (there it only runs in Triton's interpreter).
Importing this package does not import Triton.
"""

from .base import Backend, Result
from .reference import ReferenceBackend
from .sdpa import SdpaBackend
from .tiled import TiledBackend
from .triton import TritonBackend

BACKENDS: dict[str, Backend] = {
    "sdpa": SdpaBackend(),
    "triton": TritonBackend(),
    "tiled": TiledBackend(),
    "reference": ReferenceBackend(),
}

__all__ = [
    "BACKENDS",
    "Backend",
    "ReferenceBackend",
    "Result",
    "SdpaBackend",
    "TiledBackend",
    "TritonBackend",
]
