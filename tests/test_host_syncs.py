"""Dispatch and the kernels read no tensor values on the host: on CUDA each read is a
device-to-host sync, and it would stop torch.compile and CUDA graphs. The test makes every
such read raise (`Tensor.item`, `bool(t)`, `t.tolist()`, `int(t)`, `float(t)`) during warm
calls (a layout is built once and cached; building it from a Mask reads its rule's values)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import qkv
from qkv import masks
from qkv.kernels import TiledBackend

from .helpers import make_qkv


@contextlib.contextmanager
def no_host_reads():
    def refuse(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"host read of a tensor: Tensor.{name}")

        return method

    names = ("item", "__bool__", "tolist", "__int__", "__float__")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    try:
        for n in names:
            setattr(torch.Tensor, n, refuse(n))
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def _bias(nq, nk):
    b = torch.randn(1, 1, nq, nk, generator=torch.Generator().manual_seed(4))
    b[..., 1:3] = -torch.inf
    return b


CASES = {
    "dense": dict(),
    "causal": dict(causal=True),
    "gqa": dict(Hkv=2, causal=True),
    "nq<nk": dict(Nq=17, Nk=40, causal=True),
    "nq>nk": dict(Nq=40, Nk=17),
    "float-bias": dict(bias=True),
    "mask": dict(mask=masks.sliding_window(6) | masks.global_tokens([0])),
}


@pytest.mark.parametrize("backend", ["auto", "tiled", TiledBackend(16, 16), "cpu"], ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_no_host_reads_in_warm_calls(case, backend, grad):
    if backend == "cpu" and case == "float-bias":
        pytest.skip("the compiled CPU kernel refuses float masks")
    kw = dict(CASES[case])
    shape = {k: kw.pop(k) for k in ("Hkv", "Nq", "Nk") if k in kw}
    q, k, v = make_qkv(B=2, H=4, D=8, requires_grad=grad, **{"Nq": 40, **shape})
    if kw.pop("bias", False):
        kw["mask"] = _bias(q.shape[2], k.shape[2])

    def call():
        out = qkv.attention(q, k, v, backend=backend, **kw)
        if grad:
            torch.autograd.grad(out.square().sum(), (q, k, v))
        return out

    call()  # warm: layouts built and cached
    with no_host_reads():
        call()


def test_a_bool_mask_tensor_is_read_in_one_visible_step():
    # The reads are there to be found: a bool mask tensor's tiles come from its values, on
    # every call (its content may change). Built ahead (masks.from_tensor, block_layout) and
    # passed in, the layout is read once, before the calls, and the calls read nothing.
    q, k, v = make_qkv(B=1, H=2, Nq=40, D=8)
    m = torch.rand(40, 40, generator=torch.Generator().manual_seed(0)) < 0.3
    m |= torch.eye(40, dtype=torch.bool)
    with no_host_reads(), pytest.raises(AssertionError, match="host read"):
        qkv.attention(q, k, v, mask=m, backend="tiled")
    lay = qkv.block_layout(masks.from_tensor(m), 40, 40, block_q=16, block_k=16)
    with no_host_reads():
        out = qkv.attention(q, k, v, mask=lay, backend=TiledBackend(16, 16))
    torch.testing.assert_close(out, qkv.attention(q, k, v, mask=m, backend="reference"))
