"""Attention over a long sequence sharded across CPU processes (gloo), checked and measured.

    python -m qkv.examples.long_context --nproc 4 --seq-len 65536
    torchrun --standalone --nproc-per-node 4 -m qkv.examples.long_context --seq-len 65536

What it does, on every rank:

1. joins a gloo process group with a timeout (`--timeout`, seconds), so that a dead or stuck
   peer ends the run with an error instead of a hang;
2. checks: shards a small problem (`--check-len` tokens, float64), runs the sharded attention
   forward and backward, and compares this rank's outputs and gradients with single-process
   `qkv.attention` over the whole sequence (max error must be ≤ 1e-10);
3. runs the long problem: this rank's shard of `--seq-len` tokens (float32, random), forward
   (and backward with `--backward`), and reports per rank the peak resident memory the call
   added (VmHWM, reset just before), the time, the bytes it sent and the tiles it computed.

Without torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) the script spawns
`--nproc` processes itself on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m qkv.examples.long_context", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--nproc", type=int, default=4, help="processes to spawn (without torchrun)")
    ap.add_argument("--seq-len", type=int, default=65536, help="total tokens of the long run")
    ap.add_argument("--heads", type=int, default=4, help="query heads H")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--method", choices=("ring", "ulysses"), default="ring")
    ap.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    ap.add_argument("--no-causal", action="store_true", help="bidirectional attention")
    ap.add_argument("--backward", action="store_true", help="also time the backward")
    ap.add_argument("--check-len", type=int, default=512, help="tokens of the exactness check")
    ap.add_argument("--timeout", type=float, default=300.0, help="process-group timeout, s")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: auto)")
    return ap.parse_args(argv)


# --------------------------------------------------------------------------- memory


def _reset_peak_rss() -> float | None:
    """Reset this process's peak-RSS mark (Linux: /proc/self/clear_refs) and return the
    current RSS in MiB, or None where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_mib("VmRSS")
    except OSError:
        return None


