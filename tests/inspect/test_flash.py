"""`flash_steps`: FlashAttention's walk as data, computed by the `tiled` backend's own steps.

On shapes drawn by a seeded RNG (Nq ≠ Nk, tiles that do not divide N, causal, windows,
Longformer, packed documents, 1–4 splits): the output against the float64 formula by the error
rule; m, l, α and O true at every step against sums formed here in float64 from the reference's
scores; the skipped tiles exactly the layout's empty tiles; the merged splits equal to the
unsplit walk; the output bit for bit the tiled backend's; bad inputs refused by name. Then the
text walk (`render_walk`, en and zh) and `qkv explain --flash`."""

from __future__ import annotations

import random
import re

import pytest
import torch

import qkv
from qkv import masks, reference
from qkv.cli import main
from qkv.inspect.explain import ExplainError, walkthrough
from qkv.inspect.flash import MAX_STEPS, FlashSteps, flash_steps
from qkv.inspect.flash_text import render_steps, render_walk
from qkv.kernels import TiledBackend
from qkv.layout import EMPTY, FULL, block_layout

from ..helpers import assert_error_ratio, golden

KINDS = ("none", "causal", "window", "causal-window", "documents", "longformer")
CASES = 36  # seeds of the shape RNG: each mask kind six times


def _case(seed: int) -> dict:
    """A problem drawn from `seed`: sizes, tiles, a mask of kind KINDS[seed % 6], splits."""
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]
    nk = rng.randint(2, 23)
    nq = rng.randint(1, nk - 1) if kind == "documents" else rng.choice(
        [n for n in range(1, 24) if n != nk]
    )  # fmt: skip
    case = {
        "nq": nq, "nk": nk, "dk": rng.randint(1, 8), "dv": rng.randint(1, 8),
        "tile_q": rng.randint(1, 7), "tile_k": rng.randint(1, 7), "splits": rng.randint(1, 4),
        "causal": kind in ("causal", "causal-window"), "mask": None, "kind": kind,
    }  # fmt: skip
    if kind in ("window", "causal-window"):
        case["mask"] = masks.sliding_window(rng.randint(0, 4))
    elif kind == "documents":
        cuts = sorted(rng.sample(range(1, nk), rng.randint(0, min(3, nk - 1))))
        case["mask"] = masks.document([b - a for a, b in zip([0, *cuts], [*cuts, nk], strict=True)])
    elif kind == "longformer":
        glob = rng.sample(range(nk), rng.randint(1, min(2, nk)))
        case["mask"] = masks.sliding_window(rng.randint(0, 3)) | masks.global_tokens(glob)
    return case


