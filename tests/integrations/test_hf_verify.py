"""Families qkv cannot run in, told to the user: the warning, `hf.verify`, `hf.routes_attention`.

BLOOM computes attention in its own code (it never calls transformers' attention interface) and
Falcon picks its attention class by name, so `attn_implementation="qkv"` cannot reach qkv in
either. BLOOM used to take qkv's mask anyway and run non-causal (no padding) or raise a
TypeError (padding); now it gets the mask its own code reads, with a warning, and `verify`
reports every layer.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it
transformers = pytest.importorskip("transformers", reason="needs: pip install -e '.[hf]'")

from qkv.integrations import hf  # noqa: E402

from .hf_helpers import build, padded_ids  # noqa: E402

hf.register()

V = 97


def _bloom_config() -> transformers.BloomConfig:
    return transformers.BloomConfig(
        vocab_size=V, hidden_size=32, n_layer=2, n_head=4, pad_token_id=0, bos_token_id=1
    )


def _llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        pad_token_id=0,
    )


def _loaded_with(cls, config, impl: str, seed: int = 0):
    """A model built as `from_pretrained(..., attn_implementation=impl)` builds it."""
    torch.manual_seed(seed)
    return cls._from_config(copy.deepcopy(config), attn_implementation=impl).eval()


@pytest.mark.parametrize("padded", [False, True], ids=["", "padded"])
def test_bloom_warns_and_computes_what_eager_computes(padded, monkeypatch):
    monkeypatch.setattr(hf, "_warned", set())
    config = _bloom_config()
    eager = _loaded_with(transformers.BloomForCausalLM, config, "eager")
    model = _loaded_with(transformers.BloomForCausalLM, config, "qkv")
    assert model.config._attn_implementation == "qkv"  # transformers accepts the name
    ids, am = padded_ids(V, [10, 6] if padded else [10, 10], 10, side="left")
    with torch.no_grad():
        want = eager(ids, attention_mask=am).logits
        with pytest.warns(RuntimeWarning, match=r"Bloom models compute attention in their own"):
            got = model(ids, attention_mask=am).logits
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once, not on every forward
            again = model(ids, attention_mask=am).logits
    assert torch.equal(got, want) and torch.equal(again, want)


def test_bloom_verify_reports_every_layer():
    model = _loaded_with(transformers.BloomForCausalLM, _bloom_config(), "qkv")
    ids, am = padded_ids(V, [8, 8], 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the warning has its own test
        report = hf.verify(model, {"input_ids": ids, "attention_mask": am})
    assert not report.ok and report.measured and report.family_routes is False
    assert [layer.name for layer in report.layers] == [
        "transformer.h.0.self_attention",
        "transformer.h.1.self_attention",
    ]
    assert all(layer.calls == 0 and not layer.runs_qkv for layer in report.layers)
    assert all("own code" in layer.reason for layer in report.layers)
    assert "runs in 0 of 2 attention layers" in str(report)
    assert any("never calls transformers' attention interface" in p for p in report.problems)
    assert not hf.verify(model).ok  # without a forward, read from the code: the same answer


def test_bloom_switched_after_loading_stays_eager_and_verify_says_so():
    # transformers refuses to switch a model whose code does not use the interface, with only
    # a log line; verify names the implementation the layers really ask for.
    model = build(transformers.BloomForCausalLM, _bloom_config())
    model.set_attn_implementation("qkv")
    assert model.config._attn_implementation == "eager"
    report = hf.verify(model)
    assert not report.ok
    assert all("attn_implementation='eager'" in layer.reason for layer in report.layers)


def _falcon_builds_with_qkv() -> bool:
    """Whether this transformers builds Falcon with attn_implementation="qkv": up to 5.24 it
    picks its attention class by name and raises transformers' own KeyError ('qkv'); from 5.25
    its layers call the attention interface."""
    config = transformers.FalconConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4
    )
    try:
        transformers.FalconForCausalLM._from_config(config, attn_implementation="qkv")
    except KeyError as e:
        assert "qkv" in str(e)
        return False
    return True


def test_verify_says_beforehand_whether_falcon_can_run_qkv():
    report = hf.verify(transformers.FalconForCausalLM)
    if _falcon_builds_with_qkv():
        assert report.ok and "can run in FalconForCausalLM" in str(report)
    else:
        assert not report.ok and report.of_class and not report.layers
        assert "cannot run in FalconForCausalLM" in str(report)
    assert hf.verify(transformers.LlamaForCausalLM).ok
    assert "can run in LlamaForCausalLM" in str(hf.verify(transformers.LlamaForCausalLM))


def test_routes_attention_reads_the_family_code():
    assert hf.routes_attention(_llama_config()) is True
    assert hf.routes_attention(transformers.LlamaForCausalLM) is True
    assert hf.routes_attention(_bloom_config()) is False
    falcon = _falcon_builds_with_qkv()  # the family's code changed in transformers 5.25
    assert hf.routes_attention(transformers.FalconConfig()) is falcon
    assert hf.routes_attention(transformers.FalconModel) is falcon
    assert hf.routes_attention(torch.nn.Linear(2, 2)) is None  # not a transformers model


def test_verify_counts_calls_and_catches_a_layer_that_skips_qkv():
    model = _loaded_with(transformers.LlamaForCausalLM, _llama_config(), "qkv")
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 8]])}
    report = hf.verify(model, inputs)
    assert report.ok and report.measured, str(report)
    assert [layer.calls for layer in report.layers] == [1, 1]
    assert "runs in 2 of 2 attention layers (counted on a forward)" in str(report)

    # A layer whose code asks the interface but takes a path of its own on this forward: the
    # code says qkv, only the count shows it does not run.
    layer = model.model.layers[1].self_attn
    layer.forward = lambda hidden_states, *args, **kwargs: (torch.zeros_like(hidden_states), None)
    assert hf.verify(model).ok
    report = hf.verify(model, inputs)
    assert not report.ok
    (problem,) = report.problems
    assert problem.startswith("model.layers.1.self_attn (LlamaAttention): did not call qkv")


def test_verify_bad_input():
    with pytest.raises(TypeError, match=r"torch\.nn\.Module or a model class"):
        hf.verify("llama")
    model = build(transformers.LlamaForCausalLM, _llama_config())
    with pytest.raises(TypeError, match="mapping of forward"):
        hf.verify(model, [torch.tensor([[1, 2]])])
