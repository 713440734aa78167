"""The HTML viewer: self-contained, and its embedded data decodes to the map's weights."""

from __future__ import annotations

import base64
import json
import re

import torch

from qkv.inspect.attend import AttentionMap
from qkv.inspect.viewer import viewer_html, write_viewer


def _map(n=6):
    w = torch.randn(2, 3, n, n, generator=torch.Generator().manual_seed(0)).softmax(-1)
    return AttentionMap.from_weights(w, [f"w{i}" for i in range(n)], text="a </script> test")


def _embedded(page: str) -> dict:
    match = re.search(r"const DATA = (\{.*?\});\n", page)
    assert match, "the data is embedded in the page"
    return json.loads(match.group(1))


def test_the_page_needs_no_network(tmp_path):
    page = write_viewer(_map(), tmp_path / "v.html").read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # nothing fetched
    assert "<link" not in page and "@import" not in page and "fetch(" not in page
    assert page.count("</script>") == 1  # the text's "</script>" cannot end the script early


def test_embedded_weights_decode_to_the_map():
    amap = _map()
    data = _embedded(viewer_html(amap))
    assert data["words"] == amap.words and (data["layers"], data["heads"]) == (2, 3)
    raw = base64.b64decode(data["weights_u16"])
    q = torch.tensor(list(raw), dtype=torch.int32).view(-1, 2)
    decoded = (q[:, 0] + 256 * q[:, 1]).double().view(amap.weights.shape) / 65535
    # 16-bit fixed point: the error is at most half a step
    assert (decoded - amap.weights).abs().max().item() <= 0.5 / 65535 + 1e-12


HOSTILE = "a <!--<script> b </script> c & d \u2028 > e"


def test_no_user_string_reaches_the_page_as_markup():
    amap = AttentionMap.from_weights(
        torch.eye(3).view(1, 1, 3, 3), ["<!--<script>", "</script>", "&amp;"], text=HOSTILE
    )
    page = viewer_html(amap)
    start = page.index("const DATA = ") + len("const DATA = ")
    embedded = page[start : page.index(";\n", start)]
    assert not set("<>&") & set(embedded)  # nothing the HTML parser could read as a tag
    data = json.loads(embedded)
    assert data["text"] == HOSTILE and data["words"] == amap.words  # the text itself is intact


def test_the_opening_state_is_embedded_and_checked():
    """The page opens on a word (by its text or position), a layer and a head, all counted
    from 0; what is not in the map is refused before any page is written."""
    import pytest

    from qkv.inspect.attend import AttendError
    from qkv.inspect.viewer import opening

    amap = _map()
    assert _embedded(viewer_html(amap))["open"] == {"word": None, "layer": 0, "head": 0}
    data = _embedded(viewer_html(amap, "zh", word="W3", layer=1, head=2))
    assert data["open"] == {"word": 3, "layer": 1, "head": 2} and data["lang"] == "zh"
    assert opening(amap, 5, 1) == {"word": 5, "layer": 1, "head": 0}
    for bad in ({"word": "cat"}, {"word": 6}, {"word": -1}, {"layer": 2}, {"head": 3}):
        with pytest.raises(AttendError):
            opening(amap, **bad)


def test_the_docs_copy_of_the_viewer_is_the_template_of_today():
    """docs/labs/attend/viewer.html (written by the command in docs/labs.md) is today's
    template around its data: a template change must regenerate it."""
    from pathlib import Path

    from qkv.inspect.viewer import PLACEHOLDER

    root = Path(__file__).resolve().parents[2]
    template = (root / "src" / "qkv" / "inspect" / "viewer.html").read_text(encoding="utf-8")
    before, after = template.split(PLACEHOLDER)
    copy = (root / "docs" / "labs" / "attend" / "viewer.html").read_text(encoding="utf-8")
    assert copy.startswith(before) and copy.endswith(after), (
        "regenerate it: qkv attend --token it --target cat --out docs/labs/attend"
    )
    assert _embedded(copy)["words"], "with its data"
