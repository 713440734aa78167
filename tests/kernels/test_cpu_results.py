"""The memory of the compiled kernel's large results (csrc/results.h): blocks of freed results of
8 MiB or more are kept and handed to the next result of the same size, uninitialised. Whatever a
reused block held, the results are the bits a fresh block gives."""

from __future__ import annotations

import sys

import pytest
import torch

import qkv
from qkv.kernels.cpu import cached_result_bytes, release_cached_results

from ..helpers import make_qkv
from .cpu_kernel import require_kernel

OPS, ISA = require_kernel()

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="results are kept for reuse on Linux only"
)

MIB = 2**20
SHAPE = dict(B=1, H=32, Nq=1024, D=64)  # q, out, dq, dk, dv: 8 MiB each in float32


def _mask() -> torch.Tensor:
    """Rows and key columns nobody attends: the kernel's own writes must cover them."""
    mask = torch.ones(1024, 1024, dtype=torch.bool)
    mask[5] = False
    mask[960:] = False  # a whole tile of empty rows
    mask[:, :64] = False  # a whole tile of keys no row sees (dk, dv rows of zeros)
    return mask


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _run(q, k, v, dout):
    out, lse = qkv.attention(q, k, v, mask=_mask(), backend="cpu", return_lse=True)
    grads = torch.autograd.grad((out * dout).sum() + lse[:, :, :5].sum(), (q, k, v))
    return [out.detach(), lse.detach(), *grads]


def test_a_freed_result_block_is_reused_and_its_old_contents_never_show():
    q, k, v = make_qkv(**SHAPE, requires_grad=True)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    release_cached_results()
    fresh = _run(q, k, v, dout)
    poisoned = _run(q, k, v, dout)
    blocks = {_storage(t) for t in poisoned if t.nbytes >= 8 * MIB}
    assert len(blocks) == 4  # out, dq, dk, dv
    for t in poisoned:
        t.fill_(float("nan"))
    del poisoned, t
    assert cached_result_bytes() >= 4 * 8 * MIB
    again = _run(q, k, v, dout)
    assert {_storage(t) for t in again if t.nbytes >= 8 * MIB} == blocks
    for a, b in zip(again, fresh, strict=True):
        assert torch.equal(a, b)
    assert release_cached_results() >= 0 and cached_result_bytes() == 0


def test_at_most_eight_blocks_are_kept_and_release_gives_them_back():
    q, k, v = make_qkv(**SHAPE)
    release_cached_results()
    with torch.no_grad():
        outs = [qkv.attention(q, k, v, backend="cpu") for _ in range(10)]
    assert cached_result_bytes() == 0
    del outs
    assert cached_result_bytes() == 8 * 8 * MIB
    assert release_cached_results() == 8 * 8 * MIB
    assert cached_result_bytes() == 0


def test_a_result_can_be_resized_and_freed_like_any_tensor():
    q, k, v = make_qkv(**SHAPE)
    release_cached_results()
    with torch.no_grad():
        out = qkv.attention(q, k, v, backend="cpu")
    want = out.clone()
    out.resize_(2 * out.numel())  # a new, larger block; the old contents copied
    assert torch.equal(out[: want.numel()], want.flatten())
    del out
    release_cached_results()
    assert cached_result_bytes() == 0


@pytest.mark.parametrize("dv", [64, 72])
def test_a_large_output_written_past_the_caches_has_the_bits_of_a_small_one(dv):
    # float32 outputs of 8 MiB or more whose rows are whole 16-float vectors are written with
    # non-temporal stores; heads are independent, so the first half of the heads, an output
    # half that size (written as usual), must hold the very same bits. Dv = 72: the usual path.
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 32, 1024, 64, generator=g) for _ in range(2))
    v = torch.randn(1, 32, 1024, dv, generator=g)
    with torch.no_grad():
        whole, lse = qkv.attention(q, k, v, mask=_mask(), backend="cpu", return_lse=True)
        half, lse_half = qkv.attention(
            q[:, :16], k[:, :16], v[:, :16], mask=_mask(), backend="cpu", return_lse=True
        )
    assert whole.nbytes >= 8 * MIB > half.nbytes
    assert torch.equal(whole[:, :16], half)
    assert torch.equal(lse[:, :16], lse_half)
