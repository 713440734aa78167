"""How much memory this process may still allocate, and the refusal every O(N²) step raises
before it allocates more than that.

On the CPU the answer is the smallest of the limits that apply to this process:

- cgroup v2: `memory.max − memory.current` of this process's cgroup and of each ancestor
  (`/proc/self/cgroup` names it, under `/sys/fs/cgroup`); the reclaimable page cache
  (`inactive_file` of `memory.stat`) counts as free, as container runtimes count it;
- cgroup v1: `memory.limit_in_bytes − memory.usage_in_bytes` of the memory controller's cgroup
  (less `total_inactive_file`);
- the address-space limit, `RLIMIT_AS` (`ulimit -v`), less the process's current `VmSize`;
- the host's `MemAvailable` (`/proc/meminfo`).

On a CUDA device it is the free memory `torch.cuda.mem_get_info` reports. Unknown (None) where
none of these can be read. The paths are module constants so that tests can point them at fake
files.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

import torch

PROC_CGROUP = Path("/proc/self/cgroup")
PROC_STATUS = Path("/proc/self/status")
PROC_MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")

# Below this, an allocation is not worth the files a check reads (a few µs each).
SMALL = 64 << 20


class MemoryRefusal(MemoryError):
    """A step refused, before allocating, an allocation larger than the memory the process may
    still take. `need` and `available` are in bytes; `limit` names the limit that binds."""

    def __init__(self, message: str, need: int, available: int, limit: str):
        super().__init__(message)
        self.need, self.available, self.limit = need, available, limit


@dataclass(frozen=True)
class Headroom:
    """Bytes the process may still allocate and the limit that says so."""

    bytes: int
    limit: str  # e.g. "cgroup v2 memory.max of /sys/fs/cgroup/a", "RLIMIT_AS", "MemAvailable"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except (OSError, ValueError):
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_field(path: Path, name: str) -> int:
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_paths() -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and cgroup v1 memory-controller path (None: none)."""
    v2 = v1 = None
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _cgroup_v2(path: str) -> Headroom | None:
    """The tightest `memory.max − (memory.current − inactive_file)` from the cgroup to the root
    (a limit on an ancestor binds its children)."""
    best = None
    folder = CGROUP_ROOT / path.lstrip("/")
    while True:
        limit = _read_int(folder / "memory.max")
        used = _read_int(folder / "memory.current")
        if limit is not None and used is not None:
            used -= _stat_field(folder / "memory.stat", "inactive_file")
            left = max(limit - used, 0)
            if best is None or left < best.bytes:
                best = Headroom(left, f"cgroup v2 memory.max of {folder}")
        if folder == CGROUP_ROOT or folder.parent == folder:
            return best
        folder = folder.parent


def _cgroup_v1(path: str) -> Headroom | None:
    root = CGROUP_ROOT / "memory"
    for folder in (root / path.lstrip("/"), root):  # a container sees its own cgroup as root
        limit = _read_int(folder / "memory.limit_in_bytes")
        used = _read_int(folder / "memory.usage_in_bytes")
        if limit is None or used is None:
            continue
        if limit >= 1 << 60:  # "no limit" is written as a page-rounded 2⁶³ − 1
            return None
        used -= _stat_field(folder / "memory.stat", "total_inactive_file")
        return Headroom(max(limit - used, 0), f"cgroup v1 memory.limit_in_bytes of {folder}")
    return None


def _address_space() -> Headroom | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    size = 0
    try:
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith("VmSize:"):
                size = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    return Headroom(max(soft - size, 0), "RLIMIT_AS (ulimit -v) less this process's VmSize")


def _mem_available() -> Headroom | None:
    try:
        for line in PROC_MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return Headroom(int(line.split()[1]) * 1024, "the host's MemAvailable")
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_headroom() -> Headroom | None:
    """The smallest of the limits in the module docstring, or None where none is known."""
    v2, v1 = _cgroup_paths()
    found = [
        _cgroup_v2(v2) if v2 is not None else None,
        _cgroup_v1(v1) if v1 is not None else None,
        _address_space(),
        _mem_available(),
    ]
    known = [h for h in found if h is not None]
    return min(known, key=lambda h: h.bytes) if known else None


def headroom(device: torch.device | str) -> Headroom | None:
    """What a new allocation can take on `device` (see the module docstring), or None."""
    device = torch.device(device)
    if device.type == "cuda":
        return Headroom(torch.cuda.mem_get_info(device)[0], f"free memory of {device}")
    if device.type == "cpu":
        return cpu_headroom()
    return None


def available_bytes(device: torch.device | str) -> int | None:
    """`headroom(device).bytes`, or None where unknown."""
    h = headroom(device)
    return None if h is None else h.bytes


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check(need: int, device: torch.device | str, what: str, instead: str) -> None:
    """Raise `MemoryRefusal` when `need` bytes on `device` exceed what the process may still
    allocate. `what` says what would be allocated, `instead` what to do. Skipped for small
    allocations and while torch.compile traces (sizes may be symbolic there)."""
    if torch.compiler.is_compiling() or need <= SMALL:
        return
    h = headroom(device)
    if h is None or need <= h.bytes:
        return
    raise MemoryRefusal(
        f"{what}: about {gib(need)}, and this process may allocate {gib(h.bytes)} more on "
        f"{torch.device(device)} (the binding limit: {h.limit}). {instead}",
        need,
        h.bytes,
        h.limit,
    )
