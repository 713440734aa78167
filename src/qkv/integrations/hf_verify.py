"""Does qkv actually run in a transformers model? `verify(model)` answers layer by layer.

`attn_implementation="qkv"` reaches qkv only through transformers' attention interface: an
attention layer asks `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`
for its attention function and calls it. A model family whose modeling code never asks (BLOOM
computes attention in its own code; Falcon picks an attention class by name and raises
`KeyError: 'qkv'`) accepts the name and runs without qkv. `verify` finds the attention layers
(modules whose class name says "Attention", innermost ones), and for each says whether qkv runs
there: measured, by counting qkv's calls on a forward of `inputs`, or, without inputs, read from
the code (does the layer's `forward` call the interface, and does its config ask for qkv).

This module imports transformers only inside its functions, like the rest of the integration.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

__all__ = ["LayerReport", "Report", "routes_attention", "verify"]

# The qkv attention calls seen per module while `verify` runs its forward (None otherwise).
_CALLS: ContextVar[Counter | None] = ContextVar("qkv_hf_calls", default=None)
_ASKS = "ALL_ATTENTION_FUNCTIONS.get_interface("  # how a layer's code asks the interface
_ATTENTION_CLASS = re.compile(r"^class \w*Attention\w*\(nn\.Module\):", re.MULTILINE)
_routes_cache: dict[str, bool | None] = {}


def note_call(module: torch.nn.Module) -> None:
    """Called by qkv's attention function for every layer it serves (counted while verifying,
    which never compiles; a compiled model is not traced through the context variable)."""
    if torch.compiler.is_compiling():
        return
    calls = _CALLS.get()
    if calls is not None:
        calls[module] += 1


@contextmanager
def _counting() -> Iterator[Counter]:
    calls: Counter = Counter()
    token = _CALLS.set(calls)
    try:
        yield calls
    finally:
        _CALLS.reset(token)


def _modeling_module(obj: object) -> str | None:
    """The name of the modeling module of a model, model class or config (None if unknown)."""
    cls = obj if isinstance(obj, type) else type(obj)
    name = getattr(cls, "__module__", "") or ""
    if ".configuration_" in name:  # a config: its family's modeling module sits beside it
        return name.replace(".configuration_", ".modeling_")
    return name if ".modeling_" in name else None


def routes_attention(obj: object) -> bool | None:
    """Does the modeling code of this family (a model, model class or config) send its attention
    through transformers' attention interface? False: it defines attention layers and never asks
    the interface (BLOOM, Falcon), so qkv cannot run in it. None: the code cannot be read.

    The same reading of the source that transformers uses to decide whether a model may switch
    `attn_implementation` after loading."""
    name = _modeling_module(obj)
    if name is None:
        return None
    if name not in _routes_cache:
        try:
            module = sys.modules.get(name) or importlib.import_module(name)
            code = inspect.getsource(module)
        except (ImportError, OSError, TypeError):
            code = None
        if code is None:
            _routes_cache[name] = None
        else:  # no attention layer of its own (a composite model): its parts decide
            _routes_cache[name] = _ASKS in code or not _ATTENTION_CLASS.search(code)
    return _routes_cache[name]


@dataclass(frozen=True)
class LayerReport:
    """One attention layer of a model, and whether qkv runs in it."""

    name: str  # the module's path in the model, e.g. "model.layers.0.self_attn"
    cls: str  # its class name
    implementation: str | None  # the attn_implementation its config (or its model's) asks for
    asks_interface: bool | None  # does its forward call transformers' attention interface
    calls: int | None  # qkv calls counted on the forward of `inputs` (None: no forward ran)
    runs_qkv: bool  # measured when `calls` is known, else read from the code
    reason: str  # why qkv does not run here ("" when it does)


@dataclass(frozen=True)
class Report:
    """What `verify` found; `str(report)` prints it as a table, `report.ok` sums it up."""

    model: str  # the model's (or model class's) name
    name: str  # the attn_implementation name checked ("qkv")
    family_routes: bool | None  # `routes_attention` of the model's family
    layers: tuple[LayerReport, ...]  # every attention layer found (none for a class)
    measured: bool  # True when a forward ran and qkv's calls were counted
    of_class: bool  # a model class was checked (its family's code only, no layers)

    @property
    def ok(self) -> bool:
        """qkv runs in every attention layer (for a class: its family can run qkv at all)."""
        return not self.problems

    @property
    def problems(self) -> tuple[str, ...]:
        """One line per reason qkv does not run: the family's code, then layer by layer."""
        lines = [f"{self.model}: {_OWN_CODE}"] if self.family_routes is False else []
        if not self.layers and not self.of_class:
            lines.append(f"{self.model}: no attention layer found")
        lines += [f"{r.name} ({r.cls}): {r.reason}" for r in self.layers if not r.runs_qkv]
        return tuple(lines)

    def __str__(self) -> str:
        if self.of_class:
            verdict = "cannot run" if self.family_routes is False else "can run"
            return "\n".join([f"{self.name!r} {verdict} in {self.model}", *self.problems])
        how = "counted on a forward" if self.measured else "read from the code"
        runs = sum(r.runs_qkv for r in self.layers)
        lines = [
            f"{self.name!r} in {self.model}: runs in {runs} of {len(self.layers)} attention "
            f"layers ({how})"
        ]
        for r in self.layers:
            calls = "" if r.calls is None else f"  {r.calls} call{'s' * (r.calls != 1)}"
            state = "qkv" if r.runs_qkv else f"NOT qkv: {r.reason}"
            lines.append(f"  {r.name}  {r.cls}{calls}  {state}")
        if self.family_routes is False:
            lines.append(f"  {self.model}: {_OWN_CODE}")
        return "\n".join(lines)


