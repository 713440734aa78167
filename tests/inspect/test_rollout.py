"""Attention rollout: one layer is 0.5·A + 0.5·I row-normalised, layers multiply in order, and
`qkv attend`, its JSON, its figure and the viewer show it."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.inspect.attend import AttentionMap, summary
from qkv.inspect.rollout import rollout


def _weights(L=3, H=4, N=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, N, N, generator=g, dtype=torch.float64).mul(2).softmax(-1)


def test_one_layer_is_half_attention_half_identity_row_normalised():
    w = _weights(L=1)
    a = w[0].mean(0)  # heads averaged
    want = 0.5 * a + 0.5 * torch.eye(5, dtype=torch.float64)
    want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(rollout(w)[0], want, rtol=0, atol=1e-15)


def test_layers_multiply_from_the_first_upwards():
    w = _weights(L=3)
    eye = torch.eye(5, dtype=torch.float64)
    step = [(0.5 * w[layer].mean(0) + 0.5 * eye) for layer in range(3)]
    r = rollout(w)
    torch.testing.assert_close(r[1], step[1] @ step[0], rtol=0, atol=1e-14)
    torch.testing.assert_close(r[2], step[2] @ step[1] @ step[0], rtol=0, atol=1e-14)
    torch.testing.assert_close(r.sum(-1), torch.ones(3, 5, dtype=torch.float64))


def test_rows_that_do_not_sum_to_one_are_renormalised():
    w = torch.rand(2, 1, 4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(rollout(w).sum(-1), torch.ones(2, 4, dtype=torch.float64))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: rollout(torch.rand(2, 3, 4)), r"weights must be \(L, H, N, N\)"),
        (lambda: rollout(torch.rand(1, 1, 3, 4)), r"weights must be \(L, H, N, N\)"),
        (lambda: rollout(torch.rand(1, 1, 3, 3), residual=1.5), "residual=1.5 is out of range"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_attention_map_summary_and_json_carry_the_rollout():
    amap = AttentionMap.from_weights(_weights(), ["[CLS]", "the", "cat", "it", "[SEP]"])
    r = amap.rollout()
    torch.testing.assert_close(r, rollout(amap.weights))
    text = summary(amap, "it")
    assert 'where "it" draws from after all 3 layers (attention rollout' in text
    top = int(r[-1, 3].argmax())
    assert f"    {amap.words[top]:<5}  {r[-1, 3, top].item():.3f}" in text
    assert f"rollout {r[-1, 3, 2].item():.3f}" in text  # beside "cat" in the per-word table
    doc = json.loads(json.dumps(amap.to_dict()))
    torch.testing.assert_close(
        torch.tensor(doc["rollout"], dtype=torch.float64), r.round(decimals=6)
    )


def test_rollout_figure_rows_are_the_rollout(tmp_path):
    pytest.importorskip("matplotlib")
    from qkv.inspect.figures import rollout_figure

    amap = AttentionMap.from_weights(_weights(), ["[CLS]", "the", "cat", "it", "[SEP]"])
    fig = rollout_figure(amap, "it", tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 0
    raw, rolled = (torch.as_tensor(ax.images[0].get_array()) for ax in fig.axes[:2])
    torch.testing.assert_close(raw, amap.weights[:, :, 3].mean(1))
    torch.testing.assert_close(rolled, amap.rollout()[:, 3])


def test_viewer_embeds_the_rollout():
    import base64
    import re

    from qkv.inspect.viewer import viewer_html

    amap = AttentionMap.from_weights(_weights(), list("abcde"))
    data = json.loads(re.search(r"const DATA = (\{.*?\});\n", viewer_html(amap)).group(1))
    raw = base64.b64decode(data["rollout_u16"])
    q = torch.tensor(list(raw), dtype=torch.int32).view(-1, 2)
    decoded = (q[:, 0] + 256 * q[:, 1]).double().view(3, 5, 5) / 65535
    assert (decoded - amap.rollout()).abs().max().item() <= 0.5 / 65535 + 1e-12


def test_minilm_rollout_of_it(cat_map):
    """The real model: rollout rows are distributions, and the last layer's row of "it" is the
    product of the six layers' 0.5·A + 0.5·I (heads averaged)."""
    r = cat_map.rollout()
    assert r.shape == (6, 12, 12)
    eye = torch.eye(12, dtype=torch.float64)
    acc = eye
    for layer in range(6):
        acc = (0.5 * cat_map.weights[layer].mean(0) + 0.5 * eye) @ acc
    torch.testing.assert_close(r[-1, 8], acc[8] / acc[8].sum())
