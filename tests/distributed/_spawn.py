"""Run a worker on P local processes (gloo over loopback) with a hard deadline.

`run(world, worker_fn, timeout_s)` spawns `world` processes with torch.multiprocessing, each
joining a gloo process group on 127.0.0.1 at a free port with a timeout, runs
`worker_fn(rank, world)` (which returns a dict of check name → None if it passed, else the
failure text), and returns the per-rank dicts. A process that outlives the deadline is killed,
so a bug cannot hang the test run.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GROUP_TIMEOUT_S = 30  # what one collective may wait before it fails (no test should hang)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, out_dir, worker):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # P processes share two cores
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    try:
        results = worker(rank, world)
    except BaseException:  # a crash outside the checks: report it for every check
        results = {"__crash__": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    # Leave at once: a group whose peer was left behind on purpose (the dead-peer check) must
    # neither block nor abort the exit in its destructor.
    os._exit(0)


def run(world: int, worker, timeout_s: float = 120) -> list[dict[str, str | None]]:
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry,
            args=(world, free_port(), out_dir, worker),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world} processes did not finish within {timeout_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