_OWN_CODE = (
    "its modeling code never calls transformers' attention interface, so attention is "
    "computed in the model's own code"
)


def _attention_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules whose class name says "Attention", innermost only (BERT's `BertAttention` holds
    `BertSelfAttention`, which is the one that computes attention)."""
    found = [(n, m) for n, m in model.named_modules() if "Attention" in type(m).__name__]
    names = [n for n, _ in found]
    return [(n, m) for n, m in found if not any(o.startswith(f"{n}.") for o in names)]


def _asks_interface(module: torch.nn.Module) -> bool | None:
    try:
        return _ASKS in inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return None


def verify(
    model: torch.nn.Module | type,
    inputs: Mapping[str, object] | None = None,
    *,
    name: str = "qkv",
) -> Report:
    """Which attention layers of `model` run qkv.

    Args:
        model: a transformers model (or a model class, to check a family before loading one:
            `verify(transformers.FalconForCausalLM).ok` is False).
        inputs: keyword arguments for one forward (`model(**inputs)`, run under `no_grad`);
            qkv's calls are then counted per layer, which is the proof. Without them the answer
            is read from the code and the configs.
        name: the attn_implementation name qkv was registered under.

    Returns:
        a `Report`: `ok`, `problems` (one line per layer that does not run qkv, with the
        reason), and `str(report)` as a table.
    """
    if isinstance(model, type):
        return Report(model.__name__, name, routes_attention(model), (), False, of_class=True)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or a model class, got {model!r}")
    if inputs is not None and not isinstance(inputs, Mapping):
        raise TypeError(f"inputs must be a mapping of forward() keyword arguments, got {inputs!r}")
    calls: Counter | None = None
    if inputs is not None:
        with _counting() as calls, torch.no_grad():
            model(**inputs)
    layers = _attention_layers(model)
    if calls:  # a layer that called qkv but is not named like an attention layer still counts
        known = {id(m) for _, m in layers}
        layers += [(n, m) for n, m in model.named_modules() if calls[m] and id(m) not in known]
    configs = _model_configs(model)
    reports = tuple(_layer_report(n, m, name, calls, configs) for n, m in layers)
    routes = routes_attention(model)
    return Report(type(model).__name__, name, routes, reports, calls is not None, of_class=False)


def _model_configs(model: torch.nn.Module) -> dict[str, object]:
    """The config of the model and of every sub-model with its own, by module path."""
    return {
        n: m.config
        for n, m in model.named_modules()
        if getattr(m, "config", None) is not None and hasattr(m.config, "_attn_implementation")
    }


def _implementation(layer: str, module: torch.nn.Module, configs: dict[str, object]):
    """The attn_implementation a layer reads: its own config's, else its nearest model's."""
    config = getattr(module, "config", None)
    if config is None:
        owners = [n for n in configs if n == "" or layer.startswith(f"{n}.")]
        config = configs[max(owners, key=len)] if owners else None
    return getattr(config, "_attn_implementation", None)


def _layer_report(
    layer: str,
    module: torch.nn.Module,
    name: str,
    calls: Counter | None,
    configs: dict[str, object],
) -> LayerReport:
    impl = _implementation(layer, module, configs)
    asks = _asks_interface(module)
    n = None if calls is None else calls[module]
    runs = n > 0 if n is not None else bool(asks) and impl == name
    if runs:
        reason = ""
    elif impl is not None and impl != name:
        reason = f"its config asks for attn_implementation={impl!r}"
    elif not asks:
        reason = "computes attention in its own code (never calls the attention interface)"
    else:
        reason = "did not call qkv on this forward (a code path of its own for these inputs)"
    return LayerReport(layer, type(module).__name__, impl, asks, n, runs, reason)
