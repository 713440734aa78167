"""The triton backend's kernels, run in Triton's interpreter on CPU tensors, against the fp64
golden under the error-ratio rule (forward, lse, dQ, dK, dV).

`TRITON_INTERPRET=1` must be set before `triton` is first imported: `triton.jit` reads it at
decoration time, for Triton's own library (tl.max, …) as for our kernels, and Triton imports
more of itself lazily at the first launch. So this module sets it for the rest of the process
(nothing else in the suite uses Triton; `auto` never picks triton on CPU tensors either way).
Shapes are small: the interpreter executes every program in Python.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch


def _import_interpreted_kernels():
    """Import triton and the kernels with TRITON_INTERPRET=1, or return a reason why they
    cannot run in the interpreter in this process."""
    name = "qkv.kernels.triton.kernels"
    if name in sys.modules:
        mod = sys.modules[name]
        return mod if mod.INTERPRETED else f"{name} was imported without TRITON_INTERPRET=1"
    if "triton" in sys.modules:
        # triton.jit reads the variable at decoration time, its own library (tl.max, …) too.
        import triton

        if isinstance(triton.language.standard.max, triton.runtime.JITFunction):
            return "triton was imported before TRITON_INTERPRET=1 could be set"
    os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton", reason="triton is not installed (pip install 'qkv[triton]')")
    from qkv.kernels.triton import kernels as triton_kernels

    return triton_kernels


_kernels = _import_interpreted_kernels()
if isinstance(_kernels, str):  # pragma: no cover - only when something imported triton first
    pytest.skip(
        f"{_kernels}; run the triton tests in their own process, e.g. "
        "TRITON_INTERPRET=1 pytest tests/kernels/test_triton.py",
        allow_module_level=True,
    )

import qkv  # noqa: E402
from qkv import masks, scores  # noqa: E402
from qkv.kernels import TritonBackend  # noqa: E402
from qkv.kernels.triton import host as triton_mod  # noqa: E402

from ..helpers import assert_error_ratio, make_qkv  # noqa: E402

SMALL = TritonBackend(16, 16)  # tiles of 16: every awkward size crosses tile boundaries
ASYM = TritonBackend(32, 16, bwd_block_m=16, bwd_block_n=32)  # backward tiled differently


def _loss_weights(out, lse, seed=5):
    g = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    w_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    return w_out, w_lse


def _run(backend, q, k, v, **kw):
    """out, lse and (dq, dk, dv[, dparams]) of a loss that uses both out and lse."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    mod = kw.get("score_mod")
    params = list(mod.params) if mod is not None else []
    kw.setdefault("finite_inputs", True)  # the inputs are finite: masked requests may run
    out, lse = qkv.attention(*leaves, backend=backend, return_lse=True, **kw)
    w_out, w_lse = _loss_weights(out, lse)
    finite_lse = torch.where(torch.isinf(lse), 0.0, lse)
    loss = (out.double() * w_out).sum() + (finite_lse.double() * w_lse).sum()
    grads = torch.autograd.grad(loss, leaves + params)
    return out.detach(), lse.detach(), grads


def _check(backend, q, k, v, grad=True, golden_mod=None, **kw):
    """Compare a backend with the fp64 golden, scaled by the reference in the same dtype.
    `golden_mod`: the fp64 twin of a score_mod that holds a learnable table."""
    got = _run(backend, q, k, v, **kw)
    ref = _run("reference", q, k, v, **kw)
    gkw = {**kw, "score_mod": golden_mod} if golden_mod is not None else kw
    gold = _run("reference", *(t.detach().double() for t in (q, k, v)), **gkw)
    assert_error_ratio(got[0], ref[0], gold[0], what="out")
    assert_error_ratio(got[1], ref[1], gold[1], what="lse")
    if grad:
        names = ("dq", "dk", "dv", "dtable")[: len(got[2])]
        for name, a, r, g in zip(names, got[2], ref[2], gold[2], strict=True):
            assert_error_ratio(a, r, g, factor=3.0, what=name)
    return got


