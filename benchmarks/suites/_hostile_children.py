"""The hostile suite's service cases as their child processes run them: `torch.compile` with
dynamic shapes, masks that pickle and travel to a spawn worker, a process's address-space limit,
Ctrl-C during a long compiled call.

`python -c "...; child(case)"` runs one case and prints its figures as the last JSON line;
`_hostile_service` starts the processes and judges what they printed. Everything here runs
in those children (the spawn worker imports `spawn_worker` and `only_even_keys` from here).
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import resource
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# The program of every child: this module, importable from the repository root.
CODE = (
    f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
    "from benchmarks.suites._hostile_children import child\n"
    "child(sys.argv[1], *sys.argv[2:])\n"
)

# --------------------------------------------------------------------------- torch.compile

H, HKV, D = 8, 2, 64
LENGTHS = (48, 96, 200, 333, 500, 700, 1024, 1500)  # square: dense and causal
CACHE_LENGTHS = (300, 1000, 2500, 5000, 7000, 9000, 12000, 16000)  # one query, GQA 8/2
PROMPT, STEPS = 100, 12  # MultiHeadAttention with a KVCache


def _floor(gold, dtype) -> float:
    """tests/helpers.py's floor: the rounding of the golden's magnitude in `dtype`."""
    import torch

    g = torch.nan_to_num(gold.to(dtype), nan=0.0, posinf=0.0, neginf=0.0)
    if not g.numel():
        return 0.0
    fa = 2 * ((g + 0.3 - 0.3) - g).abs().max().item()
    return max(fa, torch.finfo(dtype).eps * (g.abs().max().item() + 0.3))


def rule_ratio(got, ref, gold) -> float:
    """The error rule of docs/design.md as a ratio: max|got − gold| over 2·max|ref − gold| +
    floor (≤ 1 holds), `ref` the reference formula in got's dtype, `gold` it in float64."""
    err = (got.double() - gold).abs().max().item()
    ref_err = (ref.double() - gold).abs().max().item()
    return err / (2 * ref_err + _floor(gold, got.dtype))


def _counter():
    """A dynamo backend that counts graphs and keeps which attention each one runs."""
    from torch._dynamo.testing import CompileCounterWithBackend

    class Graphs(CompileCounterWithBackend):
        def __init__(self) -> None:
            super().__init__("eager")
            self.runs: list[str] = []

        def __call__(self, gm, example_inputs):
            ops = " ".join(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            self.runs.append(
                "cpu" if "qkv.cpu_forward" in ops else "sdpa" if "scaled_dot" in ops else "?"
            )
            return super().__call__(gm, example_inputs)

    return Graphs()


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:160]


def _compiled(make, calls, fullgraph=True) -> dict[str, Any]:
    """`make()` (a fresh function) compiled with dynamic shapes, called on every call's arguments:
    its outputs, graphs, graph breaks, or the error fullgraph raised."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs = _counter()
    fn = torch.compile(make(), dynamic=True, fullgraph=fullgraph, backend=graphs)
    try:
        with torch.no_grad():
            outs = [fn(*args) for args in calls]
    except Exception as e:  # what fullgraph raises is the finding
        return {"error": _one_line(e)}
    breaks = sum(counters["graph_break"].values())
    return {"outs": outs, "graphs": graphs.frame_count, "runs": graphs.runs, "breaks": breaks}


def _judge(kwargs, calls, got, want, decisions) -> dict[str, Any]:
    """Figures of compiled outputs against eager's (`want`) and the float64 formula."""
    import qkv

    res: dict[str, Any] = {"calls": len(calls)}
    if "error" in got:
        return res
    res["identical"] = sum(
        bool(g.shape == w.shape and (g == w).all()) for g, w in zip(got["outs"], want, strict=True)
    )
    worst = 0.0
    if kwargs is not None:
        for out, (q, k, v) in zip(got["outs"], calls, strict=True):
            ref = qkv.attention(q, k, v, backend="reference", **kwargs)
            gold = qkv.attention(q.double(), k.double(), v.double(), backend="reference", **kwargs)
            worst = max(worst, rule_ratio(out, ref, gold))
        res["rule_ratio"] = worst
    res["changes"] = sum(a != b for a, b in itertools.pairwise(decisions))
    return res


