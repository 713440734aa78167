"""One test per bad input: the exception type and a message naming the argument."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.kernels import TiledBackend

from .helpers import make_qkv


@pytest.fixture
def qkv3():
    return make_qkv(B=2, H=4, Nq=6, Nk=7, D=8)


def test_q_not_a_tensor(qkv3):
    _, k, v = qkv3
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor, got list"):
        qkv.attention([[1.0]], k, v)


def test_v_not_a_tensor(qkv3):
    q, k, _ = qkv3
    with pytest.raises(TypeError, match=r"v must be a torch.Tensor, got NoneType"):
        qkv.attention(q, k, None)


@pytest.mark.parametrize("shape", [(8,), (1, 1, 1, 6, 8)])
def test_q_wrong_rank(shape):
    q = torch.randn(shape)
    with pytest.raises(
        ValueError, match=r"q must have shape \(B, H, N, D\), \(H, N, D\) or \(N, D\)"
    ):
        qkv.attention(q, q, q)


def test_k_rank_differs_from_q(qkv3):
    q, k, v = qkv3
    with pytest.raises(ValueError, match=r"k must have the same number of dims as q \(4\)"):
        qkv.attention(q, k[0], v)


def test_integer_dtype(qkv3):
    q, k, v = qkv3
    with pytest.raises(
        TypeError, match=r"q must be float16, bfloat16, float32 or float64, got dtype=torch.int64"
    ):
        qkv.attention(q.long(), k, v)


def test_dtype_mismatch(qkv3):
    q, k, v = qkv3
    with pytest.raises(
        TypeError, match=r"v.dtype=torch.float64 differs from q.dtype=torch.float32"
    ):
        qkv.attention(q, k, v.double())


def test_device_mismatch(qkv3):
    q, k, v = qkv3
    with pytest.raises(ValueError, match=r"k is on meta but q is on cpu"):
        qkv.attention(q, k.to("meta"), v)


def test_head_dim_mismatch(qkv3):
    q, k, v = qkv3
    with pytest.raises(ValueError, match=r"k's head dim must equal q's"):
        qkv.attention(q, k[..., :5], v)


def test_batch_mismatch(qkv3):
    q, k, v = qkv3
    with pytest.raises(ValueError, match=r"batch sizes differ: q has B=2, k has B=1, v has B=2"):
        qkv.attention(q, k[:1], v)


def test_k_and_v_lengths_differ(qkv3):
    q, k, v = qkv3
    with pytest.raises(ValueError, match=r"k and v must share \(B, Hkv, Nk\)"):
        qkv.attention(q, k, v[:, :, :3])


def test_heads_not_divisible():
    q, k, v = make_qkv(H=6, Hkv=4, Nq=5, D=8)
    with pytest.raises(
        ValueError, match=r"query heads H=6 must be a multiple of key/value heads Hkv=4"
    ):
        qkv.attention(q, k, v)


def test_mask_not_broadcastable(qkv3):
    q, k, v = qkv3
    with pytest.raises(
        ValueError,
        match=r"mask of shape \(6, 6\) is not broadcastable to \(B, H, Nq, Nk\)=\(2, 4, 6, 7\)",
    ):
        qkv.attention(q, k, v, mask=torch.ones(6, 6, dtype=torch.bool))


def test_mask_too_many_dims(qkv3):
    q, k, v = qkv3
    with pytest.raises(ValueError, match=r"mask must have at most 4 dims"):
        qkv.attention(q, k, v, mask=torch.ones(1, 2, 4, 6, 7, dtype=torch.bool))


def test_mask_integer_dtype(qkv3):
    q, k, v = qkv3
    with pytest.raises(
        TypeError, match=r"mask must have dtype torch.bool .* got dtype=torch.int64"
    ):
        qkv.attention(q, k, v, mask=torch.ones(6, 7, dtype=torch.long))


def test_mask_not_a_tensor(qkv3):
    q, k, v = qkv3
    with pytest.raises(TypeError, match=r"mask must be a torch.Tensor .* got list"):
        qkv.attention(q, k, v, mask=[[True]])


def test_mask_on_another_device(qkv3):
    q, k, v = qkv3
    with pytest.raises(ValueError, match=r"mask is on meta but q is on cpu"):
        qkv.attention(q, k, v, mask=torch.ones(6, 7, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("p", [1.0, -0.1, 1.5])
def test_dropout_out_of_range(qkv3, p):
    q, k, v = qkv3
    with pytest.raises(ValueError, match=rf"dropout_p={p} is out of range \[0, 1\)"):
        qkv.attention(q, k, v, dropout_p=p)


def test_dropout_not_a_number(qkv3):
    q, k, v = qkv3
    with pytest.raises(TypeError, match=r"dropout_p must be a real number, got str '0.1'"):
        qkv.attention(q, k, v, dropout_p="0.1")


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_scale_not_positive_finite(qkv3, scale):
    q, k, v = qkv3
    with pytest.raises(ValueError, match=r"scale must be a finite number > 0, got scale="):
        qkv.attention(q, k, v, scale=scale)


def test_scale_not_a_number(qkv3):
    q, k, v = qkv3
    with pytest.raises(TypeError, match=r"scale must be a real number, got str"):
        qkv.attention(q, k, v, scale="0.5")


def test_causal_not_a_bool(qkv3):
    q, k, v = qkv3
    with pytest.raises(TypeError, match=r"causal must be a bool, got int 1"):
        qkv.attention(q, k, v, causal=1)


def test_return_lse_not_a_bool(qkv3):
    q, k, v = qkv3
    with pytest.raises(TypeError, match=r"return_lse must be a bool"):
        qkv.attention(q, k, v, return_lse="yes")


def test_unknown_backend(qkv3):
    q, k, v = qkv3
    with pytest.raises(
        ValueError,
        match=r"backend='flash' is unknown; expected one of 'auto', 'cpu', 'sdpa', 'triton', "
        r"'tiled', 'reference'",
    ):
        qkv.attention(q, k, v, backend="flash")


def test_backend_wrong_type(qkv3):
    q, k, v = qkv3
    with pytest.raises(
        TypeError, match=r"backend must be a backend name or a backend object, got int"
    ):
        qkv.attention(q, k, v, backend=3)


@pytest.mark.parametrize(
    "backend,kwargs,reason",
    [
        ("sdpa", dict(return_lse=True), "returns no lse"),
        ("sdpa", dict(return_weights=True), "cannot return the attention weights"),
        ("sdpa", dict(dropout_p=0.1), "draws its own dropout mask"),
        ("tiled", dict(return_weights=True), "never materialises the attention weights"),
    ],
)
def test_named_backend_that_cannot_is_an_error_not_a_fallback(qkv3, backend, kwargs, reason):
    q, k, v = qkv3
    with pytest.raises(
        NotImplementedError, match=rf"backend='{backend}' cannot run this request: .*{reason}"
    ):
        qkv.attention(q, k, v, backend=backend, **kwargs)


def test_tiled_float_mask_with_grad_is_refused(qkv3):
    q, k, v = qkv3
    bias = torch.zeros(6, 7, requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"does not differentiate a float mask"):
        qkv.attention(q, k, v, mask=bias, backend="tiled")


@pytest.mark.parametrize("arg,value", [("block_q", 0), ("block_k", -4), ("block_q", 2.5)])
def test_tiled_block_sizes(arg, value):
    with pytest.raises(ValueError, match=rf"{arg} must be a positive int, got {value}"):
        TiledBackend(**{arg: value})


@pytest.mark.parametrize("scale", [1e-46, 1e-39, 1e39])
def test_scale_that_rounds_to_zero_or_inf_in_the_compute_dtype(qkv3, scale):
    # 1e-46 passed validation, then ZeroDivisionError deep in the tiled kernel.
    q, k, v = qkv3
    with pytest.raises(ValueError, match=r"outside the normal range of torch.float32"):
        qkv.attention(q, k, v, scale=scale)


def test_scale_small_for_float32_is_fine_in_float64(qkv3):
    q, k, v = (t.double() for t in qkv3)
    out = qkv.attention(q, k, v, scale=1e-46, backend="tiled")
    ref = qkv.attention(q, k, v, scale=1e-46, backend="reference")
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "be", ["tiled", qkv.kernels.TiledBackend(8, 8, fused=False), "cpu"], ids=str
)
def test_double_backward_says_which_backend_can(be):
    q, k, v = (torch.randn(1, 2, 9, 4, requires_grad=True) for _ in range(3))
    out = qkv.attention(q, k, v, causal=True, backend=be)
    # A gradient penalty: the gradient is taken with create_graph=True (as torch.func.grad
    # does), which works; differentiating it again raises, instead of giving zero (it once
    # raised `matmul(): functions with out=... arguments don't support automatic
    # differentiation`).
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    (plain,) = torch.autograd.grad(out.sum(), q, retain_graph=True)
    torch.testing.assert_close(g, plain, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="backend='reference'"):
        torch.autograd.grad(g.square().sum(), q)


def test_double_backward_through_the_reference_works():
    q, k, v = (torch.randn(1, 1, 5, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradgradcheck(
        lambda q, k, v: qkv.attention(q, k, v, causal=True, backend="reference"), (q, k, v)
    )


def test_reference_says_up_front_it_will_not_fit():
    # N = 65536 died in torch's allocator asking for 17 GB; meta tensors cost nothing here.
    n = 2**20
    q = torch.empty(1, 1, n, 8)
    k = v = torch.empty(1, 1, n, 8)
    with pytest.raises(MemoryError, match=r"about \d+\.\d GiB.*backend='tiled'"):
        qkv.attention(q, k, v, backend="reference")
