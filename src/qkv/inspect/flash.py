"""FlashAttention as data: the tiled online softmax of one head, step by step.

`flash_steps(q, k, v, tile_q=…, tile_k=…)` runs the `tiled` backend's own step functions
(`qkv.kernels.tiled.steps`: `TileProblem`, `fold_run`, `forward_loop`) on tiles of
`tile_q × tile_k` and keeps what each step saw and left behind: for every query tile, every key
tile in the kernel's order, its status in the real block layout (`"full"`, `"partial"` or
`"skipped"`), the tile of S the softmax sees (scaled and masked), and the query tile's running
max m, denominator l and output after it. For every row::

    m' = max(m, rowmax S_tile)       alpha = exp(m − m')      P = exp(S_tile − m')
    l' = alpha·l + rowsum P          acc' = alpha·acc + P V_tile       O = acc' / l'

Only one tile of S exists at a time; at the end O is exactly softmax(S) V, though the N×N
matrix was never held. With `splits > 1` each query tile's kept key tiles are cut into chunks
folded from scratch, as the decoding kernel's split-KV does, and their partial (m, l, acc)
merged in split order (`m* = max m_s`, `l = Σ l_s·exp(m_s − m*)`, `acc = Σ acc_s·exp(m_s − m*)`,
the CPU kernel's `fwd_merge_splits`).

Meant for small problems a person reads: every tile's numbers are kept (see `MAX_STEPS`).
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import torch

from ..kernels.tiled.steps import TileProblem, Tiling, fold_run, forward_loop
from ..layout import EMPTY, FULL, BlockLayout, Run
from ..masks import Mask
from ..plan import make_plan

MAX_STEPS = 65_536  # tiles a walk may visit (query tiles × key tiles)
MAX_RECORDED = 1 << 24  # numbers a walk may keep (its tiles of S and its running states)
KIND_NAMES = {EMPTY: "empty", 1: "partial", FULL: "full"}


@dataclass(frozen=True)
class FlashStep:
    """One key tile visited by one query tile: what the kernel computed (or skipped) and the
    query tile's running state after it. n = rows of the tile, w = keys of the tile."""

    index: int  # position in the walk, 0-based
    q_tile: int  # query tile (row of the tile grid)
    k_tile: int  # key tile (column of the tile grid)
    rows: tuple[int, int]  # query rows [start, stop)
    cols: tuple[int, int]  # keys [start, stop)
    status: str  # "full" (no mask arithmetic), "partial" (masked pair by pair), "skipped"
    split: int  # the split (chunk of key tiles) this step belongs to; 0 without splits
    scores: torch.Tensor | None  # (n, w) S tile as the softmax sees it (−inf: masked); None
    # when skipped
    m: torch.Tensor  # (n,) running max after the step (−inf: no key seen yet)
    l: torch.Tensor  # (n,) running denominator Σ exp(s − m)
    acc: torch.Tensor  # (n, d_v) running numerator Σ exp(s − m)·v, not normalised
    o: torch.Tensor  # (n, d_v) acc / l: the output so far (0 for a row with l = 0)
    alpha: torch.Tensor | None  # (n,) exp(m_before − m_after), what l and acc were multiplied
    # by; None when skipped or when nothing came before (the first kept tile of its split)


@dataclass(frozen=True)
class SplitPartial:
    """One split of a query tile's kept key tiles, folded from scratch."""

    q_tile: int  # query tile
    split: int  # index of the split, in key order
    k_tiles: tuple[int, ...]  # the kept key tiles it folds (empty: a split with nothing)
    m: torch.Tensor  # (n,) its max (−inf when it folded nothing)
    l: torch.Tensor  # (n,) its denominator
    acc: torch.Tensor  # (n, d_v) its numerator


@dataclass(frozen=True)
class Merged:
    """A query tile's splits merged in split order (float64, as the CPU kernel merges)."""

    q_tile: int  # query tile
    m: torch.Tensor  # (n,) m* = max over splits of m_s
    weights: torch.Tensor  # (splits, n) exp(m_s − m*), 0 for a split that saw nothing
    l: torch.Tensor  # (n,) Σ_s l_s·weight_s, float64
    acc: torch.Tensor  # (n, d_v) Σ_s acc_s·weight_s, float64
    o: torch.Tensor  # (n, d_v) acc / l (0 for a row with l = 0), in the inputs' dtype


