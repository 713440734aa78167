"""`qkv lab routing`: a CNN's gradient stops at its window, attention's reaches the far end,
the trained router's weights are distributions, and the documented JSON."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.labs import routing

TINY = routing.Preset(
    length=12, width=8, layers=(1, 2), trials=2, route_length=8, steps=10, examples=4, samples=32
)


@pytest.mark.parametrize("layers", [1, 3])
def test_a_cnn_sees_exactly_its_window(layers):
    torch.manual_seed(0)
    model = routing.make_model("cnn", 8, layers)
    g = routing.gradient_reach(model, torch.randn(20, 8), torch.ones(8) / 8**0.5).flip(0)
    assert (g[: layers + 1] > 0).all() and (g[layers + 1 :] == 0).all()


def test_attention_and_the_lstm_reach_the_first_position():
    torch.manual_seed(0)
    x, direction = torch.randn(20, 8), torch.ones(8) / 8**0.5
    for kind in ("attention", "lstm"):
        g = routing.gradient_reach(routing.make_model(kind, 8, 1), x, direction)
        assert g[0] > 0, kind  # position 0, 19 steps away from the output


def test_gradient_reach_is_the_autograd_gradient():
    torch.manual_seed(1)
    model = routing.make_model("lstm", 4, 1)
    x, r = torch.randn(6, 4, requires_grad=True), torch.randn(4)
    (model(x.unsqueeze(0))[0, -1] @ r).backward()
    torch.testing.assert_close(routing.gradient_reach(model, x, r), x.grad.norm(dim=-1))


def test_unknown_model():
    with pytest.raises(ValueError, match="model must be one of cnn, lstm, attention"):
        routing.make_model("mlp", 4, 1)


@pytest.fixture(scope="module")
def doc():
    return routing.run(TINY, progress=False)


def test_json_has_the_documented_fields(doc):
    doc = json.loads(json.dumps(doc, allow_nan=False))
    assert set(doc["verdicts"]) == set(routing.claims(doc))
    assert all(v["verdict"] in ("holds", "does not hold") for v in doc["verdicts"].values())
    rows = doc["gradient_reach"]
    assert len(rows) == 3 * 2 * TINY.length
    for r in rows:
        assert r["model"] in ("cnn", "lstm", "attention") and r["layers"] in (1, 2)
        assert 0 <= r["distance"] < TINY.length and r["grad_norm"] >= 0.0
    assert {(r["model"], r["layers"]) for r in doc["reach"]} == {
        (m, n) for m in ("cnn", "lstm", "attention") for n in (1, 2)
    }
    cnn = {r["layers"]: r["reach"] for r in doc["reach"] if r["model"] == "cnn"}
    assert cnn == {1: 1, 2: 2}
    route = doc["routing"]
    assert len(route["examples"]) == TINY.examples
    for ex in route["examples"]:
        assert len(ex["weights"]) == TINY.route_length
        assert sum(ex["weights"]) == pytest.approx(1.0, abs=1e-5)
        assert ex["source"] == TINY.route_length - 1 - ex["distance"]
    assert 0.0 <= route["accuracy"] <= 1.0 and 0.0 <= route["weight_on_source"] <= 1.0


def test_summary_in_both_languages_and_the_figure(doc, tmp_path):
    en, zh = routing.summary(doc, "en"), routing.summary(doc, "zh")
    assert "claim: a CNN sees a fixed local window → holds" in en
    assert "论断：CNN 只看固定的局部窗口 → 成立" in zh
    pytest.importorskip("matplotlib")
    routing.figure(doc, tmp_path / "routing.png")
    assert (tmp_path / "routing.png").stat().st_size > 0
