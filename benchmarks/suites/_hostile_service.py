"""The hostile suite's service stage, as the parent judges it: `torch.compile` with dynamic
shapes, masks that travel, a process's address-space limit, Ctrl-C during a long compiled call.
Each case runs in processes of its own (`_hostile_children` is what they run) through
`hostile._run`, and becomes a row by `hostile._case`, like the suite's other process cases.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from . import _hostile_children as ch


def _hostile() -> Any:
    """The suite module (imported at call time: it imports this one)."""
    from . import hostile

    return hostile


COMPILE_WHAT = {  # case -> what was compiled
    "dense": f"`qkv.attention`, dense, N = {ch.LENGTHS[0]:,} … {ch.LENGTHS[-1]:,} "
    f"({len(ch.LENGTHS)} lengths)",
    "causal": f"`qkv.attention`, causal, N = {ch.LENGTHS[0]:,} … {ch.LENGTHS[-1]:,}",
    "decoding": f"`qkv.attention`, one query, Nk = {ch.CACHE_LENGTHS[0]:,} … "
    f"{ch.CACHE_LENGTHS[-1]:,} ({len(ch.CACHE_LENGTHS)} lengths), GQA {ch.H}/{ch.HKV}",
    "kv-cache": f"`qkv.nn.MultiHeadAttention` (GQA {ch.H}/{ch.HKV}) with a `KVCache`: a "
    f"{ch.PROMPT}-token prompt, then {ch.STEPS} steps",
}
SIGNAL_BOUND_S = 5.0  # tests/kernels/test_cpu_interrupt.py's bound (a loaded machine)


def _cell(text: str) -> str:
    """Text from an error, safe in a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _compile_row(name: str, r: dict[str, Any]) -> dict[str, Any]:
    c = (r.get("cases") or {}).get(name) or {}
    res = {**c, "rc": r["rc"], "seconds": c.get("seconds", r["seconds"])}
    calls, ident = c.get("calls"), c.get("identical")
    if not c:
        did = f"exit {r['rc']}: {_cell((r['stderr'].strip().splitlines() or [''])[-1])}"
    elif c.get("error"):
        did = (
            f"fullgraph raised {_cell(c['error'])}; without fullgraph: {c.get('breaks')} graph "
            f"breaks, {c.get('graphs')} graphs"
        )
    else:
        picks = [p for i, p in enumerate(c["eager"]) if i == 0 or p != c["eager"][i - 1]]
        rule = c.get("rule_ratio")
        did = (
            f"{c['breaks']} graph breaks; {c['graphs']} graphs (`backend='sdpa'`: "
            f"{c['sdpa_graphs']}; eager `auto` picks {' → '.join(picks)}); {ident} of {calls} "
            "outputs bit-identical to eager"
            + ("" if rule is None else f", error {rule:.2f} of the rule's bound")
        )
    held = (
        r["rc"] == 0
        and bool(c)
        and not c.get("error")
        and c.get("breaks") == 0
        and c.get("sdpa_graphs") is not None
        and c["graphs"] <= c["sdpa_graphs"] + c["changes"]
        and ident == calls
        and c.get("rule_ratio", 0.0) <= 1.0
    )
    what = f"`torch.compile(dynamic=True, fullgraph=True)` of {COMPILE_WHAT[name]}"
    return _hostile()._case(f"torch.compile: {name}", what, res, held, did)


def _pickle_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    things = (
        f"{r.get('masks')} masks (every `qkv.masks` constructor, a module-level `Mask(fn)`, "
        f"combinations), {r.get('mods')} score modifiers, a held `BlockLayout`"
    )
    failed = f"; differ: {_cell(', '.join(r['failed']))}" if r.get("failed") else ""
    trips = _hostile()._case(
        "masks pickle",
        f"{things}: through `pickle`, protocol 2 and `torch.save`",
        r,
        r["rc"] == 0 and bool(r.get("trips")) and r.get("trips_same") == r.get("trips"),
        f"exit {r['rc']}; {r.get('trips_same')} of {r.get('trips')} copies compute the same "
        f"bits as the original (dense form or layout, `tiled` and `auto` outputs){failed}",
    )
    spawn = {**r, "seconds": r.get("spawn_s")}
    error = f"; {_cell(r['spawn_error'])}" if r.get("spawn_error") else ""
    return [
        trips,
        _hostile()._case(
            "masks in a spawn worker",
            "the same objects to a `multiprocessing` spawn pool; what the worker computes",
            spawn,
            r["rc"] == 0 and bool(r.get("spawned")) and r.get("spawn_same") == r.get("spawned"),
            f"exit {r['rc']}; {r.get('spawn_same')} of {r.get('spawned')} computed the same "
            f"bits there{error}",
        ),
    ]


