"""The memory the kernel keeps: blocks of freed large results, reused by the next result of the
same size (`csrc/results.h`; docs/cpu.md, "What it computes, and how").

The kernel maps each result of 8 MiB or more (the output, dq, dk, dv) on its own, in huge
pages, and when such a tensor is freed keeps its block (at most 8 blocks, 1 GiB in all) for the
next result of the same size, so repeated calls do not pay for fresh memory each time.
`release_cached_results()` gives the kept blocks back to the system, as `torch.cuda.empty_cache`
does for CUDA's cache.
"""

from __future__ import annotations

from .build import loaded


def release_cached_results() -> int:
    """Unmap every kept block; the bytes given back (0 when the kernel is not loaded)."""
    ops = loaded()
    return 0 if ops is None else int(ops.release_results())


def cached_result_bytes() -> int:
    """Bytes of freed results the kernel keeps for reuse (0 when it is not loaded)."""
    ops = loaded()
    return 0 if ops is None else int(ops.kept_result_bytes())