@dataclass(frozen=True)
class FlashSteps:
    """The walk of `flash_steps`: its steps, the layout they follow, the result and its cost.

    `_repr_html_` shows it inline in Jupyter."""

    out: torch.Tensor  # (Nq, d_v) final output (with splits: the merge), inputs' dtype
    lse: torch.Tensor  # (Nq,) m + log l (−inf for a row that sees nothing)
    steps: tuple[FlashStep, ...]  # in the kernel's order: query tile by query tile, keys left
    # to right (with splits: split by split), skipped tiles included
    layout: BlockLayout  # the real block layout the tiled kernel reads
    kinds: tuple[tuple[str, ...], ...]  # (query tiles, key tiles) "full" / "partial" / "empty"
    splits: tuple[tuple[SplitPartial, ...], ...]  # per query tile, its splits' partials
    merged: tuple[Merged, ...]  # per query tile, the merge of its splits
    tile_q: int  # query rows per tile
    tile_k: int  # keys per tile
    n_splits: int  # splits per query tile (1: the plain forward)
    scale: float  # multiplies Q Kᵀ (1/√d_k)
    causal: bool  # bottom-right causal
    mask: str  # the mask's name ("" for none)
    products: int  # q·k products computed: the kept tiles' pairs
    allowed: int  # of those, the pairs the mask allows (the rest are masked in partial tiles)
    scores_held: int  # numbers of S held at any moment: one tile
    state_held: int  # numbers of running state held: m, l, acc of a query tile, per split
    not_held: int  # Nq·Nk: the scores never held at once (nor A)

    @property
    def products_saved(self) -> int:
        """q·k products the skipped tiles save."""
        return self.not_held - self.products

    @property
    def shape(self) -> tuple[int, int]:
        """(Nq, Nk)."""
        return self.layout.q_len, self.layout.kv_len

    def _repr_html_(self) -> str:
        return steps_html(self)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype})"
    return f"{type(x).__name__} {x!r}"


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {_describe(value)}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {name}={value}")
    return value


def _check_tensors(q: object, k: object, v: object) -> None:
    for name, t, shape in (("q", q, "(Nq, d_k)"), ("k", k, "(Nk, d_k)"), ("v", v, "(Nk, d_v)")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape {shape}, got {_describe(t)}")
        if t.dim() != 2 or 0 in t.shape:
            raise ValueError(
                f"{name} must have shape {shape} (one head, no size 0), got {tuple(t.shape)}"
            )
        if t.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name} must be float32 or float64, got dtype={t.dtype}")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    assert isinstance(v, torch.Tensor)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype={t.dtype} differs from q.dtype={q.dtype}; cast them")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; move it")
    if k.shape[1] != q.shape[1]:
        raise ValueError(
            f"k's width must equal q's d_k: q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}"
        )
    if v.shape[0] != k.shape[0]:
        raise ValueError(
            f"v must have one row per key: k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
        )


