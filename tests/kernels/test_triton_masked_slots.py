"""NaN/±inf in masked-out key/value slots never reach a row of the triton backend, without the
`finite_inputs` promise (Triton's interpreter, CPU tensors; see test_triton.py).

Garbage in k/v at pairs a row may not see (causal, sliding window, key padding, −inf bias
columns, dropped weights, storage past Nk) must leave that row's output, lse and gradients
exactly as if the slot held a finite value. Where a row does attend to a non-finite value the
reference's semantics hold: that output entry is NaN/±inf (`qkv.numerics.weighted_values`), and
the gradients flow through the finite part. Judged against the fp64 golden under the error-ratio
rule (tests/helpers.py), which also asserts finiteness wherever the golden is finite.
"""

from __future__ import annotations

import pytest
import torch

from qkv import masks

from ..helpers import assert_error_ratio, make_qkv
from .test_triton import SMALL, _run  # sets TRITON_INTERPRET=1 first (or skips, saying why)

# numpy, inside the interpreter, warns of the NaN/inf products the kernels are meant to discard
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

NAN, INF = float("nan"), float("inf")


def _dirty(t: torch.Tensor, slots: dict, extra: int = 5) -> torch.Tensor:
    """A copy of `t` (B, H, N, D) with `slots` {(b, n) or (b, n, d): value} written in, viewed
    out of a buffer that holds NaN in `extra` rows past N (the kernels must never read them)."""
    B, H, N, D = t.shape
    buf = torch.full((B, H, N + extra, D), NAN, dtype=t.dtype)
    buf[:, :, :N] = t
    for where, value in slots.items():
        b, n, *d = where
        buf[b, :, n, d[0] if d else slice(None)] = value
    return buf[:, :, :N]


def _golden_pair(q, k, v, **kw):
    """(reference in the inputs' dtype, fp64 golden) of `_run`."""
    ref = _run("reference", q, k, v, **kw)
    gold = _run("reference", *(t.double() for t in (q, k, v)), **kw)
    return ref, gold


def _same_nonfinite(got, gold, what):
    """NaN, +inf and −inf exactly where the golden has them (the finite entries are judged by
    the error-ratio rule)."""
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(test(got), test(gold)), f"{what}: {test.__name__} pattern differs"


def _judge(got, ref, gold, outputs=("out", "lse"), grads=("dq", "dk", "dv")):
    for i, name in enumerate(("out", "lse")):
        if name in outputs:
            _same_nonfinite(got[i], gold[i], name)
            assert_error_ratio(got[i], ref[i], gold[i], what=name)
    for i, name in enumerate(("dq", "dk", "dv")):
        if name in grads:
            assert_error_ratio(got[2][i], ref[2][i], gold[2][i], factor=3.0, what=name)


def _bias_with_dead_columns(H, Nq, Nk, dead):
    g = torch.Generator().manual_seed(6)
    bias = torch.randn(1, H, Nq, Nk, generator=g)
    bias[..., dead] = -INF
    return bias


# Slots that no row may see, in tiles that also hold kept pairs (tiles of 16): the result must
# be that of the same request with finite values there, output, lse and gradients.
HIDDEN = {
    # key padding as a bool (B, 1, 1, Nk) tensor: batch 0 keeps 37 keys (tile 32…47 partial),
    # batch 1 keeps 29 (tile 16…31 partial, tile 32…47 empty)
    "padding-bool": dict(
        shape=dict(B=2, H=2, Nq=33, Nk=45, D=16),
        mask=lambda B, H, Nq, Nk: (
            torch.arange(Nk).view(1, 1, 1, Nk) < torch.tensor([37, 29]).view(2, 1, 1, 1)
        ),
        slots={(0, 37): NAN, (0, 40): INF, (0, 44, 3): -INF, (1, 29): NAN, (1, 31, 0): INF},
    ),
    # a float mask with −inf columns: every tile is FULL (no mask arithmetic), the bias alone
    # excludes the pairs
    "bias-dead-columns": dict(
        shape=dict(B=1, H=2, Nq=29, Nk=40, D=16),
        mask=lambda B, H, Nq, Nk: _bias_with_dead_columns(H, Nq, Nk, [3, 20, 21, 39]),
        slots={(0, 3): NAN, (0, 20, 5): INF, (0, 21): -INF, (0, 39, 1): NAN},
    ),
    # a sliding window with Nq < Nk, bottom-right aligned: row i sees keys i + 26 … i + 34, so
    # keys 0…25 are before every row's window (tile 16…31 is partial, tile 0…15 empty)
    "sliding-window": dict(
        shape=dict(B=1, H=2, Nq=30, Nk=60, D=16),
        mask=lambda B, H, Nq, Nk: masks.sliding_window(4),
        slots={(0, 3): NAN, (0, 17): -INF, (0, 20): NAN, (0, 25, 2): INF},
    ),
}


