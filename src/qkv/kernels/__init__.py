"""Backends, one file each, all implementing the contract in `base.py`.

`BACKENDS` lists them in the order `auto` prefers them (fastest exact first).
"""

from .base import Backend, Result
from .reference import ReferenceBackend
from .sdpa import SdpaBackend
from .tiled import TiledBackend

BACKENDS: dict[str, Backend] = {
    "sdpa": SdpaBackend(),
    "tiled": TiledBackend(),
    "reference": ReferenceBackend(),
}

__all__ = ["BACKENDS", "Backend", "ReferenceBackend", "Result", "SdpaBackend", "TiledBackend"]
