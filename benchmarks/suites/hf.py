"""transformers: a model's forward with attn_implementation "qkv" against "sdpa" and "eager".

- Model: random weights (no download), fp32, B=1, CPU; hidden 512, 8 query heads and 2
  key/value heads (head dim 64), MLP 1376, 4 layers, vocabulary 1024; `LlamaModel` (no LM head)
  for dense, `MistralModel` with a sliding window for the sliding-window rows. The time is
  `model(input_ids)`.
- `qkv` = `qkv.integrations.hf.register()` then `set_attn_implementation("qkv")`: every
  attention layer calls `qkv.attention`. Without padding a causal model gets no mask and
  `causal=True`; the sliding-window model gets `qkv.masks.sliding_window(w − 1, 0)`, which
  `auto` runs on qkv's block-sparse `tiled` kernel. `sdpa` and `eager` are transformers' own
  (for the window, `sdpa` gets transformers' dense N×N bool mask).
- Max rel. diff = max |out − out_sdpa| / max |out_sdpa| of the last hidden state (a sanity check
  that the rows compute the same thing; 0 means bit-identical). `eager` materialises the N×N
  fp32 scores of every head (8·N²·4 B per layer) and is skipped at large N.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable

import torch

from .. import report as rp
from ..results import Results
from ..suite import FWD, Group, Impl, Suite, Target

MODEL = dict(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1376,  # Llama-2's 2.6875×
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=16384,
)
DENSE_TARGET, SLIDING_TARGET = 0.95, 3.0


@dataclasses.dataclass(frozen=True)
class Case:
    model: str  # "dense" (LlamaModel) or "sliding" (MistralModel with a window)
    n: int
    window: int


@dataclasses.dataclass(frozen=True)
class Settings:
    dense_sizes: tuple[int, ...]
    eager_max: int  # eager runs up to this N
    window: int
    sliding_n: int
    repeats: dict[int, int]  # timed rounds by N


FULL = Settings(
    (512, 1024, 2048, 4096, 8192), 4096, 512, 8192, {512: 31, 1024: 21, 2048: 11, 4096: 5, 8192: 5}
)
QUICK = Settings((128, 256), 256, 64, 1024, {128: 2, 256: 2, 1024: 2})


def cases(s: Settings) -> list[Case]:
    return [Case("dense", n, s.window) for n in s.dense_sizes] + [
        Case("sliding", s.sliding_n, s.window)
    ]


def model(c: Case, impl: str):
    import transformers

    torch.manual_seed(0)  # every implementation gets the same weights
    if c.model == "dense":
        m = transformers.LlamaModel(transformers.LlamaConfig(**MODEL))
    else:
        m = transformers.MistralModel(transformers.MistralConfig(**MODEL, sliding_window=c.window))
    m.eval().set_attn_implementation(impl)
    return lambda ids: m(ids).last_hidden_state


def impl(name: str, **kwargs) -> Impl:
    return Impl(name, lambda c: model(c, name), passes=(FWD,), **kwargs)


def eager_skip(c: Case, r: Results) -> str | None:
    limit = r.settings["eager_max"]
    return f"skipped (N > {limit}: eager's N×N scores)" if c.n > limit else None


def relative_diff(c: Case, outs: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """max |out − out_sdpa| / max |out_sdpa| of the last hidden state."""
    anchor = outs["sdpa"]
    scale = anchor.abs().max().item()
    return {name: {"rel_diff": (o - anchor).abs().max().item() / scale} for name, o in outs.items()}


def inputs(c: Case, backward: bool):
    gen = torch.Generator().manual_seed(1)
    return (torch.randint(0, MODEL["vocab_size"], (1, c.n), generator=gen),), None


GROUP = Group(
    name="hf",
    cases=cases,
    inputs=inputs,
    impls=(
        impl("qkv"),
        impl("sdpa"),
        impl("eager", skip=eager_skip, when=lambda c: c.model == "dense"),
    ),
    passes=(FWD,),
    anchors=("sdpa",),
    repeats=lambda s, c: s.repeats.get(c.n, 3),
    check=relative_diff,
)


def requires() -> str | None:
    if importlib.util.find_spec("transformers") is None:
        return "needs transformers: pip install -e '.[hf]'"
    return None


def prepare(_: Settings) -> None:
    import transformers

    import qkv.integrations.hf

    qkv.integrations.hf.register()
    transformers.logging.set_verbosity_error()


def facts(_: Settings) -> dict[str, object]:
    import transformers

    return {"software": {"transformers": transformers.__version__}}


def method(r: Results) -> list[str]:
    s = r.settings
    rounds = ", ".join(f"{v} at N={n}" for n, v in s["repeats"].items())
    return [f"- Window {s['window']}; timed rounds: {rounds}; `eager` up to N={s['eager_max']}."]


def table(kind: str, title: Callable[[Results], str]) -> rp.Table:
    return rp.Table(
        (
            rp.field("n", "N"),
            rp.impl_column(),
            rp.time_column(FWD, "forward ms"),
            rp.ratio_column(FWD, "sdpa", "×SDPA", digits=3),
            rp.ratio_column(FWD, "sdpa", "×SDPA range over rounds", span=True),
            rp.Column("max rel. diff vs sdpa", lambda r: rp.fmt(r.extra("rel_diff"), ".1e")),
            rp.Column("rounds", lambda r: str(r.timing(FWD).rounds)),
        ),
        lambda r: rp.rows(r, "hf", lambda c: c.model == kind),
        title,
    )


def ratio_at(model_: str, n: int, window: int = 512):
    return lambda r: r.ratio("hf", Case(model_, n, window), "qkv", FWD, "sdpa")


SUITE = Suite(
    name="hf",
    title='transformers: a model\'s forward with `attn_implementation="qkv"`',
    settings={"full": FULL, "quick": QUICK},
    steps=(GROUP,),
    targets=(
        *(
            Target(
                f'dense LlamaModel forward, "qkv" ×SDPA at N={n}',
                ratio_at("dense", n),
                DENSE_TARGET,
                digits=3,
            )
            for n in FULL.dense_sizes
        ),
        Target(
            f"sliding-window (w={FULL.window}) MistralModel forward at N={FULL.sliding_n}, "
            '"qkv" ×SDPA',
            ratio_at("sliding", FULL.sliding_n, FULL.window),
            SLIDING_TARGET,
            digits=3,
        ),
    ),
    report=(
        table("dense", lambda r: "Dense (causal) forward"),
        table("sliding", lambda r: f"Sliding window (w={r.settings['window']}) forward"),
    ),
    doc=__doc__,
    method=method,
    ceiling=True,
    requires=requires,
    prepare=prepare,
    facts=facts,
)
