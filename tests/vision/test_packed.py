"""Packed vision attention: one qkv call equals each segment run alone, forward and backward."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.masks import Mask
from qkv.vision import packed, packed_attention, window_partition
from qkv.vision.packed import plan_layout

from ..helpers import assert_error_ratio, cpu_kernel_or


def _inputs(lengths, H=4, Hkv=None, D=16, Dv=None, dtype=torch.float32, seed=0):
    Hkv, Dv = Hkv or H, Dv or D
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q = torch.randn(n, H, D, generator=g).to(dtype)
    k = torch.randn(n, Hkv, D, generator=g).to(dtype)
    v = torch.randn(n, Hkv, Dv, generator=g).to(dtype)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return q, k, v, cu


def _per_segment(q, k, v, cu, scale=None):
    """The oracle: the reference formula on each segment alone, one after another."""
    outs = []
    for a, b in zip(cu.tolist(), cu.tolist()[1:], strict=False):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # (H, n, D)
        o = qkv.attention(qs, ks, vs, scale=scale, backend="reference")
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


CASES = {
    "windows": [64] * 6 + [48, 16, 64, 12],  # 112-pixel windows with cut edges
    "equal": [64] * 5,  # every segment full: a view, no gather
    "images": [400, 36, 144, 1],  # whole images of very different sizes
    "awkward": [17, 0, 1, 97, 2, 0, 33],  # empty segments and odd lengths
    "one": [255],
}


@pytest.mark.parametrize("layout", ["auto", "padded", "varlen"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_equals_each_segment_alone(case, layout):
    q, k, v, cu = _inputs(CASES[case], H=6, Hkv=2, D=16, Dv=8)
    gold = _per_segment(q.double(), k.double(), v.double(), cu)
    ref = _per_segment(q, k, v, cu)
    out = packed_attention(q, k, v, cu, layout=layout)
    assert out.shape == (q.shape[0], 6, 8)
    assert_error_ratio(out, ref, gold)
    out64 = packed_attention(q.double(), k.double(), v.double(), cu, layout=layout)
    assert_error_ratio(out64, gold, gold)


@pytest.mark.parametrize("layout", ["padded", "varlen"])
@pytest.mark.parametrize("case", ["windows", "images", "awkward", "equal"])
def test_gradients_equal_each_segment_alone(case, layout):
    q, k, v, cu = _inputs(CASES[case], H=4, D=8, seed=1)
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(q.shape[0], 4, 8, generator=g)

    def grads(q, k, v, fn):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fn(q, k, v)
        return torch.autograd.grad(out, (q, k, v), dout.to(out.dtype))

    gold = grads(q.double(), k.double(), v.double(), lambda a, b, c: _per_segment(a, b, c, cu))
    ref = grads(q, k, v, lambda a, b, c: _per_segment(a, b, c, cu))
    ours = grads(q, k, v, lambda a, b, c: packed_attention(a, b, c, cu, layout=layout))
    for name, o, r, gd in zip("qkv", ours, ref, gold, strict=True):
        assert_error_ratio(o, r, gd, factor=3.0, what=f"d{name}")


def test_scale_is_honoured():
    q, k, v, cu = _inputs([30, 12], D=8)
    gold = _per_segment(q.double(), k.double(), v.double(), cu, scale=0.3)
    ref = _per_segment(q, k, v, cu, scale=0.3)
    for layout in ("padded", "varlen"):
        assert_error_ratio(packed_attention(q, k, v, cu, scale=0.3, layout=layout), ref, gold)


def test_one_qkv_call_and_no_n_squared_mask(monkeypatch):
    calls = []
    real = packed.attention

    def spy(q, k, v, **kwargs):
        calls.append((tuple(q.shape), kwargs.get("mask")))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(packed, "attention", spy)
    lengths = CASES["windows"]
    q, k, v, cu = _inputs(lengths)
    packed_attention(q, k, v, cu, layout="padded")
    assert len(calls) == 1
    shape, mask = calls.pop()
    S, L = len(lengths), max(lengths)
    assert shape == (S, 4, L, 16)
    assert tuple(mask.shape) == (S, 1, 1, L)  # key padding only: O(S·L), not N²
    packed_attention(q, k, v, cu, layout="varlen")
    assert len(calls) == 1
    shape, mask = calls.pop()
    assert shape == (1, 4, sum(lengths), 16) and isinstance(mask, Mask)
    q, k, v, cu = _inputs(CASES["equal"])
    packed_attention(q, k, v, cu, layout="padded")
    assert calls.pop()[1] is None  # equal segments: a view, no mask at all


def test_auto_takes_padded_for_windows_and_varlen_for_images():
    grids = [(1, 96, 96), (1, 54, 96), (1, 34, 46), (1, 32, 32)]
    part = window_partition(grids)
    n = int(part.cu_seqlens[-1])
    assert plan_layout(part.cu_window_seqlens, n).layout == "padded"
    assert plan_layout(part.cu_seqlens, n).layout == "varlen"
    assert plan_layout(torch.tensor([0, 64, 128]), 128).layout == "padded"
    # the compiled CPU kernel skips the other segments' tiles: varlen for windows too
    assert plan_layout(part.cu_window_seqlens, n, compiled=True).layout == "varlen"


def test_qwen2_5_vl_shaped_packing_equals_per_window_sdpa():
    # the loop transformers runs for every backend but flash attention, on the same windows
    part = window_partition([(1, 16, 24), (1, 10, 6)])
    n = int(part.cu_seqlens[-1])
    q, k, v, _ = _inputs([n], H=2, D=8)
    lengths = part.window_lengths
    loop = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(*(t.transpose(0, 1) for t in s))
            for s in zip(*(t.split(lengths) for t in (q, k, v)), strict=True)
        ],
        dim=1,
    ).transpose(0, 1)
    torch.testing.assert_close(packed_attention(q, k, v, part.cu_window_seqlens), loop)


def test_empty_input():
    q, k, v, cu = _inputs([0, 0])
    assert packed_attention(q, k, v, cu).shape == (0, 4, 16)


def test_inference_calls_reuse_their_gather_buffers_safely():
    lengths = CASES["windows"]
    first = _inputs(lengths, seed=3)
    second = _inputs(lengths, seed=4)
    packed.release_workspace()
    with torch.no_grad():
        out1 = packed_attention(*first, layout="padded")
        buffer = packed._workspace.buffers["q"]
        out2 = packed_attention(*second, layout="padded")
        assert packed._workspace.buffers["q"] is buffer  # the same buffer, refilled
    # the first result is not a view of anything the second call overwrote
    torch.testing.assert_close(out1, _per_segment(*first), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out2, _per_segment(*second), rtol=1e-5, atol=1e-5)
    packed.release_workspace()
    assert "buffers" not in packed._workspace.__dict__


@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_cu_seqlens_changed_in_place_between_calls(layout):
    # The segments are read anew at every call: an encoder that reuses its cu_seqlens tensor
    # for a new batch (same total, other cuts) gets the new batch's segments, never the old ones.
    q, k, v, cu = _inputs([64, 64, 32, 96])
    packed_attention(q, k, v, cu, layout=layout)
    cu[1:4] = torch.tensor([32, 128, 160], dtype=cu.dtype)  # segments of 32, 96, 32, 96
    out = packed_attention(q, k, v, cu, layout=layout)
    ref = _per_segment(q, k, v, cu)
    gold = _per_segment(*(t.double() for t in (q, k, v)), cu)
    assert_error_ratio(out, ref, gold)


def _dispatch_varlen(q, k, v, cu, **kwargs):
    """What `qkv.dispatch` says auto runs the varlen request on (the packed tensors as one
    sequence under the segments' block-diagonal mask)."""
    one = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    cu64 = cu.to(torch.long)
    return qkv.dispatch(*one, mask=qkv.masks.varlen(cu64, cu64), **kwargs).name


@pytest.mark.parametrize("kernel", ["as built", "declines"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("case", ["windows", "images"])
def test_packed_follows_dispatchs_choice(case, dtype, kernel, monkeypatch):
    """One source of truth: auto's layout and backend follow what `qkv.dispatch` says of the
    varlen request: varlen on its backend where that is the compiled kernel, else the waste
    rule (varlen on tiled, padded on auto). The result is exact either way."""
    if kernel == "declines":
        monkeypatch.setattr(qkv.kernels.CpuBackend, "why_not", lambda *a: "not here")
    q, k, v, cu = _inputs(CASES[case], H=4, Hkv=2, dtype=dtype)
    n = q.shape[0]
    chosen = _dispatch_varlen(q, k, v, cu)
    layout, runs_on = packed.plan_call(q, k, v, cu)
    if chosen == "cpu":
        assert (layout.layout, runs_on.name) == ("varlen", "cpu")
    else:
        assert layout == plan_layout(cu, n)  # the waste rule alone
        assert runs_on == ("tiled" if layout.layout == "varlen" else "auto")
    built = cpu_kernel_or("none") == "cpu"  # the kernel could be built on this machine
    assert (chosen == "cpu") == (built and kernel == "as built" and dtype != torch.float64)
    forced, runs_on = packed.plan_call(q, k, v, cu, layout="varlen")
    assert forced.layout == "varlen"
    assert runs_on.name == "cpu" if chosen == "cpu" else runs_on == "tiled"
    _, runs_on = packed.plan_call(q, k, v, cu, layout="padded")
    assert runs_on == "auto"  # padded is qkv's auto, nothing asked
    gold = _per_segment(*(t.double() for t in (q, k, v)), cu)
    ref = _per_segment(q, k, v, cu)
    assert_error_ratio(packed_attention(q, k, v, cu), ref, gold)
