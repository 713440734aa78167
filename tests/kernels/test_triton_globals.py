"""Triton's compiler (unlike its interpreter, which runs the CPU tests) refuses a jit function
that reads a module global unless the global is a `tl.constexpr`: a plain float constant passes
every CPU test and fails on the first GPU call. Read the kernels' source for such reads."""

from __future__ import annotations

import ast
from pathlib import Path

import qkv

KERNELS = Path(qkv.__file__).parent / "kernels" / "triton" / "kernels.py"


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def _is_constexpr(value: ast.expr) -> bool:
    return isinstance(value, ast.Call) and ast.unparse(value.func) in ("tl.constexpr",)


def non_constexpr_reads(source: str) -> list[str]:
    """`function: NAME` for each module-level constant a jit function reads that is not a
    `tl.constexpr(...)`."""
    tree = ast.parse(source)
    plain = {
        t.id
        for node in tree.body
        if isinstance(node, ast.Assign) and not _is_constexpr(node.value)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    found = []
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and _is_jit(fn):
            local = {a.arg for a in fn.args.args}
            names = {
                n.id
                for n in ast.walk(fn)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local
            }
            found += [f"{fn.name}: {name}" for name in sorted(names & plain)]
    return found


def test_jit_functions_read_only_constexpr_globals():
    assert non_constexpr_reads(KERNELS.read_text()) == []


def test_the_check_finds_a_plain_float_global():
    source = "import triton\nimport triton.language as tl\nK = 2.0\nC = tl.constexpr(3.0)\n"
    source += "@triton.jit\ndef f(x):\n    return x * K + C\n"
    assert non_constexpr_reads(source) == ["f: K"]
