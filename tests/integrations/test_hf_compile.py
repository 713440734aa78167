"""A transformers model with attn_implementation="qkv" under `torch.compile(fullgraph=True)`.

Each case is traced with `torch._dynamo.explain` (one graph, no break), then compiled with
`fullgraph=True` (which raises on a break) under a counting backend (one frame compiled, also
over several decode steps: no recompiles). The numbers: against the same model run eagerly with
qkv, bit for bit where the compiled graph runs the same ops on the same backend (AOTAutograd
without inductor's code generation, as in tests/test_compile.py), and under the error-ratio
rule (hf_helpers) where it cannot: a padded batch reaches qkv as a key mask plus `causal=True`
while compiling (no values are read) and as `masks.causal() & masks.key_mask(...)` in eager; a
sliding window or a packed batch as transformers' dense mask while compiling (their predicates
are closures dynamo cannot read) and as a structured Mask in eager; and inductor re-derives the
model's own norms and products. One case runs inductor itself.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="needs: pip install -e '.[hf]'")
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

import qkv  # noqa: E402
from qkv.integrations import hf  # noqa: E402

from ..helpers import assert_error_ratio  # noqa: E402
from .hf_helpers import Float64Everywhere, padded_ids, run, tiny_llama, tiny_mistral  # noqa: E402

hf.register()


def _llama():
    return tiny_llama()


def _mistral(window=5):
    return tiny_mistral(window)


MODELS = {"llama": _llama, "mistral": _mistral}


def _explain(fn, *args) -> tuple[int, int, list[str]]:
    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(*args)
    return ex.graph_count, ex.graph_break_count, [str(r.reason)[:300] for r in ex.break_reasons]


def _qkv(model, dtype=torch.float32):
    m = copy.deepcopy(model).to(dtype)
    m.set_attn_implementation("qkv")
    return m


def test_register_checked_the_predicates():
    # Under compile the per-call spot check cannot read values; register() checks instead.
    assert hf._TRUSTED is True


@pytest.mark.slow
@pytest.mark.parametrize("padding", ["absent", "all-real", "left"])
@pytest.mark.parametrize("family", list(MODELS))
def test_prefill_compiles_in_one_graph(family, padding):
    model = MODELS[family]()
    lengths = [20, 13] if padding == "left" else [20, 20]
    ids, am = padded_ids(97, lengths, 20, side="left")
    real = am.bool()
    mask = None if padding == "absent" else am

    def fn(m):
        return m(ids, attention_mask=mask).logits

    m = _qkv(model)
    with torch.no_grad():
        graphs, breaks, reasons = _explain(lambda ids: m(ids, attention_mask=mask).logits, ids)
        assert (graphs, breaks) == (1, 0), reasons
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(m, fullgraph=True, backend=counter)
        got, want = fn(compiled), fn(m)
    assert counter.frame_count == 1
    if padding == "absent" and family == "llama":  # causal=True, no mask: eager's very call
        assert torch.equal(got, want)
    gold = run(model, "eager", torch.float64, fn)
    assert_error_ratio(got[real], want[real], gold[real], what="compiled logits")


def _full_mask(am: torch.Tensor, total: int) -> torch.Tensor:
    """The prompt's padding mask over all `total` slots of a static cache (slots after the
    prompt count as real; causality hides them until they are written), so that every decode
    step has the same input shapes."""
    return torch.cat([am, am.new_ones(am.shape[0], total - am.shape[1])], 1)


def _decode(m, ids, am, steps, total, step_fn=None):
    """Eager prefill into a StaticCache, then `steps` greedy decode steps through `step_fn`
    (default: the model itself); returns the logits of every step, `(B, steps, V)`."""
    cache = transformers.StaticCache(config=m.config, max_cache_len=total)
    full = _full_mask(am, total)
    logits = m(ids, attention_mask=am, cache=cache, use_cache=True).logits[:, -1:]
    step_fn = step_fn or (lambda tok, mask, cache: m(tok, attention_mask=mask, cache=cache).logits)
    out = []
    for _ in range(steps):
        logits = step_fn(logits.argmax(-1), full, cache)
        out.append(logits)
    return torch.cat(out, 1)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MODELS))
def test_static_cache_decode_step_compiles_in_one_graph(family):
    # transformers' recipe for compiled decoding: a StaticCache filled by an eager prefill,
    # then the one-token forward compiled. A full-attention cache keeps its position in a
    # tensor (one graph for every step); a sliding-window one also keeps it as an int, which
    # torch.compile specialises on once, for "sdpa" as for "qkv".
    model = MODELS[family]()
    ids, am = padded_ids(97, [12, 7], 12, side="left")
    total = 20

    def compiled_decode(m):
        def step(tok, mask, cache):
            return m(tok, attention_mask=mask, cache=cache, use_cache=True).logits

        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        logits = _decode(m, ids, am, 4, total, torch.compile(step, fullgraph=True, backend=counter))
        return logits, counter.frame_count

    m = _qkv(model)
    with torch.no_grad():
        cache = transformers.StaticCache(config=m.config, max_cache_len=total)
        m(ids, attention_mask=am, cache=cache, use_cache=True)
        step = lambda tok, mask, cache: m(tok, attention_mask=mask, cache=cache).logits  # noqa: E731
        graphs, breaks, reasons = _explain(step, ids[:, -1:], _full_mask(am, total), cache)
        assert (graphs, breaks) == (1, 0), reasons

        got, frames = compiled_decode(m)
        want = _decode(m, ids, am, 4, total)
        sdpa = copy.deepcopy(model)
        sdpa.set_attn_implementation("sdpa")
        _, sdpa_frames = compiled_decode(sdpa)
    assert frames == sdpa_frames == (1 if family == "llama" else 2)
    assert torch.equal(got, want)


@pytest.mark.slow
def test_static_cache_decode_step_under_inductor():
    model = _llama()
    ids, am = padded_ids(97, [12, 7], 12, side="left")
    total = 16

    def decode(m, compile_it=False):
        def step(tok, mask, cache):
            return m(tok, attention_mask=mask, cache=cache, use_cache=True).logits

        torch._dynamo.reset()
        fn = torch.compile(step, fullgraph=True) if compile_it else step
        return _decode(m, ids, am, 3, total, fn)

    with torch.no_grad():
        got = decode(_qkv(model), compile_it=True)
        want = decode(_qkv(model))
        with Float64Everywhere():
            gold = decode(_qkv(model, torch.float64))
    assert_error_ratio(got, want, gold, what="inductor decode logits")


def test_packed_batch_compiles_in_one_graph():
    # Packed sequences (position_ids restart, no padding mask, no cache): transformers always
    # builds its packed predicate while tracing, and qkv takes transformers' dense mask then
    # (where one sequence ends is in the values).
    model = _llama()
    lengths = [5, 9, 6]
    ids = torch.randint(3, 97, (1, sum(lengths)), generator=torch.Generator().manual_seed(4))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    m = _qkv(model)

    def fn(m):
        return m(ids, position_ids=pos, use_cache=False).logits

    with torch.no_grad():
        graphs, breaks, reasons = _explain(lambda i: m(i, position_ids=pos, use_cache=False), ids)
        assert (graphs, breaks) == (1, 0), reasons
        torch._dynamo.reset()
        got = fn(torch.compile(m, fullgraph=True, backend="aot_eager"))
    want, gold = fn(m), run(model, "eager", torch.float64, fn)
    assert_error_ratio(got, want, gold, what="compiled packed logits")


@pytest.mark.slow
def test_training_step_compiles_with_padding():
    model = _llama()
    ids, am = padded_ids(97, [16, 11], 16, side="left")
    real = am.bool()
    labels = ids.masked_fill(~real, -100)

    def grads(m, compile_it=False):
        m = copy.deepcopy(m).train()

        def step(i, a):
            return m(i, attention_mask=a, labels=labels).loss

        if compile_it:
            torch._dynamo.reset()
            step = torch.compile(step, fullgraph=True, backend="aot_eager")
        loss = step(ids, am)
        loss.backward()
        return [loss.detach()] + [p.grad.detach().clone() for p in m.parameters()]

    m = _qkv(model)
    graphs, breaks, reasons = _explain(
        lambda i, a: m(i, attention_mask=a, labels=labels).loss, ids, am
    )
    assert (graphs, breaks) == (1, 0), reasons
    got, want = grads(m, compile_it=True), grads(m)
    with Float64Everywhere():
        gold = grads(_qkv(model, torch.float64).eval())
    for i, (g, w, o) in enumerate(zip(got, want, gold, strict=True)):
        assert_error_ratio(g, w, o, what=f"loss and gradients [{i}]")


def test_compiled_padded_causal_mask_is_linear_in_keys(monkeypatch):
    # While compiling, a padded causal layer gets its real keys (B, 1, 1, Nk) and causal=True,
    # not an N² mask; in eager, causal() & key_mask(...).
    model = _llama()
    ids, am = padded_ids(97, [14, 9], 14, side="left")
    m = _qkv(model)
    seen = []
    real = qkv.attention

    def spy(*args, **kwargs):
        seen.append((kwargs["mask"], kwargs["causal"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(qkv, "attention", spy)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(m, fullgraph=True, backend="eager")(ids, attention_mask=am)
    assert len(seen) == 2
    for mask, causal in seen:
        assert causal and isinstance(mask, torch.Tensor) and tuple(mask.shape) == (2, 1, 1, 14)