def _inputs(case: dict, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(1000 + seed)
    q = torch.randn(case["nq"], case["dk"], generator=g).to(dtype)
    k = torch.randn(case["nk"], case["dk"], generator=g).to(dtype)
    v = torch.randn(case["nk"], case["dv"], generator=g).to(dtype)
    return q, k, v


def _walk(case: dict, q, k, v, splits: int | None = None) -> FlashSteps:
    return flash_steps(
        q, k, v, tile_q=case["tile_q"], tile_k=case["tile_k"], causal=case["causal"],
        mask=case["mask"], splits=case["splits"] if splits is None else splits,
    )  # fmt: skip


def _fp64_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The error rule's float64 clause: −inf exactly where the truth has it, elsewhere within
    1e-10 of the truth's magnitude."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    inf = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), inf), (what, got, want)
    if (~inf).any():
        err = (got[~inf].double() - want[~inf]).abs().max().item()
        scale = max(1.0, want[~inf].abs().max().item())
        assert err <= 1e-10 * scale, (what, err)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed", range(CASES))
def test_the_output_is_the_formula(seed, dtype):
    case = _case(seed)
    q, k, v = _inputs(case, dtype, seed)
    fs = _walk(case, q, k, v)
    opts = {"causal": case["causal"], "mask": case["mask"]}
    gold = golden(q, k, v, **opts)
    ref = qkv.attention(q, k, v, backend="reference", **opts)  # the formula in `dtype`
    assert fs.out.dtype == dtype and fs.out.shape == (case["nq"], case["dv"])
    assert_error_ratio(fs.out, ref, gold, what=f"{case['kind']} splits={case['splits']}")


def _truth(case: dict, q, k, v):
    """The reference's scaled, masked scores S (Nq, Nk) in float64, and v in float64."""
    st = reference.steps(q, k, v, causal=case["causal"], mask=case["mask"])
    return st.S_scaled, v.double()


@pytest.mark.parametrize("seed", range(CASES))
def test_m_l_alpha_and_o_are_true_at_every_step(seed):
    case = _case(seed)
    q, k, v = _inputs(case, seed=seed)
    fs = _walk(case, q, k, v)
    S, v64 = _truth(case, q, k, v)
    folded: dict[tuple[int, int], list[int]] = {}  # (query tile, split) → keys folded so far
    before: dict[tuple[int, int], torch.Tensor] = {}  # its true m before the step
    for s in fs.steps:
        (r0, r1), (c0, c1) = s.rows, s.cols
        keys = folded.setdefault((s.q_tile, s.split), [])
        if s.status == "skipped":
            assert s.scores is None and s.alpha is None
        else:
            _fp64_close(s.scores, S[r0:r1, c0:c1], f"step {s.index}: S tile")
            keys += range(c0, c1)
        if not keys:  # nothing folded yet: the empty state
            assert torch.isneginf(s.m).all() and (s.l == 0).all() and (s.o == 0).all()
            continue
        seen = S[r0:r1, keys]
        m = seen.max(-1).values
        p = torch.where(torch.isneginf(m)[:, None], 0.0, torch.exp(seen - m[:, None]))
        l = p.sum(-1)
        o = torch.where(l[:, None] > 0, (p @ v64[keys]) / l.clamp(min=1e-300)[:, None], 0.0)
        _fp64_close(s.m, m, f"step {s.index}: m")
        _fp64_close(s.l, l, f"step {s.index}: l")
        _fp64_close(s.o, o, f"step {s.index}: O")
        assert torch.equal(s.o, s.acc / torch.where(s.l == 0, 1.0, s.l)[:, None])
        m_old = before.get((s.q_tile, s.split))
        if s.status != "skipped" and m_old is not None:
            alpha = torch.where(torch.isneginf(m_old), 0.0, torch.exp(m_old - m))
            _fp64_close(s.alpha, alpha, f"step {s.index}: alpha")
        before[(s.q_tile, s.split)] = m


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed", range(0, CASES, 5))
def test_the_walk_is_the_tiled_backends_own(seed, dtype):
    case = _case(seed)
    q, k, v = _inputs(case, dtype, seed)
    fs = _walk(case, q, k, v, splits=1)
    tq, tk = case["tile_q"], case["tile_k"]
    tiled = TiledBackend(tq, tk, max_rows=tq, max_cols=tk, fused=False)
    out = qkv.attention(q, k, v, causal=case["causal"], mask=case["mask"], backend=tiled)
    assert torch.equal(fs.out, out)  # bit for bit: the same steps, in the same order
    last = {s.q_tile: s for s in fs.steps}
    for s in last.values():  # each query tile's last state, normalised, is its output rows
        assert torch.equal(s.o, fs.out[s.rows[0] : s.rows[1]])


@pytest.mark.parametrize("seed", range(CASES))
def test_the_skipped_tiles_are_the_layouts_empty_tiles(seed):
    case = _case(seed)
    q, k, v = _inputs(case, seed=seed)
    fs = _walk(case, q, k, v)
    tq, tk, nq, nk = case["tile_q"], case["tile_k"], case["nq"], case["nk"]
    kind = block_layout(case["mask"], nq, nk, causal=case["causal"], block_q=tq, block_k=tk).kind
    nqb, nkb = kind.shape
    assert [(s.q_tile, s.k_tile) for s in fs.steps] == [
        (r, c) for r in range(nqb) for c in range(nkb)
    ]  # every tile once, in the kernel's order
    for s in fs.steps:
        want = {EMPTY: "skipped", FULL: "full"}.get(int(kind[s.q_tile, s.k_tile]), "partial")
        assert s.status == want, (s.q_tile, s.k_tile)
    skipped = {(s.q_tile, s.k_tile) for s in fs.steps if s.status == "skipped"}
    assert skipped == {(r, c) for r in range(nqb) for c in range(nkb) if kind[r, c] == EMPTY}
    # and a skipped tile really holds no pair that may attend
    S, _ = _truth(case, q, k, v)
    for r, c in skipped:
        assert torch.isneginf(S[r * tq : (r + 1) * tq, c * tk : (c + 1) * tk]).all()
    assert fs.kinds == tuple(
        tuple({EMPTY: "empty", FULL: "full"}.get(int(x), "partial") for x in row) for row in kind
    )


@pytest.mark.parametrize("seed", range(CASES))
def test_the_counts_are_the_tiles(seed):
    case = _case(seed)
    q, k, v = _inputs(case, seed=seed)
    fs = _walk(case, q, k, v)
    S, _ = _truth(case, q, k, v)
    kept = [s for s in fs.steps if s.status != "skipped"]
    area = sum((s.rows[1] - s.rows[0]) * (s.cols[1] - s.cols[0]) for s in kept)
    assert fs.products == area
    assert fs.products_saved == case["nq"] * case["nk"] - area == fs.not_held - area
    assert fs.allowed == int(torch.isfinite(S).sum())  # every allowed pair lies in a kept tile
    assert fs.scores_held == min(case["tile_q"], case["nq"]) * min(case["tile_k"], case["nk"])
    assert fs.state_held == case["splits"] * min(case["tile_q"], case["nq"]) * (2 + case["dv"])


@pytest.mark.parametrize("seed", range(CASES))
def test_merged_splits_are_the_unsplit_walk(seed):
    case = _case(seed)
    q, k, v = _inputs(case, seed=seed)
    one = _walk(case, q, k, v, splits=1)
    for splits in (2, 3, 4):
        fs = _walk(case, q, k, v, splits=splits)
        _fp64_close(fs.out, one.out, f"{splits} splits: out")
        _fp64_close(fs.lse, one.lse, f"{splits} splits: lse")
        for r, (parts, merged) in enumerate(zip(fs.splits, fs.merged, strict=True)):
            assert len(parts) == splits
            tiles = [t for p in parts for t in p.k_tiles]
            kept = [s.k_tile for s in one.steps if s.q_tile == r and s.status != "skipped"]
            assert tiles == kept  # contiguous chunks, in key order, covering the kept tiles
            sizes = [len(p.k_tiles) for p in parts]
            assert max(sizes) - min(sizes) <= 1
            final = [s for s in one.steps if s.q_tile == r][-1]
            assert torch.equal(merged.m, final.m)  # the max of the splits' maxima
            _fp64_close(merged.l, final.l.double(), "merged l")
            assert torch.equal(fs.out[final.rows[0] : final.rows[1]], merged.o)


def test_a_split_with_no_tile_stays_empty_and_merges_to_nothing():
    q, k, v = _inputs({"nq": 2, "nk": 3, "dk": 2, "dv": 2})
    fs = flash_steps(q, k, v, tile_q=2, tile_k=2, splits=4)  # 2 key tiles, 4 splits
    parts = fs.splits[0]
    assert [p.k_tiles for p in parts] == [(0,), (1,), (), ()]
    assert torch.isneginf(parts[3].m).all() and (parts[3].l == 0).all()
    assert (fs.merged[0].weights[2:] == 0).all()
    _fp64_close(fs.out, reference.attention(q, k, v), "out")


def test_float32_walks_compute_in_float32():
    case = _case(1)
    q, k, v = _inputs(case, torch.float32)
    fs = _walk(case, q, k, v)
    kept = [s for s in fs.steps if s.scores is not None]
    assert all(s.scores.dtype == s.m.dtype == s.o.dtype == torch.float32 for s in kept)


BAD = [
    ({"q": [[1.0]]}, TypeError, "q must be a torch.Tensor of shape (Nq, d_k)"),
    ({"q": torch.zeros(1, 2, 3)}, ValueError, "q must have shape (Nq, d_k)"),
    ({"k": torch.zeros(0, 2, dtype=torch.float64)}, ValueError, "k must have shape (Nk, d_k)"),
    ({"v": torch.zeros(3, 2, dtype=torch.float16)}, TypeError, "v must be float32 or float64"),
    ({"k": torch.zeros(3, 2)}, TypeError, "k.dtype=torch.float32 differs from q.dtype"),
    ({"k": torch.zeros(3, 5, dtype=torch.float64)}, ValueError, "k's width must equal q's d_k"),
    ({"v": torch.zeros(4, 2, dtype=torch.float64)}, ValueError, "v must have one row per key"),
    ({"tile_q": 0}, ValueError, "tile_q must be a positive int, got tile_q=0"),
    ({"tile_k": 2.0}, TypeError, "tile_k must be a positive int, got float 2.0"),
    ({"tile_k": True}, TypeError, "tile_k must be a positive int, got bool True"),
    ({"splits": 0}, ValueError, "splits must be a positive int, got splits=0"),
    ({"causal": 1}, TypeError, "causal must be a bool, got int 1"),
    ({"mask": "causal"}, TypeError, "mask must be a qkv.masks.Mask"),
    ({"mask": torch.ones(2, 3)}, TypeError, "a mask tensor must be bool of shape (Nq, Nk)"),
    ({"mask": masks.document([1, 1])}, ValueError, "document lengths sum to 2"),
]


@pytest.mark.parametrize(("change", "error", "message"), BAD)
def test_bad_inputs_are_refused_by_name(change, error, message):
    args = {
        "q": torch.zeros(2, 2, dtype=torch.float64),
        "k": torch.zeros(3, 2, dtype=torch.float64),
        "v": torch.zeros(3, 2, dtype=torch.float64),
        "tile_q": 1, "tile_k": 2,
    }  # fmt: skip
    args.update(change)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(error, match=re.escape(message)):
        flash_steps(q, k, v, **args)


def test_a_walk_too_large_to_keep_is_refused_before_any_work():
    q = torch.zeros(300, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"at most {MAX_STEPS:,}\).*backend='tiled'"):
        flash_steps(q, q, q, tile_q=1, tile_k=1)


def test_a_bool_tensor_mask_is_the_same_walk_as_its_rule():
    case = _case(2)  # a sliding window
    q, k, v = _inputs(case)
    rule = _walk(case, q, k, v)
    dense = case["mask"].to_dense(case["nq"], case["nk"])
    tensor = flash_steps(q, k, v, tile_q=case["tile_q"], tile_k=case["tile_k"], mask=dense,
                         splits=case["splits"])  # fmt: skip
    assert [s.status for s in tensor.steps] == [s.status for s in rule.steps]
    assert torch.equal(tensor.out, rule.out)


def test_the_notebook_view_is_a_static_summary():
    w = walkthrough(n=8)
    fs = flash_steps(w.Q, w.K, w.V, tile_q=2, tile_k=2, causal=True)
    page = fs._repr_html_()
    assert "<script" not in page and "FlashAttention, tile by tile" in page
    assert "10 of 16 tiles computed, 6 skipped" in page
    assert f"{fs.products_saved} saved" in page
    assert page.count('<td title="query tile') == 16


# ------------------------------------------------------------------------------- the text walk


def test_the_text_walk_prints_the_kernels_numbers():
    text = render_walk()
    w = walkthrough()
    fs = flash_steps(w.Q, w.K, w.V, tile_q=2, tile_k=2)
    assert text.startswith("FlashAttention on the walk-through's Q, K, V: N=4 tokens")
    assert text.count("  step ") == 4  # 2 × 2 tiles of 2
    last = fs.steps[-1]
    shown = "[" + " ".join(f"{x:8.3f}" for x in last.l.tolist()) + "]"
    assert shown in text  # the last step's l, as flash_steps computed it
    assert "equal: max |difference|" in text and "DIFFERENT" not in text
    assert "never held: the N×N = 16 scores" in " ".join(text.split())
    assert "4.4 TB" in text  # the long-document line


def test_the_text_walk_shows_skipped_tiles_and_what_they_save():
    text = render_walk(n=8, causal=True, window=1)
    assert "skipped: nothing here may be seen, not computed" in text
    w = walkthrough(n=8, causal=True)
    fs = flash_steps(w.Q, w.K, w.V, tile_q=2, tile_k=2, causal=True,
                     mask=masks.sliding_window(1))  # fmt: skip
    assert f"skipped tiles saved {fs.products_saved}." in " ".join(text.split())
    assert fs.layout.show() in "\n".join(line.strip() for line in text.splitlines())


ALLOWED_LATIN = {  # symbols, names and code: what a Chinese text keeps as written
    "FlashAttention", "softmax", "rowmax", "rowsum", "max", "max_j", "exp", "acc", "m_old",
    "inf", "float32", "KB", "TB", "d_k", "O_", "S", "Q", "K", "Kᵀ", "V", "A", "N", "O", "m", "l",
    "j", "s", "m_s", "l_s", "Σ_j", "q", "k",
    "e",  # of 2.2e-16
}  # fmt: skip


def test_the_chinese_walk_is_chinese():
    text = render_walk(n=8, causal=True, window=1, lang="zh")
    assert text.startswith("FlashAttention：用讲解示例的 Q、K、V，N=8 个词元")
    words = set(re.findall(r"[A-Za-z_ᵀΣ][A-Za-z_0-9ᵀ]*", text))
    assert words <= ALLOWED_LATIN, sorted(words - ALLOWED_LATIN)
    # fullwidth punctuation beside Chinese, never ASCII
    assert not re.search(r"[\u4e00-\u9fff][,:;()]|[,:;()][\u4e00-\u9fff]", text)
    assert "相等：最大差值" in text and "跳过" in text


def test_render_steps_shows_splits_and_their_merge():
    w = walkthrough(n=6)
    fs = flash_steps(w.Q, w.K, w.V, tile_q=3, tile_k=2, splits=2)
    text = render_steps(fs)
    assert "Split 0 (key tiles 0, 1)" in text and "Split 1 (key tiles 2)" in text
    assert text.count("Merged (m* = max m_s") == 2
    assert "段" in render_steps(fs, "zh")


def test_the_text_walk_refuses_what_it_cannot_print():
    with pytest.raises(ExplainError, match="at most 1,024"):
        render_walk(n=100, tile=1)
    with pytest.raises(ExplainError, match="window must be an int ≥ 0"):
        render_walk(window=-1)
    with pytest.raises(ValueError, match="lang must be one of"):
        render_walk(lang="fr")


# ------------------------------------------------------------------------ qkv explain --flash


def test_qkv_explain_flash_prints_the_walk(capsys):
    assert main(["explain", "--flash"]) == 0
    assert capsys.readouterr().out == render_walk() + "\n"
    argv = ["explain", "--flash", "--n", "6", "--tile", "3", "--causal", "--window", "1"]
    assert main([*argv, "--seed", "2", "--lang", "zh"]) == 0
    want = render_walk(n=6, tile=3, causal=True, window=1, seed=2, lang="zh")
    assert capsys.readouterr().out == want + "\n"


def test_qkv_explain_flash_html_writes_the_flash_page(capsys, tmp_path):
    page = tmp_path / "flash.html"
    assert main(["explain", "--flash", "--n", "8", "--html", str(page), "--lang", "zh"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("FlashAttention：") and f"{page}" in out
    html = page.read_text(encoding="utf-8")
    assert "<title>qkv: FlashAttention, tile by tile</title>" in html
    assert "/*QKV_FLASH*/" not in html and '"lang": "zh"' in html
    assert '"start": {"n": 8, "tile": 2, "view": "dense"}' in html
    formula = tmp_path / "formula.html"
    assert main(["explain", "--html", str(formula)]) == 0  # without --flash: the formula page
    assert "FlashAttention, tile by tile" not in formula.read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("argv", "english", "chinese"),
    [
        (["--window", "1"], "--window needs --flash", "--window 需要同时给出 --flash"),
        (["--flash", "--n", "100", "--tile", "1"], "(at most 1,024)", "（最多 1,024 步）"),
        (["--flash", "--n", "40", "--html", "PAGE"], "the flash page takes n from 1 to 32",
         "FlashAttention 网页的 n 取值为 1 到 32"),
        (["--flash", "--n", "4", "--tile", "8", "--html", "PAGE"], "tile must be at most n",
         "块大小不能超过 N"),
        (["--flash", "--window", "-1"], "expected an integer ≥ 0, got '-1'",
         "需要一个 ≥ 0 的整数，得到的是 '-1'"),
    ],
)  # fmt: skip
def test_qkv_explain_flash_refuses_in_one_line(argv, english, chinese, capsys, tmp_path):
    argv = [str(tmp_path / "p.html") if a == "PAGE" else a for a in argv]
    for lang, message in (("en", english), ("zh", chinese)):
        try:
            code = main(["explain", *argv, "--lang", lang])
        except SystemExit as e:  # argparse's own refusal
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (lang, err)
    assert not (tmp_path / "p.html").exists()
