"""The compiled kernel in a hostile world: bad shapes, changed tensors, a full cache, broken
caches and builds, forks.

- Every case but the cache stage runs in fresh Python processes, against a cache folder of its
  own (`QKV_CACHE_DIR` in a temporary folder), holding a copy of this machine's good build where
  the case needs one. "no compiler" means `CXX` naming a file that does not exist, so a rebuild
  fails at once; the concurrent and killed builds compile for real (about 40 s each on 2 cores).
- **outcome** is what the process did (its exit status, the backend `auto` picked and why `cpu`
  was passed over, the largest error against the formula); **held** says whether that is what
  qkv promises for the case (docs/backends.md, *Reliability*): a result within the error rule or a
  clear error, never a crash, a hang or a silent wrong answer.
- Service cases (in processes of their own, one good build): `torch.compile(dynamic=True,
  fullgraph=True)` with dynamo's `eager` backend (graphs counted as tests/test_compile_dynamic.py
  does) of `qkv.attention` (`auto`, `finite_inputs=True`, fp32, B=1, H=8, D=64) across 8 lengths
  and of `qkv.nn.MultiHeadAttention` with a `KVCache`, against the same calls in eager mode (bit
  for bit) and the float64 formula (the error rule, as a fraction of its bound), and against the
  graphs `backend="sdpa"` takes: **held** is no graph break, bit-identical outputs, and no more
  graphs than SDPA's plus the times eager `auto` changes its pick along the lengths (this
  machine's crossover table). Masks, score modifiers and a held layout through `pickle`,
  protocol 2, `torch.save` and a `multiprocessing` spawn worker, compared bit for bit. Under
  RLIMIT_AS 1 GiB above what `import qkv` maps, the reference backend and SDPA with a structured
  mask are asked for 2–3 GiB: held is a `MemoryRefusal` naming RLIMIT_AS before anything is
  allocated (peak RSS grows < 64 MiB). A long `backend="cpu"` call gets SIGINT after 1 s: held
  is `KeyboardInterrupt` within 5 s and the same bits from the kernel afterwards.
- Cache: a server holding one `masks.sliding_window(16)` that sees a new length per request
  (B=1, H=1, D=8, `backend="cpu"`). A **new-length** call is the first at a length, a
  **repeated** one the second; each the median over 16 lengths (500 … 515), once on an empty
  cache and once on a cache filled to its bound (`QKV_CACHE_MB`, default 256 MiB) with calls at
  other lengths (from 600 up, until entries were evicted).
- Layout build: for a built-in rule at a new length, in interleaved rounds (3), a call on a
  fresh `Mask` object (its layout built) then a second call on it (the layout cached); the
  median of the first minus the median of the second, over the latter, H=8, D=64, fp32, `auto`;
  the result memory of that size is warmed by a call on another `Mask` first, so the figure is
  the layout's alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import report as rp
from ..machine import progress
from ..suite import Stage, Suite, Target
from ._hostile_service import service_cases

# Run first by a child process: with READ_ONLY set, its cache folder behaves as on a read-only
# file system (writes and mkdir there raise EROFS). Shared with tests/test_kernel_cache.py.
READ_ONLY_PRELUDE = r"""
import errno, os
if os.environ.get("READ_ONLY"):
    import builtins
    root = os.environ["QKV_CACHE_DIR"]
    def refuse(path):
        raise OSError(errno.EROFS, "Read-only file system", str(path))
    real_open, real_mkdir = builtins.open, os.mkdir
    def ro_open(file, mode="r", *a, **k):
        if str(file).startswith(root) and any(c in mode for c in "wax+"):
            refuse(file)
        return real_open(file, mode, *a, **k)
    def ro_mkdir(path, *a, **k):
        if str(path).startswith(root):
            refuse(path)
        return real_mkdir(path, *a, **k)
    builtins.open, os.mkdir = ro_open, ro_mkdir
"""

# One program for every process case: its argument names the case, its last line is JSON.
_CHILD = (
    READ_ONLY_PRELUDE
    + r"""
import json, sys
case = sys.argv[1]
import torch, qkv
from qkv import masks
torch.manual_seed(0)
out = {}
def err(a, b):
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
if case == "attend":
    q, k, v = (torch.randn(1, 2, 300, 8) for _ in range(3))
    d = qkv.dispatch(q, k, v, return_lse=True)  # a request only the kernel and tiled serve
    o = qkv.attention(q, k, v, return_lse=True)[0]
    out.update(backend=d.name, reason=d.reasons.get("cpu"),
               error=err(o, qkv.attention(q, k, v, backend="reference")))