CASES = {
    "plain-D24": dict(shape=dict(B=1, H=2, Nq=37, Nk=45, D=24), kw=dict()),
    "causal-Nq<Nk-D40": dict(shape=dict(B=1, H=2, Nq=20, Nk=45, D=40), kw=dict(causal=True)),
    "causal-Nq>Nk": dict(shape=dict(B=1, H=1, Nq=41, Nk=19, D=16), kw=dict(causal=True)),
    "gqa-Dv": dict(shape=dict(B=2, H=6, Hkv=2, Nq=33, D=16, Dv=24), kw=dict(causal=True)),
    "sliding-window": dict(shape=dict(B=1, H=2, Nq=70, D=16), kw=dict(mask="window")),
    "document": dict(shape=dict(B=1, H=2, Nq=55, D=16), kw=dict(mask="document")),
    "padding-per-batch": dict(shape=dict(B=2, H=2, Nq=30, D=16), kw=dict(mask="padding")),
    "bool-tensor": dict(shape=dict(B=2, H=2, Nq=29, Nk=35, D=8), kw=dict(mask="bool")),
    "float-bias": dict(shape=dict(B=1, H=2, Nq=29, Nk=35, D=16), kw=dict(mask="float")),
}


def _materialise(kw, B, nq, nk):
    g = torch.Generator().manual_seed(4)
    m = kw.get("mask")
    if m == "window":
        return {**kw, "mask": masks.sliding_window(9)}
    if m == "document":
        return {**kw, "mask": masks.document([20, 3, 32])}
    if m == "padding":
        return {**kw, "mask": masks.padding([30, 11][:B])}
    if m == "bool":
        mask = torch.rand(B, 1, nq, nk, generator=g) > 0.5
        mask[:, :, :, 16:32] = False  # a whole empty tile column
        mask[1, 0, 3] = False  # a fully masked row
        return {**kw, "mask": mask}
    if m == "float":
        bias = torch.randn(1, 2, nq, nk, generator=g)
        bias[0, 1, 5] = -torch.inf  # a fully masked row
        bias[0, 0, :, 7] = -torch.inf
        return {**kw, "mask": bias}
    return kw


@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_fp32(case):
    spec = CASES[case]
    q, k, v = make_qkv(**spec["shape"])
    kw = _materialise(spec["kw"], q.shape[0], q.shape[2], k.shape[2])
    _check(SMALL, q, k, v, **kw)


@pytest.mark.parametrize("case", ["causal-Nq<Nk-D40", "gqa-Dv", "document"])
def test_asymmetric_tiles(case):
    spec = CASES[case]
    q, k, v = make_qkv(**spec["shape"])
    _check(ASYM, q, k, v, **_materialise(spec["kw"], q.shape[0], q.shape[2], k.shape[2]))


@pytest.mark.parametrize(
    "dtype,case",
    [
        (torch.bfloat16, "causal-Nq<Nk-D40"),
        (torch.bfloat16, "sliding-window"),
        (torch.float16, "gqa-Dv"),
    ],
)
def test_low_precision(dtype, case):
    spec = CASES[case]
    q, k, v = make_qkv(**spec["shape"], dtype=dtype)
    out, _, _ = _check(SMALL, q, k, v, **_materialise(spec["kw"], 1, q.shape[2], k.shape[2]))
    assert out.dtype == dtype


def test_default_tiles_and_non_contiguous_inputs():
    # (B, N, H, D) storage viewed as (B, H, N, D): strides that are not the canonical ones.
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 150, 2, 40, generator=g).transpose(1, 2)
    k = torch.randn(1, 150, 2, 40, generator=g).transpose(1, 2)
    v = torch.randn(1, 150, 2, 40, generator=g).transpose(1, 2)
    _check("triton", q, k, v, causal=True)


def test_fully_masked_rows_give_zero_output_and_gradient():
    q, k, v = make_qkv(B=1, H=1, Nq=20, Nk=8, D=16, requires_grad=True)
    out, lse = qkv.attention(
        q, k, v, causal=True, backend=SMALL, return_lse=True, finite_inputs=True
    )
    assert torch.equal(out[0, 0, :12], torch.zeros(12, 16))
    assert torch.isneginf(lse[0, 0, :12]).all() and torch.isfinite(lse[0, 0, 12:]).all()
    out.sum().backward()
    assert torch.equal(q.grad[0, 0, :12], torch.zeros(12, 16))
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


SLOPES = scores.alibi_slopes(4)


@pytest.mark.parametrize(
    "name,mod",
    [
        ("alibi", scores.alibi(SLOPES)),
        ("softcap", scores.softcap(2.0)),
        ("alibi-then-softcap", scores.compose(scores.alibi(SLOPES), scores.softcap(3.0))),
        ("softcap-then-alibi", scores.compose(scores.softcap(3.0), scores.alibi(SLOPES))),
    ],
)
def test_score_mods(name, mod):
    q, k, v = make_qkv(B=1, H=4, Nq=33, Nk=40, D=16)
    _check(SMALL, q, k, v, causal=True, score_mod=mod)


