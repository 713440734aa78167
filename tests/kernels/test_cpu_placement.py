"""Where the compiled kernel's threads run (csrc/placement.h): one per CPU for the length of a
large call when the call's threads are as many as the CPUs it may use, then each thread's own
affinity mask back. Observed from a Python thread that polls every thread's mask while the call
runs (the op releases the GIL)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import pytest
import torch

import qkv

from ..helpers import make_qkv
from .cpu_kernel import require_kernel

OPS, ISA = require_kernel()

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="thread placement is Linux-only and needs two CPUs",
)


def _masks() -> dict[int, frozenset[int]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            out[int(tid)] = frozenset(os.sched_getaffinity(int(tid)))
    return out


def _observe(call) -> tuple[list[dict[int, frozenset[int]]], dict[int, frozenset[int]]]:
    """Every thread's mask, polled again and again while `call` runs, and the masks after it."""
    seen: list[dict[int, frozenset[int]]] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            seen.append(_masks())
            time.sleep(0.0005)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        call()
    finally:
        done.set()
        poller.join()
    after = _masks()
    after.pop(poller.native_id, None)  # its /proc entry can outlive join() for a moment
    return seen, after


@pytest.fixture
def threads():
    """torch's thread count set to `n` for the test, then put back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _large_call():
    q, k, v = make_qkv(B=1, H=8, Nq=2048, D=64, requires_grad=True)

    def call():
        out = qkv.attention(q, k, v, backend="cpu")
        out.sum().backward()

    return call


def test_threads_are_held_one_per_cpu_during_a_large_call_then_given_back(threads, monkeypatch):
    monkeypatch.delenv("QKV_CPU_PIN", raising=False)
    cpus = os.sched_getaffinity(0)
    threads(len(cpus))
    call = _large_call()
    call()  # warm-up: torch's pool threads exist before the masks are read
    before = _masks()
    for _ in range(5):  # the poller samples; another thread of the process may starve it a while
        seen, after = _observe(call)
        assert after == before
        # One poll at a time: a thread takes whichever CPU it is on, so across the call's parallel
        # regions one thread may be held on each CPU in turn.
        held = [{tid: mask for tid, mask in poll.items() if len(mask) == 1} for poll in seen]
        both = [pinned for pinned in held if len(set().union(*pinned.values())) >= 2]
        if both:
            break
    distinct = sorted({tuple(sorted((tid, min(mask)) for tid, mask in h.items())) for h in held})
    assert both, f"no poll saw two threads held on two CPUs; (thread, cpu) held: {distinct[:8]}"
    assert all(set().union(*pinned.values()) <= cpus for pinned in held)


def test_fewer_threads_than_cpus_or_pin_off_leave_placement_to_linux(threads, monkeypatch):
    cpus = os.sched_getaffinity(0)
    call = _large_call()
    for n, env in ((len(cpus), "0"), (len(cpus) - 1, None)):
        if n < 2:
            continue  # one thread: no parallel region
        threads(n)
        if env is None:
            monkeypatch.delenv("QKV_CPU_PIN", raising=False)
        else:
            monkeypatch.setenv("QKV_CPU_PIN", env)
        call()
        before = _masks()
        seen, after = _observe(call)
        assert all(len(mask) > 1 for poll in seen for mask in poll.values()), (n, env, seen)
        assert after == before


def test_a_caller_restricted_to_one_cpu_is_not_moved_and_gets_the_same_results(threads):
    q, k, v = make_qkv(B=1, H=8, Nq=1024, D=64, requires_grad=True)
    dout = torch.randn(1, 8, 1024, 64, generator=torch.Generator().manual_seed(1))

    def run():
        out = qkv.attention(q, k, v, backend="cpu")
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    threads(2)
    free = run()
    cpus = os.sched_getaffinity(0)
    one = {min(cpus)}
    os.sched_setaffinity(0, one)
    try:
        held = run()
        assert os.sched_getaffinity(0) == one
    finally:
        os.sched_setaffinity(0, cpus)
    for a, b in zip(free, held, strict=True):
        assert torch.equal(a, b)
