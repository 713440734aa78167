"""Ctrl-C during a long compiled call: the kernel stops handing out items, the call raises
KeyboardInterrupt soon after the signal (not when the call would have ended), and the kernel
then answers the next call with the same bits as before. Runs in a child process, where a
SIGINT cannot reach the test runner. The bound on how soon is generous (a loaded machine): the
uninterrupted calls take many times longer."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .cpu_kernel import require_kernel

_CHILD = r"""
import os, signal, sys, threading, time, torch, qkv
torch.manual_seed(0)
small = [torch.randn(1, 4, 1024, 64, requires_grad=True) for _ in range(3)]
want = qkv.attention(*small, backend="cpu")
want.sum().backward()
want_grads = [t.grad.clone() for t in small]
# 8 heads of 65,536 tokens, dense: about 9 TFLOP forward; of 16,384, causal: 0.7 TFLOP backward
n, which = int(sys.argv[1]), sys.argv[2]
q, k, v = (torch.randn(1, 8, n, 64, requires_grad=which == "backward") for _ in range(3))
if which == "backward":  # the forward of a causal call, then Ctrl-C in its backward
    out = qkv.attention(q, k, v, backend="cpu", causal=True)
    call = lambda: out.sum().backward()
else:
    call = lambda: qkv.attention(q, k, v, backend="cpu")
sent = []
def ctrl_c():
    sent.append(time.perf_counter())
    os.kill(os.getpid(), signal.SIGINT)
threading.Timer(1.0, ctrl_c).start()
try:
    call()
    print("NOT INTERRUPTED")
except KeyboardInterrupt:
    print("AFTER", time.perf_counter() - sent[0])
for t in small:
    t.grad = None
again = qkv.attention(*small, backend="cpu")
again.sum().backward()
same = torch.equal(again, want) and all(torch.equal(t.grad, g) for t, g in zip(small, want_grads))
print("SAME", same)
"""


@pytest.mark.slow
@pytest.mark.parametrize("which,n", [("forward", 65536), ("backward", 16384)])
def test_ctrl_c_stops_a_long_call_and_leaves_the_kernel_usable(which, n):
    require_kernel()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(n), which], capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    lines = dict(line.split(" ", 1) for line in proc.stdout.split("\n") if " " in line)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "AFTER" in lines, proc.stdout
    assert float(lines["AFTER"]) < 5.0  # seconds from the signal to KeyboardInterrupt
    assert lines["SAME"] == "True"
