"""Which instruction-set path of the compiled kernel runs.

One build holds five paths: `amx` (the AVX-512 path with the AMX tile unit for bfloat16
products: AMX-TILE, AMX-BF16, AVX512-BF16 and the OS's leave), `avx512bf16` (the AVX-512 path
with bfloat16 products on AVX512-BF16's dot-product instruction), `avx512` (AVX-512
F/BW/DQ/VL), `avx2` (AVX2 + FMA + F16C) and `portable` (the build's baseline, any CPU). By
default the widest one the CPU has runs, except that `avx512bf16` is the default on AMD CPUs
only (Zen 4 and 5 run its instruction at twice their float32 FMA rate, Intel's cores at half of
it); the environment variable `QKV_CPU_ISA=amx|avx512bf16|avx512|avx2|portable` forces one
(read at every call, so a test can switch paths), and `QKV_CPU_ISA=auto` (or unset) restores
the default. A value that names no path, or one this CPU lacks, is refused with the reason
(`choose`), and warned about once per value (`QkvSettingWarning`): `auto` then runs another
backend instead of the compiled kernel.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

# The paths' one table, csrc/isa_paths.h (which the C++ includes), read here as text: a line
# `QKV_ISA_PATH(name, default_on, stands_in)` per path, widest first, the baseline last as
# `QKV_ISA_BASELINE(name)`. Reading it needs no built kernel.
TABLE = Path(__file__).resolve().parent / "csrc" / "isa_paths.h"
_LINE = re.compile(r"^QKV_ISA_(?:PATH\((\w+), *(\w+), *(\w*)\)|BASELINE\((\w+)\))$", re.M)


def _paths() -> list[tuple[str, str]]:
    """`(name, stands_in)` of each line of TABLE, in its order (stands_in "" for none)."""
    return [(m[1] or m[4], m[3] or "") for m in _LINE.finditer(TABLE.read_text())]


_PATHS = _paths()
ISAS = tuple(name for name, _ in _PATHS)
# a path without a default crossover table of its own -> the path whose table it reads
STAND_INS = {name: stand for name, stand in _PATHS if stand}
ENV = "QKV_CPU_ISA"


def requested() -> str:
    """The path asked for by the environment: one of ISAS, or "auto"."""
    return os.environ.get(ENV, "").strip().lower() or "auto"


class QkvSettingWarning(UserWarning):
    """A `QKV_*` environment variable holds a value qkv cannot honour (it says which, once)."""


_WARNED: set[tuple[str, str]] = set()


def warn_once(env: str, value: str, message: str) -> None:
    """Warn once per (variable, value) in this process."""
    if (env, value) not in _WARNED:
        _WARNED.add((env, value))
        warnings.warn(message, QkvSettingWarning, stacklevel=3)


def choose(ops) -> tuple[str | None, str | None]:
    """`(isa, None)` for the path to run, or `(None, reason)` when the requested one cannot
    (also warned once per value: the compiled kernel stays off while it is set)."""
    want = requested()
    if want == "auto":
        return str(ops.best_isa()), None
    if want not in ISAS:
        reason = f"{ENV}={want!r} is not one of auto, {', '.join(ISAS)}"
    elif not ops.isa_supported(want):
        reason = f"{ENV}={want} but this CPU lacks the instructions of that path"
    else:
        return want, None
    warn_once(
        ENV,
        want,
        f"{reason}: qkv's compiled CPU kernel will not run while it is set "
        f"(backend='auto' uses another backend); unset it or set {ENV}=auto",
    )
    return None, reason
