"""The checks every spawned rank runs, grouped so that one spawn per world size covers them.

Each check runs on every rank, does all its collectives first and asserts last (so a failed
assertion on one rank cannot leave the others waiting in a collective), and compares this
rank's shard of outputs and gradients with single-process `qkv.attention` over the whole
sequence: fp64 to 1e-10, lower precisions under the error rule of docs/design.md.
"""

from __future__ import annotations

import copy
import datetime
import time
import traceback

import torch
import torch.distributed as dist

import qkv
import qkv.distributed as qd
from qkv import masks
from qkv import nn as qnn
from qkv.kernels import TiledBackend

from ..helpers import assert_error_ratio

SMALL_TILES = TiledBackend(8, 8, max_rows=16, max_cols=16)  # many tiles per block, some skipped


def _inputs(B, H, Hkv, N, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, N, Dv, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, N, Dv, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, H, N, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v)], dout, dlse


def _single(q, k, v, dout, dlse, dtype, **kw):
    """Outputs and gradients of single-process reference attention in `dtype`."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = qkv.attention(*leaves, backend="reference", return_lse=True, **kw)
    loss = (out * dout.to(dtype)).sum() + (lse * dlse.to(lse.dtype)).sum()
    loss.backward()
    return [out.detach(), lse.detach()] + [t.grad for t in leaves]


NAMES = ("out", "lse", "dq", "dk", "dv")


def compare(
    fn,
    *,
    dtype=torch.float64,
    layout="contiguous",
    causal=False,
    mask=None,
    B=2,
    H=4,
    Hkv=2,
    N=48,
    D=8,
    Dv=6,
    seed=0,
    **kw,
):
    """Run `fn` (ring_attention / ulysses_attention) on this rank's shards, backward with lse in
    the loss, and return the failures (empty if every tensor agrees)."""
    (q, k, v), dout, dlse = _inputs(B, H, Hkv, N, D, Dv, dtype, seed)
    local = [qd.shard(t, 2, layout).requires_grad_() for t in (q, k, v)]
    out, lse = fn(*local, causal=causal, mask=mask, layout=layout, return_lse=True, **kw)
    loss = (out * qd.shard(dout, 2, layout).to(dtype)).sum()
    loss = loss + (lse * qd.shard(dlse, 2, layout).to(lse.dtype)).sum()
    loss.backward()
    got = [out, lse] + [t.grad for t in local]
    gold = _single(q, k, v, dout, dlse, torch.float64, causal=causal, mask=mask)
    same = (
        gold
        if dtype == torch.float64
        else _single(q, k, v, dout, dlse, dtype, causal=causal, mask=mask)
    )
    failures = []
    for name, a, g, s in zip(NAMES, got, gold, same, strict=True):
        g, s = qd.shard(g, 2, layout), qd.shard(s, 2, layout)
        try:
            assert a.dtype == s.dtype, (name, a.dtype, s.dtype)
            assert_error_ratio(a, s, g, factor=2.0 if name in ("out", "lse") else 3.0, what=name)
        except AssertionError as e:
            failures.append(f"{layout} causal={causal} mask={mask!r} {dtype}: {e}")
    return failures


# --------------------------------------------------------------------------- the checks


def check_ring_fp64(rank, world):
    fails = []
    for layout in qd.LAYOUTS:
        for causal in (False, True):
            chunks = 1 if layout == "contiguous" else "auto"  # one pass / one per kv head
            fails += compare(
                qd.ring_attention,
                layout=layout,
                causal=causal,
                backend=SMALL_TILES,
                head_chunks=chunks,
            )
    assert not fails, fails


def check_ring_masks_fp64(rank, world):
    qd.reset_counters()
    fails = []
    window = masks.sliding_window(5, 2)
    for layout in qd.LAYOUTS:
        fails += compare(qd.ring_attention, layout=layout, causal=True, mask=window)
        fails += compare(qd.ring_attention, layout=layout, mask=window, backend=SMALL_TILES)
    skipped_window = qd.counters().blocks_skipped
    docs = masks.document([10, 20, 3, 15])
    fails += compare(qd.ring_attention, layout="zigzag", mask=docs, backend=SMALL_TILES)
    fails += compare(qd.ring_attention, layout="contiguous", causal=True, mask=docs)
    assert not fails, fails
    if world == 4:  # a window of 8 positions cannot reach most pairs of 6- or 12-token shards
        assert skipped_window > 0, qd.counters()


def check_ring_fp32_and_bf16(rank, world):
    fails = compare(qd.ring_attention, dtype=torch.float32, layout="zigzag", causal=True)
    fails += compare(qd.ring_attention, dtype=torch.float32, layout="contiguous", N=64, D=16)
    fails += compare(qd.ring_attention, dtype=torch.bfloat16, layout="zigzag", causal=True)
    assert not fails, fails


def check_ring_head_chunks_and_layouts(rank, world):
    fails = compare(qd.ring_attention, layout="zigzag", causal=True, head_chunks=3, H=6, Hkv=3)
    fails += compare(qd.ring_attention, layout="contiguous", B=1, H=3, Hkv=1, D=5, Dv=5)
    # (H, N, D) inputs: the caller's layout comes back
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 8 * world, 4, generator=g, dtype=torch.float64) for _ in range(3))
    full = qkv.attention(q, k, v, causal=True)
    out = qd.ring_attention(
        *(qd.shard(t, 1, "zigzag") for t in (q, k, v)), causal=True, layout="zigzag"
    )
    assert not fails, fails
    assert out.shape == (2, 8, 4)
    torch.testing.assert_close(out, qd.shard(full, 1, "zigzag"), rtol=0, atol=1e-12)


def check_ulysses(rank, world):
    fails = []
    for layout in qd.LAYOUTS:
        for causal in (False, True):
            fails += compare(qd.ulysses_attention, layout=layout, causal=causal)
    # GQA with Hkv=2 < P=4: the key/value heads are repeated; a window mask; fp32
    fails += compare(
        qd.ulysses_attention,
        layout="zigzag",
        causal=True,
        H=8,
        Hkv=2,
        mask=masks.sliding_window(6, 0),
    )
    fails += compare(qd.ulysses_attention, dtype=torch.float32, layout="contiguous", H=4, Hkv=4)
    assert not fails, fails


def check_shard_unshard(rank, world):
    x = torch.arange(2 * 4 * world * 3, dtype=torch.float64).view(2, 4 * world, 3)
    results = {}
    for layout in qd.LAYOUTS:
        mine = qd.shard(x, 1, layout)
        results[layout] = (mine, qd.unshard(mine, 1, layout), qd.positions(4, layout))
    # unshard's gradient: each rank uses the whole tensor, so a shard's gradient sums the ranks'
    leaf = qd.shard(x, 1, "zigzag").requires_grad_()
    (qd.unshard(leaf, 1, "zigzag") * (rank + 1)).sum().backward()
    for layout, (mine, back, pos) in results.items():
        assert mine.shape == (2, 4, 3)
        assert torch.equal(back, x), layout
        assert torch.equal(mine, x[:, pos]), layout
    assert qd.positions(4, "zigzag").tolist() == (
        list(range(2 * rank, 2 * rank + 2))
        + list(range(2 * (2 * world - 1 - rank), 2 * (2 * world - 1 - rank) + 2))
    )
    assert torch.equal(leaf.grad, torch.full_like(leaf, world * (world + 1) / 2))


def _block_grads(block, x, rank, world, sharded, layout, mask=None):
    """Output shard and all-reduced parameter gradients of a TransformerBlock on x."""
    g = torch.Generator().manual_seed(7)
    target = torch.randn(x.shape, generator=g, dtype=x.dtype)
    if sharded:
        x, target = qd.shard(x, 1, layout), qd.shard(target, 1, layout)
    x = x.detach().requires_grad_()
    block.zero_grad()
    y = block(x, causal=True, mask=mask)
    ((y - target) ** 2).sum().backward()
    grads = []
    for p in block.parameters():
        gr = p.grad.clone()
        if sharded:
            dist.all_reduce(gr)  # per-rank partial sums → the full gradient (what DDP does)
        grads.append(gr)
    return y.detach(), x.grad, grads


def check_transformer_block(rank, world):
    torch.manual_seed(3)
    block = qnn.TransformerBlock(32, 4, 2, rope=True, norm="rmsnorm", ffn="swiglu").double()
    x = torch.randn(2, 8 * world, 32, dtype=torch.float64)
    ring = qd.parallelize(copy.deepcopy(block), qd.SequenceParallel(layout="zigzag"))
    uly = copy.deepcopy(block)
    uly.attn = qnn.MultiHeadAttention(
        32,
        4,
        2,
        rope=True,
        sequence_parallel=qd.SequenceParallel(layout="contiguous", method="ulysses"),
    ).double()
    uly.attn.load_state_dict(block.attn.state_dict())
    block.attn.backend = "reference"  # the golden: the formula, in one process
    window = masks.sliding_window(5, 0)
    runs = [
        (_block_grads(ring, x, rank, world, True, "zigzag"), None, "zigzag"),
        (_block_grads(uly, x, rank, world, True, "contiguous", mask=window), window, "contiguous"),
    ]
    for (y, dx, grads), mask, layout in runs:
        fy, fdx, fgrads = _block_grads(block, x, rank, world, False, None, mask=mask)
        torch.testing.assert_close(y, qd.shard(fy, 1, layout), rtol=0, atol=1e-10)
        torch.testing.assert_close(dx, qd.shard(fdx, 1, layout), rtol=0, atol=1e-10)
        for a, b in zip(grads, fgrads, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


def _raises(fn, *args, **kwargs):
    """(exception type name, message) that fn raised, or None."""
    try:
        fn(*args, **kwargs)
    except (TypeError, ValueError, NotImplementedError) as e:
        return type(e).__name__, str(e)
    return None


def check_failures(rank, world):
    """Bad input on one rank: every rank raises the same error, and the group still works."""
    (q, k, v), _, _ = _inputs(1, 4, 2, 8 * world, 8, 8, torch.float64)
    ql, kl, vl = (qd.shard(t, 2) for t in (q, k, v))
    longer = [torch.randn(1, h, ql.shape[2] + 2, 8, dtype=torch.float64) for h in (4, 2, 2)]
    cases = {
        # rank 1 holds a longer shard (a sequence that did not divide evenly)
        "shape": lambda: qd.ring_attention(*(longer if rank == 1 else (ql, kl, vl))),
        "dtype": lambda: qd.ring_attention(*(t.float() if rank == 1 else t for t in (ql, kl, vl))),
        "causal": lambda: qd.ulysses_attention(ql, kl, vl, causal=rank == 0),
        # only rank 0's arguments are invalid (H=4 is not a multiple of Hkv=3)
        "local": lambda: qd.ring_attention(
            ql, kl[:, :1].expand(1, 3, -1, -1) if rank == 0 else kl, vl
        ),
        "odd zigzag": lambda: qd.ring_attention(
            ql[:, :, 1:], kl[:, :, 1:], vl[:, :, 1:], layout="zigzag"
        ),
        "heads % P": lambda: qd.ulysses_attention(ql[:, :3], kl[:, :1], vl[:, :1]),
        "grad": lambda: qd.ring_attention(ql.requires_grad_(rank == 0), kl, vl),
        "dense mask": lambda: qd.ring_attention(ql, kl, vl, mask=torch.ones(8, 8, dtype=bool)),
        "unshard": lambda: qd.unshard(torch.zeros(rank + 1, 3), 0),
        "shard": lambda: qd.shard(torch.zeros(4 * world + 1, 2), 0),
    }
    got = {}
    for name, case in cases.items():
        ql.requires_grad_(False)
        got[name] = _raises(case)
    everyone = [None] * world
    dist.all_gather_object(everyone, got)
    out = qd.ring_attention(ql, kl, vl)  # the group survived all that
    expected_type = {"local": "ValueError", "dense mask": "TypeError"}
    for name in cases:
        res = got[name]
        assert res is not None, f"{name}: nothing raised"
        assert res[0] == expected_type.get(name, "ValueError"), (name, res)
        assert all(e[name] == res for e in everyone), (name, [e[name] for e in everyone])
    assert "disagree on q.shape" in got["shape"][1] and "divisible" in got["shape"][1]
    assert "q/k/v dtype" in got["dtype"][1]
    assert got["local"][1].startswith(f"ring_attention: rank 0 of {world}:")
    assert "must be even" in got["odd zigzag"][1]
    assert "divisible by the number of ranks" in got["heads % P"][1]
    assert "needs gradients" in got["grad"][1]
    assert "must be divisible by" in got["shard"][1]
    torch.testing.assert_close(out, qd.shard(qkv.attention(q, k, v), 2), rtol=0, atol=1e-12)


def check_dead_peer(rank, world):
    """A peer that never joins the call: the others fail within the group's timeout."""
    short = dist.new_group(timeout=datetime.timedelta(seconds=3))
    x = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    if rank == world - 1:
        time.sleep(6)  # stays alive but never calls: the others must not wait past 3 s
        return
    start = time.monotonic()
    try:
        qd.ring_attention(x, x, x, group=short)
    except Exception as e:  # gloo raises RuntimeError / DistBackendError on a timeout
        elapsed = time.monotonic() - start
        assert elapsed < 15, elapsed
        text = str(e).lower()
        assert "timed out" in text or "timeout" in text or "connection" in text, text[:300]
        return
    raise AssertionError("ring_attention returned although a peer never called it")


CHECKS = {
    "ring_fp64": (check_ring_fp64, (2, 4)),
    "ring_masks_fp64": (check_ring_masks_fp64, (2, 4)),
    "ring_fp32_and_bf16": (check_ring_fp32_and_bf16, (2, 4)),
    "ring_head_chunks_and_layouts": (check_ring_head_chunks_and_layouts, (2,)),
    "ulysses": (check_ulysses, (2, 4)),
    "shard_unshard": (check_shard_unshard, (2, 4)),
    "transformer_block": (check_transformer_block, (2, 4)),
    "failures": (check_failures, (2, 4)),
    "dead_peer": (check_dead_peer, (2,)),  # last: it leaves the peers out of step
}


def worker(rank, world):
    results = {}
    for name, (check, worlds) in CHECKS.items():
        if world not in worlds:
            continue
        try:
            check(rank, world)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    return results
