"""The compiled kernel's instruction-set paths have one table, csrc/isa_paths.h: the C++ includes
it wherever it lists the paths and isa.py reads it as text. No other code in src/qkv names the
paths (comments, docstrings and each path's own isa_<name>.cpp may), and the kernel, the build
and Python agree on what the table says."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from qkv.kernels.cpu import build, crossover, isa

from .csrc_shape import _TOKEN, CSRC, _strip_comments

SRC = Path(isa.__file__).resolve().parents[2]  # src/qkv
# CPU features share some names with paths (avx2, avx512bf16): the literal handed to a
# feature check names the CPU's feature, not a path
FEATURE_CHECKS = ("__builtin_cpu_supports", "__builtin_cpu_is", "QKV_CPU_HAS")


def _allowed() -> set[Path]:
    return {CSRC / "isa_paths.h", *(CSRC / f"isa_{name}.cpp" for name in isa.ISAS)}


def _lists_paths(text: str) -> bool:
    """Whether a string literal names a path: it is one, or it lists two or more (a message
    naming one path in prose is fine)."""
    words = set(re.split(r"[^\w-]+", text.strip()))
    return text.strip() in isa.ISAS or len(words & set(isa.ISAS)) >= 2


def python_violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        text = node.value if isinstance(node, ast.Constant) else None
        if isinstance(text, str) and id(node) not in docstrings and _lists_paths(text):
            found.append(f"{path}:{node.lineno}: {text!r}")
        name = next((getattr(node, a) for a in ("id", "attr", "arg") if hasattr(node, a)), None)
        if name in isa.ISAS:
            found.append(f"{path}:{node.lineno}: identifier {name}")
    return found


def cpp_violations(path: Path) -> list[str]:
    found = []
    for n, line in enumerate(_strip_comments(path.read_text()), 1):
        tokens = _TOKEN.findall(line)
        for i, tok in enumerate(tokens):
            if tok[0] == '"':
                checked = i >= 2 and tokens[i - 1] == "(" and tokens[i - 2] in FEATURE_CHECKS
                if not checked and _lists_paths(tok[1:-1]):
                    found.append(f"{path}:{n}: {tok}")
            elif tok in isa.ISAS:
                found.append(f"{path}:{n}: identifier {tok}")
    return found


def violations(root: Path = SRC) -> list[str]:
    found = []
    for path in sorted(root.rglob("*")):
        if path in _allowed():
            continue
        if path.suffix == ".py":
            found += python_violations(path)
        elif path.suffix in (".h", ".cpp"):
            found += cpp_violations(path)
    return found


def test_no_code_outside_the_table_names_a_path():
    found = violations()
    assert not found, "name the paths through csrc/isa_paths.h (isa.ISAS):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "suffix, code",
    [
        (".py", 'PATHS = ("avx2", "portable")\n'),
        (".py", 'if want == "amx":\n    pass\n'),
        (".py", "def pick(avx512):\n    return avx512\n"),
        (".cpp", 'bool f(const std::string& s) { return s == "avx512"; }\n'),
        (".h", "namespace avx2 {\nextern const Kernels kernels;\n}\n"),
        (".cpp", 'const char* m = "expected amx, avx512bf16 or portable";\n'),
    ],
)
def test_the_check_finds_a_path_named_outside_the_table(tmp_path, suffix, code):
    (tmp_path / f"planted{suffix}").write_text(code)
    assert violations(tmp_path)


def test_the_check_passes_over_prose_and_cpu_features(tmp_path):
    (tmp_path / "prose.py").write_text(
        '"""The amx path, avx2 and portable."""\n'
        "# amx, avx512bf16\n"
        'MESSAGE = "this CPU lacks the amx path"\n'
    )
    (tmp_path / "features.cpp").write_text(
        "// the avx2 and avx512 paths\n"
        'bool has() { return __builtin_cpu_supports("avx2") && QKV_CPU_HAS("avx512bf16"); }\n'
        '__attribute__((target("avx2,fma"))) void f() {}\n'
    )
    assert violations(tmp_path) == []


def test_python_reads_every_line_of_the_table():
    lines = [
        line
        for line in isa.TABLE.read_text().splitlines()
        if line.startswith(("QKV_ISA_PATH(", "QKV_ISA_BASELINE("))
    ]
    assert len(isa.ISAS) == len(lines) == len(set(isa.ISAS))
    assert lines[-1] == f"QKV_ISA_BASELINE({isa.ISAS[-1]})"  # the baseline comes last
    assert set(isa.STAND_INS) < set(isa.ISAS) and set(isa.STAND_INS.values()) < set(isa.ISAS)
    assert crossover.STAND_INS is isa.STAND_INS


def test_the_build_compiles_one_unit_per_path():
    units = {p.name for p in CSRC.glob("*.cpp") if '#include "isa_unit.h"' in p.read_text()}
    assert units == {f"isa_{name}.cpp" for name in isa.ISAS}
    assert units < set(build.SOURCES)


def test_the_kernel_knows_the_paths_of_the_table():
    ops = build.load()
    assert ops.best_isa() in isa.ISAS
    assert ops.isa_supported(isa.ISAS[-1]) and not ops.isa_supported("none")
    q, none = torch.zeros(1, 1, 1, 8), torch.zeros(0, dtype=torch.long)
    args = (q, q, q, none, none, none, none, None, None, 1, 1.0, None, 0.0, False, 0.0, 0, False)
    with pytest.raises(RuntimeError) as err:
        ops.forward(*args, "none")
    listed = f"{', '.join(isa.ISAS[:-1])} or {isa.ISAS[-1]}"
    assert f"unknown ISA 'none' (expected {listed})" in str(err.value)
