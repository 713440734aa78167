"""What `qkv.inspect`'s objects show in a Jupyter notebook (`_repr_html_`): a matrix as a
heatmap table with its values, and a self-contained page inline in an iframe (no network).

Only strings are built here; nothing is imported from IPython, so these work (and are tested)
without Jupyter."""

from __future__ import annotations

import html

import torch

MAX_CELLS = 32  # rows or columns shown of a matrix; more are cut with a note


def _colour(v: float, lim: float, prob: bool) -> str:
    """A cell's background: white → blue for probabilities (0..1); blue for positive and red for
    negative values otherwise, deeper as |v| nears the matrix's largest `lim`."""
    if v == float("-inf"):
        return "#ddd"
    x = max(0.0, min(1.0, v)) if prob else max(-1.0, min(1.0, v / lim if lim > 0 else 0.0))
    fade = round(150 * abs(x))
    if x >= 0:
        return f"rgb({255 - fade},{255 - round(0.7 * fade)},255)"
    return f"rgb(255,{255 - fade},{255 - fade})"


def _cell(v: float) -> str:
    return "−∞" if v == float("-inf") else f"{v:.2f}"


def matrix_table(t: torch.Tensor, title: str, meaning: str = "", prob: bool = False) -> str:
    """A 2-D tensor as an HTML heatmap table: its title, shape and meaning above, each value in
    its cell (at most `MAX_CELLS` rows and columns)."""
    rows, cols = t.shape
    shown = t[:MAX_CELLS, :MAX_CELLS].double()
    finite = shown[torch.isfinite(shown)]
    lim = finite.abs().max().item() if finite.numel() else 1.0
    body = []
    for row in shown.tolist():
        cells = "".join(
            f'<td style="background:{_colour(v, lim, prob)};padding:2px 5px">{_cell(v)}</td>'
            for v in row
        )
        body.append(f"<tr>{cells}</tr>")
    cut = rows > MAX_CELLS or cols > MAX_CELLS
    note = f" (first {MAX_CELLS} rows and columns)" if cut else ""
    head = f"<b>{html.escape(title)}</b> <code>{tuple(t.shape)}</code>{note}"
    if meaning:
        head += f" — {html.escape(meaning)}"
    return (
        f"<div style='margin:6px 0'>{head}<div style='overflow-x:auto'>"
        f"<table style='border-collapse:collapse;font:12px monospace;text-align:right'>"
        f"{''.join(body)}</table></div></div>"
    )


def iframe(page: str, height: int = 720) -> str:
    """A whole self-contained HTML page inline, in an iframe that scrolls within the cell."""
    return (
        f'<iframe srcdoc="{html.escape(page, quote=True)}" style="width:100%;height:{height}px;'
        'border:1px solid #ddd" sandbox="allow-scripts"></iframe>'
    )
