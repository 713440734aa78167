"""What the compiled kernel reads of the block layout (`qkv.kernels.cpu.tile_encoding`): the
tiles of `qkv.layout.layout_for`, bits equal to the dense mask, a transposed list of the same tiles,
O(kept tiles) memory, and qkv's cache."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest
import torch

from qkv import masks
from qkv.cache import CACHE
from qkv.kernels.cpu import tile_encoding as lay
from qkv.layout import EMPTY, FULL, PARTIAL, block_layout, layout_for, segment_tiles, tile_plan
from qkv.plan import make_plan

from ..helpers import make_qkv

PATTERNS = {
    "none": None,
    "window": masks.sliding_window(20),
    "longformer": masks.sliding_window(9) | masks.global_tokens([0, 77]),
    "bigbird": masks.bigbird(window=1, n_global=1, n_random=2, block=16, seed=3),
    "document": masks.document([40, 100, 60]),
    "padding": masks.padding([200, 70]),
    "custom": masks.Mask(lambda b, h, q, kv: (q - kv) % 7 == 0, "every seventh"),
    "per-head": masks.from_tensor(
        torch.rand(4, 200, 200, generator=torch.Generator().manual_seed(1)) > 0.97
    ),
}


def _pairs(mask, causal, nq=200, nk=200):
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=nq, Nk=nk, D=8)
    return make_plan(q, k, v, mask=mask, causal=causal).pairs


def _kinds(L: lay.CpuLayout) -> torch.Tensor:
    """(nqb, nkb) tile kinds read back from the forward CSR."""
    nqb, nkb = L.row_ptr.numel() - 1, L.col_ptr.numel() - 1
    kind = torch.full((nqb, nkb), EMPTY, dtype=torch.int8)
    rows = torch.repeat_interleave(torch.arange(nqb), L.row_ptr.diff())
    kind[rows, L.col_idx.long()] = torch.where(L.code == lay.TILE_FULL, FULL, PARTIAL).to(
        torch.int8
    )
    return kind


def _starts(L: lay.CpuLayout) -> tuple[list[int], list[int]]:
    """Tile origins (+ the end) of a layout, uniform or cut at segments."""
    if L.q_starts is not None:
        return L.q_starts.tolist(), L.k_starts.tolist()
    nqb, nkb = L.row_ptr.numel() - 1, L.col_ptr.numel() - 1
    return [min(i * L.block_q, L.q_len) for i in range(nqb + 1)], [
        min(j * 64, L.kv_len) for j in range(nkb + 1)
    ]


def _dense(L: lay.CpuLayout, bm: int, hm: int) -> torch.Tensor:
    """(bm, hm, Nq, Nk) allowed pairs read back from the layout (a pair covered twice fails)."""
    nq, nk = L.q_len, L.kv_len
    qs, ks = _starts(L)
    out = torch.zeros(bm, hm, nq, nk, dtype=torch.bool)
    seen = torch.zeros(nq, nk, dtype=torch.int)
    shifts = torch.arange(64)
    for i in range(len(qs) - 1):
        for e in range(int(L.row_ptr[i]), int(L.row_ptr[i + 1])):
            j, code = int(L.col_idx[e]), int(L.code[e])
            r0, r1, c0, c1 = qs[i], qs[i + 1], ks[j], ks[j + 1]
            assert r1 - r0 <= L.block_q and c1 - c0 <= 64
            seen[r0:r1, c0:c1] += 1
            if code == lay.TILE_FULL:
                out[:, :, r0:r1, c0:c1] = True
            else:
                bits = ((L.bits[code].unsqueeze(-1) >> shifts) & 1).bool()
                out[:, :, r0:r1, c0:c1] = bits[:, :, : r1 - r0, : c1 - c0]
    assert not bool((seen > 1).any())
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bq", [16, 64])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_kinds_and_bits_match_the_mask(name, bq, causal):
    pairs = _pairs(PATTERNS[name], causal)
    L = lay.kernel_layout(pairs, bq)
    uniform = layout_for(pairs, bq, 64)
    if L.q_starts is None:
        assert torch.equal(_kinds(L), uniform.kind)
    else:  # cut at the segments of a packed-sequence mask: never more tiles than the grid
        assert PATTERNS[name].segments(200, 200) is not None
        assert L.kept_tiles <= uniform.nnz
    bm, hm = L.bits.shape[1:3] if L.bits.numel() else (1, 1)
    want = torch.ones(bm, hm, 200, 200, dtype=torch.bool)
    if causal:
        want &= torch.ones(200, 200, dtype=torch.bool).tril()
    if pairs.rule is not None:
        want &= pairs.rule.dense4(200, 200)
    # FULL tiles are whole for every (b, h); the allowed pairs read back are exactly the mask's
    assert torch.equal(_dense(L, bm, hm), want.expand(bm, hm, 200, 200))


def test_a_bool_mask_tensor_and_nq_ne_nk():
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(2, 1, 90, 150, generator=g) > 0.5
    mask[:, :, :, 64:128] = True  # a column of FULL tiles
    mask[:, :, 10] = False
    pairs = _pairs(mask, True, nq=90, nk=150)
    L = lay.kernel_layout(pairs, 16)
    assert torch.equal(_kinds(L), layout_for(pairs, 16, 64).kind)
    assert L.bits.shape[1:] == (2, 1, 16)
    want = mask[:, :, :, :] & torch.ones(90, 150, dtype=torch.bool).tril(150 - 90)
    assert torch.equal(_dense(L, 2, 1), want)


def test_the_transposed_list_holds_the_same_tiles_by_column():
    pairs = _pairs(PATTERNS["longformer"], True)
    L = lay.kernel_layout(pairs, 16)
    rows = torch.repeat_interleave(torch.arange(L.row_ptr.numel() - 1), L.row_ptr.diff())
    by_row = sorted(zip(rows.tolist(), L.col_idx.tolist(), L.code.tolist(), strict=True))
    cols = torch.repeat_interleave(torch.arange(L.col_ptr.numel() - 1), L.col_ptr.diff())
    by_col = list(zip(L.row_idx.tolist(), cols.tolist(), L.code_t.tolist(), strict=True))
    assert sorted(by_col) == by_row
    assert by_col == sorted(by_col, key=lambda t: (t[1], t[0]))  # column by column, top down


def test_bits_are_evaluated_a_chunk_of_tiles_at_a_time(monkeypatch):
    pairs = _pairs(PATTERNS["custom"], True)
    whole = lay.encode(pairs, layout_for(pairs, 16, 64))
    monkeypatch.setattr(lay, "BITS_CHUNK", 5000)  # a few tiles per chunk
    chunked = lay.encode(pairs, layout_for(pairs, 16, 64))
    for field in ("row_ptr", "col_idx", "code", "col_ptr", "row_idx", "code_t", "bits"):
        assert torch.equal(getattr(whole, field), getattr(chunked, field)), field


MILLION = """
import time, torch
from qkv import masks
from qkv.plan import make_plan
from qkv.kernels.cpu import tile_encoding as lay
from qkv.kernels.cpu import load
if LOAD:  # the compiled kernel's one-pass build; else the tile-by-tile examination
    assert load() is not None

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024

