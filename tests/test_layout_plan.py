"""How `qkv.layout` tells a kernel to find a problem's tiles (issue 53): the rows' key
intervals with the causal rule in them (`row_intervals`, `causal_last`), the plan of which
builder applies (`tile_plan`) and the rows of blocks chosen per head (`chosen_tiles`). The
kernels' C++ reads these and decides nothing about causality itself."""

from __future__ import annotations

import pytest
import torch

from qkv import masks
from qkv.layout import block_layout, causal_last, chosen_tiles, row_intervals, tile_plan
from qkv.pairs import Pairs
from qkv.sparse import select_blocks

from .helpers import make_qkv

RULES = {
    "none": None,
    "window": masks.sliding_window(20),
    "longformer": masks.sliding_window(9) | masks.global_tokens([0, 1, 77]),
    "documents": masks.document([40, 100, 0, 60]),
    "prefix LM": masks.prefix_lm(70),
}


def _dense(lo, hi, nq: int, nk: int) -> torch.Tensor:
    """bool (Nq, Nk): the union of each row's intervals (None: from key 0 / to the last)."""
    lo = torch.zeros(1, nq, dtype=torch.long) if lo is None else lo
    hi = torch.full((1, nq), nk - 1, dtype=torch.long) if hi is None else hi
    c = torch.arange(nk)
    return ((c >= lo[..., None]) & (c <= hi[..., None])).any(0)


@pytest.mark.parametrize("nq", [200, 130, 1, 260])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", list(RULES))
def test_row_intervals_are_exactly_the_allowed_pairs_causal_rule_included(name, causal, nq):
    rule, nk = RULES[name], 200
    lo, hi = row_intervals(rule, nq, nk, causal)
    want = torch.ones(nq, nk, dtype=torch.bool) if rule is None else rule.dense4(nq, nk)[0, 0]
    if causal:
        want = want & torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
    assert torch.equal(_dense(lo, hi, nq, nk), want)


def test_the_causal_bound_is_given_only_where_it_hides_keys():
    assert causal_last(5, 9, False) is None
    assert causal_last(1, 9, True) is None  # a decoding step's row sits at the last key
    assert causal_last(3, 9, True).tolist() == [6, 7, 8]
    assert causal_last(4, 2, True).tolist() == [-2, -1, 0, 1]  # Nq > Nk: the first see none
    assert row_intervals(None, 1, 9, True) == (None, None)
    assert row_intervals(masks.dilated_window(4, 2), 9, 9) is None  # not intervals


def _pairs(mask, causal=False, nq=200, nk=200) -> Pairs:
    from qkv.plan import make_plan

    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=nq, Nk=nk, D=8)
    return make_plan(q, k, v, mask=mask, causal=causal).pairs


@pytest.mark.parametrize(
    "mask, intervals, segments",
    [
        (None, True, False),
        (masks.sliding_window(20), True, True),  # a rule alone: its segments are asked for
        (masks.document([40, 160]), True, True),
        (masks.dilated_window(4, 2), False, True),
        (masks.padding([200, 70]), False, True),
        (torch.ones(2, 1, 1, 200, dtype=torch.bool), True, False),  # key padding
        (torch.ones(2, 1, 200, 200, dtype=torch.bool), False, False),  # varies by row
        (block_layout(masks.sliding_window(20), 200), False, False),  # held: read as it is
    ],
)
def test_the_tile_plan_picks_the_builders(mask, intervals, segments):
    plan = tile_plan(_pairs(mask), 64, 64)
    assert (plan.intervals, plan.segments) == (intervals, segments)


def test_a_problem_without_keys_or_queries_has_no_intervals_to_build():
    assert not tile_plan(Pairs(200, 0), 64, 64).intervals
    assert not tile_plan(Pairs(0, 200, causal=True), 64, 64).intervals


def test_the_tile_plan_takes_the_cut_only_where_it_keeps_no_more_tiles():
    cu = torch.tensor([0, 12, 76, 140, 188, 252])  # vision windows off the 64-grid
    plan = tile_plan(_pairs(masks.varlen(cu, cu), nq=252, nk=252), 32, 64)
    cut = plan.cut(10**6)
    assert cut is not None and set(cu.tolist()) <= set(cut.q_starts.tolist())
    assert plan.cut(cut.rows.numel()) is not None
    assert plan.cut(cut.rows.numel() - 1) is None
    assert tile_plan(_pairs(None), 32, 64).cut(10**6) is None


@pytest.mark.parametrize("nq, nk", [(300, 300), (100, 300), (1, 300)])
@pytest.mark.parametrize("choice_causal, flag", [(True, False), (False, True), (False, False)])
def test_chosen_tiles_carry_the_rows_last_keys(nq, nk, choice_causal, flag):
    q, k, _ = make_qkv(B=1, H=2, Nq=nq, Nk=nk, D=8, seed=1)
    pairs = Pairs(nq, nk, causal=flag, rule=select_blocks(q, k, topk=2, causal=choice_causal))
    tiles = chosen_tiles(pairs, 64, 64)
    assert tiles is not None and tiles.block == 64
    want = causal_last(nq, nk, choice_causal or flag)
    assert (tiles.last is None) == (want is None)
    assert want is None or torch.equal(tiles.last, want)
    assert chosen_tiles(pairs, 128, 64) is None  # a block does not hold whole query tiles
