"""Build the compiled CPU kernel once per machine, and load it.

The C++ sources in `csrc/` are compiled with `torch.utils.cpp_extension` (ninja and the system's
C++ compiler) into a shared library that registers the ops `torch.ops.qkv_cpu.*`. One build holds
every instruction-set path (AVX-512, AVX2, portable); the path is chosen when a kernel runs.

- Where: `$QKV_CACHE_DIR`, else `$XDG_CACHE_HOME/qkv`, else `~/.cache/qkv`, in a folder named for
  the torch version, the Python version, the machine, the CPU model and a hash of the sources, so
  a new torch, another CPU or an edited source builds afresh and nothing stale is ever loaded.
- When: on first use (`qkv.attention` considering the `cpu` backend) or ahead of time with
  `qkv build`. Building prints one line on stderr and takes well under a minute on 2 cores.
- If it cannot be built (no compiler, no ninja, a compiler error, a cache folder that cannot be
  written), `status()` says why, a compiler's failure is kept in the build folder so later
  processes do not retry (until `qkv build`), and qkv keeps working on its other backends.
- Never a crash or a hang from the cache: a library is loaded only when its size and sha256
  equal what its build recorded (`library.json`), so a truncated or corrupted file is rebuilt,
  not loaded; a recorded build loads without writing anything (a read-only cache works); one
  process builds at a time under an OS file lock (released when its holder dies, even by
  SIGKILL), in a fresh folder of its own whose library is moved into place by a rename, and
  what a killed build left is cleared by the next one.

Importing this module does not build or load anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .isa import ISAS

NAME = "qkv_cpu"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    "ops.cpp",
    "inputs.cpp",
    "schedule.cpp",
    "isa_select.cpp",
    "tile_layout.cpp",
    "chosen_blocks.cpp",
    "peak.cpp",
    *(f"isa_{name}.cpp" for name in ISAS),  # one translation unit per path (isa_paths.h)
)
HEADERS = (
    "interrupt.h",
    "placement.h",
    "problem.h",
    "isa_paths.h",
    "isa_select.h",
    "inputs.h",
    "schedule.h",
    "tile_bits.h",
    "results.h",
    "isa_unit.h",
    "isa_contract.h",
    "kernel.h",
    "worker.h",
    "unit_choice.h",
    "rows.h",
    "scratch.h",
    "packing.h",
    "scores.h",
    "forward.h",
    "backward.h",
    "microkernel.h",
    "simd_avx512.h",
    "bf16_pack.h",
    "tiles_amx.h",
    "tiles_dpbf16.h",
    "tiles_none.h",
    "tiles_no_f32.h",
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
# QKV_CPU_SANITIZE=1 (for CI and kernel developers): a separate build under AddressSanitizer and
# UndefinedBehaviorSanitizer, any report fatal. Python must start with the ASan runtime first
# (LD_PRELOAD=$(gcc -print-file-name=libasan.so), ASAN_OPTIONS=detect_leaks=0); .ci/run does.
SANITIZE_ENV = "QKV_CPU_SANITIZE"
SANITIZE_FLAGS = (
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
)
FAILED = "build-failed.txt"
MANIFEST = "library.json"  # size and sha256 of the library a build finished
BUILDING = "building-"  # prefix of a build's own folder (inside the kernel's folder)


class KernelUnavailable(RuntimeError):
    """The compiled kernel could not be built or loaded; the message says why."""


def cache_root() -> Path:
    """`$QKV_CACHE_DIR` (`~` expanded, a relative path resolved against the working directory
    and made absolute, so that every working directory shares one build), else
    `$XDG_CACHE_HOME/qkv`, else `~/.cache/qkv`."""
    if os.environ.get("QKV_CACHE_DIR", "").strip():
        return Path(os.environ["QKV_CACHE_DIR"].strip()).expanduser().absolute()
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
    h.update(" ".join(_cflags()).encode())
    return h.hexdigest()[:16]


PIN_ENV = "QKV_CPU_PIN"  # read by the kernel at every call (csrc/placement.h): "0" turns it off


def _flag(env: str, unset: str) -> str:
    """A 0/1 switch's value (`unset` when empty); any other value is warned about once and
    read as `unset`."""
    raw = os.environ.get(env, "").strip()
    if raw in ("0", "1"):
        return raw
    if raw:
        from .isa import warn_once

        warn_once(env, raw, f"{env}={raw!r} is neither 0 nor 1; read as {unset}")
    return unset


def sanitized() -> bool:
    """Whether this process builds and loads the sanitizer build (`QKV_CPU_SANITIZE=1`)."""
    return _flag(SANITIZE_ENV, "0") == "1"


def _cflags() -> tuple[str, ...]:
    return (*CFLAGS, *SANITIZE_FLAGS) if sanitized() else CFLAGS


def build_dir() -> Path:
    """The folder of this (torch, Python, machine, CPU, sources) combination."""
    cpu = hashlib.sha256(cpu_model().encode()).hexdigest()[:8]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    tag = f"torch{torch.__version__}-{py}-{platform.machine()}-cpu{cpu}-src{_sources_hash()}"
    if sanitized():
        tag += "-sanitized"
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
        extra_cflags=list(_cflags()),
        extra_ldflags=list(SANITIZE_FLAGS[:1]) if sanitized() else None,
        build_directory=str(folder),
        is_python_module=False,
        verbose=verbose,
    )


def _digest(path: Path) -> dict[str, object]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def _verified(folder: Path) -> bool:
    """Whether `folder` holds a library that a build finished: its size and sha256 are those
    the build recorded in MANIFEST. A truncated, emptied or corrupted file is never loaded
    (loading one kills the process with SIGSEGV or SIGBUS); it is rebuilt instead."""
    try:
        want = json.loads((folder / MANIFEST).read_text())
        return isinstance(want, dict) and all(
            want.get(key) == value for key, value in _digest(_library(folder)).items()
        )
    except (OSError, ValueError):
        return False


def _load(folder: Path):
    global _ops
    torch.ops.load_library(str(_library(folder)))
    _ops = torch.ops.qkv_cpu
    return _ops


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Write `path` through a temporary name in its folder and a rename: readers see the old
    file or the new one, never a part."""
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        write(part)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def _install(built: Path, folder: Path) -> None:
    """Move a finished build's library into `folder`, then record its size and checksum."""
    write_atomic(_library(folder), lambda p: shutil.copyfile(_library(built), p))
    manifest = {**_digest(_library(folder)), "torch": torch.__version__}
    write_atomic(folder / MANIFEST, lambda p: p.write_text(json.dumps(manifest) + "\n"))


