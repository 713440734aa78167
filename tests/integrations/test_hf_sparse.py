"""Content-selected blocks in a transformers model (`qkv.integrations.hf_sparse`).

Tiny random Llama and Qwen2 models (no download), prefill and greedy decoding through
`generate()`, judged under the error-ratio rule of docs/design.md as the transformers tests
judge "qkv" (tests/integrations/hf_helpers.py: fp32 against a float64 golden, the float32
reference's error as the yardstick; fp64 runs to ~1e-10):

- with `topk` keeping every block, the selection path (forced with `min_len=0`) against
  "eager": the same attention;
- with a small `topk` (or a `threshold`), against "eager" over the dense mask of the same choice
  (`select_blocks` on the same q and k, `chosen.to_dense(...)`): exact attention over exactly
  the chosen pairs, in prefill and in every decoding step;
- a padded batch against each row alone; the dense fallback below `min_len`; what is refused.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it
transformers = pytest.importorskip("transformers", reason="needs: pip install -e '.[hf]'")
masking_utils = pytest.importorskip("transformers.masking_utils")

import qkv  # noqa: E402
from qkv import masks, sparse  # noqa: E402
from qkv.integrations import hf_sparse  # noqa: E402
from qkv.integrations.hf import verify  # noqa: E402

from ..helpers import assert_error_ratio, make_qkv  # noqa: E402
from .hf_helpers import (  # noqa: E402
    ReferenceAttention,
    build,
    generate_fn,
    padded_ids,
    run,
    tiny_config,
)

BLOCK = 8
ALL = dict(block=BLOCK, topk=64, local=1, sink=0, min_len=0)  # keeps every block
FEW = dict(block=BLOCK, topk=2, local=1, sink=1, min_len=0)
MASS = dict(block=BLOCK, topk=None, threshold=0.6, local=1, sink=0, min_len=0)
SETTINGS = {"all": ALL, "few": FEW, "mass": MASS}
for _name, _kw in SETTINGS.items():
    hf_sparse.register(f"sparse_{_name}", **_kw)
hf_sparse.register()  # the defaults, as "qkv_sparse"
N_PROMPT, N_NEW = 61, 4  # 8 key blocks of 8 at the prompt, 9 after the last new token


def _model(cls: str = "Llama", **kw):
    return build(getattr(transformers, f"{cls}ForCausalLM"), tiny_config(cls, **kw))


def _ids(n: int, b: int = 1, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, 97, (b, n), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- the reference


def _register_chosen_reference(name: str, kw: dict) -> str:
    """Register `name`: "eager" (the textbook formula, softmax in float32) over the dense mask
    `chosen.to_dense(...)` of `select_blocks(q, k, **kw)` on the layer's own q and k; unpadded
    batches only (transformers' sdpa mask function: None, which this ignores)."""
    choose = {k: v for k, v in kw.items() if k != "min_len"}

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_):
        assert attention_mask is None, "the reference runs unpadded batches only"
        chosen = sparse.select_blocks(query, key, **choose)
        n_q, n_k = query.shape[2], key.shape[2]
        allowed = chosen.to_dense(n_q, n_k).view(-1, query.shape[1], n_q, n_k)
        groups = query.shape[1] // key.shape[1]
        k, v = (t.repeat_interleave(groups, dim=1) for t in (key, value))
        scores = torch.matmul(query, k.transpose(2, 3)) * scaling
        scores = scores.masked_fill(~allowed, -math.inf)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(weights, v).transpose(1, 2).contiguous(), None

    transformers.AttentionInterface.register(name, attention)
    masking_utils.AttentionMaskInterface.register(name, masking_utils.sdpa_mask)
    return name


REFERENCE = {n: _register_chosen_reference(f"chosen_{n}", kw) for n, kw in SETTINGS.items()}


def _prefill_and_generate(ids, am=None, position_ids=None):
    """`fn(model)` for `run`: `(the prompt's logits (a forward), greedy generate()'s logits,
    its tokens)`."""
    inputs = {"input_ids": ids} if am is None else {"input_ids": ids, "attention_mask": am}
    gen = generate_fn(inputs, N_NEW)

    def fn(m):
        logits = m(**inputs, position_ids=position_ids).logits
        tokens, new = gen(m)
        return logits, new, tokens

    return fn