def _check_size(nq: int, nk: int, dv: int, tile_q: int, tile_k: int) -> None:
    nqb, nkb = -(-nq // tile_q), -(-nk // tile_k)
    recorded = nqb * nkb * min(tile_q, nq) * (min(tile_k, nk) + 2 * dv + 3)
    if nqb * nkb > MAX_STEPS or recorded > MAX_RECORDED:
        raise ValueError(
            f"flash_steps keeps every tile's numbers and is meant for small problems: "
            f"Nq={nq}, Nk={nk} with tile_q={tile_q}, tile_k={tile_k} makes {nqb * nkb:,} steps "
            f"(at most {MAX_STEPS:,}) keeping ~{recorded:,} numbers (at most {MAX_RECORDED:,}); "
            f"use larger tiles, or qkv.attention(q, k, v, backend='tiled') to just compute it"
        )


def _chunks(tiles: list[int], splits: int) -> list[list[int]]:
    """`tiles` cut into `splits` contiguous chunks whose sizes differ by at most one (the
    first ones larger); chunks are empty when there are fewer tiles than splits."""
    base, extra = divmod(len(tiles), splits)
    out, at = [], 0
    for s in range(splits):
        size = base + (1 if s < extra else 0)
        out.append(tiles[at : at + size])
        at += size
    return out


def _scores(
    T: TileProblem, q_t: torch.Tensor, k: torch.Tensor, i0: int, i1: int, run: Run
) -> torch.Tensor:
    """The tile of S `fold_run` computes for `run`, formed by the same operations (so bit for
    bit the same): Q_i K_jᵀ · scale, then `TileProblem.scores` (mask on partial tiles)."""
    j0, j1 = run.start, run.stop
    s = (q_t @ k[:, :, j0:j1].transpose(-1, -2)).mul_(T.plan.scale)
    s5, _ = T.scores(s, i0, i1, j0, j1, [(i0, i1, a, b) for a, b in run.partial])
    return s5.reshape(i1 - i0, j1 - j0).clone()


@dataclass
class _State:
    """The running (m, l, acc) of one split of a query tile, as `fold_run` leaves it."""

    m: torch.Tensor | None = None  # (1, 1, n, 1)
    l: torch.Tensor | None = None  # (1, 1, n, 1)
    acc: torch.Tensor | None = None  # (1, 1, n, d_v)

    def snapshot(self, n: int, dv: int, like: torch.Tensor):
        """(m (n,), l (n,), acc (n, d_v), o (n, d_v)) as copies; nothing yet: −inf, 0, 0, 0."""
        if self.m is None or self.l is None or self.acc is None:  # set together
            zero = torch.zeros(n, dtype=like.dtype, device=like.device)
            m = torch.full_like(zero, -torch.inf)
            acc = torch.zeros(n, dv, dtype=like.dtype, device=like.device)
            return m, zero, acc, acc.clone()
        m, l, acc = self.m.reshape(n).clone(), self.l.reshape(n).clone(), self.acc.reshape(n, dv)
        o = acc / torch.where(l == 0, 1.0, l).unsqueeze(-1)
        return m, l, acc.clone(), o


def _merge(q_tile: int, parts: list[SplitPartial], dtype: torch.dtype) -> Merged:
    """Merge the splits in split order, in float64 (`fwd_merge_splits`)."""
    ms = torch.stack([p.m for p in parts]).double()  # (S, n)
    m_star = ms.max(0).values
    seen = ~torch.isneginf(ms) & ~torch.isneginf(m_star)
    weights = torch.where(seen, torch.exp(torch.where(seen, ms - m_star, 0.0)), 0.0)
    l = torch.zeros_like(m_star)
    acc = torch.zeros_like(parts[0].acc, dtype=torch.float64)
    for p, w in zip(parts, weights, strict=True):
        l = l + p.l.double() * w
        acc = acc + p.acc.double() * w.unsqueeze(-1)
    o = (acc / torch.where(l == 0, 1.0, l).unsqueeze(-1)).to(dtype)
    return Merged(q_tile, m_star.to(parts[0].m.dtype), weights, l, acc, o)


def flash_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    tile_q: int,
    tile_k: int,
    causal: bool = False,
    mask: Mask | torch.Tensor | None = None,
    splits: int = 1,
) -> FlashSteps:
    """FlashAttention on one head, tile by tile, as the `tiled` backend computes it.

    q `(Nq, d_k)`, k `(Nk, d_k)`, v `(Nk, d_v)`, float32 or float64 (the walk computes in that
    dtype); `causal` bottom-right aligned (query i sees keys j ≤ i + Nk − Nq); `mask` a
    `qkv.masks.Mask` (or a bool `(Nq, Nk)` tensor, True = may attend), combined with `causal`
    by "and"; `splits` cuts each query tile's kept key tiles into that many chunks folded
    separately and merged (split-KV decoding). Returns a `FlashSteps`; its `.out` is the
    attention output `(Nq, d_v)`."""
    _check_tensors(q, k, v)
    tile_q, tile_k = _check_int("tile_q", tile_q), _check_int("tile_k", tile_k)
    splits = _check_int("splits", splits)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {_describe(causal)}")
    if mask is not None and not isinstance(mask, (Mask, torch.Tensor)):
        raise TypeError(
            f"mask must be a qkv.masks.Mask, a bool (Nq, Nk) tensor or None, got {_describe(mask)}"
        )
    if isinstance(mask, torch.Tensor) and (mask.dtype != torch.bool or mask.dim() != 2):
        raise TypeError(
            f"a mask tensor must be bool of shape (Nq, Nk)=({q.shape[0]}, {k.shape[0]}), "
            f"got {_describe(mask)}"
        )
    (nq, _), (nk, dv) = q.shape, v.shape
    _check_size(nq, nk, dv, tile_q, tile_k)
    q4, k4, v4 = (t.detach().reshape(1, 1, *t.shape) for t in (q, k, v))
    plan = make_plan(q4, k4, v4, mask=mask, causal=causal)
    T = TileProblem(plan, q4, Tiling(tile_q, tile_k, tile_q, tile_k))
    with torch.no_grad():
        steps, partials, merged = _walk(T, q4, k4, v4, splits)
        loop = forward_loop(T, q4, k4, v4) if splits == 1 else None  # the kernel's own loop
    if loop is not None:
        out, lse = loop[0].reshape(nq, dv), loop[1].reshape(nq)
    else:
        out = torch.cat([mg.o for mg in merged]).to(q.dtype)
        m, l = torch.cat([mg.m for mg in merged]).double(), torch.cat([mg.l for mg in merged])
        lse = torch.where(l == 0, -torch.inf, m + torch.log(torch.where(l == 0, 1.0, l)))
        lse = lse.to(q.dtype)
    layout = T.layout
    kept = [
        (s.rows[1] - s.rows[0]) * (s.cols[1] - s.cols[0]) for s in steps if s.scores is not None
    ]
    allowed = sum(int(torch.isfinite(s.scores).sum()) for s in steps if s.scores is not None)
    return FlashSteps(
        out=out,
        lse=lse,
        steps=tuple(steps),
        layout=layout,
        kinds=tuple(tuple(KIND_NAMES[int(x)] for x in row) for row in layout.kind),
        splits=tuple(tuple(p) for p in partials),
        merged=tuple(merged),
        tile_q=tile_q,
        tile_k=tile_k,
        n_splits=splits,
        scale=plan.scale,
        causal=causal,
        mask="" if mask is None else (repr(mask) if isinstance(mask, Mask) else "bool tensor"),
        products=sum(kept),
        allowed=allowed,
        scores_held=min(tile_q, nq) * min(tile_k, nk),
        state_held=splits * min(tile_q, nq) * (2 + dv),
        not_held=nq * nk,
    )