def _attention_case(kwargs, calls) -> dict[str, Any]:
    import torch

    import qkv

    kwargs = {**kwargs, "finite_inputs": True}  # as qkv.nn and the transformers backend pass
    decisions = [qkv.dispatch(*args, **kwargs).name for args in calls]
    with torch.no_grad():
        want = [qkv.attention(*args, **kwargs) for args in calls]

    def make(backend):
        return lambda: lambda q, k, v: qkv.attention(q, k, v, backend=backend, **kwargs)

    got = _compiled(make("auto"), calls)
    sdpa = _compiled(make("sdpa"), calls)
    res = _figures(got, sdpa, decisions, lambda: _compiled(make("auto"), calls, False))
    return {**res, **_judge(kwargs, calls, got, want, decisions)}


def _figures(got, sdpa, decisions, unfused) -> dict[str, Any]:
    res = {"eager": decisions, "sdpa_graphs": sdpa.get("graphs"), "sdpa_error": sdpa.get("error")}
    if "error" in got:  # what the same calls do without fullgraph
        loose = unfused()
        res.update(error=got["error"], graphs=loose.get("graphs"), breaks=loose.get("breaks"))
    else:
        res.update(graphs=got["graphs"], breaks=got["breaks"], runs=got["runs"])
    return res


def _mha_case() -> dict[str, Any]:
    import torch

    import qkv
    from qkv.nn.attention import Local

    torch.manual_seed(0)
    state = qkv.nn.MultiHeadAttention(H * D, H, n_kv_heads=HKV).state_dict()
    xs = [torch.randn(1, PROMPT, H * D)] + [torch.randn(1, 1, H * D) for _ in range(STEPS)]
    decisions: list[str] = []

    def model(backend, record=False):
        m = qkv.nn.MultiHeadAttention(H * D, H, n_kv_heads=HKV, backend=backend).eval()
        m.load_state_dict(state)
        if record:  # eager: which backend auto takes for each call the module makes
            m.strategy = Recorder()
        return m

    class Recorder(Local):
        def attention(self, q, k, v, *, cross=False, cache=False, **kw):
            decisions.append(qkv.dispatch(q, k, v, finite_inputs=True, **kw).name)
            return super().attention(q, k, v, cross=cross, cache=cache, **kw)

    def make(backend):
        def fresh():
            m, cache = model(backend), qkv.nn.KVCache(1, PROMPT + STEPS, HKV, D)
            return lambda x: m(x, cache=cache)

        return fresh

    eager, cache = model("auto", record=True), qkv.nn.KVCache(1, PROMPT + STEPS, HKV, D)
    with torch.no_grad():
        want = [eager(x, cache=cache) for x in xs]
    calls = [(x,) for x in xs]
    got = _compiled(make("auto"), calls)
    sdpa = _compiled(make("sdpa"), calls)
    res = _figures(got, sdpa, decisions, lambda: _compiled(make("auto"), calls, False))
    return {**res, **_judge(None, calls, got, want, decisions)}


def compile_cases() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)

    def square(n):
        return tuple(torch.randn(1, H, n, D, generator=g) for _ in range(3))

    def step(nk):
        q = torch.randn(1, H, 1, D, generator=g)
        return q, torch.randn(1, HKV, nk, D, generator=g), torch.randn(1, HKV, nk, D, generator=g)

    cases = {}
    for name, kwargs, calls in (
        ("dense", {}, [square(n) for n in LENGTHS]),
        ("causal", {"causal": True}, [square(n) for n in LENGTHS]),
        ("decoding", {"causal": True}, [step(n) for n in CACHE_LENGTHS]),
    ):
        t0 = time.perf_counter()
        cases[name] = {**_attention_case(kwargs, calls), "seconds": time.perf_counter() - t0}
    t0 = time.perf_counter()
    cases["kv-cache"] = {**_mha_case(), "seconds": time.perf_counter() - t0}
    return {"cases": cases}


# --------------------------------------------------------------------------- pickle


def only_even_keys(b, h, q, kv):
    """A custom rule at module level (what `Mask(fn)` needs to pickle)."""
    return (kv % 2 == 0) | (kv == q)


