"""qkv.distributed in one process (no process group: rank 0 of 1), the work balance of the
layouts, argument checks, and that `import qkv` leaves qkv.distributed alone."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import qkv
import qkv.distributed as qd
from qkv import masks
from qkv import nn as qnn
from qkv.distributed._blocks import block_pairs, schedule
from qkv.distributed.sharding import segments
from qkv.kernels import TiledBackend
from qkv.pairs import Pairs

from ..helpers import make_qkv


def test_import_qkv_does_not_import_distributed():
    code = "import sys, qkv; assert 'qkv.distributed' not in sys.modules, 'eager import'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("layout", qd.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_one_process_is_plain_attention(layout, causal):
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=24, D=8, dtype=torch.float64, requires_grad=True)
    window = masks.sliding_window(4)
    want, want_lse = qkv.attention(q, k, v, causal=causal, mask=window, return_lse=True)
    (want.sum() + want_lse.sum()).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    got, lse = qd.ring_attention(
        q,
        k,
        v,
        causal=causal,
        mask=window,
        layout=layout,
        return_lse=True,
        backend=TiledBackend(8, 8),
    )
    (got.sum() + lse.sum()).backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    for a, b in zip((q.grad, k.grad, v.grad), grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    uly = qd.ulysses_attention(q, k, v, causal=causal, mask=window, layout=layout)
    torch.testing.assert_close(uly, want, rtol=0, atol=1e-12)


def test_fully_masked_rows_are_zero_with_lse_minus_inf():
    q, k, v = make_qkv(B=1, H=2, Nq=16, D=4, dtype=torch.float64)
    nobody = masks.Mask(lambda b, h, qq, kv: (qq < 8) & (kv <= qq), name="first half causal")
    out, lse = qd.ring_attention(q, k, v, mask=nobody, return_lse=True)
    assert torch.all(out[:, :, 8:] == 0) and torch.all(torch.isneginf(lse[:, :, 8:]))
    want = qkv.attention(q, k, v, mask=nobody)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_balances_causal_work(world):
    zig = qd.tiles_per_rank(4096, world, "zigzag", causal=True)
    contig = qd.tiles_per_rank(4096, world, "contiguous", causal=True)
    assert sum(zig) == sum(contig) == 64 * 65 // 2  # the causal half of 64×64 tiles
    assert max(zig) <= 1.1 * min(zig)
    assert max(contig) >= 2 * min(contig)


def test_masks_skip_blocks():
    window = masks.sliding_window(64, 0)
    tiles = qd.tiles_per_rank(4096, 4, "contiguous", mask=window)
    dense = qd.tiles_per_rank(4096, 4, "contiguous")
    assert sum(tiles) < sum(dense) / 10


PER_HEAD = torch.rand(3, 24, 24, generator=torch.Generator().manual_seed(1)) < 0.5


@pytest.mark.parametrize("layout", qd.LAYOUTS)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    ("causal", "mask", "heads"),
    [
        (True, None, (0, 1)),
        (False, masks.sliding_window(5, 2), (0, 1)),
        (True, masks.document([7, 13, 4]), (0, 1)),
        (False, masks.from_tensor(PER_HEAD), (1, 2)),  # heads 1 and 2 of 3
    ],
)
def test_block_pairs_cut_the_global_pairs(layout, world, causal, mask, heads):
    """Every scheduled block's pairs, for a slice of the heads, are the global pairs at the
    block's positions; a block left out holds none, and only a rule's bounds skip one that
    causality does not hide."""
    n, (h0, nh) = 24, heads
    whole = Pairs(n, n, causal=causal, rule=mask)
    dense = whole.dense()
    for qr in range(world):
        for kr in range(world):
            kept, _ = schedule(qr, kr, world, n // world, layout, whole)
            for blk in kept:
                want = dense[:, h0 : h0 + nh, blk.q.start : blk.q.stop, blk.k.start : blk.k.stop]
                got = blk.heads(whole, h0, nh).dense()  # None: every pair may attend
                got = torch.ones_like(want) if got is None else got.expand_as(want)
                assert torch.equal(got, want), (qr, kr, blk)
            starts = {(b.q.start, b.k.start) for b in kept}
            for qs in segments(qr, world, n // world, layout):
                for ks in segments(kr, world, n // world, layout):
                    if (qs.start, ks.start) in starts:
                        continue
                    assert not dense[..., qs.start : qs.stop, ks.start : ks.stop].any()
                    assert block_pairs(whole, qs, ks) is None or mask.has_bounds


def test_shard_and_positions_in_one_process():
    x = torch.arange(24.0).view(2, 12)
    assert torch.equal(qd.shard(x, 1, "zigzag"), x)
    assert torch.equal(qd.unshard(x, -1, "zigzag"), x)
    assert qd.positions(6, "zigzag").tolist() == list(range(6))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: qd.shard(torch.zeros(5, 2), 0, "zigzag"), ValueError, "divisible by 2"),
        (lambda: qd.shard(torch.zeros(4, 2), 2), ValueError, "out of range"),
        (lambda: qd.shard(torch.zeros(4, 2), 0, "spiral"), ValueError, "layout must be one of"),
        (lambda: qd.shard([1, 2], 0), TypeError, "must be a torch.Tensor"),
        (lambda: qd.unshard(torch.zeros(3, 2), 0, "zigzag"), ValueError, "odd"),
    ],
)
def test_shard_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _qkv():
    return make_qkv(B=1, H=4, Hkv=2, Nq=10, D=4, dtype=torch.float64)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mask": torch.ones(10, 10, dtype=torch.bool)}, TypeError, "structured"),
        ({"layout": "spiral"}, ValueError, "layout must be one of"),
        ({"head_chunks": 3}, ValueError, "must divide the key/value heads"),
        ({"head_chunks": 0}, TypeError, "positive int"),
        ({"mask": masks.document([3, 3])}, ValueError, "sum to 6"),
        ({"causal": 1}, TypeError, "causal must be a bool"),
        ({"scale": -1.0}, ValueError, "scale must be"),
        ({"backend": "tiled"}, TypeError, "TiledBackend"),
    ],
)
def test_ring_argument_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        qd.ring_attention(*_qkv(), **kwargs)


def test_ring_shape_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="same sequence"):
        qd.ring_attention(q, k[:, :, :8], v[:, :, :8])
    with pytest.raises(ValueError, match="must be even"):
        qd.ring_attention(q[:, :, :9], k[:, :, :9], v[:, :, :9], layout="zigzag")
    with pytest.raises(TypeError, match="ProcessGroup"):
        qd.ring_attention(q, k, v, group="world")


def test_sequence_parallel_module_in_one_process():
    torch.manual_seed(0)
    plain = qnn.MultiHeadAttention(16, 4, 2, rope=True).double()
    sharded = qnn.MultiHeadAttention(16, 4, 2, rope=True, sequence_parallel=qd.SequenceParallel())
    sharded = sharded.double()
    sharded.load_state_dict(plain.state_dict())
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    torch.testing.assert_close(sharded(x, causal=True), plain(x, causal=True))
    torch.testing.assert_close(sharded(x[0]), plain(x[0]))
    with pytest.raises(NotImplementedError, match="KVCache"):
        sharded(x, cache=qnn.KVCache(2, 16, 2, 4, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="cross-attention"):
        sharded(x, context=x)
    with pytest.raises(TypeError, match="structured"):
        sharded(x, mask=torch.ones(12, 12, dtype=torch.bool))
    with pytest.raises(TypeError, match="sequence_parallel must be"):
        qnn.MultiHeadAttention(16, 4, sequence_parallel="yes")
    with pytest.raises(ValueError, match="method must be"):
        qd.SequenceParallel(method="tree")
    with pytest.raises(ValueError, match="holds no"):
        qd.parallelize(torch.nn.Linear(2, 2))
    block = qd.parallelize(qnn.TransformerBlock(16, 4), qd.SequenceParallel(method="ulysses"))
    assert block.attn.sequence_parallel.method == "ulysses"
    assert qd.parallelize(block, None).attn.sequence_parallel is None