def _walk(T: TileProblem, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, splits: int):
    """Every query tile's walk over the key tiles: (steps, partials per query tile, merges)."""
    layout = T.layout
    nqb, nkb = layout.shape
    tq, tk = T.tiling.block_q, T.tiling.block_k
    nq, nk, dv = layout.q_len, layout.kv_len, v4.shape[-1]
    cdt = T.cdt
    qc, kc, vc = q4.to(cdt), k4.to(cdt), v4.to(cdt)  # as forward_loop: no copy for fp32/64
    # One-tile strips and runs (max_rows = block_q, max_cols = block_k): the kernel's own.
    runs = {(st.start // tq, run.start // tk): run for st in T.forward_strips() for run in st.runs}
    steps: list[FlashStep] = []
    partials: list[list[SplitPartial]] = []
    merged: list[Merged] = []
    for r in range(nqb):
        i0, i1 = r * tq, min((r + 1) * tq, nq)
        n = i1 - i0
        q_t = qc[:, :, i0:i1]
        full = dict(layout.rows()[r])
        chunks = _chunks(sorted(full), splits)
        split_of = {t: s for s, chunk in enumerate(chunks) for t in chunk}
        states = [_State() for _ in range(splits)]
        current = 0
        for c in range(nkb):
            j0, j1 = c * tk, min((c + 1) * tk, nk)
            current = split_of.get(c, current)
            st = states[current]
            scores = alpha = None
            status = "skipped"
            if c in full:
                status = "full" if full[c] else "partial"
                run = runs[(r, c)]
                scores = _scores(T, q_t, kc, i0, i1, run)
                m_old = st.m
                l_in = None if st.l is None else st.l.clone()  # fold_run updates l, acc in place
                acc_in = None if st.acc is None else st.acc.clone()
                st.m, st.l, st.acc = fold_run(T, q_t, kc, vc, i0, i1, run, st.m, l_in, acc_in)
                if m_old is not None:  # the factor fold_run rescaled l and acc by
                    m_use = st.m.clamp(min=torch.finfo(cdt).min)
                    alpha = torch.exp(m_old - m_use).reshape(n)
            m, l, acc, o = st.snapshot(n, dv, qc)
            steps.append(
                FlashStep(
                    len(steps),
                    r,
                    c,
                    (i0, i1),
                    (j0, j1),
                    status,
                    current,
                    scores,
                    m,
                    l,
                    acc,
                    o,
                    alpha,
                )
            )
        parts = []
        for s, chunk in enumerate(chunks):
            m, l, acc, _ = states[s].snapshot(n, dv, qc)
            parts.append(SplitPartial(r, s, tuple(chunk), m, l, acc))
        partials.append(parts)
        merged.append(_merge(r, parts, q4.dtype))
    return steps, partials, merged


# ------------------------------------------------------------------------------ notebook view

_COLOURS = {"full": "#2b6cb0", "partial": "#90cdf4", "empty": "#e2e2e2"}


def _fmt(x: float) -> str:
    return "−∞" if x == float("-inf") else f"{x:.4g}"


def steps_html(fs: FlashSteps, max_steps: int = 64) -> str:
    """A self-contained HTML summary of a walk (no script, inline styles): the tile grid
    coloured by kind with each tile's step number, the counts, and the first `max_steps` steps
    (m, l, alpha per row) in a collapsible table."""
    nq, nk = fs.shape
    kept = sum(row.count("full") + row.count("partial") for row in fs.kinds)
    tiles = len(fs.kinds) * len(fs.kinds[0])
    order = {(s.q_tile, s.k_tile): s.index for s in fs.steps}
    cell = "width:34px;height:22px;text-align:center;font-size:11px;border:1px solid #fff;"
    grid = []
    for r, row in enumerate(fs.kinds):
        tds = []
        for c, kind in enumerate(row):
            colour = "#fff" if kind == "full" else "#222"
            label = "·" if kind == "empty" else str(order[(r, c)] + 1)
            tds.append(
                f'<td title="query tile {r}, key tile {c}: {kind}" '
                f'style="{cell}background:{_COLOURS[kind]};color:{colour}">{label}</td>'
            )
        grid.append("<tr>" + "".join(tds) + "</tr>")
    mask = f", mask {fs.mask}" if fs.mask else ""
    head = (
        f"<b>FlashAttention, tile by tile</b>: Nq={nq} × Nk={nk}, tiles {fs.tile_q}×{fs.tile_k}"
        f"{', causal' if fs.causal else ''}{html.escape(mask)}"
        f"{f', {fs.n_splits} splits' if fs.n_splits > 1 else ''}. "
        f"{kept} of {tiles} tiles computed, {tiles - kept} skipped; "
        f"{fs.products} of {fs.not_held} q·k products computed ({fs.allowed} allowed), "
        f"{fs.products_saved} saved. Held at once: {fs.scores_held} scores + {fs.state_held} "
        f"numbers of m, l, O; never held: the {nq}×{nk} = {fs.not_held} scores."
    )
    pad = 'style="padding:1px 8px;border-bottom:1px solid #eee;white-space:nowrap"'
    rows = []
    for s in fs.steps[:max_steps]:
        vals = lambda t: "—" if t is None else ", ".join(_fmt(x) for x in t.tolist())  # noqa: E731
        cells = (s.index + 1, s.q_tile, s.k_tile, s.status, vals(s.m), vals(s.l), vals(s.alpha))
        rows.append("<tr>" + "".join(f"<td {pad}>{c}</td>" for c in cells) + "</tr>")
    more = len(fs.steps) - max_steps
    tail = f"<p>… {more} more steps</p>" if more > 0 else ""
    heads = ("step", "q tile", "k tile", "status", "m", "l", "α")
    th = "".join(f"<th {pad}>{h}</th>" for h in heads)
    names = {"full": "full", "partial": "partial", "empty": "skipped"}
    legend = " ".join(
        f'<span style="background:{c};padding:0 6px;margin-right:4px">&nbsp;</span>{names[k]}'
        for k, c in _COLOURS.items()
    )
    return (
        '<div class="qkv-flash" style="font:13px/1.4 system-ui,sans-serif;max-width:100%;'
        'overflow-x:auto">'
        f"<p style='margin:0 0 6px'>{head}</p>"
        f'<table style="border-collapse:collapse">{"".join(grid)}</table>'
        f"<p style='margin:4px 0;font-size:12px'>{legend} (numbers: step of the walk)</p>"
        f"<details><summary>steps ({len(fs.steps)})</summary>"
        f'<table style="font-size:12px;border-collapse:collapse"><tr>{th}</tr>'
        f"{''.join(rows)}</table>{tail}</details></div>"
    )