elif case == "empty":
    shapes = []
    for B, H, Nq, Nk, D in [(0, 2, 5, 5, 8), (1, 0, 5, 5, 8), (1, 2, 0, 5, 8), (1, 2, 5, 0, 8),
                            (1, 2, 5, 5, 1), (0, 0, 0, 0, 1), (1, 1, 1, 1, 1)]:
        q = torch.randn(B, H, Nq, D, requires_grad=True)
        k = torch.randn(B, H, Nk, D, requires_grad=True)
        v = torch.randn(B, H, Nk, D, requires_grad=True)
        for backend in ("cpu", "auto"):
            try:
                o = qkv.attention(q, k, v, backend=backend)
                g = torch.autograd.grad(o.sum(), (q, k, v), allow_unused=True)
            except (ValueError, NotImplementedError) as e:  # a clear error is an answer too
                shapes.append("error")
                continue
            ok = o.shape == (B, H, Nq, D) and all(x is None or x.shape == t.shape
                                                  for x, t in zip(g, (q, k, v)))
            shapes.append(ok)
    out.update(isa=os.environ.get("QKV_CPU_ISA", "default"), shapes=len(shapes),
               right=shapes.count(True), errors=shapes.count("error"))
elif case == "stale":
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    errors = {}
    for kind in ("key_mask", "from_tensor"):
        t = torch.ones(1, 40, dtype=torch.bool)
        if kind == "from_tensor":
            t = torch.ones(40, 40, dtype=torch.bool).tril()
        m = masks.key_mask(t) if kind == "key_mask" else masks.from_tensor(t)
        for backend in ("cpu", "tiled"):
            qkv.attention(q, k, v, mask=m, backend=backend)
            t2 = t.clone()
            t[..., 5:] = False  # changed in place after the mask was built
            o = qkv.attention(q, k, v, mask=m, backend=backend)
            dense = t2 if kind == "from_tensor" else t2[:, None, None, :]
            ref = qkv.attention(q, k, v, mask=dense, backend="reference")
            errors[f"{kind}/{backend}"] = err(o, ref)
            t.copy_(t2)
    out.update(errors=errors)
