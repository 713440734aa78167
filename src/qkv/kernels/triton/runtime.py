"""Whether Triton can run here, asked without importing it: read by the backend (what it
accepts) and by the host side (how it launches)."""

from __future__ import annotations

import importlib.util
import os
import sys


def triton_available() -> bool:
    """True when `import triton` would succeed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when the kernels run in Triton's interpreter: once `kernels.py` is imported,
    whether its kernels were decorated in interpreter mode (`triton.jit` reads the variable at
    decoration time); before that, whether `TRITON_INTERPRET=1` is set now."""
    kernels = sys.modules.get(f"{__package__}.kernels")
    if kernels is not None:
        return kernels.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