def _judge(model, impl, ref_impl, fn):
    """`impl` (fp32) against `ref_impl` in fp64 (the golden), by the float32 reference's error
    (the larger of `ref_impl`'s and `impl`'s on qkv's `reference` backend, as hf_helpers.judge
    does); `impl` in fp64 against the golden to ~1e-10; the same tokens."""
    got = run(model, impl, torch.float32, fn)
    refs = [run(model, ref_impl, torch.float32, fn)]
    with ReferenceAttention():
        refs.append(run(model, impl, torch.float32, fn))
    gold = run(model, ref_impl, torch.float64, fn)
    got64 = run(model, impl, torch.float64, fn)
    for what, i in (("prefill logits", 0), ("generate logits", 1)):
        worse = max(refs, key=lambda r: (r[i].double() - gold[i]).abs().max().item())[i]
        assert_error_ratio(got[i], worse, gold[i], what=what)
        assert_error_ratio(got64[i], refs[0][i], gold[i], what=f"{what} fp64")
    assert torch.equal(got[2], gold[2]) and torch.equal(got[2], refs[0][2]), "tokens"
    return got


class Spy:
    """Records each `qkv.attention` call's keyword arguments, with its `shape` (Nq, Nk)."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = qkv.attention

        def spy(q, k, v, **kwargs):
            self.calls.append({**kwargs, "shape": (q.shape[2], k.shape[2])})
            return real(q, k, v, **kwargs)

        monkeypatch.setattr(qkv, "attention", spy)


def _chosen(spy) -> list[tuple[masks.ChosenBlocks, tuple[int, int]]]:
    return [(c["mask"], c["shape"]) for c in spy.calls
            if isinstance(c.get("mask"), masks.ChosenBlocks)]  # fmt: skip


# --------------------------------------------------------------------------- models


@pytest.mark.parametrize("cls", ["Llama", "Qwen2"])
def test_keeping_every_block_equals_eager(cls, monkeypatch):
    model = _model(cls)
    fn = _prefill_and_generate(_ids(N_PROMPT))
    got = _judge(model, "sparse_all", "eager", fn)
    dense = run(model, "qkv", torch.float32, fn)
    assert torch.equal(got[2], dense[2])  # the same tokens as qkv's dense registration
    inputs = {"input_ids": _ids(N_PROMPT)}
    assert run(
        model, "sparse_all", torch.float32, lambda m: verify(m, inputs, name="sparse_all").ok
    )

    spy = Spy(monkeypatch)
    run(model, "sparse_all", torch.float32, fn)
    chosen = _chosen(spy)
    assert len(chosen) == len(spy.calls)  # every call selected (min_len=0) ...
    for m, (n_q, n_k) in chosen:  # ... and kept every block a causal query block sees
        assert torch.equal(m.to_dense(n_q, n_k).view(-1, n_q, n_k).all(0),
                           masks.causal().to_dense(n_q, n_k))  # fmt: skip


@pytest.mark.parametrize("setting", ["few", "mass"])
@pytest.mark.parametrize("cls", ["Llama", "Qwen2"])
def test_few_blocks_equal_eager_over_the_chosen_pairs(cls, setting, monkeypatch):
    model = _model(cls)
    fn = _prefill_and_generate(_ids(N_PROMPT))
    got = _judge(model, f"sparse_{setting}", REFERENCE[setting], fn)
    eager = run(model, "eager", torch.float32, fn)
    assert (got[0] - eager[0]).abs().max() > 1e-2  # the choice leaves out what matters

    spy = Spy(monkeypatch)
    run(model, f"sparse_{setting}", torch.float32, fn)
    chosen = _chosen(spy)
    layers = model.config.num_hidden_layers
    # the forward, generate()'s prefill, then its N_NEW − 1 decoding steps
    shapes = [shape for _, shape in chosen[::layers]]
    assert len(chosen) == len(spy.calls) == layers * (N_NEW + 1)
    assert shapes == [(N_PROMPT, N_PROMPT)] * 2 + [(1, N_PROMPT + t) for t in range(1, N_NEW)]
    left_out = [m.density(*shape) < masks.causal().density(*shape) for m, shape in chosen]
    assert all(left_out), left_out  # prefill and every decoding step read fewer pairs


def test_padded_batch_equals_each_row_alone():
    # Left padding (generate()'s): each row gets what it gets alone, its blocks counted from
    # its first real token (a forward with position ids from the mask, and greedy decoding).
    model = _model()
    lengths = [N_PROMPT, 45, 30]
    ids, am = padded_ids(97, lengths, N_PROMPT, side="left", seed=5)
    positions = (am.cumsum(-1) - 1).clamp(min=0)
    batch = run(model, "sparse_few", torch.float32, _prefill_and_generate(ids, am, positions))
    batch64 = run(model, "sparse_few", torch.float64, _prefill_and_generate(ids, am, positions))
    for b, n in enumerate(lengths):
        alone = _prefill_and_generate(ids[b : b + 1, N_PROMPT - n :])
        ref = run(model, REFERENCE["few"], torch.float32, alone)
        gold = run(model, REFERENCE["few"], torch.float64, alone)
        for i, what in ((0, "prefill logits"), (1, "generate logits")):
            got, got64 = batch[i][b : b + 1], batch64[i][b : b + 1]
            if i == 0:
                got, got64 = got[:, N_PROMPT - n :], got64[:, N_PROMPT - n :]
            assert_error_ratio(got, ref[i], gold[i], what=f"row {b} {what}")
            assert_error_ratio(got64, ref[i], gold[i], what=f"row {b} {what} fp64")
        assert torch.equal(batch[2][b, N_PROMPT:], gold[2][0, n:])


def test_right_padded_prefill_equals_each_row_alone():
    model = _model()
    lengths = [N_PROMPT, 37]
    ids, am = padded_ids(97, lengths, N_PROMPT, side="right", seed=6)
    fn = lambda m: m(ids, attention_mask=am).logits  # noqa: E731
    got = run(model, "sparse_few", torch.float32, fn)
    for b, n in enumerate(lengths):
        alone = lambda m, b=b, n=n: m(ids[b : b + 1, :n]).logits  # noqa: E731
        ref = run(model, REFERENCE["few"], torch.float32, alone)
        gold = run(model, REFERENCE["few"], torch.float64, alone)
        assert_error_ratio(got[b : b + 1, :n], ref, gold, what=f"row {b}")


def test_below_min_len_runs_the_dense_path(monkeypatch):
    # block 8, topk 2, local 1: selection starts at (2 + 1) · 8 + 1 = 25 keys. A prompt of 24:
    # the prefill is dense (qkv's causal path), every decoding step selects.
    name = hf_sparse.register("sparse_from_25", block=BLOCK, topk=2, local=1)
    assert hf_sparse.SELECTIONS[name].shortest == 25
    assert hf_sparse.SELECTIONS["qkv_sparse"].shortest == (16 + 1) * 64 + 1
    model = _model()
    spy = Spy(monkeypatch)
    run(model, name, torch.float32, generate_fn({"input_ids": _ids(24)}, 3))
    layers = model.config.num_hidden_layers
    kinds = ["chosen" if isinstance(c["mask"], masks.ChosenBlocks) else c["mask"]
             for c in spy.calls]  # fmt: skip
    assert kinds == [None] * layers + ["chosen"] * 2 * layers
    assert all(c["causal"] for c in spy.calls[:layers])


def test_sliding_window_layers_keep_their_window(monkeypatch):
    # Qwen2 with layers 2 and 3 sliding: the full layers select, the sliding ones run their
    # window as "qkv" does, and keeping every block equals eager.
    kw = dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=5, max_window_layers=2)
    model = _model("Qwen2", **kw)
    fn = _prefill_and_generate(_ids(N_PROMPT))
    _judge(model, "sparse_all", "eager", fn)
    spy = Spy(monkeypatch)
    run(model, "sparse_few", torch.float32, fn)
    kinds = [type(c["mask"]).__name__ if not isinstance(c["mask"], masks.Mask) or
             isinstance(c["mask"], masks.ChosenBlocks) else repr(c["mask"])
             for c in spy.calls]  # fmt: skip
    assert kinds[:4] == ["ChosenBlocks"] * 2 + ["sliding_window(4, 0)"] * 2, kinds
    assert all(k == "ChosenBlocks" for k in kinds[0::4] + kinds[1::4])


# --------------------------------------------------------------------------- the function itself


class _Layer(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("n_q, n_k", [(40, 40), (1, 53), (9, 50)])  # prefill, decode, chunk
def test_attention_function_is_exact_over_the_chosen_pairs(n_q, n_k):
    q, k, v = make_qkv(B=2, H=6, Hkv=2, Nq=n_q, Nk=n_k, D=8, dtype=torch.float64)
    chooser = sparse.BlockSelector(block=4, topk=2, local=1, sink=1)
    selection = hf_sparse.Selection(chooser, min_len=0)
    chosen = sparse.select_blocks(q, k, block=4, topk=2, local=1, sink=1)
    allowed = chosen.to_dense(n_q, n_k)
    assert not allowed.all(-1).all()  # something is left out
    out, w = hf_sparse.attention_forward(_Layer(), q, k, v, None, selection=selection)
    ref = qkv.attention(q, k, v, mask=allowed, backend="reference")
    assert w is None and out.shape == (2, n_q, 6, 8)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=0, atol=1e-12)
    # weights, when transformers records them: zero outside the chosen pairs
    out, w = hf_sparse.attention_forward(
        _Layer(), q, k, v, hf_sparse.Plain(None), selection=selection, output_attentions=True
    )
    _, ref_w = qkv.attention(q, k, v, mask=allowed, backend="reference", return_weights=True)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-12)
    assert (w[~allowed.expand_as(w)] == 0).all()


def test_attention_function_runs_padded_rows_alone():
    q, k, v = make_qkv(B=3, H=4, Hkv=2, Nq=1, Nk=45, D=8, dtype=torch.float64)
    valid = torch.ones(3, 45, dtype=torch.bool)
    valid[1, :12] = False  # left padding
    valid[2, :] = False  # no real token at all: zeros
    selection = hf_sparse.Selection(sparse.BlockSelector(block=4, topk=2), min_len=0)
    layer = _Layer()
    padded = hf_sparse.Plain(valid)
    out, _ = hf_sparse.attention_forward(layer, q, k, v, padded, selection=selection)
    for b, s in ((0, 0), (1, 12)):
        alone, _ = hf_sparse.attention_forward(
            layer, q[b : b + 1], k[b : b + 1, :, s:], v[b : b + 1, :, s:], None,
            selection=selection,
        )  # fmt: skip
        torch.testing.assert_close(out[b : b + 1], alone, rtol=0, atol=1e-12)
    assert (out[2] == 0).all()


# --------------------------------------------------------------------------- what is refused


def test_refuses_a_static_cache():
    fn = generate_fn({"input_ids": _ids(N_PROMPT)}, 2, cache_implementation="static")
    with pytest.raises(NotImplementedError, match="static cache"):
        run(_model(), "sparse_few", torch.float32, fn)
    # a static cache's decoding step: its query position is a tensor
    step = dict(batch_size=1, q_length=1, kv_length=64, q_offset=torch.tensor(61))
    with pytest.raises(NotImplementedError, match="static cache"):
        hf_sparse.make_mask(**step)


def test_refuses_padding_between_a_rows_tokens():
    # Right padding, then decoding: the new tokens follow the padding.
    ids, am = padded_ids(97, [N_PROMPT, 40], N_PROMPT, side="right")
    fn = generate_fn({"input_ids": ids, "attention_mask": am}, 2)
    with pytest.raises(ValueError, match="row 1's real tokens are not one contiguous run"):
        run(_model(), "sparse_few", torch.float32, fn)


def test_refuses_packed_sequences():
    # position_ids restarting (DataCollatorWithFlattening), no cache: a mask of transformers'
    # own pattern on a full-attention layer
    positions = torch.cat([torch.arange(30), torch.arange(31)])[None]
    fn = lambda m: m(_ids(N_PROMPT), position_ids=positions, use_cache=False)  # noqa: E731
    with pytest.raises(NotImplementedError, match="pattern beyond causal attention"):
        run(_model(), "sparse_few", torch.float32, fn)


def test_refuses_bidirectional_layers():
    config = transformers.BertConfig(
        vocab_size=99, hidden_size=48, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=96, max_position_embeddings=64,
    )  # fmt: skip
    model = build(transformers.BertModel, config)
    with pytest.raises(NotImplementedError, match="not causal"):
        run(model, "sparse_few", torch.float32, lambda m: m(_ids(20)))


def test_refuses_other_masks_and_a_position_bias():
    q, k, v = make_qkv(B=1, H=2, Nq=10, D=8)
    selection = hf_sparse.Selection()
    dense = torch.ones(1, 1, 10, 10, dtype=torch.bool).tril()
    with pytest.raises(NotImplementedError, match=r"a torch\.bool tensor"):
        hf_sparse.attention_forward(_Layer(), q, k, v, dense, selection=selection)
    with pytest.raises(NotImplementedError, match="position bias"):
        bias = torch.zeros(1, 2, 10, 10)
        hf_sparse.attention_forward(_Layer(), q, k, v, None, selection=selection,
                                    position_bias=bias)  # fmt: skip


@pytest.mark.parametrize(
    "kw, error",
    [
        (dict(topk=-1), ValueError),
        (dict(block=0), ValueError),
        (dict(threshold=1.5), ValueError),
        (dict(topk=None), ValueError),  # neither topk nor threshold
        (dict(min_len=-1), ValueError),
        (dict(name=""), TypeError),
    ],
)
def test_register_checks_its_arguments(kw, error):
    with pytest.raises(error):
        hf_sparse.register(**kw)
