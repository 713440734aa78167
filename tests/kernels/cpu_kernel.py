"""Shared by the test_cpu*.py modules: the compiled kernel, or a skip when the CPU lacks the
instruction set `QKV_CPU_ISA` asks for. Any other reason it is unavailable fails the tests (the
README's install brings ninja and a compiler is part of the machine: a build that does not work
is a bug, not a skip)."""

from __future__ import annotations

import pytest

from qkv.kernels import cpu
from qkv.kernels.cpu import isa


def require_kernel():
    """`(ops, isa_name)` of the kernel the tests run; skips the module when the forced ISA is
    not on this CPU."""
    try:
        ops = cpu.load()
    except cpu.KernelUnavailable as err:
        pytest.fail(f"the compiled CPU kernel is unavailable: {err}")
    name, why = isa.choose(ops)
    if why is not None:
        pytest.skip(f"skipped on this machine: {why}", allow_module_level=True)
    return ops, name
