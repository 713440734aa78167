"""qkv inside torch.compile and torch.func: the tiled backend is a pair of custom ops
(`qkv::tiled_forward`, `qkv::tiled_backward`), and so is the compiled CPU kernel
(`qkv::cpu_forward`, `qkv::cpu_backward`), so a model traces through either in one graph."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

import qkv
from qkv import masks
from qkv.kernels import TiledBackend

from .helpers import assert_error_ratio, cpu_kernel_or, make_qkv

SMALL = TiledBackend(16, 16, max_rows=16, max_cols=32)  # many tiles at these sizes


def _block(backend, dtype=torch.float32, dropout=0.0):
    torch.manual_seed(0)
    blk = qkv.nn.TransformerBlock(32, 4, n_kv_heads=2, dropout=dropout, backend=backend)
    return blk.to(dtype)


def _step(blk, x, **kw):
    """Output and gradients (parameters, then x) of a loss that uses the whole output."""
    x = x.detach().clone().requires_grad_(True)
    y = blk(x, **kw)
    y.square().sum().backward()
    grads = [p.grad.detach().clone() for p in blk.parameters()] + [x.grad.detach().clone()]
    blk.zero_grad()
    return y.detach(), grads


def _breaks(fn, *args) -> tuple[int, list[str]]:
    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(*args)
    return ex.graph_break_count, [str(r.reason)[:300] for r in ex.break_reasons]


@pytest.mark.parametrize("backend", ["tiled", SMALL, "cpu", "auto"], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_transformer_block_compiles_in_one_graph_with_eager_numbers(backend, causal, n=40):
    blk = _block(backend)
    x = torch.randn(2, n, 32, generator=torch.Generator().manual_seed(1))
    count, reasons = _breaks(lambda x: blk(x, causal=causal), x)
    assert count == 0, reasons

    # The numbers under AOTAutograd without inductor's code generation: inductor re-derives the
    # LayerNorm, bias and MLP reductions in its own order, and on whole-block gradients that
    # alone exceeded the rule against eager by up to 1.2× on some inputs for every backend
    # (`tiled` too, seeds 1-8), so it would judge torch's reductions, not qkv's ops. Inductor
    # around the kernel is held to eager bit for bit below
    # (test_auto_picking_the_cpu_kernel_compiles_in_one_graph).
    compiled = copy.deepcopy(blk)
    compiled.compile(fullgraph=True, backend="aot_eager")
    got = _step(compiled, x, causal=causal)
    eager = _step(blk, x, causal=causal)
    gold_blk = copy.deepcopy(blk).double()
    for m in gold_blk.modules():  # the fp64 golden runs the reference backend
        if isinstance(m, qkv.nn.MultiHeadAttention):
            m.backend = "reference"
    gold = _step(gold_blk, x.double(), causal=causal)
    assert_error_ratio(got[0], eager[0], gold[0], what="output")
    for i, (g, e, r) in enumerate(zip(got[1], eager[1], gold[1], strict=True)):
        assert_error_ratio(g, e, r, what=f"gradient {i}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_auto_picking_the_cpu_kernel_compiles_in_one_graph(causal):
    # At N = 40 auto leaves these plain requests to torch SDPA (faster there); at N = 256 it
    # picks "cpu", qkv's compiled kernel, where it could be built.
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=256, D=8, requires_grad=True)
    assert qkv.dispatch(q, k, v, causal=causal).name == cpu_kernel_or("sdpa")
    blk = _block("auto")
    x = torch.randn(2, 256, 32, generator=torch.Generator().manual_seed(1))
    count, reasons = _breaks(lambda x: blk(x, causal=causal), x)
    assert count == 0, reasons

    def f(q, k, v):
        out, lse = qkv.attention(q, k, v, causal=causal, return_lse=True)
        return out.square().sum() + lse.sum()

    cf = torch.compile(f, fullgraph=True)
    got = torch.autograd.grad(cf(q, k, v), (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for g, w in zip(got, want, strict=True):  # the same op on the same inputs: bit for bit
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_float64_compiled_matches_eager():
    blk = _block("tiled", torch.float64)
    x = torch.randn(1, 24, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    compiled = copy.deepcopy(blk)
    compiled.compile(fullgraph=True)
    got, eager = _step(compiled, x, causal=True), _step(blk, x, causal=True)
    for g, e in zip([got[0], *got[1]], [eager[0], *eager[1]], strict=True):
        assert_error_ratio(g, e, e)  # float64: within 1e-10 of eager


def test_dropout_seed_does_not_break_the_graph():
    blk = _block("tiled", dropout=0.2).train()
    x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(3))
    count, reasons = _breaks(lambda x: blk(x, causal=True), x)
    assert count == 0, reasons
    compiled = copy.deepcopy(blk)
    compiled.compile(fullgraph=True)
    import torch._inductor.config as inductor_config

    # Inductor's own random numbers differ from eager's unless it falls back to torch's:
    # with the fallback both draw the same seeds, so dropout drops the same weights.
    with inductor_config.patch(fallback_random=True):
        torch.manual_seed(7)
        got = _step(compiled, x, causal=True)
    torch.manual_seed(7)
    eager = _step(blk, x, causal=True)
    torch.testing.assert_close(got[0], eager[0], rtol=1e-5, atol=1e-5)
    for g, e in zip(got[1], eager[1], strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "mask",
    [
        masks.sliding_window(5),
        masks.sliding_window(3) | masks.global_tokens([0, 1]),
        masks.document([9, 11, 13]),
    ],
    ids=str,
)
@pytest.mark.parametrize("backend", [SMALL, "cpu"], ids=str)
def test_structured_masks_compile(mask, backend):
    q, k, v = make_qkv(B=1, H=2, Nq=33, D=8, requires_grad=True)

    def f(q, k, v):
        return qkv.attention(q, k, v, mask=mask, backend=backend).sum()

    count, reasons = _breaks(f, q, k, v)
    assert count == 0, reasons
    cf = torch.compile(f, fullgraph=True)
    got = torch.autograd.grad(cf(q, k, v), (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for g, w in zip(got, want, strict=True):  # the same op on the same inputs: bit for bit
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_torch_func_grad_and_vmap():
    q, k, v = make_qkv(B=2, H=2, Nq=20, D=8, dtype=torch.float64)

    def loss(q, k, v):
        return qkv.attention(q, k, v, causal=True, backend=SMALL).square().sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad(loss(*leaves), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)

    Q, K, V = (torch.stack([t, t.flip(2), 2 * t]) for t in (q, k, v))  # a mapped dim of 3
    out = torch.func.vmap(lambda q, k, v: qkv.attention(q, k, v, causal=True, backend=SMALL))(
        Q, K, V
    )
    for i in range(3):
        want = qkv.attention(Q[i], K[i], V[i], causal=True, backend=SMALL)
        torch.testing.assert_close(out[i], want, rtol=0, atol=1e-12)
    per_item = torch.func.vmap(torch.func.grad(loss))(Q, K, V)
    for i in range(3):
        torch.testing.assert_close(
            per_item[i], torch.func.grad(loss)(Q[i], K[i], V[i]), rtol=0, atol=1e-12
        )


def test_torch_func_grad_through_the_cpu_kernel():
    q, k, v = make_qkv(B=2, H=2, Nq=20, D=8)

    def loss(q, k, v):
        return qkv.attention(q, k, v, causal=True, backend="cpu").square().sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad(loss(*leaves), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_torch_func_over_a_score_modifier_says_what_works():
    q, k, v = make_qkv(B=1, H=2, Nq=12, D=4, dtype=torch.float64)
    mod = qkv.scores.softcap(3.0)

    def loss(q):
        return qkv.attention(q, k, v, score_mod=mod, backend=SMALL).sum()

    with pytest.raises(NotImplementedError, match="backend='reference'"):
        torch.func.grad(loss)(q)
    with pytest.raises(NotImplementedError, match="backend='reference'"):
        torch.func.vmap(loss)(q.unsqueeze(0))
    leaf = q.clone().requires_grad_(True)
    (got,) = torch.autograd.grad(loss(leaf), leaf)  # what works
    (want,) = torch.autograd.grad(
        qkv.attention(leaf, k, v, score_mod=mod, backend="reference").sum(), leaf
    )
    assert_error_ratio(got, want, want)


@pytest.mark.slow
def test_first_call_under_compile_registers_the_ops():
    """`import qkv` leaves the custom ops unregistered (a light import); a fresh process whose
    first attention call is being traced registers them then and still gets one graph."""
    code = (
        "import sys, torch, qkv\n"
        "assert 'qkv.kernels.tiled.op' not in sys.modules\n"
        "blk = qkv.nn.TransformerBlock(32, 4, n_kv_heads=2, backend='tiled')\n"
        "x = torch.randn(2, 40, 32)\n"
        "y = torch.compile(lambda x: blk(x, causal=True), fullgraph=True)(x)\n"
        "y.square().sum().backward()\n"
        "assert 'qkv.kernels.tiled.op' in sys.modules\n"
    )  # fullgraph=True raises on a graph break; the numbers are the test above's
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
