"""Which instruction-set path of the compiled kernel runs.

One build holds five paths: `amx` (the AVX-512 path with the AMX tile unit for bfloat16
products: AMX-TILE, AMX-BF16, AVX512-BF16 and the OS's leave), `avx512bf16` (the AVX-512 path
with bfloat16 products on AVX512-BF16's dot-product instruction), `avx512` (AVX-512
F/BW/DQ/VL), `avx2` (AVX2 + FMA + F16C) and `portable` (the build's baseline, any CPU). By
default the widest one the CPU has runs, except that `avx512bf16` is the default on AMD CPUs
only (Zen 4 and 5 run its instruction at twice their float32 FMA rate, Intel's cores at half of
it); the environment variable `QKV_CPU_ISA=amx|avx512bf16|avx512|avx2|portable` forces one
(read at every call, so a test can switch paths), and `QKV_CPU_ISA=auto` (or unset) restores
the default.
"""

from __future__ import annotations

import os

ISAS = ("amx", "avx512bf16", "avx512", "avx2", "portable")
ENV = "QKV_CPU_ISA"


def requested() -> str:
    """The path asked for by the environment: one of ISAS, or "auto"."""
    return os.environ.get(ENV, "").strip().lower() or "auto"


def choose(ops) -> tuple[str | None, str | None]:
    """`(isa, None)` for the path to run, or `(None, reason)` when the requested one cannot."""
    want = requested()
    if want == "auto":
        return str(ops.best_isa()), None
    if want not in ISAS:
        return None, f"{ENV}={want!r} is not one of auto, {', '.join(ISAS)}"
    if not ops.isa_supported(want):
        return None, f"{ENV}={want} but this CPU lacks the instructions of that path"
    return want, None
