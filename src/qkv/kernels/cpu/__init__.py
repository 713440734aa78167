"""qkv's compiled CPU kernel: block-sparse FlashAttention-2, forward and backward, in C++.

- `csrc/`: the C++ sources (`ops.cpp` registers `torch.ops.qkv_cpu.*`; `kernel.h` is the
  algorithm, compiled once per instruction set by `isa_*.cpp` over `simd_*.h`);
- `build.py`: builds them once per machine (at first use or with `qkv build`) and loads them;
- `isa.py`: which instruction-set path runs (`QKV_CPU_ISA`);
- `layout.py`: what the kernel reads of `qkv.layout`'s block layout (and the PARTIAL tiles' bits).

The backend that uses it is `qkv.kernels.cpu_backend.CpuBackend` (`backend="cpu"`). Importing
this package builds and loads nothing.
"""

from .build import KernelUnavailable, build_dir, load, status
from .isa import ISAS
from .layout import CpuLayout, kernel_layout

__all__ = ["ISAS", "CpuLayout", "KernelUnavailable", "build_dir", "kernel_layout", "load", "status"]
