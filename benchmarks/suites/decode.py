"""Decoding: `qkv.nn.Transformer.generate` through KV caches, against a full re-forward per token
and against transformers' own `generate` on a model of the same shape.

- **Model:** `qkv.nn.Transformer` vocab 8192, d_model 512, 4 layers, 8 heads / 2 KV heads, RoPE,
  SwiGLU, RMSNorm, fp32, batch 1, greedy, CPU; `transformers`: a random-weight
  `LlamaForCausalLM` of the same shape with its own cache.
- Implementations: `qkv cache` = `Transformer.generate(prompt, new_tokens)` (the prompt once,
  then one position per token through per-layer `qkv.nn.KVCache`s); `re-forward` = the same
  tokens, each step running the whole sequence through the model; `transformers` =
  `generate(..., do_sample=False)`; `prompt forward` = one forward of the prompt.
- **Per token** = (median time of the whole generation − median time of the prompt's forward) /
  new tokens, all measured in the same interleaved run.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch

from qkv import nn as qnn

from .. import report as rp
from ..results import Results
from ..suite import FWD, Group, Impl, Suite, Target

VOCAB, D_MODEL, LAYERS, HEADS, KV_HEADS = 8192, 512, 4, 8, 2


@dataclasses.dataclass(frozen=True)
class Case:
    prompt: int
    new_tokens: int


@dataclasses.dataclass(frozen=True)
class Settings:
    prompts: tuple[int, ...]
    new_tokens: int
    repeats: int


FULL = Settings((128, 512, 2048), 32, 3)
QUICK = Settings((128,), 8, 1)


@functools.cache
def model() -> qnn.Transformer:
    torch.manual_seed(0)
    return qnn.Transformer(
        VOCAB,
        D_MODEL,
        LAYERS,
        HEADS,
        KV_HEADS,
        max_len=4096,
        positions="rope",
        ffn="swiglu",
        norm="rmsnorm",
    ).eval()


@functools.cache
def hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=-(-(8 * D_MODEL // 3) // 8) * 8,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).eval()


def reforward(ids: torch.Tensor, new: int) -> torch.Tensor:
    for _ in range(new):
        ids = torch.cat([ids, model()(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def transformers_generate(c: Case):
    m = hf_model()
    return lambda ids: m.generate(
        ids,
        max_new_tokens=c.new_tokens,
        min_new_tokens=c.new_tokens,
        do_sample=False,
        pad_token_id=0,
    )


def no_transformers(c: Case, r: Results) -> str | None:
    return (
        None
        if importlib.util.find_spec("transformers")
        else "skipped (transformers is not installed)"
    )


GROUP = Group(
    name="decode",
    cases=lambda s: [Case(n, s.new_tokens) for n in s.prompts],
    inputs=lambda c, _: (
        (
            torch.randint(
                0, VOCAB, (1, c.prompt), generator=torch.Generator().manual_seed(c.prompt)
            ),
        ),
        None,
    ),
    impls=(
        Impl("prompt forward", lambda c: lambda ids: model()(ids), passes=(FWD,)),
        Impl(
            "qkv cache",
            lambda c: lambda ids: model().generate(ids, c.new_tokens, temperature=0),
            passes=(FWD,),
        ),
        Impl("re-forward", lambda c: lambda ids: reforward(ids, c.new_tokens), passes=(FWD,)),
        Impl("transformers", transformers_generate, skip=no_transformers, passes=(FWD,)),
    ),
    passes=(FWD,),
    repeats=lambda s, c: s.repeats,
)


def per_token(row: rp.Row, impl: str) -> float | None:
    """(median generation time − median prompt forward) / new tokens, in seconds."""
    total, prompt = row.median(FWD, impl), row.median(FWD, "prompt forward")
    if total is None or prompt is None:
        return None
    return (total - prompt) / row.case.new_tokens


def speedup(row: rp.Row) -> float | None:
    cache, again = per_token(row, "qkv cache"), per_token(row, "re-forward")
    return again / cache if cache and again is not None else None


def ms_per_token(impl: str) -> rp.Column:
    return rp.Column(
        f"{impl} ms/token",
        lambda r: rp.fmt(None if (t := per_token(r, impl)) is None else t * 1e3, ".2f"),
    )


TABLE = rp.Table(
    (
        rp.field("prompt"),
        rp.field("new_tokens", "new tokens"),
        rp.Column(
            "prompt forward ms",
            lambda r: rp.fmt(
                None if (t := r.median(FWD, "prompt forward")) is None else t * 1e3, ".1f"
            ),
        ),
        ms_per_token("qkv cache"),
        ms_per_token("re-forward"),
        ms_per_token("transformers"),
        rp.Column("re-forward ÷ cache", lambda r: rp.fmt(speedup(r), ".1f") + "×"),
    ),
    lambda r: rp.case_rows(r, "decode"),
)


SUITE = Suite(
    name="decode",
    title="Decoding through the KV cache",
    settings={"full": FULL, "quick": QUICK},
    steps=(GROUP,),
    targets=(
        Target(
            "cache vs full re-forward per token, prompt 512",
            lambda r: next(
                (
                    speedup(rp.Row(r, "decode", c))
                    for c in r.case_objects("decode")
                    if c.prompt == 512
                ),
                None,
            ),
            5.0,
            digits=1,
        ),
    ),
    report=(TABLE,),
    doc=__doc__,
    method=lambda r: [f"- Timed rounds: {r.settings['repeats']}."],
)
