"""A self-contained HTML viewer of an `AttentionMap`: one file, data embedded, no network.

Pick a layer and a head (or the mean of a layer's heads, or the attention rollout through that
layer: where information has ended up after it) and one of three views: *links*, where hovering
or clicking a word shows where it looks as links whose width and opacity follow the weight;
*heatmap*, the whole matrix (rows: the looking word, columns: the word looked at) on one canvas,
a cell's weight read out under the pointer; *all heads*, every head of the layer drawn at once
in its own colour (bertviz's head view), with a chip per head that hides or shows it. The
chosen word's ten strongest weights are listed, and an overview shows every head's matrix and
each layer's rollout; clicking one selects it. The page can open on a question: a word already
selected, at a chosen layer and head (`qkv attend --word it` and the demo open it on the head
they answer with); layers, heads and words are numbered from 0, as `qkv attend` prints them.
Long inputs draw only each word's top-k links (5
by default above 40 words) and thin out the heatmap's labels, so the page stays responsive.

Weights are embedded as 16-bit fixed point (weight · 65535, base64): error ≤ 8·10⁻⁶, well below
the three decimals shown, and a 128-word map of a 6-layer, 12-head model stays ~3 MB.
"""

from __future__ import annotations

import base64
import json
from importlib import resources
from pathlib import Path
from typing import Protocol

import torch

from .specific import WordMap


class AttentionMap(WordMap, Protocol):
    """What the viewer reads of a `qkv.inspect.AttentionMap` (not imported: the map's notebook
    display imports this module): what `specific` reads, and more. Read-only, as the frozen
    map's fields are."""

    @property
    def model(self) -> str: ...

    @property
    def layers(self) -> int: ...

    def check(self, layer: int | None = None, head: int | None = None) -> None: ...

    def position(self, word: str | int) -> int: ...

    def note(self, lang: str = "en") -> str: ...


PLACEHOLDER = "/*QKV_DATA*/"


def _u16(t: torch.Tensor) -> str:
    """Weights in [0, 1] as little-endian 16-bit fixed point (· 65535), base64."""
    q = (t.clamp(0, 1) * 65535).round().to(torch.int32).flatten()
    little_endian = torch.stack([q & 0xFF, q >> 8], dim=1).flatten().to(torch.uint8)
    return base64.b64encode(bytes(little_endian.tolist())).decode()


def opening(
    amap: AttentionMap,
    word: str | int | None = None,
    layer: int | None = None,
    head: int | None = None,
) -> dict[str, int | None]:
    """Where the page opens: the selected word's position (None: no word), the layer and the
    head, all from 0 (layer 0 and head 0 when not given). `word` is a word of the text (as
    `AttentionMap.index` finds it) or a position."""
    amap.check(layer, head)
    i = None if word is None else amap.position(word)
    return {"word": i, "layer": layer or 0, "head": head or 0}


def viewer_html(
    amap: AttentionMap,
    lang: str = "en",
    word: str | int | None = None,
    layer: int | None = None,
    head: int | None = None,
) -> str:
    """The viewer page for `amap` as one HTML string: weights `(L, H, W, W)` and the attention
    rollout through each layer `(L, W, W)` embedded; its words in English (`en`) or Chinese
    (`zh`), switchable on the page. It opens on `word` selected (a word or its position; none
    by default) at `layer` and `head` (0 and 0 by default), see `opening`."""
    if lang not in ("en", "zh"):
        raise ValueError(f"lang must be en or zh, got {lang!r}")
    data = {
        "text": amap.text,
        "model": amap.model,
        "words": amap.words,
        "layers": amap.layers,
        "heads": amap.heads,
        "weights_u16": _u16(amap.weights),
        "rollout_u16": _u16(amap.rollout()),
        "note": {"en": amap.note("en"), "zh": amap.note("zh")},
        "lang": lang,
        "open": opening(amap, word, layer, head),
    }
    template = resources.files("qkv.inspect").joinpath("viewer.html").read_text(encoding="utf-8")
    return template.replace(PLACEHOLDER, script_json(data))


def script_json(data: object) -> str:
    """`data` as JSON that no string in it can break out of a `<script>` block with.

    Inside a script element the HTML parser still looks for `</script`, and `<!--` followed by
    `<script` switches it to a state where the real `</script>` no longer ends the block (the
    page then stays blank). Every `<`, `>` and `&` is therefore written as its JSON escape
    (`\\u003c`...), which JavaScript reads back as the same character (json.dumps escapes every
    non-ASCII one, U+2028 included). JSON has these characters only inside strings, so the
    escapes never change the data."""
    text = json.dumps(data)  # ensure_ascii: every other non-ASCII character is escaped already
    for ch, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
        text = text.replace(ch, escape)
    return text


def write_viewer(
    amap: AttentionMap,
    path: str | Path,
    lang: str = "en",
    word: str | int | None = None,
    layer: int | None = None,
    head: int | None = None,
) -> Path:
    """Write the viewer page to `path` and return it (opening on `word`, `layer`, `head`: see
    `viewer_html`)."""
    path = Path(path)
    path.write_text(viewer_html(amap, lang, word, layer, head), encoding="utf-8")
    return path
