"""Sequence parallelism: ring and Ulysses attention over P ∈ {1, 2, 4} CPU processes.

- **Problem:** a fixed total N, batch 1, 8 heads × 64, fp32, causal, forward + backward; each
  configuration in fresh processes on this machine, gloo over loopback, one torch thread per
  rank (on a shared 2-core machine two threads in one process ran the single-process forward +
  backward 4× slower than one: oversubscribed), so P=1 uses one core and P ≥ 2 both. The
  baseline is single-process `qkv.attention(..., backend="tiled")`, the kernel the ring runs
  per block.
- **Peak/rank** = the rank's peak resident set during the call minus its resident set just
  before (VmHWM reset via /proc/self/clear_refs, after a small warm-up call): what attention
  added on top of the inputs; **with inputs** adds the rank's shards of q, k, v and the upstream
  gradient. **Sent/rank** = payload bytes the busiest rank sent (`qkv.distributed.counters()`).
  **Tiles** = 64×64 forward tiles per rank. **Time** = the slowest rank's.
- **Time does not scale here:** the P processes share the machine's cores, so beyond using the
  second core (P ≥ 2) the same total work takes about as long at any P. Memory and counts are
  not affected.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from qkv.inspect.bench import peak_rss_mib, reset_peak_rss

from .. import report as rp
from ..machine import progress
from ..results import Results
from ..suite import Stage, Suite, Target
from . import _attention as A

SINGLE = "single process (tiled)"
CONFIGS = {  # name → (P, method, layout, head_chunks)
    SINGLE: (1, "single", None, 1),
    "ring P=1": (1, "ring", "zigzag", "auto"),
    "ring zigzag P=2": (2, "ring", "zigzag", "auto"),
    "ring zigzag P=4": (4, "ring", "zigzag", "auto"),
    "ring zigzag P=4, head_chunks=1": (4, "ring", "zigzag", 1),
    "ring contiguous P=4": (4, "ring", "contiguous", "auto"),
    "ulysses P=2": (2, "ulysses", "zigzag", 1),
    "ulysses P=4": (4, "ulysses", "zigzag", 1),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    seq_len: int
    timeout_s: float = 1200.0


FULL, QUICK = Settings(16384), Settings(2048)


def call(method: str, layout: str | None, head_chunks: Any, q, k, v) -> torch.Tensor:
    import qkv
    import qkv.distributed as qd

    if method == "single":
        return qkv.attention(q, k, v, causal=True, backend="tiled")
    if method == "ring":
        return qd.ring_attention(q, k, v, causal=True, layout=layout, head_chunks=head_chunks)
    return qd.ulysses_attention(q, k, v, causal=True, layout=layout, backend="tiled")


def rank_main(rank: int, world: int, port: int, spec: dict[str, Any], out_dir: str) -> None:
    """One rank: warm up small, then one forward + backward on its shards, measured."""
    import torch.distributed as dist

    import qkv.distributed as qd

    try:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        torch.set_num_threads(1)  # see the module's docstring
        if world > 1:
            timeout = datetime.timedelta(seconds=600)
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        how = (spec["method"], spec["layout"], spec["head_chunks"])
        (q, k, v), g = A.inputs(512 // world, True, seed=rank)
        call(*how, q, k, v).backward(g)  # code pages, thread pools, gloo buffers
        (q, k, v), g = A.inputs(spec["n"] // world, True, seed=rank)
        if world > 1:
            dist.barrier()
        qd.reset_counters()
        base = reset_peak_rss()
        start = time.perf_counter()
        call(*how, q, k, v).backward(g)
        wall = time.perf_counter() - start
        counters = qd.counters()
        result = {
            "peak_mib": peak_rss_mib() - base,
            "inputs_mib": 4 * q.numel() * q.element_size() / 2**20,
            "wall_s": wall,
            "bytes_sent": counters.bytes_sent,
            "tiles": counters.tiles,
        }
        if world > 1:
            dist.barrier()
    except BaseException:
        result = {"error": traceback.format_exc()[-2000:]}
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(name: str, s: Settings) -> dict[str, Any]:
    import torch.multiprocessing as mp

    world, method, layout, head_chunks = CONFIGS[name]
    spec = {"method": method, "layout": layout, "head_chunks": head_chunks, "n": s.seq_len}
    progress(f"[distributed] {name}: N={s.seq_len} ...")
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(
            rank_main,
            (world, free_port(), spec, out),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + s.timeout_s
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not finish in {s.timeout_s:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        raise RuntimeError(f"{name} failed:\n{errors[0]}")
    row = {"name": name, "world": world, "method": method, "layout": layout}
    row |= {
        "head_chunks": head_chunks,
        "peak_mib": max(r["peak_mib"] for r in ranks),
        "inputs_mib": ranks[0]["inputs_mib"],
        "wall_s": max(r["wall_s"] for r in ranks),
        "sent_mib": max(r["bytes_sent"] for r in ranks) / 2**20,
        "tiles": [r["tiles"] for r in ranks],
        "ranks": ranks,
    }
    progress(f"[distributed] {name}: peak/rank {row['peak_mib']:.0f} MiB, {row['wall_s']:.1f} s")
    return row


def configs(r: Results) -> list[dict[str, Any]]:
    return r.stages.get("configs", [])


def single(r: Results) -> dict[str, Any] | None:
    return next((c for c in configs(r) if c["name"] == SINGLE), None)


def share(r: Results, row: dict[str, Any], with_inputs: bool) -> float | None:
    base = single(r)
    if base is None:
        return None
    extra = (lambda c: c["inputs_mib"]) if with_inputs else (lambda c: 0.0)
    return (row["peak_mib"] + extra(row)) / (base["peak_mib"] + extra(base))


def balance(row: dict[str, Any] | None) -> float | None:
    return max(row["tiles"]) / min(row["tiles"]) if row and min(row["tiles"]) else None


def named(r: Results, name: str) -> dict[str, Any] | None:
    return next((c for c in configs(r) if c["name"] == name), None)


def table_rows(r: Results) -> list[tuple[Results, dict[str, Any]]]:
    return [(r, c) for c in configs(r)]


TABLE = rp.Table(
    (
        rp.Column("configuration", lambda rc: rc[1]["name"], "l"),
        rp.Column("P", lambda rc: str(rc[1]["world"])),
        rp.Column("peak/rank MiB", lambda rc: f"{rc[1]['peak_mib']:.0f}"),
        rp.Column("with inputs MiB", lambda rc: f"{rc[1]['peak_mib'] + rc[1]['inputs_mib']:.0f}"),
        rp.Column("÷ single (peak)", lambda rc: f"{share(*rc, False):.2f}"),
        rp.Column("÷ single (with inputs)", lambda rc: f"{share(*rc, True):.2f}"),
        rp.Column("time s", lambda rc: f"{rc[1]['wall_s']:.1f}"),
        rp.Column("sent/rank MiB", lambda rc: f"{rc[1]['sent_mib']:.1f}"),
        rp.Column(
            "tiles per rank",
            lambda rc: ", ".join(map(str, rc[1]["tiles"])) if rc[1]["method"] == "ring" else "—",
            "l",
        ),
    ),
    table_rows,
)


def notes(r: Results) -> list[str]:
    lines = [
        'Ring rows run with the default `head_chunks="auto"` (one ring pass per key/value head) '
        "unless the row says `head_chunks=1` (one pass over all heads: the same bytes in fewer, "
        "larger messages, with all in-flight key/value and dK/dV buffers at full size). Ulysses "
        "holds the whole sequence for H/P heads (gathered q, k, v, the output and their "
        "gradients, plus the all-to-all buffers), so its per-rank memory falls more slowly.",
        "",
    ]
    contiguous = balance(named(r, "ring contiguous P=4"))
    if contiguous is not None:
        lines += [
            "For comparison, the contiguous layout at P=4 gives the busiest rank "
            f"{contiguous:.1f}× the tiles of the least busy (rank 0 sees only its own keys, "
            "rank 3 all of them).",
            "",
        ]
    return lines


def zigzag_target(name: str) -> Target:
    return Target(
        f"causal zigzag balance, {name}: busiest ÷ least busy tiles",
        lambda r: balance(named(r, name)),
        1.1,
        at_least=False,
    )


SUITE = Suite(
    name="distributed",
    title="Sequence parallelism: ring and Ulysses attention over P processes",
    settings={"full": FULL, "quick": QUICK},
    steps=(Stage("configs", lambda s, r: [run_config(name, s) for name in CONFIGS]),),
    targets=(
        Target(
            "per-rank peak at P=4 vs single process (ring zigzag P=4)",
            lambda r: share(r, c, False) if (c := named(r, "ring zigzag P=4")) else None,
            0.35,
            at_least=False,
        ),
        zigzag_target("ring zigzag P=2"),
        zigzag_target("ring zigzag P=4"),
    ),
    report=(TABLE, notes),
    doc=__doc__,
    method=lambda r: [f"- Total N = {r.settings['seq_len']}."],
)
