"""The zoo: every transformers family of zoo.py with "qkv" against "eager".

For each family: the forward on a padded batch (`hf_helpers.judge`: the error-ratio rule
against eager in float64), `output_attentions=True` (one map per layer, as eager returns, equal
to eager's), `hf.verify` counting qkv in every attention layer, and for generative families
greedy generate() with the default (dynamic) cache and with the static cache, where sliding-
window families run a prompt longer than the window.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it
transformers = pytest.importorskip("transformers", reason="needs: pip install -e '.[hf]'")

from qkv.integrations import hf  # noqa: E402

from ..helpers import assert_error_ratio  # noqa: E402
from . import zoo  # noqa: E402
from .hf_helpers import generate_fn, judge, run  # noqa: E402

hf.register()

FAMILIES = list(zoo.FAMILIES)
GENERATIVE = [name for name, f in zoo.FAMILIES.items() if f.generates]
# Attention layers where qkv does not run, by design of the model: SigLIP's vision pooling head
# is a torch.nn.MultiheadAttention (one learned query over the patches), not a transformers layer.
NOT_QKV = {"siglip": {"vision_model.head.attention"}}


def _cast(inputs: dict, model: torch.nn.Module) -> dict:
    """Floating inputs (pixels, audio features) in the model's dtype, as a caller would pass."""
    return {
        k: v.to(model.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inputs.items()
    }


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_matches_eager(name):
    family = zoo.FAMILIES[name]
    inputs = family.inputs()
    judge(family.model(), lambda m: family.pick(m(**_cast(inputs, m)), inputs), what=name)


def _attentions(output) -> dict[str, tuple[torch.Tensor, ...]]:
    """Every `*attentions` field of a model output, nested outputs included (CLIP's text and
    vision towers), by name."""
    found = {}
    for key, value in output.items():
        if key.endswith("attentions") and value is not None:
            found[key] = tuple(value)
        elif isinstance(value, transformers.utils.ModelOutput):
            found.update({f"{key}.{k}": v for k, v in _attentions(value).items()})
    return found


@pytest.mark.parametrize("name", FAMILIES)
def test_output_attentions_match_eager(name):
    family = zoo.FAMILIES[name]
    inputs = family.inputs()
    rows = zoo.real(inputs)

    def fn(m):
        found = _attentions(m(**_cast(inputs, m), output_attentions=True))
        return tuple(w for key in sorted(found) for w in found[key])

    def select(w):  # self-attention over the padded sequence: real rows only (zoo.py)
        n = None if rows is None else rows.shape[1]
        return w.transpose(1, 2)[rows] if w.dim() == 4 and w.shape[-2:] == (n, n) else w

    eager = run(family.model(), "eager", torch.float32, fn)
    assert eager, f"{name}: eager returned no attention weights"
    got = judge(family.model(), fn, select, what=f"{name} attentions")
    assert len(got) == len(eager)


@pytest.mark.parametrize("name", FAMILIES)
def test_verify_counts_qkv_in_every_attention_layer(name):
    family = zoo.FAMILIES[name]
    model = copy.deepcopy(family.model())
    model.set_attn_implementation("qkv")
    report = hf.verify(model, _cast(family.inputs(), model))
    assert report.measured and report.layers, str(report)
    missing = {layer.name for layer in report.layers if not layer.runs_qkv}
    assert missing == NOT_QKV.get(name, set()), str(report)
    assert all(layer.calls for layer in report.layers if layer.name not in missing)
    assert hf.verify(model).ok == (not missing)  # the reading of the code agrees


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", GENERATIVE)
def test_generate_matches_eager(name, cache):
    family = zoo.FAMILIES[name]
    prompt = {k: v for k, v in family.inputs().items() if not k.startswith("decoder_")}
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    model = family.model()

    def fn(m):
        return generate_fn(_cast(prompt, m), 4, **kw)(m)

    got_tokens, got = run(model, "qkv", torch.float32, fn)
    ref_tokens, ref = run(model, "eager", torch.float32, fn)
    gold_tokens, gold = run(model, "eager", torch.float64, fn)
    assert torch.equal(got_tokens, ref_tokens) and torch.equal(got_tokens, gold_tokens)
    assert_error_ratio(got, ref, gold, what=f"{name} generate logits ({cache} cache)")