n = 1 << 20
t = torch.empty(1, 1, n, 8, device="meta")
pairs = make_plan(t, t, t, mask=masks.sliding_window(256)).pairs
before, start = hwm(), time.perf_counter()
L = lay.kernel_layout(pairs, 64)
print(time.perf_counter() - start, hwm() - before, L.kept_tiles, L.partial_tiles,
      tuple(L.bits.shape))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("one_pass", [False, True])
def test_a_million_token_sliding_window_builds_in_seconds_and_o_kept_tiles_memory(one_pass):
    if one_pass:
        _needs_kernel()
    # N = 1,048,576: 16384 × 16384 tiles, of which ~0.05% are kept. A fresh process, so its
    # peak RSS (VmHWM) is this build's: the 64 rows × 8 bytes of bits of each PARTIAL tile
    # (16 MiB here) and O(kept tiles) around it, never O(tiles²) (that would be 256 MiB a byte).
    res = subprocess.run(
        [sys.executable, "-c", f"LOAD = {one_pass}\n" + textwrap.dedent(MILLION)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    seconds, grew, kept, partial, bits = res.stdout.split(maxsplit=4)
    nt = (1 << 20) // 64
    # query tile i keeps key tiles i−4 … i+4, the outer two partial (clipped at the ends)
    assert int(kept) == sum(min(nt - 1, i + 4) - max(0, i - 4) + 1 for i in range(nt))
    assert int(partial) == sum((i - 4 >= 0) + (i + 4 < nt) for i in range(nt))
    assert bits.strip() == f"({partial}, 1, 1, 64)"
    assert float(seconds) < 30
    assert int(grew) < 64 * 2**20


def test_layouts_live_in_qkvs_cache():
    CACHE.clear()
    a = lay.kernel_layout(_pairs(None, True), 64)
    b = lay.kernel_layout(_pairs(None, True), 64)
    c = lay.kernel_layout(_pairs(None, False), 64)
    assert a is b and a is not c
    assert c.partial_tiles == 0 and c.kept_tiles == 4 * 4
    rule = masks.sliding_window(20)
    d = lay.kernel_layout(_pairs(rule, True), 64)
    assert lay.kernel_layout(_pairs(rule, True), 64) is d
    entries = CACHE.info().entries
    del rule, d  # the Mask's entries go with it
    gc.collect()
    assert CACHE.info().entries < entries


def test_a_held_layout_is_read_as_it_is():
    rule = masks.sliding_window(20) | masks.global_tokens([0, 77])
    held = block_layout(rule, 200, causal=True, block_q=32)
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=200, Nk=200, D=8)
    pairs = make_plan(q, k, v, mask=held, causal=True).pairs
    assert layout_for(pairs, 32, 64) is held
    L = lay.kernel_layout(pairs, 32)
    assert torch.equal(L.row_ptr, held.row_ptr) and torch.equal(L.col_idx.long(), held.col)
    assert torch.equal(
        _dense(L, 1, 1)[0, 0],
        rule.dense4(200, 200)[0, 0] & torch.ones(200, 200, dtype=torch.bool).tril(),
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "cu_q, cu_k",
    [
        ([0, 12, 76, 140, 188, 252], None),  # vision windows: 12, then 64s off the 64-grid
        ([0, 0, 70, 70, 200], [0, 5, 75, 75, 205]),  # empty segments, Nq != Nk per segment
        ([0, 130, 131, 200], None),  # segments longer than a tile, and one of a single token
    ],
)
def test_packed_segments_cut_the_tiles_at_their_boundaries(cu_q, cu_k, causal):
    cu_q = torch.tensor(cu_q)
    cu_k = cu_q if cu_k is None else torch.tensor(cu_k)
    rule = masks.varlen(cu_q, cu_k, causal=causal)
    nq, nk = int(cu_q[-1]), int(cu_k[-1])
    q, k, v = make_qkv(B=1, H=2, Nq=nq, Nk=nk, D=8)
    pairs = make_plan(q, k, v, mask=rule).pairs
    uniform = layout_for(pairs, 32, 64).nnz
    cut = segment_tiles(nq, nk, 32, 64, rule=rule)
    assert cut is not None
    L = lay.encode_segments(pairs, cut, 32)
    assert L.q_starts is not None and L.k_starts is not None
    qs, ks = _starts(L)
    assert set(cu_q.tolist()) <= set(qs) and set(cu_k.tolist()) <= set(ks)
    assert torch.equal(_dense(L, 1, 1)[0, 0], rule.dense4(nq, nk)[0, 0])
    if not causal:  # bidirectional segments: every kept tile is FULL, no bits at all
        assert L.partial_tiles == 0
    # the kernel takes the cut where it keeps no more tiles than the grid
    assert (tile_plan(pairs, 32, 64).cut(uniform) is not None) == (L.kept_tiles <= uniform)
    assert (lay.kernel_layout(pairs, 32).q_starts is not None) == (L.kept_tiles <= uniform)


def test_many_tiny_segments_keep_the_uniform_grid():
    # segments of 3 tokens: cutting at each would make 67 tiles where the grid needs 4
    cu = torch.arange(0, 201, 3)
    cu[-1] = 200
    q, k, v = make_qkv(B=1, H=2, Nq=200, Nk=200, D=8)
    pairs = make_plan(q, k, v, mask=masks.varlen(cu, cu)).pairs
    L = lay.kernel_layout(pairs, 64)
    assert L.q_starts is None
    assert torch.equal(_dense(L, 1, 1)[0, 0], masks.varlen(cu, cu).dense4(200, 200)[0, 0])


def _key_mask(shape, p: float, seed: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < p


@pytest.mark.parametrize(
    "nq,nk,shape,causal",
    [
        (1, 300, (2, 1, 1, 300), False),  # a decoding step with padding
        (1, 300, (1, 1, 1, 300), True),
        (5, 130, (2, 4, 1, 130), True),  # per head, several queries, causal
        (70, 200, (2, 1, 1, 200), True),  # prefill rows: causal tiles on the diagonal
        (200, 70, (1, 4, 1, 70), True),  # Nq > Nk: the first rows see nothing
        (64, 256, (1, 1, 1, 1), False),  # broadcast over keys too
    ],
)
@pytest.mark.parametrize("p", [0.0, 0.8, 1.0])
@pytest.mark.parametrize("block_q", [16, 64])
def test_a_key_mask_layout_equals_the_general_encoding(nq, nk, shape, causal, p, block_q):
    """The key-padding fast path gives the arrays `encode(layout_for(...))` gives."""
    _needs_kernel()
    mask = _key_mask(shape, p, seed=nq + nk)
    if shape[-1] == 1:
        mask = torch.ones(shape, dtype=torch.bool)
    pairs = _pairs(mask, causal, nq, nk)
    fast = _one_pass(pairs, block_q)
    assert fast is not None
    slow = lay.encode(pairs, layout_for(pairs, block_q, lay.BLOCK_K))
    for name in ("row_ptr", "col_idx", "code", "col_ptr", "row_idx", "code_t", "bits"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


EXACT = {
    "window": masks.sliding_window(20),
    "causal window": masks.causal() & masks.sliding_window(70, 0),
    "longformer": masks.sliding_window(9) | masks.global_tokens([0, 1, 2, 77, 150]),
    "documents": masks.document([40, 100, 0, 60]),
    "prefix LM": masks.prefix_lm(70),
    "window within documents": masks.sliding_window(30) & masks.document([120, 80]),
    "globals or causal": masks.global_tokens([5, 6, 199]) | masks.causal(),
}


@pytest.mark.parametrize("nq", [200, 130, 1])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_q", [16, 64])
@pytest.mark.parametrize("name", list(EXACT))
def test_a_rule_with_exact_ranges_builds_in_one_pass(name, block_q, causal, nq):
    """A rule's exact key ranges give its allowed pairs in one pass over the tiles: exactly the
    mask's pairs, in no more tiles than the general encoding keeps, FULL wherever it is FULL."""
    _needs_kernel()
    rule = EXACT[name]
    assert rule.exact_ranges
    pairs = _pairs(rule, causal, nq, 200)
    fast = _one_pass(pairs, block_q)
    assert fast is not None and fast.bits.shape[1:3] == (1, 1)
    want = rule.dense4(nq, 200)[0, 0]
    if causal:
        want = want & torch.ones(nq, 200, dtype=torch.bool).tril(200 - nq)
    assert torch.equal(_dense(fast, 1, 1)[0, 0], want)
    slow = _kinds(lay.encode(pairs, layout_for(pairs, block_q, lay.BLOCK_K)))
    mine = _kinds(fast)
    assert not bool(((mine != EMPTY) & (slow == EMPTY)).any())
    assert bool((mine[slow == FULL] == FULL).all())


def _one_pass(pairs, block_q: int) -> lay.CpuLayout | None:
    """The arrays the kernel's one pass builds from the rows' key intervals."""
    plan = tile_plan(pairs, block_q, lay.BLOCK_K)
    assert plan.intervals
    return lay.encode_intervals(plan)


def _needs_kernel():
    from qkv.kernels import cpu

    if cpu.status() is not None:
        pytest.skip(f"the compiled kernel builds the interval layout: {cpu.status()}")


def test_the_one_pass_build_declines_other_masks():
    pairs = _pairs(_key_mask((2, 1, 200, 200), 0.8, 0), False)  # varies by row
    assert not tile_plan(pairs, 64, 64).intervals
    for rule in (
        masks.dilated_window(4, 2),  # not an interval
        masks.padding([200, 70]),  # differs by batch element
        ~masks.sliding_window(20),
        masks.sliding_window(20) & masks.Mask(lambda b, h, q, kv: kv % 2 == 0),
        masks.strided(8),
    ):
        assert not rule.exact_ranges
        assert not tile_plan(_pairs(rule, False), 64, 64).intervals


def test_a_decoding_loop_keeps_one_entry_shared_by_the_layers_of_a_step():
    _needs_kernel()
    CACHE.clear()
    before = CACHE.info()
    rule = masks.sliding_window(100) | masks.global_tokens([0])
    for nk in range(300, 340):
        for _layer in range(3):
            a = lay.kernel_layout(_pairs(rule, True, nq=1, nk=nk), 64)
            b = lay.kernel_layout(_pairs(None, True, nq=1, nk=nk), 64)
            assert (a.kv_len, b.kv_len) == (nk, nk)
    info = CACHE.info()
    assert info.entries == 2
    assert (info.misses - before.misses, info.hits - before.hits) == (2 * 40, 2 * 40 * 2)
    want = rule.dense4(1, 339)[0, 0]
    assert torch.equal(_dense(a, 1, 1)[0, 0], want)