N = 63


def masks_to_travel() -> dict[str, Any]:
    """Every constructor of `qkv.masks`, a custom rule, and combinations."""
    import torch

    from qkv import masks

    cu = torch.tensor([0, 10, 40, 63])
    g = torch.Generator().manual_seed(2)
    return {
        "causal": masks.causal(),
        "sliding_window": masks.sliding_window(2, 7),
        "dilated_window": masks.dilated_window(3, 2),
        "global_tokens": masks.global_tokens([0, 5, 40]),
        "strided": masks.strided(4),
        "fixed": masks.fixed(8, 2),
        "bigbird": masks.bigbird(window=1, n_global=1, n_random=2, block=8, seed=3),
        "document": masks.document([10, 0, 33, 20]),
        "prefix_lm": masks.prefix_lm(9),
        "padding": masks.padding([63, 20]),
        "key_mask": masks.key_mask(torch.rand(2, N, generator=g) > 0.3),
        "from_tensor": masks.from_tensor(torch.rand(2, N, N, generator=g) > 0.5),
        "varlen": masks.varlen(cu, cu, causal=True),
        "Mask(fn)": masks.Mask(only_even_keys, "even keys"),
        "window | global": masks.sliding_window(4) | masks.global_tokens([1, 30]),
        "causal & ~window": masks.causal() & ~masks.sliding_window(3),
        "shifted": (masks.sliding_window(6) | masks.global_tokens([3])).shifted(20, 10, 200),
    }


def mods_to_travel() -> dict[str, Any]:
    import torch

    from qkv import scores

    table = (0.3 * torch.randn(2, 13, generator=torch.Generator().manual_seed(11))).requires_grad_()
    return {
        "alibi": scores.alibi(scores.alibi_slopes(2)),
        "softcap": scores.softcap(2.0),
        "relative_bias": scores.relative_bias(torch.nn.Parameter(table), 6),
        "compose": scores.compose(scores.softcap(3.0), scores.alibi([0.5, 0.25])),
    }


def _inputs(mask=None):
    import torch

    g = torch.Generator().manual_seed(7)
    b = (mask.batch if mask is not None else None) or 2
    return tuple(torch.randn(b, 2, N, 16, generator=g) for _ in range(3))


def computed(obj: Any, kind: str) -> list[Any]:
    """What an object computes: its dense form and attention under it on `tiled` and `auto`."""
    import torch

    import qkv

    with torch.no_grad():
        if kind == "mod":
            q, k, v = _inputs()
            return [
                qkv.attention(q, k, v, causal=True, score_mod=obj, backend=b)
                for b in ("tiled", "auto")
            ]
        mask = obj.mask if kind == "layout" else obj
        q, k, v = _inputs(mask)
        dense = [mask.to_dense(N, N)] if kind == "mask" else [obj.row_ptr, obj.col, obj.full]
        backends = ("tiled",) if kind == "layout" else ("tiled", "auto")
        return dense + [qkv.attention(q, k, v, mask=obj, backend=b) for b in backends]


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and bool((x == y).all())
        for x, y in zip(a, b, strict=True)
    )


def spawn_worker(job: tuple[str, Any, str]) -> tuple[str, list[Any]]:
    """In a spawned worker: what the object it received computes."""
    name, obj, kind = job
    return name, computed(obj, kind)


def _round_trip(obj: Any, how: str) -> Any:
    import io

    import torch

    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)
    return pickle.loads(pickle.dumps(obj, protocol=2 if how == "protocol 2" else None))