def _clear_leftovers(folder: Path) -> None:
    """What killed builds left (their build folders, half-written files); called holding the
    lock, so no other qkv process is building here."""
    for entry in folder.iterdir():
        if entry.name.startswith(BUILDING) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.endswith(".part"):
            entry.unlink(missing_ok=True)


def load(build: bool = True, force: bool = False, verbose: bool = False, retry: bool = False):
    """`torch.ops.qkv_cpu`, building it first if needed. Raises `KernelUnavailable` with the
    reason when it cannot be had. `force` rebuilds a good build too; `retry` tries again after
    a recorded failure (`qkv build` does); `build=False` only loads an existing build.

    A build that the MANIFEST vouches for is loaded without writing anything (a read-only cache
    works). Otherwise one process at a time builds (an OS file lock, released when its holder
    dies, however it dies), in a fresh folder of its own, and moves the library into place with
    a rename; a library that does not load is rebuilt once."""
    global _error
    if _ops is not None:
        return _ops
    if _error is not None and not (force or retry):
        raise KernelUnavailable(_error)
    _flag(PIN_ENV, "1")  # the kernel reads it; a value it would misread is named here, once
    folder = build_dir()
    if not force and _verified(folder):
        try:
            return _load(folder)
        except Exception:  # vouched for but unloadable: build it again, once
            force = True
    if not build:
        _error = "not built yet (run `qkv build`)"
        raise KernelUnavailable(_error)
    try:
        return _build(folder, force, retry, verbose)
    except KernelUnavailable as err:
        _error = str(err)
        raise


def _build(folder: Path, force: bool, retry: bool, verbose: bool):
    global _ops
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / ".lock", "a")  # noqa: SIM115 (closed by the `with` below)
    except OSError as err:
        raise KernelUnavailable(
            f"its cache folder {folder} cannot be written ({err.strerror or err}); set "
            f"QKV_CACHE_DIR to a writable folder"
        ) from err
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; others wait, then load
        if not force and _verified(folder):  # built by the process this one waited for
            return _load(folder)
        failed = folder / FAILED
        if failed.exists() and not (force or retry):
            raise KernelUnavailable(failed.read_text().strip() or "an earlier build failed")
        _clear_leftovers(folder)
        print(
            f"qkv: compiling the CPU attention kernel into {folder} "
            "(once per machine and torch version)...",
            end="",
            file=sys.stderr,
            flush=True,
        )
        start = time.perf_counter()
        building = Path(tempfile.mkdtemp(prefix=BUILDING, dir=folder))
        try:
            _compile(building, verbose)  # builds and loads the library there
            _install(building, folder)
        except KernelUnavailable:
            raise
        except Exception as err:  # a compile error, a bad library, a full disk: record why
            reason = f"building it failed: {_first_line(err)}"
            with contextlib.suppress(OSError):  # an unwritable folder: the reason is raised
                failed.write_text(reason + "\n")
            raise KernelUnavailable(reason) from err
        finally:
            print(f" {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
            shutil.rmtree(building, ignore_errors=True)
        failed.unlink(missing_ok=True)
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