def _address_cap(cap: int) -> Any:
    import resource

    def limit() -> None:  # in the child, before it runs Python
        resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))

    return limit


def _mem_available() -> float | None:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _limit_rows(cache: Path) -> list[dict[str, Any]]:
    vm = _hostile()._run("vm-size", cache, code=ch.CODE).get("vm_size")
    if vm is None:
        return []
    cap, host, rows = vm + 2**30, _mem_available(), []
    for what, n, call in (
        ("reference", 16384, "`backend='reference'`, dense"),
        ("sdpa", 32768, "`backend='sdpa'` with `sliding_window(64)`"),
    ):
        r = _hostile()._run(
            "limit", cache, code=ch.CODE, args=(what, str(n)), preexec_fn=_address_cap(cap)
        )
        refused = r.get("raised") == "MemoryRefusal"
        held = (
            r["rc"] == 0
            and refused
            and r.get("memory_error")
            and "RLIMIT_AS" in str(r.get("limit"))
            and r.get("peak_grew_mib", 1e9) < 64
        )
        did = (
            f"refused: `MemoryRefusal` (a `MemoryError`) needing {r['need'] / 2**30:.1f} GiB, "
            f"{r['available'] / 2**30:.1f} GiB allowed by “{r['limit']}”; peak RSS "
            f"+{r['peak_grew_mib']:.0f} MiB"
            if refused
            else f"raised {r.get('raised')}: {_cell(str(r.get('message'))[:120])}"
        )
        host_s = "" if host is None else f"; the host's MemAvailable: {host / 2**30:.0f} GiB"
        rows.append(
            _hostile()._case(
                f"address-space limit: {what}",
                f"`ulimit -v` (RLIMIT_AS) 1 GiB above what `import qkv` maps; {call} at "
                f"N = {n:,}, B = H = 1, D = 8",
                r,
                bool(held),
                f"exit {r['rc']}; {did}{host_s}",
            )
        )
    return rows


def _signal_row(which: str, n: int, cache: Path) -> dict[str, Any]:
    r = _hostile()._run("signal", cache, code=ch.CODE, args=(which, str(n)), timeout=600)
    call = (
        f"a dense forward, 8 heads × {n:,} tokens, D = 64 (about "
        f"{4 * n * n * 64 * 8 / 1e12:.0f} TFLOP)"
        if which == "forward"
        else f"the backward of a causal call, 8 heads × {n:,} tokens, D = 64"
    )
    if r.get("interrupted"):
        did = f"`KeyboardInterrupt` {r['after_s']:.2f} s after the signal"
    else:
        did = f"not interrupted (the call ran {r.get('call_s', 0):.0f} s)"
    return _hostile()._case(
        f"Ctrl-C in a long {which}",
        f"`backend='cpu'`: {call}; SIGINT 1 s in, then a small call again",
        r,
        r["rc"] == 0
        and bool(r.get("interrupted"))
        and r["after_s"] < SIGNAL_BOUND_S
        and bool(r.get("same")),
        f"exit {r['rc']}; {did}; the next call gave the same bits: {r.get('same')}",
    )


def service_cases(settings: dict[str, Any], results: Any) -> list[dict[str, Any]]:
    """torch.compile with dynamic shapes, masks that travel, a process's memory limit, Ctrl-C:
    each in processes of its own, against a copy of this machine's good build."""
    tmp = Path(tempfile.mkdtemp(prefix="qkv-hostile-"))
    try:
        cache = tmp / "c"
        _hostile().good_build(cache)
        r = _hostile()._run("compile", cache, timeout=900, code=ch.CODE)
        out = [_compile_row(name, r) for name in COMPILE_WHAT]
        out += _pickle_rows(_hostile()._run("pickle", cache, code=ch.CODE))
        out += _limit_rows(cache)
        out += [_signal_row(w, n, cache) for w, n in (("forward", 65536), ("backward", 16384))]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