def pickle_case() -> dict[str, Any]:
    import multiprocessing

    import qkv

    objects = [(n, m, "mask") for n, m in masks_to_travel().items()]
    objects += [(n, m, "mod") for n, m in mods_to_travel().items()]
    held = masks_to_travel()["window | global"]
    objects.append(("held BlockLayout", qkv.block_layout(held, N, block_q=16, block_k=8), "layout"))
    want = {name: computed(obj, kind) for name, obj, kind in objects}
    failed: list[str] = []
    trips = 0
    for how in ("pickle", "protocol 2", "torch.save"):
        for name, obj, kind in objects:
            trips += 1
            try:
                same = _same(computed(_round_trip(obj, how), kind), want[name])
            except Exception as e:  # a failure is the finding
                same = False
                name = f"{name} ({_one_line(e)})"
            if not same:
                failed.append(f"{how}: {name}")
    t0 = time.perf_counter()
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            back = dict(pool.map(spawn_worker, objects, chunksize=len(objects)))
        spawn_same = sum(_same(back[n], want[n]) for n, _, _ in objects)
        spawn_error = None
    except Exception as e:  # a worker that cannot start or unpickle
        spawn_same, spawn_error = 0, _one_line(e)
    return {
        "masks": sum(k == "mask" for _, _, k in objects),
        "mods": sum(k == "mod" for _, _, k in objects),
        "layouts": sum(k == "layout" for _, _, k in objects),
        "trips": trips,
        "trips_same": trips - len(failed),
        "failed": failed[:6],
        "spawned": len(objects),
        "spawn_same": spawn_same,
        "spawn_error": spawn_error,
        "spawn_s": time.perf_counter() - t0,
    }


# --------------------------------------------------------------------------- memory limit


def vm_size() -> dict[str, Any]:
    import qkv  # noqa: F401 - what importing it maps

    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if "VmSize" in x)
    return {"vm_size": int(line.split()[1]) * 1024}


def limit_case(what: str, n: str) -> dict[str, Any]:
    """Under RLIMIT_AS (the parent's preexec_fn): ask for more than fits."""
    import torch

    import qkv
    from qkv import limits

    q = k = v = torch.randn(1, 1, int(n), 8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res: dict[str, Any] = {"rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0]}
    try:
        if what == "reference":
            qkv.attention(q, k, v, backend="reference")
        else:
            qkv.attention(
                q, k, v, mask=qkv.masks.sliding_window(64), backend="sdpa", finite_inputs=True
            )
        res["raised"] = None
    except limits.MemoryRefusal as e:
        res.update(raised="MemoryRefusal", limit=e.limit, need=e.need, available=e.available)
        res.update(memory_error=isinstance(e, MemoryError), message=str(e)[:400])
    except BaseException as e:  # what else it raised is the finding
        res.update(raised=type(e).__name__, message=str(e)[:400])
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    res["peak_grew_mib"] = grown / 1024  # ru_maxrss is in KiB on Linux
    return res


# --------------------------------------------------------------------------- Ctrl-C


def signal_case(which: str, n: str) -> dict[str, Any]:
    """A long call on the compiled kernel, SIGINT after 1 s: when KeyboardInterrupt arrived, and
    whether the kernel then answers a small call with the bits it gave before."""
    import torch

    import qkv

    torch.manual_seed(0)
    small = [torch.randn(1, 4, 1024, 64, requires_grad=True) for _ in range(3)]
    want = qkv.attention(*small, backend="cpu")
    want.sum().backward()
    want_grads = [t.grad.clone() for t in small]
    big = [torch.randn(1, 8, int(n), 64, requires_grad=which == "backward") for _ in range(3)]
    if which == "backward":  # the forward of a causal call, then Ctrl-C in its backward
        out = qkv.attention(*big, backend="cpu", causal=True)

        def call():
            out.sum().backward()
    else:

        def call():
            qkv.attention(*big, backend="cpu")

    sent: list[float] = []

    def ctrl_c():
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Timer(1.0, ctrl_c).start()
    res: dict[str, Any] = {"interrupted": False}
    t0 = time.perf_counter()
    try:
        call()
    except KeyboardInterrupt:
        res.update(interrupted=True, after_s=time.perf_counter() - sent[0])
    res["call_s"] = time.perf_counter() - t0
    for t in small:
        t.grad = None
    again = qkv.attention(*small, backend="cpu")
    again.sum().backward()
    res["same"] = torch.equal(again, want) and all(
        torch.equal(t.grad, g) for t, g in zip(small, want_grads, strict=True)
    )
    return res


def child(case: str, *args: str) -> None:
    run = {
        "compile": compile_cases,
        "pickle": pickle_case,
        "vm-size": vm_size,
        "limit": limit_case,
        "signal": signal_case,
    }[case]
    print(json.dumps(run(*args)), flush=True)
    sys.stdout.flush()