@pytest.mark.parametrize("case", list(HIDDEN))
def test_garbage_in_slots_no_row_sees_changes_nothing(case):
    spec = HIDDEN[case]
    q, k, v = make_qkv(**spec["shape"])
    B, H, Nq, Nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    kw = dict(mask=spec["mask"](B, H, Nq, Nk), finite_inputs=False)
    kd, vd = _dirty(k, spec["slots"]), _dirty(v, spec["slots"])
    assert not torch.isfinite(kd).all() and not torch.isfinite(vd).all()
    got = _run(SMALL, q, kd, vd, **kw)
    # the golden of the same request with the slots' finite values: the reference's own
    # autograd lets 0 · NaN of a masked k slot into dQ, so it cannot judge dirty k directly
    ref, gold = _golden_pair(q, k, v, **kw)
    _judge(got, ref, gold)
    assert all(torch.isfinite(t).all() for t in (got[0], *got[2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_causal_value_garbage_reaches_only_the_rows_that_attend_to_it(dtype):
    # Values on the diagonal tiles: rows before a slot never see it (finite, as with a finite
    # value there); rows at and after it get NaN/±inf in that entry, as the reference does
    # (+inf and −inf in one column give NaN); gradients flow through the finite part.
    q, k, v = make_qkv(B=1, H=2, Nq=40, Nk=40, D=16, dtype=dtype)
    vd = _dirty(v, {(0, 5, 0): NAN, (0, 21, 2): INF, (0, 22, 2): -INF, (0, 23, 3): INF})
    kw = dict(causal=True, finite_inputs=False)
    got = _run(SMALL, q, k, vd, **kw)
    ref, gold = _golden_pair(q, k, vd, **kw)
    assert torch.isfinite(gold[0][0, :, :5]).all() and torch.isnan(gold[0][0, :, 22:, 2]).all()
    assert torch.isposinf(gold[0][0, :, 23:, 3]).all()
    _judge(got, ref, gold)


def test_causal_key_garbage_reaches_only_the_rows_that_attend_to_it():
    # A NaN key makes the rows that see it NaN (out, lse); the rows before it, and their dQ,
    # are those of a finite key there. (dK/dV sum over rows, NaN ones included: no check.)
    q, k, v = make_qkv(B=1, H=2, Nq=24, Nk=40, D=16)  # causal offset 16: row i sees j ≤ i + 16
    kd = _dirty(k, {(0, 30, 4): NAN, (0, 33): INF})
    kw = dict(causal=True, finite_inputs=False)
    got = _run(SMALL, q, kd, v, **kw)
    ref, gold = _golden_pair(q, kd, v, **kw)
    _judge(got, ref, gold, grads=())
    assert torch.isnan(gold[0][0, :, 14:]).all() and torch.isfinite(gold[0][0, :, :14]).all()
    ref_c, gold_c = _golden_pair(q, k, v, **kw)
    dq, dq_ref, dq_gold = (
        got[2][0][..., :14, :],
        ref_c[2][0][..., :14, :],
        gold_c[2][0][..., :14, :],
    )
    assert_error_ratio(dq, dq_ref, dq_gold, factor=3.0, what="dq of rows before the key")


def test_dropped_weights_do_not_let_value_garbage_through():
    # No mask: a dropped weight is exactly 0, so a NaN value reaches only the rows that keep
    # it (the reference: `weighted_values`); out and gradients, same keep-mask bit for bit.
    q, k, v = make_qkv(B=1, H=2, Nq=29, Nk=37, D=16)
    vd = _dirty(v, {(0, 11): NAN, (0, 30, 1): -INF})
    kw = dict(dropout_p=0.5, finite_inputs=False)
    torch.manual_seed(3)
    got = _run(SMALL, q, k, vd, **kw)
    torch.manual_seed(3)
    ref = _run("reference", q, k, vd, **kw)
    torch.manual_seed(3)
    gold = _run("reference", q.double(), k.double(), vd.double(), **kw)
    rows_ok = torch.isfinite(gold[0]).all(-1)
    assert rows_ok.any() and not rows_ok.all()  # some rows dropped the slot, some kept it
    _judge(got, ref, gold)
