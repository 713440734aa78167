"""The house rules, read from the code: imports flow down the layers, nothing reaches into
another module's private names, `nn` never imports `distributed`, tile kinds are worked out in
one module, and `import qkv` stays light while its submodules are one attribute away."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "qkv"

# A module may import modules of its own layer or below, never above.
LAYERS = {
    "cache": 0, "numerics": 0, "dropout": 0, "layout": 0, "masks": 0, "scores": 0, "plan": 0,
    "pairs": 0,
    "limits": 0,
    "reference": 1, "kernels": 1, "sparse": 1,
    "dispatch": 2, "functional": 2, "varlen": 2, "tune": 2,
    "nn": 3,
    "distributed": 4, "integrations": 4, "inspect": 4, "labs": 4, "vision": 4, "examples": 4,
    "cli": 5, "cli_zh": 5, "__init__": 5, "__main__": 5,
}  # fmt: skip


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        yield path, rel.parts


def _top(parts: tuple[str, ...]) -> str:
    return parts[0]


def _imports(path: Path, parts: tuple[str, ...]):
    """(qkv module parts imported, names taken from it, node) for every import in a file."""
    package = parts[:-1]  # a module's package; an __init__'s package is its own directory
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = (*base, *(node.module.split(".") if node.module else ()))
            elif node.module and node.module.split(".")[0] == "qkv":
                target = tuple(node.module.split(".")[1:])
            else:
                continue
            for alias in node.names:
                yield target, alias.name, node
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "qkv":
                    yield tuple(alias.name.split(".")[1:]), None, node


def test_every_module_has_a_layer():
    tops = {_top(parts) for _, parts in _modules()}
    assert tops <= set(LAYERS), sorted(tops - set(LAYERS))


def test_imports_flow_down_the_layers():
    upward = []
    for path, parts in _modules():
        me = LAYERS[_top(parts)]
        for target, name, node in _imports(path, parts):
            if not target:  # `from . import x` at the top level
                target = (name,)
            if target[0] not in LAYERS:
                continue
            if LAYERS[target[0]] > me:
                upward.append(f"{'/'.join(parts)}:{node.lineno} imports qkv.{'.'.join(target)}")
    assert not upward, "\n".join(upward)


def _module_of(target: tuple[str, ...], name: str | None) -> tuple[str, ...] | None:
    """The qkv module an import loads: `from A import n` is module A.n when that is a module
    (or package), else A itself; a package is its `__init__`."""
    for parts in ((*target, name), target) if name else (target,):
        if not parts:
            continue
        if SRC.joinpath(*parts).with_suffix(".py").exists():
            return parts
        if SRC.joinpath(*parts, "__init__.py").exists():
            return (*parts, "__init__")
    return None


def import_graph() -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    """Every qkv module → the qkv modules it imports, anywhere in it (functions included)."""
    graph: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for path, parts in _modules():
        edges = graph.setdefault(parts, set())
        for target, name, _ in _imports(path, parts):
            module = _module_of(tuple(target), name)
            if module is not None and module != parts:
                edges.add(module)
    return graph


def circles(graph: dict) -> list[list[tuple[str, ...]]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    on_stack: set = set()
    found: list = []

    def visit(v) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_circles():
    shown = [" ↔ ".join("/".join(m) for m in group) for group in circles(import_graph())]
    assert not shown, "\n".join(shown)


def test_the_circle_check_finds_a_circle():
    graph = {("a",): {("b",)}, ("b",): {("c",)}, ("c",): {("a",)}, ("d",): {("a",)}}
    assert circles(graph) == [[("a",), ("b",), ("c",)]]


# Process-wide memos that are not derived tensor structures, each with its reason.
MEMOS = {
    ("kernels", "sdpa"): "_fused_16bit_breaks: a fact about this CPU and torch build",
    ("inspect", "figures"): "font lookups: facts about the installed fonts",
    ("inspect", "attend"): "the loaded models: one per folder and process",
}


def test_every_cache_of_derived_structures_is_qkv_cache():
    """`functools.cache`/`lru_cache` would hide tensors from `qkv.cache_info()` and survive
    `qkv.clear_caches()`; such structures go through `qkv.cache.CACHE`."""
    found = []
    for path, parts in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            memo = isinstance(node, ast.Attribute) and node.attr in ("cache", "lru_cache")
            if memo and getattr(node.value, "id", None) == "functools" and parts not in MEMOS:
                found.append(f"{'/'.join(parts)}:{node.lineno}")
    assert not found, found


def test_nn_never_imports_distributed():
    found = [
        f"{'/'.join(parts)}:{node.lineno}"
        for path, parts in _modules()
        if parts[0] == "nn"
        for target, name, node in _imports(path, parts)
        if (target[:1] or (name,)) == ("distributed",)
    ]
    assert not found, found


# Packages whose `__init__` binds private names of their own modules, each with its reason.
REBINDS = {
    ("masks",): "pickles name the rule classes `qkv.masks._Causal`, … (the path of masks.py)",
}


def test_no_module_takes_another_modules_private_names():
    taken = []
    for path, parts in _modules():
        for target, name, node in _imports(path, parts):
            if name is None or not name.startswith("_") or name.startswith("__"):
                continue
            # `from . import _comm`: a private module of the importer's own package is fine
            same_package = tuple(target) == tuple(parts[:-1])
            if same_package and (SRC.joinpath(*target, f"{name}.py")).exists():
                continue
            own_module = tuple(target[:-1]) == tuple(parts[:-1]) and parts[-1] == "__init__"
            if own_module and tuple(parts[:-1]) in REBINDS:
                continue
            taken.append(f"{'/'.join(parts)}:{node.lineno} takes {name} from {'.'.join(target)}")
    assert not taken, "\n".join(taken)


@pytest.mark.parametrize("attr", ["_rule", "_bounds", "_ranges", "_check"])
def test_mask_internals_are_read_only_in_the_masks_package(attr):
    readers = []
    for path, parts in _modules():
        if parts[0] == "masks":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == attr:
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue  # an object's own attribute
                readers.append(f"{'/'.join(parts)}:{node.lineno}")
    assert not readers, readers


def test_tile_kinds_are_worked_out_in_one_module():
    # `classify` (EMPTY / PARTIAL / FULL from bounds) and the tile bounds themselves are
    # called only from qkv/layout.py (masks/mask.py defines the bounds and their algebra).
    callers = []
    for path, parts in _modules():
        if parts in {("layout",), ("masks", "mask")}:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if fname in {"classify", "tile_bounds", "key_ranges", "dense_kinds"}:
                    callers.append(f"{'/'.join(parts)}:{node.lineno} calls {fname}")
    assert not callers, callers


ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _mentions(node: ast.AST, word: str, exact: bool = False) -> bool:
    for n in ast.walk(node):
        name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
        if (name == word) if exact else (word in name):
            return True
    return False


def causal_comparisons(tree: ast.AST) -> list[tuple[int, str]]:
    """Where code writes the causal rule itself: a triangle (`tril`/`triu`), an order
    comparison with `causal_offset`, or one inside an `if` on a causal flag."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("tril", "triu", "tril_", "triu_"):
                found.append((node.lineno, f"calls {name}"))
        ordered = isinstance(node, ast.Compare) and any(isinstance(o, ORDER) for o in node.ops)
        if ordered and _mentions(node, "causal_offset", exact=True):
            found.append((node.lineno, "compares with causal_offset"))
        if isinstance(node, ast.If) and _mentions(node.test, "causal"):
            for sub in node.body:
                for n in ast.walk(sub):
                    if isinstance(n, ast.Compare) and any(isinstance(o, ORDER) for o in n.ops):
                        found.append((n.lineno, "compares under `if causal`"))
    return found


