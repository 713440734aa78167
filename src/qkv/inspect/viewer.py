"""A self-contained HTML viewer of an `AttentionMap`: one file, data embedded, no network.

Pick a layer and a head (or the mean of a layer's heads); hover or click a word to see where it
looks as links whose width and opacity follow the weight, with its ten strongest weights listed;
an overview shows every head's matrix, and clicking one selects it. Long inputs draw only each
word's top-k links (5 by default above 40 words) so the page stays responsive.

Weights are embedded as 16-bit fixed point (weight · 65535, base64): error ≤ 8·10⁻⁶, well below
the three decimals shown, and a 128-word map of a 6-layer, 12-head model stays ~3 MB.
"""

from __future__ import annotations

import base64
import json
from importlib import resources
from pathlib import Path

import torch

from .attend import AttentionMap

PLACEHOLDER = "/*QKV_DATA*/"


def viewer_html(amap: AttentionMap) -> str:
    """The viewer page for `amap` as one HTML string."""
    q = (amap.weights.clamp(0, 1) * 65535).round().to(torch.int32).flatten()
    little_endian = torch.stack([q & 0xFF, q >> 8], dim=1).flatten().to(torch.uint8)
    data = {
        "text": amap.text,
        "model": amap.model,
        "words": amap.words,
        "layers": amap.layers,
        "heads": amap.heads,
        "weights_u16": base64.b64encode(bytes(little_endian.tolist())).decode(),
    }
    template = resources.files("qkv.inspect").joinpath("viewer.html").read_text(encoding="utf-8")
    # "</" cannot appear inside a <script> block; JSON allows the escaped form "<\/".
    return template.replace(PLACEHOLDER, json.dumps(data).replace("</", "<\\/"))


def write_viewer(amap: AttentionMap, path: str | Path) -> Path:
    """Write the viewer page to `path` and return it."""
    path = Path(path)
    path.write_text(viewer_html(amap), encoding="utf-8")
    return path
