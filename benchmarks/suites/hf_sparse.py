"""transformers with content-selected blocks (`qkv.integrations.hf_sparse`) on the e2e model
shape: prefill and decoding with "qkv_sparse" against "qkv" (dense) and "sdpa".

- **Model:** the e2e suite's (benchmarks/suites/e2e.py): `LlamaForCausalLM` with random weights
  (no download) in the shape of Qwen2.5-0.5B (hidden 896, 14 query heads on 2 key/value heads,
  head dim 64, MLP 4864, vocabulary 4096), 2 layers (1 in the quick run), fp32, B=1, CPU; the
  same weights for every implementation.
- Implementations: `qkv_sparse` = `qkv.integrations.hf_sparse.register("qkv_sparse",
  block=…, topk=…, local=…, sink=…)` (settings in the method below; `min_len` its default, so
  every call here selects); `qkv` = `qkv.integrations.hf.register()`, qkv's dense path; `sdpa`
  is transformers' own.
- **Prefill** = `model(ids, logits_to_keep=1)`. **max rel. diff** = max |logits − SDPA's| /
  max |SDPA's| of the last position: what leaving blocks out changes (0 for "qkv" up to
  rounding); **blocks read** = the share of the causal key blocks the choice reads (each query
  block reads at most `topk + local + sink` of the blocks it sees), from the settings.
- **Decoding:** as in the e2e suite: the prompt minus its last token is prefilled once per case,
  untimed, by `sdpa` (a `DynamicCache`; a static cache is refused by qkv_sparse), and every call
  continues from a copy of that cache with greedy `generate(max_new_tokens=T)`; the `… 1 token`
  rows are the same call with T=1. **ms/step** = (median T-token call − median 1-token call) /
  (T − 1); **step ×SDPA** = SDPA's step time / the row's, per round, the median. Each
  qkv_sparse step pools the whole cache's keys (transformers' cache keeps no pooled keys), then
  reads the chosen blocks. **tokens** compares the generated ids with SDPA's (a choice that
  leaves blocks out may change them).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings

from .. import report as rp
from ..results import Results
from ..suite import FWD, Group, Impl, Suite
from . import e2e
from .hf import relative_diff

NAME = "qkv_sparse"
IMPLS = (NAME, "qkv", "sdpa")


@dataclasses.dataclass(frozen=True)
class Settings:
    layers: int
    prefill: tuple[int, ...]  # prompt lengths
    decode: tuple[int, ...]  # prompt lengths
    new_tokens: int
    block: int
    topk: int
    local: int
    sink: int
    repeats: int
    decode_repeats: int


FULL = Settings(
    layers=2,
    prefill=(8192, 16384),
    decode=(16384,),
    new_tokens=16,
    block=64,
    topk=16,
    local=1,
    sink=0,
    repeats=3,
    decode_repeats=5,
)
QUICK = Settings(
    layers=1,
    prefill=(1024,),
    decode=(1024,),
    new_tokens=3,
    block=64,
    topk=4,  # 16 key blocks at 1024: the choice reads at most 5
    local=1,
    sink=0,
    repeats=1,
    decode_repeats=1,
)
SETTINGS = FULL  # the run in progress (`prepare` sets it; the impls read the layer count)


@dataclasses.dataclass(frozen=True)
class Prefill:
    n: int
    block: int
    topk: int


@dataclasses.dataclass(frozen=True)
class Decode:
    prompt: int
    new_tokens: int
    block: int
    topk: int


def blocks_read(n_q: int, n_k: int, s: Settings) -> float:
    """The share of the causal key blocks (those holding a key at or before a query block's
    last position) that a choice of `topk + local + sink` blocks per query block reads, over
    the query blocks of an (Nq, Nk) call."""
    keep = s.topk + s.local + s.sink
    seen = read = 0
    for r in range(max(1, -(-n_q // s.block))):
        last = min((r + 1) * s.block, n_q) - 1 + n_k - n_q  # the block's last position
        visible = last // s.block + 1
        seen, read = seen + visible, read + min(visible, keep)
    return read / seen if seen else 1.0


def prefill_impl(name: str) -> Impl:
    def make(c: Prefill):
        m = e2e.hf_model("dense", SETTINGS.layers, name)
        return lambda ids: m(ids, logits_to_keep=1).logits

    return Impl(name, make, passes=(FWD,))


def decode_case(c: Decode) -> e2e.Decode:
    """The e2e suite's case of the same prompt (its prefilled cache and ids)."""
    return e2e.Decode(c.prompt, "dynamic", c.new_tokens)


