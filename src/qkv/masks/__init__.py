"""Mask algebra: which (query, key) pairs may attend, as small named rules.

A `Mask` is a vectorised rule `(b, h, q, kv) -> bool` over broadcastable int64 index tensors.
Compose masks with `&`, `|` and `~`::

    longformer = masks.sliding_window(256) | masks.global_tokens([0, 1, 2])
    qkv.attention(q, k, v, mask=longformer)

Positions: `q` is a query's *position in key coordinates*. When Nq == Nk it is just the query
index; when Nq < Nk the queries are the last Nq positions of the key sequence (bottom-right
alignment, what KV-cache decoding needs): query row i has position `i + Nk − Nq`. So
`masks.causal()` is exactly `causal=True`.

Each rule may also know, without looking at pairs, which keys a run of queries may reach
(`key_ranges`: intervals of key positions) and how to bound a whole tile (`tile_bounds`:
could any pair be allowed? is every pair?). `qkv.layout` uses both to find the kept tiles
without building the N×N matrix, which is what lets the kernels skip work. Both stay safe
under composition: an uncertain tile is partial and its rule is applied element-wise.

The modules: `mask` (the `Mask` class and its algebra), `patterns` (rules on positions alone:
causal, windows, global tokens, strided, fixed, prefix LM), `packed` (document, varlen),
`padded` (padding, key_mask), `random_blocks` (bigbird), `dense` (from_tensor), `chosen`
(ChosenBlocks) and `checks` (the constructors' argument checks). Import their names from
`qkv.masks`.
"""

from __future__ import annotations

from ..layout import EMPTY as EMPTY  # tile kinds, re-exported for callers of Mask.blocks
from ..layout import FULL as FULL
from ..layout import PARTIAL as PARTIAL
from ..layout import BlockLayout as BlockLayout
from .chosen import ChosenBlocks, _rebuild_chosen, chosen_blocks
from .dense import _FromTensor, from_tensor
from .mask import Bounds, Mask, Ranges, Rule, Segments, _Combined, _FnRule, _Not, _Shifted
from .packed import _Document, _Varlen, document, varlen
from .padded import _KeyMask, _Padding, key_mask, padding
from .patterns import (
    _Causal,
    _Dilated,
    _Fixed,
    _Global,
    _KeysBelow,
    _Strided,
    _Window,
    causal,
    dilated_window,
    fixed,
    global_tokens,
    prefix_lm,
    sliding_window,
    strided,
)
from .random_blocks import _BigBird, bigbird

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BlockLayout",
    "Bounds",
    "ChosenBlocks",
    "Mask",
    "Ranges",
    "Rule",
    "Segments",
    "bigbird",
    "causal",
    "chosen_blocks",
    "dilated_window",
    "document",
    "fixed",
    "from_tensor",
    "global_tokens",
    "key_mask",
    "padding",
    "prefix_lm",
    "sliding_window",
    "strided",
    "varlen",
]

# A pickle names a class or function by its `__module__` and name. Everything a pickled Mask
# names keeps the path it had when this package was one file, `qkv.masks.<name>`, rather than
# the module it is written in: pickles written before the split load, pickles written now load
# in those versions too, and moving a rule between the modules here never breaks one. (The
# private names are bound above for the same reason: unpickling looks them up here.)
_PICKLED = (
    Mask, ChosenBlocks, _rebuild_chosen, _FnRule, _Not, _Combined, _Shifted,
    _Causal, _Window, _Dilated, _Global, _Strided, _Fixed, _KeysBelow,
    _Document, _Varlen, _Padding, _KeyMask, _BigBird, _FromTensor,
)  # fmt: skip
for _named in _PICKLED:
    _named.__module__ = __name__
del _named
