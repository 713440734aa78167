"""qkv's compiled CPU kernel: block-sparse FlashAttention-2, forward and backward, in C++.

- `csrc/`: the C++ sources (`ops.cpp` registers `torch.ops.qkv_cpu.*`; `kernel.h` is the
  algorithm, compiled once per instruction set by `isa_*.cpp` over the names `isa_contract.h`
  lists; docs/cpu.md, "Instruction sets", lists the files);
- `build.py`: builds them once per machine (at first use or with `qkv build`) and loads them;
- `isa.py`: which instruction-set path runs (`QKV_CPU_ISA`);
- `tile_encoding.py`: what the kernel reads of `qkv.layout`'s block layout (and the PARTIAL
  tiles' bits);
- `memory.py`: the freed large results it keeps for reuse, and how to give them back;
- `crossover.py`: where the kernel beats torch SDPA on this machine (`qkv tune`);
- `backend.py`: `CpuBackend` (`backend="cpu"`), what it accepts and why not;
- `op.py`: its custom ops (`torch.compile`, `torch.func`) around `torch.ops.qkv_cpu`.

Importing this package builds and loads nothing.
"""

from .build import KernelUnavailable, build_dir, load, loaded, status
from .isa import ISAS
from .memory import cached_result_bytes, release_cached_results
from .tile_encoding import CpuLayout, kernel_layout

__all__ = [
    "ISAS",
    "CpuLayout",
    "KernelUnavailable",
    "build_dir",
    "cached_result_bytes",
    "kernel_layout",
    "load",
    "loaded",
    "release_cached_results",
    "status",
]
