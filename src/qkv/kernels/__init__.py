"""Backends, one file each, all implementing the contract in `base.py`.

`BACKENDS` lists them in the order `auto` prefers them (fastest exact first). `cpu` (qkv's
compiled CPU kernel) comes first: on CPU tensors it was measured faster than torch SDPA from small
sizes up (dense and causal included; below ~200×200 fp32 scores SDPA keeps what it can run: the
cpu/sdpa crossover, `qkv.dispatch.CROSSOVERS`, decided from `CpuBackend.crossover`), and it also
runs what SDPA cannot (lse, qkv's dropout, ALiBi/softcap, structured masks); on other devices it
declines. `triton` comes after `sdpa`: torch's own
flash/cuDNN kernels keep what they can run exactly, and triton takes the rest on CUDA (lse, qkv's
dropout, score modifiers, structured masks whose empty tiles it skips). `auto` never picks triton
on CPU tensors (there it only runs in Triton's interpreter). Importing this package does not
import Triton, and nothing here builds or loads the compiled CPU kernel: that happens when `cpu`
is first considered for a CPU request (`qkv build` does it ahead of time).

Received attention (`qkv.received_attention`, the column sums of A) is a second operation that a
backend declares (`Backend.why_not_received` and `received`): `tiled` computes it for every
request, a band of query rows at a time; the others decline, and dispatch says so.
"""

from .base import Backend, Result, received_refusal
from .cpu.backend import CpuBackend
from .reference import ReferenceBackend
from .sdpa import SdpaBackend
from .tiled.backend import TiledBackend
from .triton.backend import TritonBackend

BACKENDS: dict[str, Backend] = {
    "cpu": CpuBackend(),
    "sdpa": SdpaBackend(),
    "triton": TritonBackend(),
    "tiled": TiledBackend(),
    "reference": ReferenceBackend(),
}


def dispatch_state() -> tuple:
    """What, besides a request, the backends' choices depend on and may change in a process:
    each backend's own `Backend.dispatch_state` (the compiled kernel's forced path and the
    generation of its crossover tables, for one)."""
    return tuple([b.dispatch_state() for b in BACKENDS.values()])


__all__ = [
    "BACKENDS",
    "Backend",
    "CpuBackend",
    "ReferenceBackend",
    "Result",
    "SdpaBackend",
    "TiledBackend",
    "TritonBackend",
    "dispatch_state",
    "received_refusal",
]