def decode_impl(name: str, one: bool = False) -> Impl:
    def make(c: Decode):
        m = e2e.hf_model("dense", SETTINGS.layers, name)
        cache = e2e.prefilled(decode_case(c), SETTINGS.layers)
        return e2e.greedy_from(m, cache, 1 if one else c.new_tokens)

    return Impl(name + e2e.ONE if one else name, make, passes=(FWD,))


PREFILL = Group(
    name="sparse_prefill",
    cases=lambda s: [Prefill(n, s.block, s.topk) for n in s.prefill],
    inputs=lambda c, _: ((e2e.ids_of(c.n),), None),
    impls=tuple(prefill_impl(name) for name in IMPLS),
    passes=(FWD,),
    anchors=("sdpa",),
    repeats=lambda s, c: s.repeats,
    check=relative_diff,
    describe=lambda c: {"blocks_read": blocks_read(c.n, c.n, SETTINGS)},
)
DECODE = Group(
    name="sparse_decode",
    cases=lambda s: [Decode(n, s.new_tokens, s.block, s.topk) for n in s.decode],
    inputs=lambda c, _: ((e2e.decode_ids(decode_case(c)),), None),
    impls=tuple(decode_impl(name, one) for name in IMPLS for one in (False, True)),
    passes=(FWD,),
    anchors=("sdpa",),
    repeats=lambda s, c: s.decode_repeats,
    check=e2e.same_tokens,
    describe=lambda c: {"blocks_read": blocks_read(1, c.prompt, SETTINGS)},
)


def requires() -> str | None:
    if importlib.util.find_spec("transformers") is None:
        return "needs transformers: pip install -e '.[hf]'"
    return None


def prepare(s: Settings) -> None:
    global SETTINGS
    import transformers

    import qkv.integrations.hf_sparse

    SETTINGS = s
    qkv.integrations.hf_sparse.register(
        NAME, block=s.block, topk=s.topk, local=s.local, sink=s.sink
    )  # and "qkv"
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    e2e.prefilled.cache_clear()
    e2e.base_model.cache_clear()


def facts(_: Settings) -> dict[str, object]:
    import transformers

    return {"software": {"transformers": transformers.__version__}}


def method(r: Results) -> list[str]:
    s = r.settings
    return [
        f"- qkv_sparse: block {s['block']}, topk {s['topk']}, local {s['local']}, sink "
        f"{s['sink']}; {s['layers']} layer(s); timed rounds: {s['repeats']} (prefill), "
        f"{s['decode_repeats']} (decoding, T = {s['new_tokens']})."
    ]


def _read(r: rp.Row) -> str:
    """qkv_sparse's share of blocks read (a figure of the case), on its row only."""
    if r.impl != NAME:
        return "—"
    record = r.results.case_record(r.group, r.case)
    share = record.extras.get("blocks_read") if record else None
    return "—" if share is None else f"{100 * share:.0f}%"


PREFILL_TABLE = rp.Table(
    (
        rp.field("n", "N"),
        rp.impl_column(),
        rp.time_column(FWD, "prefill ms"),
        rp.ratio_column(FWD, "sdpa", "×SDPA"),
        rp.ratio_column(FWD, "sdpa", "×SDPA range", span=True),
        rp.Column("blocks read", _read),
        rp.Column("max rel. diff vs sdpa", lambda r: rp.fmt(r.extra("rel_diff"), ".1e")),
    ),
    lambda r: rp.rows(r, "sparse_prefill"),
    "Prefill",
)
DECODE_TABLE = rp.Table(
    (
        rp.field("prompt"),
        rp.field("new_tokens", "T"),
        rp.impl_column(),
        rp.time_column(FWD, "T tokens ms"),
        rp.Column("1 token ms", lambda r: rp.time_cell(r.timing(FWD, (r.impl or "") + e2e.ONE))),
        rp.Column("ms/step", lambda r: e2e.ms(e2e.step_s(r), ".2f")),
        rp.Column("step ×SDPA", lambda r: rp.fmt(e2e.step_ratio(r), ".2f")),
        rp.Column("blocks read", _read),
        rp.Column("tokens", lambda r: r.extra("tokens") or "—", "l"),
    ),
    lambda r: [row for row in rp.rows(r, "sparse_decode") if not row.impl.endswith(e2e.ONE)],
    "Decoding: ms per step after the prompt",
)
SUITE = Suite(
    name="hf_sparse",
    title="transformers: content-selected blocks (`qkv_sparse`) on the e2e model shape",
    settings={"full": FULL, "quick": QUICK},
    steps=(PREFILL, DECODE),
    report=(PREFILL_TABLE, DECODE_TABLE),
    doc=__doc__,
    method=method,
    requires=requires,
    prepare=prepare,
    facts=facts,
)
