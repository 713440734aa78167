"""The reference on empty problems, its lean forward (bit for bit the formula's steps, with
fewer score copies) and tilings too narrow for the error rule."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch

import qkv
from qkv import reference
from qkv.kernels import TiledBackend
from qkv.masks import sliding_window
from qkv.plan import make_plan

from .helpers import assert_error_ratio, golden, make_qkv


def _masks(B, H, Nq, Nk):
    return {
        "none": None,
        "bool": torch.ones(B, 1, Nq, Nk, dtype=torch.bool),
        "bool-row": torch.ones(1, 1, 1, Nk, dtype=torch.bool),
        "float": torch.zeros(1, H, Nq, Nk),
        "rule": sliding_window(2),
    }


@pytest.mark.parametrize(
    ("B", "H", "Nq", "Nk"), [(1, 2, 0, 0), (1, 2, 0, 5), (1, 2, 5, 0), (0, 2, 3, 3)]
)
@pytest.mark.parametrize("mask", ["none", "bool", "bool-row", "float", "rule"])
@pytest.mark.parametrize("causal", [False, True])
def test_every_empty_shape_gives_the_formula(B, H, Nq, Nk, mask, causal):
    q, k, v = torch.randn(B, H, Nq, 4), torch.randn(B, H, Nk, 4), torch.randn(B, H, Nk, 3)
    m = _masks(B, H, Nq, Nk)[mask]
    out, lse, w = qkv.attention(
        q, k, v, mask=m, causal=causal, backend="reference", return_lse=True, return_weights=True
    )
    assert out.shape == (B, H, Nq, 3) and not out.any()  # no key: output 0
    assert lse.shape == (B, H, Nq) and bool(torch.isneginf(lse).all())  # and lse −inf
    assert w.shape == (B, H, Nq, Nk)
    st = reference.steps(q, k, v, mask=m, causal=causal)
    assert st.out.shape == (B, H, Nq, 3) and st.A.shape == (B, H, Nq, Nk)


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(
        a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_lean_forward_is_bit_identical_to_the_steps(dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 4, 2, 17, 17), (1, 2, 2, 5, 33), (1, 3, 1, 33, 5)]
    kinds = ["none", "bool", "float", "neginf", "rule", "alibi"]
    for (B, H, Hkv, Nq, Nk), kind, causal, p, rw, bad in itertools.product(
        shapes, kinds, [False, True], [0.0, 0.3], [False, True], [False, True]
    ):
        q = torch.randn(B, H, Nq, 8, generator=g).to(dtype)
        k = torch.randn(B, Hkv, Nk, 8, generator=g).to(dtype)
        v = torch.randn(B, Hkv, Nk, 6, generator=g).to(dtype)
        if bad:
            v[..., 0, 0], v[..., -1, 1] = float("nan"), float("inf")
        mask = {
            "bool": torch.rand(B, 1, Nq, Nk, generator=g) > 0.4,
            "float": torch.randn(1, H, Nq, Nk, generator=g).to(dtype),
            "neginf": torch.where(torch.rand(1, 1, Nq, Nk, generator=g) > 0.5, 0.0, -torch.inf),
            "rule": sliding_window(3),
        }.get(kind)
        if kind == "neginf":
            mask = mask.to(dtype)
        mod = qkv.scores.alibi(qkv.scores.alibi_slopes(H)) if kind == "alibi" else None
        plan = make_plan(
            q, k, v, mask=mask, causal=causal, dropout_p=p, dropout_seed=7 if p else None,
            return_weights=rw, score_mod=mod,
        )  # fmt: skip
        st = reference.compute(plan, q, k, v)
        want = (st.out, st.lse, st.A.to(plan.dtype) if rw else None)
        with torch.no_grad():
            got = reference.forward(plan, q, k, v)
        case = (dtype, (B, H, Hkv, Nq, Nk), kind, causal, p, rw, bad)
        assert all(_same(a, b) for a, b in zip(want, got, strict=True)), case


_PEAK = """
import torch, qkv
def field(name):
    for line in open("/proc/self/status"):
        if line.startswith(name):
            return int(line.split()[1]) * 1024
q, k, v = (torch.randn(1, 2, 4096, 32) for _ in range(3))
qkv.attention(q[..., :8, :], k[..., :8, :], v[..., :8, :], backend="reference")
open("/proc/self/clear_refs", "w").write("5")
base = field("VmRSS")
with torch.no_grad():
    qkv.attention(q, k, v, causal=True, backend="reference", return_weights=True)
print((field("VmHWM") - base) / (2 * 4096 * 4096 * 4))
"""


def test_the_reference_forward_keeps_about_one_score_matrix():
    """Without a gradient the formula holds one Nq×Nk matrix (and a bool mask), not five."""
    proc = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout) < 1.8, proc.stdout


def _identical_keys(N, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 16, 16, generator=g)
    k = torch.randn(1, 2, 1, 16, generator=g).expand(1, 2, N, 16).contiguous()
    v = torch.randn(1, 2, N, 16, generator=g) + 3
    return q, k, v


def test_one_key_products_refuse_with_the_reason():
    q, k, v = _identical_keys(4096)
    narrow = TiledBackend(16, 1, max_rows=16, max_cols=1, fused=False)
    with pytest.raises(NotImplementedError, match=r"span 1 keys.*4096 float32 online-softmax"):
        qkv.attention(q, k, v, backend=narrow)
    # what still runs keeps the rule: 64 one-key steps, and float64 at any length
    for n in (64, 63):
        q, k, v = _identical_keys(n)
        got = qkv.attention(q, k, v, backend=narrow)
        assert_error_ratio(got, qkv.attention(q, k, v, backend="reference"), golden(q, k, v))
    q, k, v = (t.double() for t in _identical_keys(1024))
    assert_error_ratio(qkv.attention(q, k, v, backend=narrow), None, golden(q, k, v))


@pytest.mark.parametrize("width", [1, 2, 8, 16, 32, 64, 128])
def test_every_tiling_that_runs_keeps_the_rule_on_identical_keys(width):
    be = TiledBackend(16, min(width, 64), max_rows=16, max_cols=width, fused=False)
    for n in (width * 64, width * 64 + 1):
        q, k, v = _identical_keys(n)
        try:
            got = qkv.attention(q, k, v, backend=be)
        except NotImplementedError:
            assert n > width * 64
            continue
        assert_error_ratio(got, qkv.attention(q, k, v, backend="reference"), golden(q, k, v))


def test_the_default_tiles_are_never_refused():
    q, k, v = make_qkv(B=1, H=1, Nq=4, Nk=70000, D=8)
    assert TiledBackend().why_not(make_plan(q, k, v), q, k, v) is None
