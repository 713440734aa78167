"""Peak memory of one call, measured in a fresh Python process so that the peak is its own.

The parent runs `python -m benchmarks.run --probe <spec>`; the child builds the case's inputs,
calls the implementation once on the group's small warm-up case (lazy set-up is not the call's
memory), gives freed memory back to the system, records its resident set and resets the peak mark
(VmHWM, through /proc/self/clear_refs), runs the call once and prints one JSON line: the peak
beyond that baseline, what the inputs hold, the wall time. `getrusage().ru_maxrss` is not used:
on Linux a child inherits its parent's high-water mark across exec.
"""

from __future__ import annotations

import importlib
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qkv.inspect.bench import peak_rss_mib, release_freed_memory, reset_peak_rss

from .results import MemoryResult, params, rebuild, type_path
from .suite import Call, Group, Inputs, Prepared, Probe

ROOT = Path(__file__).resolve().parent.parent


def bind_call(
    call: Call, args: tuple[Any, ...], grad: Any
) -> tuple[Callable[[], Any], Callable[[], None]]:
    """(run, reset) for one pass: `run` calls once, the forward under `torch.no_grad()` when
    `grad` is None, else forward then `backward(grad)`; `reset` clears the inputs' gradients
    (untimed, before each call, so that a backward never accumulates into the last one's)."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def reset() -> None:
        for t in leaves:
            t.grad = None

    def run() -> Any:
        if grad is None:
            with torch.no_grad():
                return call(*args)
        call(*args).backward(grad)
        return None

    return run, reset


def bind(group: Group, impl: str, case: Any, backward: bool) -> tuple[Callable[[], Any], Inputs]:
    """(one call of `impl` on `case`'s inputs, the inputs) for one pass."""
    args, grad = group.inputs(case, backward)
    made = group.impl(impl).make(case)
    run, _ = bind_call(made.call if isinstance(made, Prepared) else made, args, grad)
    return run, (args, grad)


def short_error(error: BaseException) -> str:
    """The exception's type and first line, for a table cell or a note."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:200]


def tensor_mib(values: Any) -> float:
    """MiB held by the tensors among `values` (nested in tuples and lists)."""
    if isinstance(values, torch.Tensor):
        return values.numel() * values.element_size() / 2**20
    if isinstance(values, (tuple, list)):
        return sum(tensor_mib(v) for v in values)
    return 0.0


def measure(suite: str, mode: str, probe: Probe, address_limit: int) -> MemoryResult:
    """Run `probe` in a fresh process and return what it measured (or why it failed). `suite`
    is where the child finds the suite: "module:attribute"."""
    spec = {
        "suite": suite,
        "mode": mode,
        "group": probe.group,
        "type": type_path(probe.case),
        "case": params(probe.case),
        "impl": probe.impl,
        "pass": probe.pass_,
        "threads": torch.get_num_threads(),
        "address_limit": address_limit,
    }
    result = MemoryResult(
        probe.group, params(probe.case), probe.impl, probe.pass_, type=type_path(probe.case)
    )
    cmd = [sys.executable, "-m", "benchmarks.run", "--probe", json.dumps(spec)]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=probe.timeout_s, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        result.error = f"timed out after {probe.timeout_s:.0f} s"
        return result
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        detail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        result.error = detail[:200]
        return result
    for key, value in json.loads(lines[-1]).items():
        setattr(result, key, value)
    return result


def load(ref: str) -> Any:
    """The object at "module:attribute"."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """The probe process's body: peak_mib, inputs_mib and wall_s, or the error it raised."""
    try:
        return measure_here(spec)
    except Exception as error:  # reported as a result; a crash shows in the exit status
        return {"error": short_error(error)}


def measure_here(spec: dict[str, Any]) -> dict[str, float | None]:
    group = load(spec["suite"]).group(spec["group"])
    limit = spec["address_limit"]
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.set_num_threads(spec["threads"])
    backward = spec["pass"] != "fwd"
    case = rebuild(spec["type"], spec["case"])
    once, inputs = bind(group, spec["impl"], case, backward)
    if group.warm is not None:
        warm_once, warm_inputs = bind(group, spec["impl"], group.warm(case), backward)
        warm_once()
        del warm_once, warm_inputs
    release_freed_memory()
    baseline = reset_peak_rss()
    start = time.perf_counter()
    once()
    wall = time.perf_counter() - start
    peak = peak_rss_mib()
    return {
        "peak_mib": None if peak is None or baseline is None else peak - baseline,
        "inputs_mib": tensor_mib(inputs),
        "wall_s": wall,
    }


def cuda_peak(once: Any, device: torch.device) -> float:
    """Peak CUDA memory of one call beyond what was allocated before it, in MiB."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    once()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20