@pytest.mark.parametrize("after_softcap", [False, True])
def test_relative_bias_and_its_table_gradient(after_softcap):
    g = torch.Generator().manual_seed(9)
    table = torch.randn(4, 2 * 6 + 1, generator=g)

    def mod_for(t):
        rel = scores.relative_bias(t, 6)
        cap = scores.softcap(4.0)
        return scores.compose(cap, rel) if after_softcap else scores.compose(rel, cap)

    q, k, v = make_qkv(B=1, H=4, Nq=30, Nk=30, D=16)
    t32 = table.clone().requires_grad_(True)
    t64 = table.double().requires_grad_(True)
    mod, mod64 = mod_for(t32), mod_for(t64)
    got = _check(SMALL, q, k, v, mask=masks.sliding_window(10), score_mod=mod, golden_mod=mod64)
    assert len(got[2]) == 4 and got[2][3].dtype == torch.float32


def test_dropout_matches_reference_mask_bit_for_bit():
    # Same seed → the same keep-mask as the reference: forward and gradients agree with the
    # fp64 golden under the error-ratio rule (one differing bit would be an O(1) error).
    q, k, v = make_qkv(B=1, H=4, Hkv=2, Nq=29, Nk=37, D=16)
    out_ref = None
    for seed in (3, 4):
        torch.manual_seed(seed)
        got = _run(SMALL, q, k, v, dropout_p=0.3, causal=True)
        torch.manual_seed(seed)
        ref = _run("reference", q, k, v, dropout_p=0.3, causal=True)
        torch.manual_seed(seed)
        gold = _run("reference", *(t.double() for t in (q, k, v)), dropout_p=0.3, causal=True)
        assert_error_ratio(got[0], ref[0], gold[0], what="out")
        for name, a, r, g in zip(("dq", "dk", "dv"), got[2], ref[2], gold[2], strict=True):
            assert_error_ratio(a, r, g, factor=3.0, what=name)
        assert out_ref is None or not torch.equal(out_ref, got[0])
        out_ref = got[0]


def test_kernel_lists_hold_only_non_empty_tiles(monkeypatch):
    # The kernels iterate only over the tile lists: they must hold every non-empty tile once
    # (and nothing else), and the partial ones must each have a bank tile.
    q, k, v = make_qkv(B=1, H=2, Nq=128, D=16)
    seen = {}
    real = triton_mod.build_layout

    def recording(plan, bm, bn, device):
        seen["layout"] = real(plan, bm, bn, device)
        return seen["layout"]

    monkeypatch.setattr(triton_mod, "build_layout", recording)
    _check(TritonBackend(16, 16), q, k, v, grad=False, mask=masks.sliding_window(8))
    lay = seen["layout"]
    kept = int(lay.fwd.full_num.sum() + lay.fwd.part_num.sum())
    lists = lay.fwd.full_num.shape[0] * lay.fwd.full_num.shape[1]
    assert kept == lists * int((lay.tiles.kind != masks.EMPTY).sum())
    assert lay.tiles.nnz < lay.tiles.kind.numel() // 2
    assert lay.bank is not None and lay.bank.shape[0] == int(lay.fwd.part_num.sum())


def test_gpu_script_correctness_stage_runs_on_cpu(monkeypatch):
    # the gpu benchmark suite's first stage, on tiny CPU problems in the interpreter: its checks
    # pass and its report lists them (the int64 check needs > 2³¹ elements, the host-sync
    # check CUDA streams: GPU only, skipped here).
    from .test_triton_gpu_script import load_script

    gpu = load_script()
    tiny = (
        ("causal Nq<Nk D=24 GQA", (1, 4, 2, 40, 50, 24), dict(causal=True)),
        ("window D=16", (1, 2, 2, 70, 70, 16), dict(mask=masks.sliding_window(9))),
    )
    monkeypatch.setattr(gpu, "CHECKS", tiny)
    monkeypatch.setattr(gpu, "int64_offsets", lambda device: {"check": "int64", "pass": None})
    checks = gpu.correctness(torch.device("cpu"))
    assert [c["check"] for c in checks][:3] == [t[0] for t in tiny] + ["int64"]
    assert all(c["pass"] for c in checks[:2]), checks
    assert checks[3]["pass"] is None and "CUDA" in checks[3]["skipped"]
    results = gpu.Results(suite="gpu", mode="full", command="", machine={})
    results.stages["correctness"] = checks
    assert "| causal Nq<Nk D=24 GQA | ok |" in gpu.correctness_lines(results)
