"""Build the compiled CPU kernel once per machine, and load it.

The C++ sources in `csrc/` are compiled with `torch.utils.cpp_extension` (ninja and the system's
C++ compiler) into a shared library that registers the ops `torch.ops.qkv_cpu.*`. One build holds
every instruction-set path (AVX-512, AVX2, portable); the path is chosen when a kernel runs.

- Where: `$QKV_CACHE_DIR`, else `$XDG_CACHE_HOME/qkv`, else `~/.cache/qkv`, in a folder named for
  the torch version, the Python version, the machine, the CPU model and a hash of the sources, so
  a new torch, another CPU or an edited source builds afresh and nothing stale is ever loaded.
- When: on first use (`qkv.attention` considering the `cpu` backend) or ahead of time with
  `qkv build`. Building prints one line on stderr and takes well under a minute on 2 cores.
- If it cannot be built (no compiler, no ninja, a compiler error), `status()` says why, the
  reason is kept in the build folder so later processes do not retry (until `qkv build`), and
  qkv keeps working on its pure-PyTorch backends.

Importing this module does not build or load anything.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

NAME = "qkv_cpu"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("ops.cpp", "key_layout.cpp", "isa_amx.cpp", "isa_avx512.cpp", "isa_avx2.cpp", "isa_portable.cpp")
HEADERS = (
    "placement.h",
    "problem.h",
    "results.h",
    "kernel.h",
    "simd_avx512.h",
    "tiles_amx.h",
    "simd_avx2.h",
    "simd_portable.h",
    "backward_ops.h",
)
# -ffp-contract=off: a product and a sum are fused only where the code says so, so the scores
# the forward and the backward compute are the same bits. -fopenmp at compile time only: the
# OpenMP pragma inside at::parallel_for (a header template) is compiled into ops.cpp, and its
# GOMP_* calls resolve at load time to the OpenMP runtime torch itself loaded (no second
# runtime is linked), so the kernel runs on torch's thread pool and torch.set_num_threads holds.
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp")
FAILED = "build-failed.txt"


class KernelUnavailable(RuntimeError):
    """The compiled kernel could not be built or loaded; the message says why."""


def cache_root() -> Path:
    if os.environ.get("QKV_CACHE_DIR"):
        return Path(os.environ["QKV_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "qkv"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown-cpu"


def _sources_hash() -> str:
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(CFLAGS).encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    """The folder of this (torch, Python, machine, CPU, sources) combination."""
    cpu = hashlib.sha256(cpu_model().encode()).hexdigest()[:8]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    tag = f"torch{torch.__version__}-{py}-{platform.machine()}-cpu{cpu}-src{_sources_hash()}"
    return cache_root() / "cpu-kernel" / tag.replace("+", "_")


_ops = None  # torch.ops.qkv_cpu once loaded
_error: str | None = None  # why it is unavailable, once known


def _library(folder: Path) -> Path:
    return folder / f"{NAME}.so"


def _first_line(err: BaseException) -> str:
    """The line of a failed build worth showing: the compiler's first `error:`, else the start."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for line in lines:
        if "error:" in line:
            return line[:300]
    return (lines or [type(err).__name__])[0][:300]


def _compile(folder: Path, verbose: bool) -> None:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # pip's ninja sits beside python, maybe not on PATH
        here = Path(sys.executable).parent
        if (here / "ninja").exists():
            os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"
    if shutil.which("ninja") is None:
        raise KernelUnavailable("ninja is not installed (pip install ninja)")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C++ compiler ({compiler!r} is not on PATH; install g++)")
    cpp_extension.load(
        name=NAME,
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=list(CFLAGS),
        build_directory=str(folder),
        is_python_module=False,
        verbose=verbose,
    )


def load(build: bool = True, force: bool = False, verbose: bool = False):
    """`torch.ops.qkv_cpu`, building it first if needed. Raises `KernelUnavailable` with the
    reason when it cannot be had. `force` rebuilds even after a recorded failure (`qkv build`);
    `build=False` only loads an existing build."""
    global _ops, _error
    if _ops is not None:
        return _ops
    if _error is not None and not force:
        raise KernelUnavailable(_error)
    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; others wait, then load
        failed = folder / FAILED
        if failed.exists() and not force:
            _error = failed.read_text().strip() or "an earlier build failed"
            raise KernelUnavailable(_error)
        lib = _library(folder)
        try:
            if lib.exists() and not force:
                torch.ops.load_library(str(lib))
            elif not build:
                raise KernelUnavailable("not built yet (run `qkv build`)")
            else:
                print(
                    f"qkv: compiling the CPU attention kernel into {folder} "
                    "(once per machine and torch version)...",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
                start = time.perf_counter()
                try:
                    _compile(folder, verbose)
                finally:
                    print(f" {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
                failed.unlink(missing_ok=True)
        except KernelUnavailable as err:
            _error = str(err)
            raise
        except Exception as err:  # no compiler, a compile error, a bad library: record why
            _error = f"building it failed: {_first_line(err)}"
            failed.write_text(_error + "\n")
            raise KernelUnavailable(_error) from err
    _ops = torch.ops.qkv_cpu
    return _ops


def loaded():
    """`torch.ops.qkv_cpu` if this process has loaded it, else None (builds and loads nothing)."""
    return _ops


def status() -> str | None:
    """None when the kernel is loaded (building it if needed), else why it is unavailable."""
    try:
        load()
    except KernelUnavailable as err:
        return str(err)
    return None