def test_only_masks_and_layout_write_the_causal_rule():
    found = [
        f"{'/'.join(parts)}:{line} {what}"
        for path, parts in _modules()
        if parts[0] != "masks" and parts != ("layout",)
        for line, what in causal_comparisons(ast.parse(path.read_text()))
    ]
    assert not found, "\n".join(found)


def test_the_causal_check_sees_the_rule_written_out():
    seen = causal_comparisons(
        ast.parse(
            "if plan.causal:\n    skip = k0 >= q1\n"
            "a = cols <= rows + plan.causal_offset\nb = torch.ones(3, 3).triu_(1)\n"
        )
    )
    assert [w for _, w in seen] == [
        "compares under `if causal`", "compares with causal_offset", "calls triu_"
    ]  # fmt: skip


LONGEST = 120  # lines a function may take, as the compiled kernel's C++ (test_cpu_csrc_shape)


def long_functions(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, lines) of every function (methods and nested ones too) longer than LONGEST."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > LONGEST
    ]


def test_no_function_is_longer_than_the_kernels_limit():
    found = [
        f"{'/'.join(parts)}: {name}, {n} lines"
        for path, parts in _modules()
        for name, n in long_functions(ast.parse(path.read_text()))
    ]
    assert not found, "\n".join(found)


def test_the_length_check_counts_a_function_from_def_to_its_last_line():
    def lines(n: int, indent: str) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    assert long_functions(ast.parse(f"def fine():\n{lines(LONGEST - 1, '    ')}")) == []
    method = f"class A:\n    def long(self):\n{lines(LONGEST, '        ')}"
    assert long_functions(ast.parse(method)) == [("long", LONGEST + 1)]


def backend_hooks() -> set[str]:
    """The methods of `qkv.kernels.base.Backend`: the hooks dispatch calls."""
    tree = ast.parse((SRC / "kernels" / "base.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Backend")
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}


def hooks_by_name(tree: ast.AST, hooks: set[str]) -> list[tuple[int, str]]:
    """(line, hook) of every `getattr(x, "hook", …)` / `hasattr(x, "hook")` of a hook."""
    return [
        (node.lineno, node.args[1].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value in hooks
    ]


def test_no_backend_hook_is_looked_up_by_name():
    """Every backend subclasses `Backend`, whose hooks have defaults: code calls them, never
    asks whether a backend has one."""
    hooks = backend_hooks()
    assert {"why_not", "forward", "auto_skip", "why_not_received"} <= hooks
    found = [
        f"{'/'.join(parts)}:{line} looks up {hook!r} by name"
        for path, parts in _modules()
        for line, hook in hooks_by_name(ast.parse(path.read_text()), hooks)
    ]
    assert not found, "\n".join(found)
    code = "skip = getattr(backend, 'auto_skip', None)\nok = hasattr(b, 'received')\n"
    assert [h for _, h in hooks_by_name(ast.parse(code), hooks)] == ["auto_skip", "received"]


def test_every_backend_is_a_backend():
    from qkv.kernels import BACKENDS, Backend

    assert all(isinstance(b, Backend) for b in BACKENDS.values())


def test_import_qkv_is_light_and_submodules_are_one_attribute_away():
    code = (
        "import sys, qkv\n"
        "heavy = [m for m in ('transformers', 'matplotlib', 'triton', 'qkv.nn', "
        "'qkv.distributed', 'qkv.inspect') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert qkv.nn.TransformerBlock and qkv.masks.causal and qkv.distributed.ring_attention\n"
        "assert qkv.inspect.AttentionMap\n"
        "assert 'nn' in dir(qkv)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