elif case == "nan-query":
    q, k, v = (torch.randn(1, 2, 64, 8, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        q[0, 1, 7, 3] = float("nan")
    o = qkv.attention(q, k, v, causal=True, backend="cpu")
    dq, dk, dv = torch.autograd.grad(o.sum(), (q, k, v))
    bad = ~torch.isfinite(o).all(-1)
    out.update(rows_nan=int(bad.sum()), the_row=bool(bad[0, 1, 7]),
               dq_rows_nan=int((~torch.isfinite(dq).all(-1)).sum()),
               dkv_head_nan=bool((~torch.isfinite(dk[0, 1])).any())
               and bool((~torch.isfinite(dv[0, 1])).any()),
               other_head_finite=bool(torch.isfinite(dk[0, 0]).all()))
elif case == "fork":
    threads = os.environ.get("CHILD_THREADS")
    q = torch.randn(1, 8, 2048, 64)
    qkv.attention(q, q, q, backend="cpu")  # the parent runs a parallel region first
    pid = os.fork()
    if pid == 0:
        if threads:
            torch.set_num_threads(int(threads))
        qkv.attention(q, q, q, backend="cpu")
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    out.update(child_status=status)
print(json.dumps(out))
"""
)

BUILD = "from qkv.kernels.cpu import build; build.load(); print('{\"built\": true}')"


def _run(
    case: str,
    cache: Path,
    timeout: float = 300,
    code: str = _CHILD,
    args: tuple[str, ...] = (),
    preexec_fn: Any = None,
    **env: str,
) -> dict[str, Any]:
    """Run `case` in a fresh process; what it printed (its last JSON line), exit status, time."""
    t0 = time.perf_counter()
    full = {**os.environ, "QKV_CACHE_DIR": str(cache), **env}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, case, *args],
            env=full,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=preexec_fn,
        )
    except subprocess.TimeoutExpired:
        return {"rc": "timeout", "seconds": time.perf_counter() - t0, "stderr": ""}
    res: dict[str, Any] = {
        "rc": proc.returncode,
        "seconds": time.perf_counter() - t0,
        "stderr": proc.stderr[-400:],
    }
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if lines:
        res.update(json.loads(lines[-1]))
    res["compiled"] = "compiling the CPU attention kernel" in proc.stderr
    return res


def good_build(cache: Path) -> Path:
    """A copy of this machine's good build in `cache`, where a process with QKV_CACHE_DIR=cache
    looks for it; the folder. Shared with tests/test_kernel_cache.py."""
    from qkv.kernels.cpu import build

    src = build.build_dir()
    dst = cache / "cpu-kernel" / src.name
    dst.mkdir(parents=True)
    for name in (f"{build.NAME}.so", build.MANIFEST):
        shutil.copy2(src / name, dst / name)
    return dst


def _lib(folder: Path) -> Path:
    from qkv.kernels.cpu import build

    return folder / f"{build.NAME}.so"


def _damage(folder: Path, how: str) -> None:
    lib = _lib(folder)
    data = lib.read_bytes()
    mid = len(data) // 2
    lib.write_bytes(
        {
            "corrupted": data[:mid] + bytes(4096) + data[mid + 4096 :],
            "truncated": data[:mid],
            "empty": b"",
        }[how]
    )


def _isas() -> list[str]:
    """The kernel's instruction-set paths this CPU can run."""
    from qkv.kernels.cpu import ISAS, build

    ops = build.load()
    return [name for name in ISAS if ops.isa_supported(name)]


NO_CXX = {"CXX": "/no/such/c++"}


def _case(name: str, what: str, res: dict[str, Any], held: bool, outcome: str) -> dict[str, Any]:
    progress(f"[hostile] {name}: {outcome} ({'held' if held else 'NOT HELD'})")
    return {
        "case": name,
        "what": what,
        "outcome": outcome,
        "held": held,
        "seconds": res.get("seconds"),
        "raw": {k: v for k, v in res.items() if k != "stderr"},
    }


def process_cases(settings: dict[str, Any], results: Any) -> list[dict[str, Any]]:
    out = []
    tmp = Path(tempfile.mkdtemp(prefix="qkv-hostile-"))
    n = iter(range(10**6))

    def fresh() -> Path:
        return tmp / f"c{next(n)}"

    try:
        for isa in _isas():
            cache = fresh()
            good_build(cache)
            r = _run("empty", cache, QKV_CPU_ISA=isa)
            ok = r["rc"] == 0 and r.get("right", 0) + r.get("errors", 0) == r.get("shapes")
            out.append(
                _case(
                    f"empty batch ({isa})",
                    "B, H, Nq, Nk = 0 and D = 1, forward and backward, `cpu` and `auto`",
                    r,
                    ok,
                    f"exit {r['rc']}; of {r.get('shapes')} calls {r.get('right')} results "
                    f"shaped right, {r.get('errors')} clear errors (H = 0)",
                )
            )
        cache = fresh()
        good_build(cache)
        r = _run("stale", cache)
        worst = max((r.get("errors") or {"-": float("inf")}).values())
        out.append(
            _case(
                "stale mask",
                "`key_mask(t)`, `from_tensor(t)`; `t` changed in place; "
                "the same call again, `cpu` and `tiled`",
                r,
                r["rc"] == 0 and worst < 1e-5,
                f"exit {r['rc']}; largest error against the formula of the mask as built "
                f"{worst:.1e}",
            )
        )
        r = _run("nan-query", cache)
        ok = (
            r["rc"] == 0
            and r.get("rows_nan") == 1
            and r.get("the_row")
            and r.get("dq_rows_nan", 0) >= 1
            and r.get("dkv_head_nan")
            and r.get("other_head_finite")
        )
        out.append(
            _case(
                "NaN in a query row",
                "q[0, 1, 7, 3] = NaN, causal, forward and backward on `cpu`",
                r,
                bool(ok),
                f"exit {r['rc']}; {r.get('rows_nan')} output row NaN; "
                f"dq rows NaN {r.get('dq_rows_nan')}; its kv head's dK/dV NaN "
                f"{r.get('dkv_head_nan')}, the other head's finite {r.get('other_head_finite')}",
            )
        )
        cache = fresh()
        good_build(cache)
        r = _run("attend", cache, READ_ONLY="1")
        out.append(
            _case(
                "read-only cache, good build",
                "the cache folder refuses writes",
                r,
                r["rc"] == 0 and r.get("backend") == "cpu" and not r["compiled"],
                f"exit {r['rc']}; ran on `{r.get('backend')}`, compiled: {r['compiled']}",
            )
        )
        r = _run("attend", fresh(), READ_ONLY="1")
        out.append(
            _case(
                "read-only cache, no build",
                "the cache folder refuses writes",
                r,
                r["rc"] == 0
                and "QKV_CACHE_DIR" in str(r.get("reason"))
                and r.get("error", 1) < 1e-5,
                f"exit {r['rc']}; ran on `{r.get('backend')}`; reason: {r.get('reason')}",
            )
        )
        for how in ("truncated", "corrupted", "empty"):
            cache = fresh()
            _damage(good_build(cache), how)
            r = _run("attend", cache, **NO_CXX)
            out.append(
                _case(
                    f"{how} library",
                    f"a {how} `qkv_cpu.so` in the cache, no compiler",
                    r,
                    r["rc"] == 0
                    and r.get("backend") != "cpu"
                    and r["compiled"]
                    and r.get("error", 1) < 1e-5,
                    f"exit {r['rc']}; not loaded, rebuilt (no compiler): ran on "
                    f"`{r.get('backend')}`; reason: {r.get('reason')}",
                )
            )
        r = _run("attend", fresh(), **NO_CXX)
        out.append(
            _case(
                "no compiler",
                "an empty cache, `CXX` names no file",
                r,
                r["rc"] == 0 and r.get("backend") != "cpu" and "compiler" in str(r.get("reason")),
                f"exit {r['rc']}; ran on `{r.get('backend')}`; reason: {r.get('reason')}",
            )
        )
        out.append(_concurrent(fresh()))
        out.append(_killed(fresh()))
        cache = fresh()
        good_build(cache)
        for threads, promise in ((None, "hangs (documented)"), ("1", "runs")):
            r = _run(
                "fork",
                cache,
                timeout=settings["fork_timeout_s"],
                **({"CHILD_THREADS": threads} if threads else {}),
            )
            hung = r["rc"] == "timeout"
            label = (
                "fork, child as is" if threads is None else "fork, child calls set_num_threads(1)"
            )
            ok = hung if threads is None else (r["rc"] == 0 and r.get("child_status") == 0)
            did = (
                f"hung: stopped after {settings['fork_timeout_s']} s"
                if hung
                else f"exit {r['rc']}, child status {r.get('child_status')}"
            )
            out.append(
                _case(
                    label,
                    "the parent runs the kernel, forks; the child calls it",
                    r,
                    ok,
                    f"{did}; qkv promises: {promise}",
                )
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _concurrent(cache: Path) -> dict[str, Any]:
    """Two processes build into one empty cache at once: both load the kernel, one compiles."""
    t0 = time.perf_counter()
    env = {**os.environ, "QKV_CACHE_DIR": str(cache)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    res = {
        "rc": [p.returncode for p in procs],
        "seconds": time.perf_counter() - t0,
        "compiles": sum("compiling the CPU attention kernel" in e for _, e in outs),
    }
    ok = res["rc"] == [0, 0] and all('"built": true' in o for o, _ in outs)
    return _case(
        "two processes build at once",
        "an empty cache, two processes need the kernel",
        res,
        ok,
        f"exit {res['rc']}; both loaded the kernel: {ok}; processes that said they compile: "
        f"{res['compiles']}",
    )


def kill_a_build_half_way(cache: Path) -> None:
    """Start a process that builds the kernel into `cache`, and SIGKILL its process group while
    the compilers run (an OOM kill, a closed terminal, a CI timeout). Shared with
    tests/test_kernel_cache.py."""
    from qkv.kernels.cpu import build

    env = {**os.environ, "QKV_CACHE_DIR": str(cache)}
    first = subprocess.Popen(
        [sys.executable, "-c", BUILD],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    folder = cache / "cpu-kernel" / build.build_dir().name
    deadline = time.monotonic() + 120
    while not list(folder.glob(f"{build.BUILDING}*/build.ninja")):
        if time.monotonic() > deadline or first.poll() is not None:
            first.kill()
            raise RuntimeError("the build never started")
        time.sleep(0.2)
    time.sleep(2.0)  # the compilers are running
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()


def _killed(cache: Path) -> dict[str, Any]:
    """A build killed half-way, then a new process: it builds."""
    t0 = time.perf_counter()
    kill_a_build_half_way(cache)
    r = _run("attend", cache, timeout=900)
    r["seconds"] = time.perf_counter() - t0
    return _case(
        "build killed half-way",
        "SIGKILL of the compiling process group, then a new process",
        r,
        r["rc"] == 0 and r.get("backend") == "cpu",
        f"exit {r['rc']}; the next process built and ran on `{r.get('backend')}`",
    )


# --------------------------------------------------------------------------- the cache stage


def _call(m, n: int) -> float:
    import torch

    import qkv

    q = torch.randn(1, 1, n, 8)
    t0 = time.perf_counter()
    qkv.attention(q, q, q, mask=m, backend="cpu")
    return time.perf_counter() - t0


def _probe(m, lengths: list[int]) -> tuple[float, float]:
    new = [_call(m, n) for n in lengths]
    again = [_call(m, n) for n in lengths]
    return statistics.median(new), statistics.median(again)


def cache_stage(settings: dict[str, Any], results: Any) -> dict[str, Any]:
    import qkv
    from qkv import masks

    m = masks.sliding_window(16)
    probe = list(range(500, 516))
    _call(m, 499)  # the kernel loaded, the first-call costs paid
    qkv.clear_caches()
    empty_new, empty_again = _probe(m, probe)
    qkv.clear_caches()
    before = qkv.cache_info()
    t0 = time.perf_counter()
    n, fill_calls = 600, 0
    while qkv.cache_info().evictions == before.evictions and fill_calls < settings["max_fill"]:
        _call(m, n)
        n += 1
        fill_calls += 1
    fill_s = time.perf_counter() - t0
    info = qkv.cache_info()
    full_new, full_again = _probe(m, probe)
    after = qkv.cache_info()
    progress(
        f"[hostile] cache: {fill_calls} calls filled it ({info.entries} entries) "
        f"in {fill_s:.0f} s; "
        f"new {empty_new * 1e3:.2f} → {full_new * 1e3:.2f} ms, repeated {empty_again * 1e3:.2f} → "
        f"{full_again * 1e3:.2f} ms"
    )
    return {
        "empty": {"new_s": empty_new, "again_s": empty_again},
        "full": {"new_s": full_new, "again_s": full_again},
        "fill_calls": fill_calls,
        "fill_s": fill_s,
        "entries": info.entries,
        "bytes": info.bytes,
        "max_bytes": info.max_bytes,
        "evictions": after.evictions - before.evictions,
        "at_bound": info.evictions > before.evictions,
    }


def layout_stage(settings: dict[str, Any], results: Any) -> list[dict[str, Any]]:
    import torch

    import qkv
    from qkv import masks

    rules = {
        "sliding window 256": lambda n: masks.sliding_window(256),
        "Longformer (window 256, 16 global)": lambda n: (
            masks.sliding_window(256) | masks.global_tokens(range(16))
        ),
        "causal window 256": lambda n: masks.causal() & masks.sliding_window(256, 0),
        "8 documents": lambda n: masks.document([n // 8] * 8),
    }
    rows = []
    for n in settings["layout_sizes"]:
        q = torch.randn(1, 8, n, 64)
        for name, make in rules.items():
            qkv.attention(q, q, q, mask=make(n))  # warms the result memory of this size
            firsts, again = [], []
            for _ in range(settings["layout_rounds"]):  # interleaved: a new Mask, then again
                m = make(n)
                t0 = time.perf_counter()
                qkv.attention(q, q, q, mask=m)
                firsts.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                qkv.attention(q, q, q, mask=m)
                again.append(time.perf_counter() - t0)
            first, call = statistics.median(firsts), statistics.median(again)
            share = max(first - call, 0.0) / call
            progress(
                f"[hostile] layout {name} N={n}: first {first * 1e3:.1f} ms, "
                f"cached {call * 1e3:.1f} ms, "
                f"build {share:.2f}× the call"
            )
            rows.append({"rule": name, "n": n, "first_s": first, "call_s": call, "share": share})
    return rows


# --------------------------------------------------------------------------- the section


def _rows(stage: str, title: str) -> Any:
    def table(results: Any) -> list[str]:
        return _cases_lines(results.stages.get(stage) or [], title)

    return table


def _cases_lines(data: list[dict[str, Any]], title: str) -> list[str]:
    if not data:
        return []
    lines = [
        f"### {title}",
        "",
        "| case | what was done | outcome | held | s |",
        "|:---|:---|:---|:---|---:|",
    ]
    for c in data:
        lines.append(
            f"| {c['case']} | {c['what']} | {c['outcome']} | {'yes' if c['held'] else '**no**'} | "
            f"{rp.fmt(c['seconds'], '.1f')} |"
        )
    return [*lines, ""]


cases_table = _rows("processes", "Processes")
service_table = _rows(
    "service", "In a training job or a service: torch.compile, pickling, memory limits, Ctrl-C"
)


def cache_table(results: Any) -> list[str]:
    d = results.stages.get("cache")
    if not d:
        return []
    e, f = d["empty"], d["full"]
    return [
        "### A full cache",
        "",
        f"Filled by {d['fill_calls']} calls at new lengths in {d['fill_s']:.0f} s: "
        f"{d['entries']} entries, {d['bytes'] / 2**20:.0f} of {d['max_bytes'] / 2**20:.0f} MiB; "
        f"{d['evictions']} evictions while probing.",
        "",
        "| cache | new length ms | repeated ms |",
        "|:---|---:|---:|",
        f"| empty | {e['new_s'] * 1e3:.2f} | {e['again_s'] * 1e3:.2f} |",
        f"| at its bound | {f['new_s'] * 1e3:.2f} | {f['again_s'] * 1e3:.2f} |",
        f"| full ÷ empty | {f['new_s'] / e['new_s']:.2f} | {f['again_s'] / e['again_s']:.2f} |",
        "",
    ]


def layout_table(results: Any) -> list[str]:
    rows = results.stages.get("layout") or []
    if not rows:
        return []
    lines = [
        "### Building a layout at a new length",
        "",
        "| rule | N | first call ms | cached call ms | build ÷ call |",
        "|:---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rule']} | {r['n']} | {r['first_s'] * 1e3:.1f} | {r['call_s'] * 1e3:.1f} | "
            f"{r['share']:.2f} |"
        )
    return [*lines, ""]


def _cache_ratio(results: Any, key: str) -> float | None:
    d = results.stages.get("cache")
    return None if not d else d["full"][key] / d["empty"][key]


def _held(results: Any, stage: str = "processes") -> float | None:
    data = results.stages.get(stage)
    return None if not data else sum(not c["held"] for c in data)


def _ctrl_c_s(results: Any) -> float | None:
    row = next(
        (c for c in results.stages.get("service") or [] if c["case"] == "Ctrl-C in a long forward"),
        None,
    )
    return None if row is None else row["raw"].get("after_s")


def _worst_layout(results: Any) -> float | None:
    rows = results.stages.get("layout")
    return None if not rows else max(r["share"] for r in rows)


def _requires() -> str | None:
    from qkv.kernels.cpu import build

    return build.status()


SUITE = Suite(
    name="hostile",
    title="Hostile world: the compiled kernel's inputs, caches, builds and processes",
    settings={
        "full": {
            "layout_sizes": (2048, 8192, 32768, 65536),
            "layout_rounds": 3,
            "max_fill": 20000,
            "fork_timeout_s": 20,
        },
        "quick": {
            "layout_sizes": (2048,),
            "layout_rounds": 1,
            "max_fill": 300,
            "fork_timeout_s": 10,
        },
    },
    steps=(
        Stage("processes", process_cases),
        Stage("service", service_cases),
        Stage("cache", cache_stage),
        Stage("layout", layout_stage),
    ),
    targets=(
        Target("process cases not held", _held, 0, at_least=False, unit="", digits=0),
        Target(
            "compile, pickle, limit and signal cases not held",
            lambda r: _held(r, "service"),
            0,
            at_least=False,
            unit="",
            digits=0,
        ),
        Target(
            "Ctrl-C to KeyboardInterrupt, long forward",
            _ctrl_c_s,
            1.0,
            at_least=False,
            unit=" s",
        ),
        Target(
            "new-length call, full ÷ empty cache",
            lambda r: _cache_ratio(r, "new_s"),
            1.5,
            at_least=False,
        ),
        Target(
            "repeated call, full ÷ empty cache",
            lambda r: _cache_ratio(r, "again_s"),
            1.2,
            at_least=False,
        ),
        Target(
            "layout build ÷ call at a new length (worst rule and N)",
            _worst_layout,
            0.2,
            at_least=False,
        ),
    ),
    report=(cases_table, service_table, cache_table, layout_table),
    doc=__doc__,
    requires=_requires,
)
