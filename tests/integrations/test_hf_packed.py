"""Packed training batches as transformers makes them (`DataCollatorWithFlattening`): one row,
the sequences end to end, `position_ids` restarting at 0 for each, no padding mask (and no
cache: transformers looks for packing only then, so the forwards pass `use_cache=False`).

transformers turns that into a predicate "same sequence and causal in positions"; qkv's mask
function turns it into `masks.varlen(cu, cu, causal=True)` (no N² tensor; the kernels cut
their tiles at the sequence boundaries). Judged against each sequence run alone: the logits
and the gradients under the error-ratio rule (hf_helpers), and, bit for bit, that a token
changes nothing before it in its sequence and nothing in the other sequences.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="needs: pip install -e '.[hf]'")
masking_utils = pytest.importorskip("transformers.masking_utils")

from qkv import masks  # noqa: E402
from qkv.integrations import hf  # noqa: E402

from ..helpers import assert_error_ratio  # noqa: E402
from .hf_helpers import Float64Everywhere, run, tiny_llama, tiny_mistral  # noqa: E402

hf.register()

LENGTHS = [5, 11, 3, 8]


def _llama():
    return tiny_llama()


def _mistral():  # every layer slides, with a window shorter than the longer sequences
    return tiny_mistral(4)


MODELS = {"llama": _llama, "mistral": _mistral}


def _sequences(seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=g) for n in LENGTHS]


def _pack(seqs):
    """What DataCollatorWithFlattening gives the model: `(input_ids, position_ids)`, (1, N)."""
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    return ids, pos


def _packed_logits(seqs):
    ids, pos = _pack(seqs)
    return lambda m: m(ids, position_ids=pos, use_cache=False).logits


def _alone_logits(seqs):
    return lambda m: torch.cat([m(s[None], use_cache=False).logits for s in seqs], 1)


# --------------------------------------------------------------------------- the mask function


def _config(family):
    config = MODELS[family]().config
    config._attn_implementation = "qkv"
    return config


def _create(config, **kw):
    fn = (
        masking_utils.create_sliding_window_causal_mask
        if getattr(config, "sliding_window", None)
        else masking_utils.create_causal_mask
    )
    return fn(config=config, attention_mask=None, cache=None, **kw)


@pytest.mark.parametrize("family", list(MODELS))
def test_packed_predicate_becomes_varlen(family):
    config = _config(family)
    ids, pos = _pack(_sequences())
    n = ids.shape[1]
    embeds = torch.empty(1, n, 0)
    ours = _create(config, inputs_embeds=embeds, position_ids=pos)
    assert isinstance(ours, masks.Mask), ours
    assert repr(ours).startswith(f"varlen({len(LENGTHS)} sequences, causal=True)"), ours
    if family == "mistral":
        assert "sliding_window(3, 0)" in repr(ours), ours
    config._attn_implementation = "sdpa"
    theirs = _create(config, inputs_embeds=embeds, position_ids=pos)
    assert torch.equal(ours.dense4(n, n), theirs)


def test_packed_rows_that_differ_get_the_dense_mask():
    # One qkv mask serves every row: two rows packed differently are left to the dense mask,
    # and two rows packed alike keep the varlen mask.
    config = _config("llama")
    _, pos = _pack(_sequences())
    other = torch.cat([torch.arange(7), torch.arange(pos.shape[1] - 7)])[None]
    embeds = torch.empty(2, pos.shape[1], 0)
    alike = _create(config, inputs_embeds=embeds, position_ids=pos.expand(2, -1))
    assert isinstance(alike, masks.Mask) and "varlen" in repr(alike)
    differ = torch.cat([pos, other])
    ours = _create(config, inputs_embeds=embeds, position_ids=differ)
    config._attn_implementation = "sdpa"
    theirs = _create(config, inputs_embeds=embeds, position_ids=differ)
    assert isinstance(ours, torch.Tensor) and torch.equal(ours, theirs)


# --------------------------------------------------------------------------- models


@pytest.mark.parametrize("family", list(MODELS))
def test_packed_forward_equals_each_sequence_alone(family):
    model = MODELS[family]()
    seqs = _sequences()
    got = run(model, "qkv", torch.float32, _packed_logits(seqs))
    ref = run(model, "eager", torch.float32, _alone_logits(seqs))
    gold = run(model, "eager", torch.float64, _alone_logits(seqs))
    assert_error_ratio(got, ref, gold, what="packed logits")
    got64 = run(model, "qkv", torch.float64, _packed_logits(seqs))
    assert_error_ratio(got64, ref, gold, what="packed logits fp64")


@pytest.mark.parametrize("family", list(MODELS))
def test_packed_forward_is_causal_within_each_sequence(family):
    # Change one token in the middle of the second sequence: nothing before it in that sequence
    # and nothing in the other sequences may move (bit for bit), and it and what follows do.
    model = MODELS[family]()
    seqs = _sequences()
    changed = [s.clone() for s in seqs]
    at = 6
    changed[1][at] = 3 if int(seqs[1][at]) != 3 else 4
    a = run(model, "qkv", torch.float32, _packed_logits(seqs))[0]
    b = run(model, "qkv", torch.float32, _packed_logits(changed))[0]
    starts = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    first, end = starts[1] + at, starts[2]  # the changed position, the end of its sequence
    same = torch.ones(a.shape[0], dtype=torch.bool)
    same[first:end] = False
    assert torch.equal(a[same], b[same])
    assert (a[first:end] != b[first:end]).any(-1).all()


@pytest.mark.parametrize("family", list(MODELS))
def test_packed_gradients_equal_each_sequence_alone(family):
    # A loss over every position: its gradients (parameters and embeddings of the packed
    # row) are the sums over the sequences trained alone.
    model = MODELS[family]()
    seqs = _sequences()
    n = sum(LENGTHS)
    weights = torch.randn(1, n, 97, generator=torch.Generator().manual_seed(6))

    def grads(impl, dtype, packed):
        m = copy.deepcopy(model).to(dtype).train()
        m.set_attn_implementation(impl)
        logits = (_packed_logits if packed else _alone_logits)(seqs)(m)
        (logits * weights.to(dtype)).sum().backward()
        return [p.grad.detach().clone() for p in m.parameters()]

    got = grads("qkv", torch.float32, packed=True)
    ref = grads("eager", torch.float32, packed=False)
    with Float64Everywhere():
        gold = grads("eager", torch.float64, packed=False)
        got64 = grads("qkv", torch.float64, packed=True)
    names = [name for name, _ in model.named_parameters()]
    for name, g, r, o, g64 in zip(names, got, ref, gold, got64, strict=True):
        assert_error_ratio(g, r, o, what=f"gradient {name}")
        assert_error_ratio(g64, r, o, what=f"gradient {name} fp64")
