"""No input shape kills the process: every combination of B, H, Nq, Nk, D in {0, 1, 2…}, with
and without grouped heads, forward and backward, on the compiled kernel (named and through
`auto`) returns the formula's result or a clear Python error. The grid runs in a child process,
so that a crash (the empty batch's division by zero in the backward's plan was a SIGFPE) fails
this test with the shape that caused it instead of killing the test run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qkv.kernels import cpu
from qkv.kernels.cpu.backend import kernel_status

_GRID = r"""
import itertools, json, sys, torch, qkv
for B, Hkv, Nq, Nk, D, G, backend in itertools.product(
    (0, 1, 2), (1, 2), (0, 1, 3), (0, 1, 3), (0, 1, 5), (1, 2), ("cpu", "auto")
):
    shape = dict(B=B, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, G=G, backend=backend)
    print(json.dumps(shape), flush=True)  # the last line names the shape of a crash
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hkv * G, Nq, D, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, Nk, D, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, Nk, 3, generator=g, requires_grad=True)
    try:
        out = qkv.attention(q, k, v, backend=backend, scale=0.5)
        out.sum().backward()
    except (ValueError, TypeError, NotImplementedError) as err:  # a clear error is an answer
        print("ERROR", type(err).__name__, str(err).splitlines()[0][:200], flush=True)
        continue
    x = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = qkv.attention(*x, backend="reference", scale=0.5)
    ref.sum().backward()
    for got, want in ((out, ref), (q.grad, x[0].grad), (k.grad, x[1].grad), (v.grad, x[2].grad)):
        assert got.shape == want.shape, (shape, got.shape, want.shape)
        assert torch.allclose(got.double(), want, atol=1e-5), (shape, (got - want).abs().max())
print("DONE", flush=True)
"""


@pytest.mark.slow
def test_every_degenerate_shape_answers_and_never_crashes():
    if cpu.status() is not None:
        pytest.skip(f"no compiled kernel here: {cpu.status()}")
    why = kernel_status()[1]  # a QKV_CPU_ISA path this CPU lacks
    if why is not None:
        pytest.skip(why)
    proc = subprocess.run(
        [sys.executable, "-c", _GRID], capture_output=True, text=True, timeout=600
    )
    lines = proc.stdout.strip().splitlines()
    last = next((json.loads(x) for x in reversed(lines) if x.startswith("{")), None)
    assert proc.returncode == 0, f"exit {proc.returncode} at {last}: {proc.stderr[-1500:]}"
    assert lines[-1] == "DONE"
    errors = [x for x in lines if x.startswith("ERROR")]
    # a clear error only for shapes the formula itself has no answer for
    assert all("ValueError" in x for x in errors), errors
