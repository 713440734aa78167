"""`qkv.masks` is a package whose names are the ones masks.py had, and whose pickles name the
paths masks.py's did (`qkv.masks.<name>`): a mask pickled before the split loads, and one pickled
now loads in the versions before it."""

from __future__ import annotations

import pickle
import pickletools

import torch

import qkv
from qkv import masks

from .test_pickle import MASKS

# The public names of masks.py before it became a package (its incidental imports aside).
PUBLIC = [
    "EMPTY", "FULL", "PARTIAL", "BlockLayout", "Bounds", "ChosenBlocks", "Mask", "Ranges", "Rule",
    "Segments", "bigbird", "causal", "chosen_blocks", "dilated_window", "document", "fixed",
    "from_tensor", "global_tokens", "key_mask", "padding", "prefix_lm", "sliding_window",
    "strided", "varlen",
]  # fmt: skip

# Every global a pickle of masks.py's masks named (what a pickle written then asks for).
PICKLED_BEFORE = {
    "Mask", "_rebuild_chosen", "_FnRule", "_Not", "_Combined", "_Shifted", "_Causal", "_Window",
    "_Dilated", "_Global", "_Strided", "_Fixed", "_KeysBelow", "_Document", "_Varlen",
    "_Padding", "_KeyMask", "_BigBird", "_FromTensor",
}  # fmt: skip

# `(causal() & ~sliding_window(3, 1)) | strided(4)`, pickled (protocol 2) by masks.py at 2700ef3.
WRITTEN_BY_MASKS_PY = bytes.fromhex(
    "800263716b762e6d61736b730a4d61736b0a7100298171017d71022858050000005f72756c657103635f5f62"
    "75696c74696e5f5f0a676574617474720a710463716b762e6d61736b730a5f436f6d62696e65640a71052981"
    "71067d71072858010000006171086800298171097d710a286803680468052981710b7d710c28680868002981"
    "710d7d710e286803680463716b762e6d61736b730a5f43617573616c0a710f29817110580400000072756c65"
    "711186711252711358070000005f626f756e64737114680468105806000000626f756e647371158671165271"
    "1758070000005f72616e676573711868046810580600000072616e676573711986711a52711b58040000006e"
    "616d65711c580800000063617573616c2829711d58050000006261746368711e4e5805000000686561647371"
    "1f4e58060000005f636865636b71204e58090000005f7365676d656e747371214e580c00000065786163745f"
    "72616e676573712288756258010000006371236800298171247d7125286803680463716b762e6d61736b730a"
    "5f4e6f740a7126298171277d712868086800298171297d712a286803680463716b762e6d61736b730a5f5769"
    "6e646f770a712b2981712c7d712d2858040000006c656674712e4b0358050000007269676874712f4b017562"
    "681186713052713168146804682c681586713252713368186804682c6819867134527135681c581400000073"
    "6c6964696e675f77696e646f7728332c2031297136681e4e681f4e68204e68214e6822887562736268118671"
    "37527138681468046827681586713952713a68184e681c58150000007e736c6964696e675f77696e646f7728"
    "332c203129713b681e4e681f4e68204e68214e682289756258020000006f70713c580100000026713d756268"
    "1186713e52713f68146804680b681586714052714168186804680b6819867142527143681c58200000006361"
    "7573616c28292026207e736c6964696e675f77696e646f7728332c2031297144681e4e681f4e68206804680b"
    "5805000000636865636b714586714652714768214e682289756268236800298171487d714928680368046371"
    "6b762e6d61736b730a5f537472696465640a714a2981714b7d714c5806000000737472696465714d4b047362"
    "681186714e52714f68146804684b681586715052715168184e681c580a000000737472696465642834297152"
    "681e4e681f4e68204e68214e6822897562683c58010000007c71537562681186715452715568146804680668"
    "158671565271576818680468066819867158527159681c582f0000002863617573616c28292026207e736c69"
    "64696e675f77696e646f7728332c20312929207c2073747269646564283429715a681e4e681f4e6820680468"
    "06684586715b52715c68214e68228975622e"
)


def test_the_package_has_the_names_masks_py_had():
    assert sorted(masks.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert not isinstance(getattr(masks, name), type(masks)), name  # not a module
    assert masks.bigbird(1, 0, 0, 4).name.startswith("bigbird(")
    assert masks.padding([2]).batch == 1
    assert qkv.masks.causal is masks.causal


def _globals(data: bytes) -> set[tuple[str, str]]:
    """(module, name) of every GLOBAL a protocol-2 pickle names."""
    return {
        tuple(arg.split(" ", 1)) for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"
    }


def test_a_pickle_written_by_masks_py_loads():
    assert {m for m, _ in _globals(WRITTEN_BY_MASKS_PY) if m.startswith("qkv")} == {"qkv.masks"}
    old = pickle.loads(WRITTEN_BY_MASKS_PY)
    new = (masks.causal() & ~masks.sliding_window(3, 1)) | masks.strided(4)
    assert type(old) is masks.Mask and repr(old) == repr(new)
    assert torch.equal(old.to_dense(17, 17), new.to_dense(17, 17))
    assert torch.equal(old.tile_kinds(17, 17, 4, 4), new.tile_kinds(17, 17, 4, 4))
    assert old.has_bounds and old.key_ranges(torch.tensor([4]), torch.tensor([7]), 17) is None


def only_even_keys(b, h, q, kv):
    return kv % 2 == 0


def _every_kind_of_mask():
    index = torch.tensor([[[[0, 1], [1, -1]], [[0, -1], [0, 1]]]])
    chosen = masks.chosen_blocks(index, 4, heads=4, q_len=8, kv_len=8)
    return [
        *(make() for make in MASKS.values()),
        masks.Mask(only_even_keys, "even keys"),
        chosen,
        chosen.group(0, 1),
    ]


def test_pickles_name_only_the_paths_masks_py_had():
    every = _every_kind_of_mask()
    named = {(m, n) for m, n in _globals(pickle.dumps(every, protocol=2)) if m.startswith("qkv")}
    assert {m for m, _ in named} == {"qkv.masks"}
    assert {n for _, n in named} == PICKLED_BEFORE
    copies = pickle.loads(pickle.dumps(every, protocol=pickle.HIGHEST_PROTOCOL))
    assert [repr(c) for c in copies] == [repr(m) for m in every]
