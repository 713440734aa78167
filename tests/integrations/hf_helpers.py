"""How the transformers tests judge qkv against "eager", shared by their modules.

A model runs with "qkv" and with "eager" in fp32, and the golden is the same model (same
weights) run with "eager" in float64; qkv's error from the golden must be at most 2× the float32
reference's plus the rounding floor (`assert_error_ratio`, FlashAttention's rule). The float32
reference is the model with the textbook formula as its attention, run two ways: "eager"
(transformers' own) and "qkv" with every call on qkv's `reference` backend; the yardstick is the
larger of their two errors. Over a few elements one of them can land close to the golden by
luck: CLIP's logits_per_image (a handful of values, on a Zen 4 AMD EPYC with torch's AVX-512
kernels) read 4.8e-7 with eager and 1.3e-6 with the `reference` backend, where every one of
qkv's backends, torch's SDPA included, read 1.3–1.9e-6. The same model run with "qkv" in
float64 must match the golden to ~1e-10.

transformers' decoders upcast to float32 on purpose (softmax in eager attention, RMSNorm, RoPE),
which would make a model "in float64" a float32-accurate golden. The float64 runs therefore go
under `Float64Everywhere`, a torch function mode in which float32 means float64.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

import qkv

from ..helpers import assert_error_ratio


def build(cls, config, seed=0):
    """`cls(config)` with weights drawn from `seed`, in eval mode."""
    torch.manual_seed(seed)
    return cls(config).eval()


class Float64Everywhere(TorchFunctionMode):
    """Under this mode every request for float32 (`.float()`, `.to(torch.float32)`,
    `softmax(..., dtype=torch.float32)`, factories) gets float64 instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def run(model, impl, dtype, fn):
    """`fn` on a copy of `model` in `dtype` with attn_implementation `impl`, under no_grad."""
    m = copy.deepcopy(model).to(dtype)
    m.set_attn_implementation(impl)
    with torch.no_grad():
        if dtype != torch.float64:
            return fn(m)
        with Float64Everywhere():
            return fn(m)


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


class ReferenceAttention:
    """Within it, every `qkv.attention` call (the transformers backend's) runs qkv's `reference`
    backend: the textbook formula, step by step."""

    def __enter__(self):
        self.real = real = qkv.attention
        qkv.attention = lambda *a, **k: real(*a, **{**k, "backend": "reference"})

    def __exit__(self, *exc):
        qkv.attention = self.real


def judge(model, fn, select=lambda t: t, what="output"):
    """qkv (fp32) against eager (fp64), by the float32 reference's error (the larger of eager's
    and the `reference` backend's, module docstring), and qkv (fp64) against eager (fp64).
    `fn(model)` returns a tensor or a tuple of tensors; `select` picks the positions judged."""
    got = run(model, "qkv", torch.float32, fn)
    ref = run(model, "eager", torch.float32, fn)
    with ReferenceAttention():
        ref_qkv = run(model, "qkv", torch.float32, fn)
    gold = run(model, "eager", torch.float64, fn)
    got64 = run(model, "qkv", torch.float64, fn)
    assert len(as_tuple(got)) == len(as_tuple(gold)), (what, len(as_tuple(got)))
    for i, (g, r, rq, o, g64) in enumerate(
        zip(*map(as_tuple, (got, ref, ref_qkv, gold, got64)), strict=True)
    ):
        r, rq, o = select(r), select(rq), select(o)
        worse = max((r, rq), key=lambda x: (x.double() - o).abs().max().item())
        assert_error_ratio(select(g), worse, o, what=f"{what}[{i}]")
        assert_error_ratio(select(g64), r, o, what=f"{what}[{i}] fp64")
    return got


class Spy:
    """Wraps qkv.attention to record each call's mask, causal flag and dropout."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = qkv.attention

        def spy(*args, **kwargs):
            self.calls.append(kwargs)
            return real(*args, **kwargs)

        monkeypatch.setattr(qkv, "attention", spy)


def padded_ids(vocab, lengths, total, side="right", seed=1):
    """Token ids `(B, total)` in [3, vocab) and a 2-D padding mask with `lengths` real tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(lengths), total), generator=g)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for b, n in enumerate(lengths):
        if side == "right":
            mask[b, :n] = 1
        else:
            mask[b, total - n :] = 1
    return ids, mask


def generate_fn(inputs: dict, n_new: int, **kw) -> Callable:
    """A `fn(model)` for `run`: greedy generate() of `n_new` tokens from `inputs`, returning
    `(sequences, logits (B, n_new, V))`."""

    def fn(m):
        out = m.generate(
            **inputs,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **kw,
        )
        return out.sequences, torch.stack(out.logits, 1)

    return fn


def tiny_config(cls: str = "Llama", **kw):
    """A 2-layer config of transformers' `{cls}Config` with grouped heads (6 on 2), vocabulary
    97, width 96; `kw` overrides any of it."""
    import transformers

    base = dict(
        vocab_size=97,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,  # GQA: 3 query heads per key/value head
        max_position_embeddings=128,
        pad_token_id=0,
    )
    return getattr(transformers, f"{cls}Config")(**{**base, **kw})


def tiny_llama():
    """A 2-layer Llama with grouped heads (6 on 2), random weights, built by `build`."""
    import transformers

    return build(transformers.LlamaForCausalLM, tiny_config())


def tiny_mistral(window: int):
    """A 2-layer Mistral (every layer slides over `window` keys), built by `build`."""
    import transformers

    config = transformers.MistralConfig(
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
    return build(transformers.MistralForCausalLM, config)
