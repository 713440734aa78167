"""Dispatch policy lives in one room: a backend states its own facts (`why_not`, `auto_skip`,
`crossover`, `dispatch_state`) and never consults another backend; `qkv.dispatch` reads them
all and decides (the cpu/sdpa crossover, `dispatch.CROSSOVERS`)."""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "src" / "qkv" / "kernels"
BACKEND_MODULES = ("cpu", "tiled", "triton", "sdpa", "reference")  # a package or a file each
# (importer, imported) pairs not yet moved into dispatch: sdpa's `auto_passes_over` asks triton
# whether it runs a structured mask on CUDA (where it does, SDPA passes the request over).
KNOWN = {("sdpa", "triton")}


def _owner(parts: tuple[str, ...]) -> str | None:
    """The backend a module under kernels/ belongs to (None: the shared contract, __init__)."""
    name = parts[0].removesuffix(".py")
    return name if name in BACKEND_MODULES else None


def _consulted(path: Path, root: Path) -> set[str]:
    """The backends whose decisions a module under kernels/ imports: a backend's own module
    (`sdpa`, `reference`, `<package>.backend`), or `BACKENDS`. Shared code (`tiled.steps`, which
    triton's host reuses) is not a decision."""
    parts = path.relative_to(root).parts
    package = ("qkv", "kernels", *parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = (*base, *(node.module.split(".") if node.module else ()))
            else:
                target = tuple((node.module or "").split("."))
            names = [(*target, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            names = [tuple(a.name.split(".")) for a in node.names]
        else:
            continue
        for name in names:
            rest = name[2:] if name[:2] == ("qkv", "kernels") else ()
            if rest[:1] in (("sdpa",), ("reference",), ("BACKENDS",)) or rest[1:2] == ("backend",):
                found.add(rest[0])
    return found


def violations(root: Path = KERNELS) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        owner = _owner(path.relative_to(root).parts)
        if owner is None:
            continue
        for other in sorted(_consulted(path, root)):
            another = other in BACKEND_MODULES and other != owner
            if (other == "BACKENDS" or another) and (owner, other) not in KNOWN:
                bad.append(f"{path.relative_to(root)} ({owner}) consults {other}")
    return bad


def test_no_backend_consults_another():
    """The cpu/sdpa crossover is dispatch's choice: the cpu backend reads no sdpa refusal."""
    assert not violations(), "\n".join(violations())


def test_the_check_sees_a_backend_asking_another(tmp_path):
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    (cpu / "backend.py").write_text("from .. import sdpa\nfrom ..tiled.steps import kv_parts\n")
    (cpu / "op.py").write_text("from ..triton.backend import TritonBackend\n")
    (tmp_path / "tiled.py").write_text("from qkv.kernels import BACKENDS\n")
    (tmp_path / "base.py").write_text("from .sdpa import refusal\n")  # the contract: allowed
    assert violations(tmp_path) == [
        "cpu/backend.py (cpu) consults sdpa",
        "cpu/op.py (cpu) consults triton",
        "tiled.py (tiled) consults BACKENDS",
    ]


def test_dispatch_owns_the_crossover():
    from qkv.dispatch import CROSSOVERS
    from qkv.kernels import BACKENDS

    for first, second in CROSSOVERS.items():
        names = list(BACKENDS)
        assert names.index(first) < names.index(second)
