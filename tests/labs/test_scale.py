"""`qkv lab scale`: the variance against its closed form, the Jacobian against autograd, the
saturation measured through qkv.attention, and the documented JSON."""

from __future__ import annotations

import json
import math

import pytest
import torch

from qkv.labs import scale

TINY = scale.Preset(
    d_ks=(4, 16, 64), samples=2000, keys=16, rows=64, train_d_k=32, steps=20, every=5
)


@pytest.mark.parametrize("d_k", [1, 4, 64, 512])
def test_variance_agrees_with_the_closed_form(d_k):
    """Var(q·k) = d_k, Var(q·k/√d_k) = 1. The sample variance of M draws has a relative
    standard error √((κ − 1)/M) with kurtosis κ = 3 + 6/d_k; allow four of them."""
    samples = 40_000
    unscaled, scaled = scale.variance(d_k, samples, torch.Generator().manual_seed(d_k))
    se = math.sqrt((2 + 6 / d_k) / samples)
    assert abs(unscaled / d_k - 1) <= 4 * se
    assert abs(scaled - 1) <= 4 * se
    assert scaled == pytest.approx(unscaled / d_k, rel=1e-12)


def test_jacobian_norm_is_the_norm_of_the_softmax_jacobian():
    logits = torch.randn(6, 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    p = logits.softmax(-1)
    for row in range(6):
        jac = torch.autograd.functional.jacobian(lambda z: z.softmax(-1), logits[row])
        want = torch.linalg.matrix_norm(jac)
        torch.testing.assert_close(scale.jacobian_norm(p[row]), want, rtol=1e-12, atol=1e-14)


def test_saturation_is_measured_on_the_softmax_of_the_scores():
    """Same generator state: the measured averages equal a direct computation on the draws."""
    d_k, keys, rows = 8, 5, 7
    got = scale.saturation(d_k, keys, rows, torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(4)
    q = torch.randn(rows, 1, d_k, generator=g)
    k = torch.randn(rows, keys, d_k, generator=g)
    s = (q @ k.transpose(1, 2))[:, 0].double()  # (rows, keys)
    for name, factor in (("unscaled", 1.0), ("scaled", d_k**-0.5)):
        p = (s * factor).softmax(-1)
        assert got[f"max_weight_{name}"] == pytest.approx(p.amax(-1).mean().item(), rel=1e-5)
        ent = -(p * p.log()).sum(-1).mean().item()
        assert got[f"entropy_{name}"] == pytest.approx(ent, rel=1e-5)
        jac = scale.jacobian_norm(p).mean().item()
        assert got[f"jacobian_{name}"] == pytest.approx(jac, rel=1e-5)


@pytest.fixture(scope="module")
def doc():
    return scale.run(TINY, progress=False)


def test_json_has_the_documented_fields(doc):
    doc = json.loads(json.dumps(doc, allow_nan=False))
    assert set(doc["verdicts"]) == set(scale.claims(doc))
    assert all(v["verdict"] in ("holds", "does not hold") for v in doc["verdicts"].values())
    assert [r["d_k"] for r in doc["variance"]] == [4, 16, 64]
    for r in doc["variance"]:
        assert isinstance(r["unscaled"], float) and isinstance(r["scaled"], float)
    for r in doc["saturation"]:
        assert set(r) >= {"d_k", "max_weight_unscaled", "max_weight_scaled"}
        assert 1 / TINY.keys <= r["max_weight_scaled"] <= 1
    assert [r["d_k"] for r in doc["jacobian"]] == [4, 16, 64]
    tr = doc["training"]
    assert len(tr["scaled"]) == len(tr["unscaled"]) == TINY.steps // TINY.every
    assert all(isinstance(x, float) and x > 0 for x in tr["scaled"] + tr["unscaled"])
    assert tr["d_k"] == 32


def test_summary_in_both_languages_and_the_figure(doc, tmp_path):
    en, zh = scale.summary(doc, "en"), scale.summary(doc, "zh")
    held = scale.claims(doc)
    assert "claim: the variance grows with d_k" in en and "论断" in zh
    word = "holds" if held["training"] else "does not hold"
    assert f"claim: without the scale, training stalls → {word}" in en
    assert f"{doc['variance'][-1]['unscaled']:>12.3f}" in en
    assert "≥ 1.5× higher with scale 1" in en  # the English rule, and the same ratio in Chinese:
    assert "不缩放时的损失至少是缩放时的 1.5 倍" in zh and "高 1.5 倍" not in zh  # not "2.5×"
    pytest.importorskip("matplotlib")
    scale.figure(doc, tmp_path / "scale.png")
    assert (tmp_path / "scale.png").stat().st_size > 0


def test_claim_rules():
    doc = {
        "variance": [{"d_k": 4, "unscaled": 4.2, "scaled": 1.05}],
        "saturation": [
            {"d_k": 4, "max_weight_unscaled": 0.3, "max_weight_scaled": 0.10},
            {"d_k": 1024, "max_weight_unscaled": 0.95, "max_weight_scaled": 0.11},
        ],
        "jacobian": [
            {"d_k": 4, "norm_unscaled": 0.26, "norm_scaled": 0.18},
            {"d_k": 1024, "norm_unscaled": 0.07, "norm_scaled": 0.184},
        ],
        "training": {"scaled": [2.0, 0.01], "unscaled": [2.0, 1.9]},
    }
    assert scale.claims(doc) == {
        "variance": True,
        "saturation": True,
        "gradient": True,
        "training": True,
    }
    doc["variance"][0]["unscaled"] = 4.5  # 12.5% off the closed form
    doc["jacobian"][-1]["norm_unscaled"] = 0.2
    doc["training"]["unscaled"] = [2.0, 0.012]
    assert scale.claims(doc) == {
        "variance": False,
        "saturation": True,
        "gradient": False,
        "training": False,
    }
