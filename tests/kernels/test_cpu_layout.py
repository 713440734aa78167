"""The block layout the compiled kernel reads (`qkv.kernels.cpu.layout`): the same tile kinds as
`schedule.tile_kinds`, bits equal to the dense mask, a transposed list of the same tiles, and a
build that works a band of rows at a time."""

from __future__ import annotations

import pytest
import torch

from qkv import masks
from qkv.kernels.cpu import layout as lay
from qkv.kernels.schedule import tile_kinds
from qkv.masks import EMPTY, FULL, PARTIAL
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


def _plan(mask, causal, nq=200, nk=200):
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=nq, Nk=nk, D=8)
    return make_plan(q, k, v, mask=mask, causal=causal)


def _kinds(L: lay.CpuLayout) -> torch.Tensor:
    """(nqb, nkb) tile kinds read back from the forward CSR."""
    nqb, nkb = L.row_ptr.numel() - 1, L.col_ptr.numel() - 1
    kind = torch.full((nqb, nkb), EMPTY, dtype=torch.int8)
    rows = torch.repeat_interleave(torch.arange(nqb), L.row_ptr.diff())
    kind[rows, L.col_idx.long()] = torch.where(L.code == lay.TILE_FULL, FULL, PARTIAL).to(
        torch.int8
    )
    return kind


def _dense(L: lay.CpuLayout, bm: int, hm: int) -> torch.Tensor:
    """(bm, hm, Nq, Nk) allowed pairs read back from the layout."""
    nq, nk, bq = L.q_len, L.kv_len, L.block_q
    nqb = L.row_ptr.numel() - 1
    out = torch.zeros(bm, hm, nqb * bq, (L.col_ptr.numel() - 1) * 64, dtype=torch.bool)
    shifts = torch.arange(64)
    for i in range(nqb):
        for e in range(int(L.row_ptr[i]), int(L.row_ptr[i + 1])):
            j, code = int(L.col_idx[e]), int(L.code[e])
            tile = out[:, :, i * bq : (i + 1) * bq, j * 64 : (j + 1) * 64]
            if code == lay.TILE_FULL:
                tile[:] = True
            else:
                tile[:] = ((L.bits[code].unsqueeze(-1) >> shifts) & 1).bool()
    return out[:, :, :nq, :nk]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bq", [16, 64])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_kinds_and_bits_match_the_mask(name, bq, causal):
    plan = _plan(PATTERNS[name], causal)
    L = lay.build_layout(plan, bq)
    assert torch.equal(_kinds(L), tile_kinds(plan, bq, 64))
    bm, hm = L.bits.shape[1:3] if L.bits.numel() else (1, 1)
    want = torch.ones(bm, hm, 200, 200, dtype=torch.bool)
    if causal:
        want &= torch.ones(200, 200, dtype=torch.bool).tril()
    if plan.mask_rule is not None:
        want &= plan.mask_rule.dense4(200, 200)
    # FULL tiles are whole for every (b, h); the allowed pairs read back are exactly the mask's
    assert torch.equal(_dense(L, bm, hm), want.expand(bm, hm, 200, 200))


def test_a_bool_mask_tensor_and_nq_ne_nk():
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(2, 1, 90, 150, generator=g) > 0.5
    mask[:, :, :, 64:128] = True  # a column of FULL tiles
    mask[:, :, 10] = False
    plan = _plan(mask, True, nq=90, nk=150)
    L = lay.build_layout(plan, 16)
    assert torch.equal(_kinds(L), tile_kinds(plan, 16, 64))
    assert L.bits.shape[1:] == (2, 1, 16)
    want = mask[:, :, :, :] & torch.ones(90, 150, dtype=torch.bool).tril(150 - 90)
    assert torch.equal(_dense(L, 2, 1), want)


def test_the_transposed_list_holds_the_same_tiles_by_column():
    plan = _plan(PATTERNS["longformer"], True)
    L = lay.build_layout(plan, 16)
    rows = torch.repeat_interleave(torch.arange(L.row_ptr.numel() - 1), L.row_ptr.diff())
    by_row = sorted(zip(rows.tolist(), L.col_idx.tolist(), L.code.tolist(), strict=True))
    cols = torch.repeat_interleave(torch.arange(L.col_ptr.numel() - 1), L.col_ptr.diff())
    by_col = list(zip(L.row_idx.tolist(), cols.tolist(), L.code_t.tolist(), strict=True))
    assert sorted(by_col) == by_row
    assert by_col == sorted(by_col, key=lambda t: (t[1], t[0]))  # column by column, top down


@pytest.mark.parametrize("name", ["longformer", "custom", "per-head"])
def test_bands_give_the_same_layout(monkeypatch, name):
    plan = _plan(PATTERNS[name], True)
    whole = lay.build_layout(plan, 16)
    monkeypatch.setattr(lay, "_BAND_TILES", 7)  # a few tile rows per band
    monkeypatch.setattr(lay, "_BAND_ELEMENTS", 5000)  # a few tiles per bits chunk
    banded = lay.build_layout(plan, 16)
    for field in ("row_ptr", "col_idx", "code", "col_ptr", "row_idx", "code_t", "bits"):
        assert torch.equal(getattr(whole, field), getattr(banded, field)), field


def test_a_long_sliding_window_is_built_band_by_band(monkeypatch):
    # N = 262144: 4096 × 4096 tiles, of which ~0.3% are kept. Every band classifies at most
    # _BAND_TILES tiles, and what is kept is O(kept tiles).
    n = 262144
    plan = make_plan(
        torch.empty(1, 1, n, 8, device="meta"),
        torch.empty(1, 1, n, 8, device="meta"),
        torch.empty(1, 1, n, 8, device="meta"),
        mask=masks.sliding_window(256),
    )
    seen = []
    real = lay._band_kinds

    def spy(plan, r0, r1, bq, dims):
        kind = real(plan, r0, r1, bq, dims)
        seen.append(kind.numel())
        return kind

    monkeypatch.setattr(lay, "_band_kinds", spy)
    L = lay.build_layout(plan, 64)
    assert max(seen) <= lay._BAND_TILES and len(seen) > 1
    # query tile i keeps key tiles i−4 … i+4, the outer two partial (clipped at the ends)
    nt = n // 64
    kept = sum(min(nt - 1, i + 4) - max(0, i - 4) + 1 for i in range(nt))
    partial = sum((i - 4 >= 0) + (i + 4 < nt) for i in range(nt))
    assert (L.kept_tiles, L.partial_tiles) == (kept, partial)
    assert L.bits.shape == (partial, 1, 1, 64) and L.col_idx.numel() == kept


def test_unmasked_layouts_are_cached_by_shape():
    a = lay.build_layout(_plan(None, True), 64)
    b = lay.build_layout(_plan(None, True), 64)
    c = lay.build_layout(_plan(None, False), 64)
    assert a is b and a is not c
    assert c.partial_tiles == 0 and c.kept_tiles == 4 * 4