def _status_mib(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------- one rank


def _attend(args, q, k, v):
    import qkv.distributed as qd

    kw = dict(causal=not args.no_causal, layout=args.layout)
    if args.method == "ring":
        return qd.ring_attention(q, k, v, **kw)
    return qd.ulysses_attention(q, k, v, **kw)


def _check(args, rank: int, world: int) -> float:
    """Max |sharded − single process| over out, dq, dk, dv on a small float64 problem."""
    import qkv
    import qkv.distributed as qd

    n = args.check_len
    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    shapes = [(1, H, n, D), (1, Hkv, n, D), (1, Hkv, n, D), (1, H, n, D)]
    q, k, v, dout = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = qkv.attention(*full, causal=not args.no_causal)
    want.backward(dout)
    local = [qd.shard(t, 2, args.layout).requires_grad_() for t in (q, k, v)]
    out = _attend(args, *local)
    out.backward(qd.shard(dout, 2, args.layout))
    pairs = [(out, want)] + [(a.grad, b.grad) for a, b in zip(local, full, strict=True)]
    err = max((a - qd.shard(b, 2, args.layout)).abs().max().item() for a, b in pairs)
    worst = torch.tensor([err], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def _long_run(args, rank: int, world: int) -> dict:
    import qkv.distributed as qd

    n_local = args.seq_len // world
    g = torch.Generator().manual_seed(1000 + rank)
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    q = torch.randn(1, H, n_local, D, generator=g).requires_grad_(args.backward)
    k = torch.randn(1, Hkv, n_local, D, generator=g).requires_grad_(args.backward)
    v = torch.randn(1, Hkv, n_local, D, generator=g).requires_grad_(args.backward)
    dist.barrier()
    qd.reset_counters()
    base = _reset_peak_rss()
    start = time.perf_counter()
    with torch.set_grad_enabled(args.backward):
        out = _attend(args, q, k, v)
        forward_s = time.perf_counter() - start
        if args.backward:
            out.backward(torch.ones_like(out))
    total_s = time.perf_counter() - start
    peak = _status_mib("VmHWM")
    c = qd.counters()
    return dict(
        rank=rank,
        peak_mib=None if base is None or peak is None else peak - base,
        inputs_mib=sum(t.numel() * t.element_size() for t in (q, k, v)) / 2**20,
        forward_s=forward_s,
        total_s=total_s,
        sent_mib=c.bytes_sent / 2**20,
        tiles=c.tiles,
    )


def _bad_length(args, world: int) -> str | None:
    parts = world * (2 if args.layout == "zigzag" else 1)
    if args.seq_len % parts or args.check_len % parts:
        chunks = ", 2 chunks each in the zigzag layout" if parts > world else ""
        return (
            f"--seq-len {args.seq_len} and --check-len {args.check_len} must be divisible by "
            f"{parts} ({world} ranks{chunks})"
        )
    return None


def run_rank(args, rank: int, world: int) -> int:
    """One rank of the example (inside an initialised process group)."""
    problem = _bad_length(args, world)
    if problem:
        if rank == 0:
            print(problem, file=sys.stderr)
        return 2
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    err = _check(args, rank, world)
    ok = err <= 1e-10
    if rank == 0:
        print(
            f"check: {args.method} attention on {world} ranks vs one process, N={args.check_len}"
            f" float64: max |error| over out, dq, dk, dv = {err:.2e} "
            f"({'OK' if ok else 'FAILED'}, limit 1e-10)",
            flush=True,
        )
    if not ok:
        return 1
    stats = _long_run(args, rank, world)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, stats)
    if rank == 0:
        what = "forward + backward" if args.backward else "forward"
        causal = "bidirectional" if args.no_causal else "causal"
        print(
            f"\n{args.method} attention, {causal}, {args.layout} layout: N={args.seq_len} "
            f"tokens over {world} ranks ({args.seq_len // world} each), {args.heads} heads "
            f"({args.kv_heads} key/value) of {args.head_dim}, float32, {what}, "
            f"{threads} thread(s) per rank"
        )
        print("rank  peak MiB (+inputs)  forward s  total s  sent MiB  tiles")
        for s in everyone:
            peak = "n/a" if s["peak_mib"] is None else f"{s['peak_mib']:.0f}"
            print(
                f"{s['rank']:>4}  {peak:>8} (+{s['inputs_mib']:.0f})  {s['forward_s']:>9.2f}  "
                f"{s['total_s']:>7.2f}  {s['sent_mib']:>8.1f}  {s['tiles']:>5}"
            )
        tiles = [s["tiles"] for s in everyone]
        if args.method == "ring" and min(tiles) > 0:
            print(f"work balance: busiest / least busy rank = {max(tiles) / min(tiles):.2f}")
    return 0


def _init(rank: int, world: int, timeout_s: float) -> None:
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


def _leave() -> None:
    """Leave the group so that the process can exit cleanly. A gloo worker thread drops its
    reference to a finished collective's tensors after the caller has moved on, and that needs
    the GIL; if the interpreter is already shutting down by then, the thread is torn down inside
    a C++ destructor and the process aborts ("terminate called without an active exception").
    A barrier waits, with the GIL released, until every rank is here, by which time the worker
    threads have released the earlier collectives."""
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    _init(rank, world, args.timeout)
    code = run_rank(args, rank, world)
    _leave()
    # End the rank without the interpreter's teardown: even after the barrier a gloo worker
    # thread can still be releasing the last collective's tensors (which takes the GIL), and a
    # thread torn down inside Py_Finalize aborts the process — seen once more in a CI run on a
    # loaded machine. The rank has nothing to flush but its standard streams.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv=None) -> int:
    args = _args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _init(rank, world, args.timeout)
        code = run_rank(args, rank, world)
        _leave()
        return code
    import torch.multiprocessing as mp

    problem = _bad_length(args, args.nproc)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(
            _spawned, args=(args.nproc, port, args), nprocs=args.nproc, start_method="spawn"
        )
    except mp.ProcessRaisedException as e:
        print(f"a rank failed:\n{e}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        print(f"a rank exited with an error: {e}", file=sys.stderr)
        return e.exit_code if e.exit_code and e.exit_code > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
