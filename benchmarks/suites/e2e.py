"""End to end: a Qwen2.5-0.5B-shaped model through transformers with `attn_implementation`
"qkv" against "sdpa" and "eager": prefill, decoding, a sliding window, training steps,
a nanoGPT training step and `torch.compile`.

- **Model:** `LlamaForCausalLM` with random weights (no download) in the shape of Qwen2.5-0.5B:
  hidden 896, 14 query heads and 2 key/value heads (head dim 64), MLP 4864, RoPE θ 10⁶,
  RMSNorm ε 10⁻⁶, tied embeddings; but 2 layers (Qwen2.5-0.5B has 24) and a vocabulary of 4096
  (151 936) so that the LM head stays cheap and the whole run fits in about 20 minutes on two
  cores. Every layer does the same work, so the shares of time below are those of the full
  depth; the LM head's share is smaller than in the real model. B=1, CPU, fp32 unless a row
  says bf16 (the same weights cast).
- Implementations: `qkv` = `qkv.integrations.hf.register()`, then
  `set_attn_implementation("qkv")`; `sdpa` and `eager` are transformers' own. `eager`
  materialises every head's N×N fp32 scores and is skipped above the sizes given below.
- **Prefill** = `model(ids, logits_to_keep=1)` (what `generate()` computes for a prompt: the
  cache filled, the last position's logits).
- **Decoding:** greedy, `generate(ids, cache=…, max_new_tokens=T, min_new_tokens=T,
  do_sample=False)` with a `DynamicCache` or a `StaticCache`. The prompt minus its last token
  is prefilled once per case, untimed, by `sdpa`, and every call continues from a copy of that
  cache (so a call is decoding, not a 16k prefill with a little decoding on top, and every
  implementation reads the same keys and values); the `… 1 token` rows are the same call with
  T=1 (the copy, the last prompt token, the first new token). **ms/step** = (median time of the
  T-token call − median time of the 1-token call) / (T − 1), both timed in the same interleaved
  run; **tok/s** = 1000 / ms per step; **step ×SDPA** = SDPA's step time / the row's, per
  round, the median over rounds. **tokens** compares the generated ids with SDPA's.
- **Sliding window:** `MistralForCausalLM` with the same weights (Mistral is Llama with a
  window) and `sliding_window` = w: transformers builds a sliding-window mask for every layer
  (the outputs check below confirms that the window changes the logits); `qkv` gets
  `qkv.masks.sliding_window(w − 1, 0)`, `sdpa` transformers' dense N×N bool mask.
- **Training step** = `zero_grad(set_to_none=True)`, `model(ids, labels=ids,
  use_cache=False).loss`, `.backward()`, in train mode (no dropout: the config has none). A
  bf16 row casts the same weights to bf16 (no autocast: activations, attention and gradients in
  bf16; transformers computes the loss from the logits cast to fp32).
- **nanoGPT:** Karpathy's nanoGPT block (LayerNorm, one `c_attn` projection split into q, k, v,
  GELU MLP 4×, learned positions, tied LM head) with d_model 768, 12 heads (head dim 64), 4
  layers, vocabulary 4096, in this file; its attention is `qkv.attention(q, k, v, causal=True)`
  or `F.scaled_dot_product_attention(q, k, v, is_causal=True)` on the same strided views of the
  `c_attn` output. The time is one training step as above.
- **Compiled:** `torch.compile(model, fullgraph=True, dynamic=False)` of the prefill, for
  `qkv` and `sdpa` (ratios against compiled `sdpa`; `sdpa, no compile` is the plain model).
  "first call s" is the warm-up call (tracing and compiling) minus the median. A model that
  does not compile is a row with the reason. No attention share here (a timer inside the
  model would break the graph).
- **Attention share:** while an implementation is timed, transformers' attention function for
  it (the entry of its `AttentionInterface`, or the model's `eager_attention_forward`) runs
  wrapped in a timer: the wall time of every attention call in the forward, and in a training
  step the backward from the moment the gradient reaches the attention output to the moment
  the gradients of q, k and v leave (two identity autograd nodes mark them; autograd runs a
  layer's attention backward in one stretch on CPU). **attn %** = median attention seconds per
  timed call / median call time; **attn ×SDPA** = SDPA's attention seconds / the row's: the
  speed of attention itself, which bounds what the whole model can gain. For decoding both
  are per step (the T-token call minus the 1-token call). **ceiling ×SDPA** = SDPA's time /
  (SDPA's time − SDPA's attention time): the ×SDPA the case would reach if attention took no
  time at all, which no attention implementation can pass (a target above it is out of reach
  for this model shape on this machine).
- **Outputs** are checked before anything is timed, on a short prompt: logits of every
  implementation against a float64 `eager` run of the same weights, under the error rule of
  docs/design.md (`max|impl − golden| ≤ 2·max|sdpa − golden| + one rounding of max|golden|`),
  and greedy tokens of `qkv` and `eager` against `sdpa` with both caches; the decoding rows
  compare their generated tokens too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.util
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import qkv

from .. import report as rp
from ..results import Results, Timing, case_key
from ..suite import FWD, FWD_BWD, Group, Impl, Prepared, Stage, Suite, Target

VOCAB = 4096
MODEL = dict(
    vocab_size=VOCAB,
    hidden_size=896,
    intermediate_size=4864,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    tie_word_embeddings=True,
)
NANO = dict(vocab=VOCAB, d_model=768, heads=12)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
HF_IMPLS = ("qkv", "sdpa", "eager")
ONE = " 1 token"  # suffix of the decoding rows that generate one token


# --------------------------------------------------------------------------- settings and cases


@dataclasses.dataclass(frozen=True)
class Settings:
    layers: int  # of the transformers model
    nanogpt_layers: int
    prefill: tuple[tuple[int, str], ...]  # (N, dtype)
    decode: tuple[int, ...]  # prompt lengths (each with a dynamic and a static cache)
    new_tokens: int
    sliding: tuple[int, int]  # (N, window)
    train: tuple[tuple[int, str], ...]  # (N, dtype)
    nanogpt: tuple[int, ...]
    compiled: tuple[int, ...]
    eager_max: int  # eager's forward runs up to this N (prefill, window)
    eager_train_max: int  # and its training step up to this N
    check_n: int  # the outputs check: prompt length, window, new tokens
    check_window: int
    check_new: int
    repeats: tuple[tuple[int, int], ...]  # (up to N, timed rounds)
    decode_repeats: int


FULL = Settings(
    layers=2,
    nanogpt_layers=4,
    prefill=((1024, "fp32"), (4096, "fp32"), (16384, "fp32"), (16384, "bf16")),
    decode=(4096, 16384),
    new_tokens=64,
    sliding=(16384, 1024),
    train=((2048, "fp32"), (8192, "fp32"), (8192, "bf16")),
    nanogpt=(1024, 4096),
    compiled=(1024, 4096),
    eager_max=4096,
    eager_train_max=2048,
    check_n=512,
    check_window=128,
    check_new=16,
    repeats=((1024, 5), (4096, 3), (1 << 30, 3)),
    decode_repeats=5,
)
QUICK = Settings(
    layers=1,
    nanogpt_layers=1,
    prefill=((128, "fp32"), (256, "fp32"), (512, "fp32"), (512, "bf16")),
    decode=(256, 512),
    new_tokens=4,
    sliding=(512, 128),
    train=((128, "fp32"), (256, "fp32"), (256, "bf16")),
    nanogpt=(128, 256),
    compiled=(128,),
    eager_max=512,
    eager_train_max=256,
    check_n=96,
    check_window=32,
    check_new=4,
    repeats=((1 << 30, 1),),
    decode_repeats=1,
)


@dataclasses.dataclass(frozen=True)
class Prefill:
    n: int
    dtype: str


@dataclasses.dataclass(frozen=True)
class Decode:
    prompt: int
    cache: str  # "dynamic" or "static"
    new_tokens: int


@dataclasses.dataclass(frozen=True)
class Sliding:
    n: int
    window: int


@dataclasses.dataclass(frozen=True)
class Step:  # a nanoGPT training step or a compiled prefill
    n: int


@dataclasses.dataclass(frozen=True)
class Train:  # a training step of the transformers model
    n: int
    dtype: str


def dtype_of(case: Any) -> str:
    """A case's dtype; fp32 for a case without one (a training step recorded as a `Step`, before
    the training steps had a dtype)."""
    return getattr(case, "dtype", "fp32")


def repeats(s: Settings, n: int) -> int:
    return next(r for limit, r in s.repeats if n <= limit)


# --------------------------------------------------------------------------- the models


def hf_model(kind: str, layers: int, impl: str, dtype: str = "fp32", window: int = 0):
    """The random-weight model (the same weights for every implementation and kind):
    `LlamaForCausalLM`, or with `kind="sliding"` a `MistralForCausalLM` holding its weights."""
    model = copy.deepcopy(base_model(kind, layers, window)).to(DTYPES[dtype]).eval()
    model.set_attn_implementation(impl)
    return model


@functools.lru_cache(maxsize=4)
def base_model(kind: str, layers: int, window: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**MODEL, num_hidden_layers=layers)
    model = transformers.LlamaForCausalLM(config)
    if kind == "sliding":
        mistral = transformers.MistralForCausalLM(
            transformers.MistralConfig(**MODEL, num_hidden_layers=layers, sliding_window=window)
        )
        mistral.load_state_dict(model.state_dict())
        model = mistral
    return model


def ids_of(n: int, seed: int = 1) -> torch.Tensor:
    # from 1: token 0 is the pad token generate() is given, and a prompt holding it would be
    # read as padded (generate builds its attention mask from ids != pad_token_id)
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


class NanoBlock(nn.Module):
    """nanoGPT's `Block`: `x + attn(ln_1(x))`, `x + mlp(ln_2(x))`."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, attend: Callable) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = attend(q, k, v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's `GPT` (no dropout, no bias switch); `attend(q, k, v)` is its attention."""

    def __init__(self, attend: Callable, vocab: int, d_model: int, heads: int, layers: int, n: int):
        super().__init__()
        self.attend = attend
        self.wte, self.wpe = nn.Embedding(vocab, d_model), nn.Embedding(n, d_model)
        self.blocks = nn.ModuleList(NanoBlock(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The LM loss of `ids (B, N)` (each position predicts the next)."""
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x, self.attend)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


NANO_ATTEND = {
    "qkv": lambda q, k, v: qkv.attention(q, k, v, causal=True),
    "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
}


# --------------------------------------------------------------------------- attention timer


class Timer:
    """Attention seconds of one model call: the forward of every attention call, and the
    backward between the gradient reaching an attention output and leaving its q, k, v."""

    def __init__(self) -> None:
        self.forward_s = self.backward_s = 0.0
        self.calls = 0
        self._since: float | None = None

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    def around(self, run: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        """`run(q, k, v)` timed; its output (or the first element of a tuple) marked for the
        backward when a gradient will flow."""
        track = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if track:
            q, k, v = _Leave.apply(self, q, k, v)
        start = time.perf_counter()
        out = run(q, k, v)
        self.forward_s += time.perf_counter() - start
        self.calls += 1
        if track:
            if isinstance(out, tuple):
                out = (_Enter.apply(self, out[0]), *out[1:])
            else:
                out = _Enter.apply(self, out)
        return out

    def entered(self) -> None:  # the gradient reached an attention output
        self._since = time.perf_counter()

    def left(self) -> None:  # the gradients of its q, k, v are out
        if self._since is not None:
            self.backward_s += time.perf_counter() - self._since
            self._since = None


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, timer: Timer, out: torch.Tensor) -> torch.Tensor:
        ctx.timer = timer
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.timer.entered()
        return None, grad


class _Leave(torch.autograd.Function):
    @staticmethod
    def forward(ctx, timer: Timer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        ctx.timer = timer
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
        ctx.timer.left()
        return None, dq, dk, dv


# (group, case key, implementation) -> one Timer per call, in the order of the calls
TIMERS: dict[tuple[str, str, str], list[Timer]] = {}


@contextlib.contextmanager
def timed_attention(model: nn.Module, timer: Timer) -> Iterator[None]:
    """transformers' attention function of `model`'s implementation, wrapped in `timer`, for the
    duration of the block (outside it the model calls the function itself)."""
    from transformers.modeling_utils import AttentionInterface

    impl = model.config._attn_implementation
    mapping = AttentionInterface._global_mapping
    had = impl in mapping
    inner = mapping[impl] if had else sys.modules[type(model).__module__].eager_attention_forward

    def timed(module, query, key, value, *args, **kwargs):
        return timer.around(
            lambda q, k, v: inner(module, q, k, v, *args, **kwargs), query, key, value
        )

    mapping[impl] = timed
    try:
        yield
    finally:
        if had:
            mapping[impl] = inner
        else:
            del mapping[impl]


def timers(group: str, case: Any, impl: str) -> list[Timer]:
    return TIMERS.setdefault((group, case_key(group, case), impl), [])


def collect(group: str) -> Callable[[Settings, Results], list[dict[str, Any]]]:
    """The stage after a group: its attention seconds per call, per (case, implementation)."""

    def run(_: Settings, r: Results) -> list[dict[str, Any]]:
        out = []
        for c in r.cases:
            if c.group != group:
                continue
            for impl in r.impls(group, c.params):
                found = TIMERS.pop((group, case_key(group, c.params), impl), None)
                if found:
                    out.append(
                        {
                            "case": c.params,
                            "impl": impl,
                            "attention_s": [t.total_s for t in found],
                            "calls": found[-1].calls,
                        }
                    )
        return out

    return run


# --------------------------------------------------------------------------- implementations


def hf_call(
    group: str, case: Any, impl: str, model: nn.Module, run: Callable[[torch.Tensor], Any]
) -> Callable[[torch.Tensor], Any]:
    """`run(ids)` with the attention of `model` timed (one Timer per call, kept under the
    implementation's name `impl`)."""
    seen = timers(group, case, impl)

    def call(ids: torch.Tensor) -> Any:
        timer = Timer()
        seen.append(timer)
        with timed_attention(model, timer):
            return run(ids)

    return call


def prefill_impl(name: str, **kwargs: Any) -> Impl:
    def make(c: Prefill | Sliding):
        group, kind = ("prefill", "dense") if isinstance(c, Prefill) else ("sliding", "sliding")
        dtype = getattr(c, "dtype", "fp32")
        m = hf_model(kind, SETTINGS.layers, name, dtype, getattr(c, "window", 0))
        return hf_call(group, c, name, m, lambda ids: m(ids, logits_to_keep=1).logits)

    return Impl(name, make, passes=(FWD,), **kwargs)


def eager_over(limit: str) -> Callable[[Any, Results], str | None]:
    def skip(c: Any, r: Results) -> str | None:
        n = r.settings[limit]
        return f"skipped (N > {n}: eager's N×N fp32 scores of 14 heads)" if c.n > n else None

    return skip


def decode_ids(c: Decode) -> torch.Tensor:
    return ids_of(c.prompt, seed=c.prompt)


@functools.lru_cache(maxsize=1)
def prefilled(c: Decode, layers: int):
    """The cache of the prompt minus its last token, filled once by `sdpa`."""
    import transformers

    m = hf_model("dense", layers, "sdpa")
    ids = decode_ids(c)
    if c.cache == "static":
        cache = transformers.StaticCache(config=m.config, max_cache_len=c.prompt + c.new_tokens)
    else:
        cache = transformers.DynamicCache(config=m.config)
    with torch.no_grad():
        m(ids[:, :-1], cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def greedy_from(m: nn.Module, cache: Any, new: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """`run(ids)`: `new` greedy tokens after `ids`, continuing from a copy of `cache`."""

    def run(ids: torch.Tensor) -> torch.Tensor:
        return m.generate(
            ids,
            cache=copy.deepcopy(cache),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )

    return run


def decode_impl(name: str, one: bool = False) -> Impl:
    def make(c: Decode):
        m = hf_model("dense", SETTINGS.layers, name)
        cache = prefilled(c, SETTINGS.layers)
        run = greedy_from(m, cache, 1 if one else c.new_tokens)
        return hf_call("decode", c, name + ONE if one else name, m, run)

    return Impl(name + ONE if one else name, make, passes=(FWD,))


def same_tokens(c: Decode, outs: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Each implementation's generated ids against SDPA's: "same", or where they first differ."""
    figures: dict[str, dict[str, Any]] = {}
    for name, out in outs.items():
        anchor = outs.get("sdpa" + ONE if name.endswith(ONE) else "sdpa")
        if anchor is None or name.startswith("sdpa"):
            continue
        new, ref = out[0, c.prompt :], anchor[0, c.prompt :]
        differ = (new != ref).nonzero()
        figures[name] = {"tokens": "same" if len(differ) == 0 else f"differ at {int(differ[0])}"}
    return figures


def train_impl(name: str, **kwargs: Any) -> Impl:
    def make(c: Train):
        m = hf_model("dense", SETTINGS.layers, name, c.dtype).train()

        def run(ids: torch.Tensor) -> torch.Tensor:
            m.zero_grad(set_to_none=True)
            return m(ids, labels=ids, use_cache=False).loss

        return hf_call("train", c, name, m, run)

    return Impl(name, make, passes=(FWD_BWD,), **kwargs)


def nanogpt_impl(name: str) -> Impl:
    def make(c: Step):
        torch.manual_seed(0)
        m = NanoGPT(
            NANO_ATTEND[name], **NANO, layers=SETTINGS.nanogpt_layers, n=max(SETTINGS.nanogpt)
        ).train()
        seen = timers("nanogpt", c, name)

        def run(ids: torch.Tensor) -> torch.Tensor:
            m.zero_grad(set_to_none=True)
            timer = Timer()
            seen.append(timer)
            m.attend = lambda q, k, v: timer.around(NANO_ATTEND[name], q, k, v)
            return m(ids)

        return run

    return Impl(name, make, passes=(FWD_BWD,))


class CompileFailed(RuntimeError):
    """The model did not compile; the message is `compile_reason`'s line."""


def compile_reason(error: BaseException) -> str:
    """One line for a model that does not compile: the error's first line, what dynamo says it
    could not trace, and the deepest frame of qkv (else of the model) it was tracing."""
    text = str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reason = f"{type(error).__name__}: {lines[0] if lines else ''}"
    skipped = re.search(r"function `([^`]+)`", text)
    if skipped:
        reason += f" (`{skipped.group(1)}`)"
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', text)
    ours = [f for f in frames if "/qkv/" in f[0]] or frames
    if ours:
        path, line, fn = ours[-1]
        reason += f" in {'/'.join(path.split('/')[-3:])}:{line} {fn}"
    return reason


def compiled_impl(name: str, compiled: bool = True) -> Impl:
    def make(c: Step):
        m = hf_model("dense", SETTINGS.layers, name)
        if not compiled:
            return lambda ids: m(ids, logits_to_keep=1).logits
        torch._dynamo.reset()
        fast = torch.compile(m, fullgraph=True, dynamic=False)

        def run(ids: torch.Tensor) -> torch.Tensor:
            try:
                return fast(ids, logits_to_keep=1).logits
            except Exception as error:  # a row with the reason, not a crash
                raise CompileFailed(compile_reason(error)) from None

        return Prepared(run)

    return Impl(name if compiled else f"{name}, no compile", make, passes=(FWD,))


def step_inputs(c: Any, backward: bool):
    ids = ids_of(c.n)
    return (ids,), (torch.ones(()) if backward else None)


# The settings of the run in progress (the runner hands `prepare` the settings; the groups'
# `make` reads the layer count from here).
SETTINGS = FULL


def prepare(s: Settings) -> None:
    global SETTINGS
    import transformers

    import qkv.integrations.hf

    SETTINGS = s
    qkv.integrations.hf.register()
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    TIMERS.clear()
    prefilled.cache_clear()
    base_model.cache_clear()


PREFILL = Group(
    name="prefill",
    cases=lambda s: [Prefill(n, dt) for n, dt in s.prefill],
    inputs=lambda c, _: ((ids_of(c.n),), None),
    impls=(
        prefill_impl("qkv"),
        prefill_impl("sdpa"),
        prefill_impl("eager", skip=eager_over("eager_max"), when=lambda c: c.dtype == "fp32"),
    ),
    passes=(FWD,),
    anchors=("sdpa",),
    repeats=lambda s, c: repeats(s, c.n),
)
SLIDING = Group(
    name="sliding",
    cases=lambda s: [Sliding(*s.sliding)],
    inputs=lambda c, _: ((ids_of(c.n),), None),
    impls=(
        prefill_impl("qkv"),
        prefill_impl("sdpa"),
        prefill_impl("eager", skip=eager_over("eager_max")),
    ),
    passes=(FWD,),
    anchors=("sdpa",),
    repeats=lambda s, c: repeats(s, c.n),
)
DECODE = Group(
    name="decode",
    cases=lambda s: [
        Decode(n, cache, s.new_tokens) for n in s.decode for cache in ("dynamic", "static")
    ],
    inputs=lambda c, _: ((decode_ids(c),), None),
    impls=tuple(decode_impl(name, one) for name in HF_IMPLS for one in (False, True)),
    passes=(FWD,),
    anchors=("sdpa",),
    repeats=lambda s, c: s.decode_repeats,
    check=same_tokens,
)
TRAIN = Group(
    name="train",
    cases=lambda s: [Train(n, dt) for n, dt in s.train],
    inputs=step_inputs,
    impls=(
        train_impl("qkv"),
        train_impl("sdpa"),
        train_impl("eager", skip=eager_over("eager_train_max")),
    ),
    passes=(FWD_BWD,),
    anchors=("sdpa",),
    repeats=lambda s, c: repeats(s, c.n),
)
NANOGPT = Group(
    name="nanogpt",
    cases=lambda s: [Step(n) for n in s.nanogpt],
    inputs=step_inputs,
    impls=(nanogpt_impl("qkv"), nanogpt_impl("sdpa")),
    passes=(FWD_BWD,),
    anchors=("sdpa",),
    repeats=lambda s, c: repeats(s, c.n),
)
COMPILED = Group(
    name="compiled",
    cases=lambda s: [Step(n) for n in s.compiled],
    inputs=lambda c, _: ((ids_of(c.n),), None),
    impls=(compiled_impl("qkv"), compiled_impl("sdpa"), compiled_impl("sdpa", compiled=False)),
    passes=(FWD,),
    anchors=("sdpa",),
    repeats=lambda s, c: repeats(s, c.n),
)


# --------------------------------------------------------------------------- the outputs check


def check_outputs(s: Settings, _: Results) -> list[dict[str, Any]]:
    """Logits against a float64 eager golden (the error rule), greedy tokens against SDPA."""
    ids = ids_of(s.check_n, seed=7)
    rows = []
    for kind, dtype in (("dense", "fp32"), ("dense", "bf16"), ("sliding", "fp32")):
        window = s.check_window if kind == "sliding" else 0
        models = {impl: hf_model(kind, s.layers, impl, dtype, window) for impl in HF_IMPLS}
        with torch.no_grad():
            golden = hf_model(kind, s.layers, "eager", "fp64", window)(ids).logits
            logits = {impl: m(ids).logits.double() for impl, m in models.items()}
        err = {impl: (out - golden).abs().max().item() for impl, out in logits.items()}
        floor = torch.finfo(DTYPES[dtype]).eps * golden.abs().max().item()
        tokens: dict[str, dict[str, str]] = {impl: {} for impl in HF_IMPLS}
        if dtype == "fp32":
            for cache in ("dynamic", "static"):
                made = {}
                for impl, m in models.items():
                    made[impl] = m.generate(
                        ids,
                        max_new_tokens=s.check_new,
                        min_new_tokens=s.check_new,
                        do_sample=False,
                        pad_token_id=0,
                        cache_implementation=cache,
                    )[0, s.check_n :]
                for impl in HF_IMPLS:
                    differ = (made[impl] != made["sdpa"]).nonzero()
                    tokens[impl][cache] = (
                        "same" if len(differ) == 0 else f"differ at {int(differ[0])}"
                    )
        row: dict[str, Any] = {"model": kind, "dtype": dtype, "window": window, "impls": {}}
        for impl in HF_IMPLS:
            row["impls"][impl] = {
                "max_err": err[impl],
                "of_sdpa": err[impl] / err["sdpa"] if err["sdpa"] else None,
                "rule": err[impl] <= 2 * err["sdpa"] + floor,
                "tokens": tokens[impl],
            }
        if kind == "sliding":  # does transformers apply the window? the same weights without it
            with torch.no_grad():
                plain = hf_model("dense", s.layers, "sdpa")(ids).logits.double()
            row["window_changes_logits"] = (plain - logits["sdpa"]).abs().max().item()
        rows.append(row)
    return rows


def outputs_block(r: Results) -> list[str]:
    rows = r.stages.get("outputs")
    if not rows:
        return []
    lines = [
        "### Outputs",
        "",
        f"Prompt of {r.settings['check_n']} tokens; greedy decoding of {r.settings['check_new']} "
        "tokens (fp32 only). max |err| = max |logits − float64 eager|; the rule passes when it is "
        "≤ 2 × SDPA's + one rounding of max |golden|.",
        "",
        "| model | dtype | impl | max \\|err\\| | ÷ SDPA's | rule | tokens vs sdpa "
        "(dynamic / static) |",
        "|:---|:---|:---|---:|---:|:---|:---|",
    ]
    notes = []
    for row in rows:
        model = "Llama" if row["model"] == "dense" else f"Mistral, window {row['window']}"
        for impl, f in row["impls"].items():
            toks = f["tokens"]
            shown = " / ".join(toks.get(c, "—") for c in ("dynamic", "static")) if toks else "—"
            lines.append(
                f"| {model} | {row['dtype']} | {impl} | {f['max_err']:.2e} | "
                f"{rp.fmt(f['of_sdpa'], '.2f')} | {'pass' if f['rule'] else '**FAIL**'} | {shown} |"
            )
        if "window_changes_logits" in row:
            change = row["window_changes_logits"]
            notes.append(
                f"The window is applied: with `sliding_window={row['window']}` SDPA's logits "
                f"differ from the same weights' without a window by up to {change:.2e}."
                if change > 0
                else "**The window is not applied**: the logits equal those without a window."
            )
    return [*lines, "", *notes, ""] if notes else [*lines, ""]


# --------------------------------------------------------------------------- derived figures


def attention_calls(r: Results, group: str, case: Any, impl: str) -> list[float] | None:
    """Attention seconds of the timed calls of `impl` at `case` (the last `rounds` calls)."""
    t = r.timing(group, case, impl, FWD_BWD if group in ("train", "nanogpt") else FWD)
    if t is None or not t.rounds:
        return None
    params = dataclasses.asdict(case) if dataclasses.is_dataclass(case) else dict(case)
    for entry in r.stages.get(f"attention {group}") or []:
        if entry["impl"] == impl and entry["case"] == params:
            return entry["attention_s"][-t.rounds :]
    return None


def timing_of(row: rp.Row, impl: str | None = None) -> Timing | None:
    return row.timing(FWD_BWD if row.group in ("train", "nanogpt") else FWD, impl)


def attention_s(row: rp.Row, impl: str | None = None) -> float | None:
    """Median attention seconds per call (per decoding step for `decode`)."""
    impl = impl or row.impl or ""
    found = attention_calls(row.results, row.group, row.case, impl)
    if found is None:
        return None
    if row.group != "decode":
        return statistics.median(found)
    one = attention_calls(row.results, row.group, row.case, impl + ONE)
    if one is None:
        return None
    return (statistics.median(found) - statistics.median(one)) / (row.case.new_tokens - 1)


def call_s(row: rp.Row, impl: str | None = None) -> float | None:
    """Median seconds per call (per decoding step for `decode`)."""
    if row.group == "decode":
        return step_s(row, impl)
    t = timing_of(row, impl)
    return t.median_s if t else None


def attention_share(row: rp.Row) -> float | None:
    attn, total = attention_s(row), call_s(row)
    return attn / total if attn is not None and total else None


def attention_ratio(row: rp.Row) -> float | None:
    mine, sdpa = attention_s(row), attention_s(row, "sdpa")
    return sdpa / mine if mine and sdpa is not None else None


def ceiling(row: rp.Row) -> float | None:
    """The most any attention could make the case ×SDPA: SDPA's time over SDPA's time without
    its attention (Amdahl), the bound a target above it cannot pass."""
    attn, total = attention_s(row, "sdpa"), call_s(row, "sdpa")
    if attn is None or not total or attn >= total:
        return None
    return total / (total - attn)


def step_times(row: rp.Row, impl: str) -> list[float | None]:
    """Seconds per decoding step in each round: (T-token call − 1-token call) / (T − 1)."""
    full, one = row.timing(FWD, impl), row.timing(FWD, impl + ONE)
    if full is None or one is None:
        return []
    return [
        None if a is None or b is None else (a - b) / (row.case.new_tokens - 1)
        for a, b in zip(full.times_s, one.times_s, strict=False)
    ]


def step_s(row: rp.Row, impl: str | None = None) -> float | None:
    """(median T-token call − median 1-token call) / (T − 1)."""
    impl = impl or row.impl or ""
    full, one = row.median(FWD, impl), row.median(FWD, impl + ONE)
    if full is None or one is None:
        return None
    return (full - one) / (row.case.new_tokens - 1)


def step_ratio(row: rp.Row) -> float | None:
    """SDPA's step time / the row's, per round, the median over rounds."""
    pairs = [
        a / b
        for a, b in zip(step_times(row, "sdpa"), step_times(row, row.impl or ""), strict=False)
        if a is not None and b is not None and b > 0
    ]
    return statistics.median(pairs) if pairs else None


# --------------------------------------------------------------------------- tables


def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def ms(seconds: float | None, spec: str = ".1f") -> str:
    return rp.fmt(None if seconds is None else 1e3 * seconds, spec)


ATTENTION = (
    rp.Column("attn %", lambda r: pct(attention_share(r))),
    rp.Column("attn ×SDPA", lambda r: rp.fmt(attention_ratio(r), ".2f")),
    rp.Column("ceiling ×SDPA", lambda r: rp.fmt(ceiling(r), ".2f")),
)


def per_second(row: rp.Row) -> str:
    t = timing_of(row)
    return rp.fmt(row.case.n / t.median_s if t and t.median_s else None, ".0f")


def timed_table(group: str, title: str, pass_: str, first: tuple[rp.Column, ...]) -> rp.Table:
    return rp.Table(
        (
            *first,
            rp.impl_column(),
            rp.time_column(pass_, "ms"),
            rp.ratio_column(pass_, "sdpa", "×SDPA"),
            rp.ratio_column(pass_, "sdpa", "×SDPA range", span=True),
            rp.Column("tok/s", per_second),
            *ATTENTION,
        ),
        lambda r: rp.rows(r, group),
        title,
    )


def decode_rows(r: Results) -> list[rp.Row]:
    return [row for row in rp.rows(r, "decode") if not (row.impl or "").endswith(ONE)]


DECODE_TABLE = rp.Table(
    (
        rp.field("prompt"),
        rp.field("cache", align="l"),
        rp.field("new_tokens", "T"),
        rp.impl_column(),
        rp.time_column(FWD, "T tokens ms"),
        rp.Column("1 token ms", lambda r: rp.time_cell(r.timing(FWD, (r.impl or "") + ONE))),
        rp.Column("ms/step", lambda r: ms(step_s(r), ".2f")),
        rp.Column("tok/s", lambda r: rp.fmt(1 / s if (s := step_s(r)) else None, ".1f")),
        rp.Column("step ×SDPA", lambda r: rp.fmt(step_ratio(r), ".2f")),
        *ATTENTION,
        rp.Column("tokens", lambda r: r.extra("tokens") or "—", "l"),
    ),
    decode_rows,
    "Decoding: ms per step after the prompt",
)


def compile_s(row: rp.Row) -> str:
    t = row.timing(FWD)
    if t is None or t.warmup_s is None or t.median_s is None:
        return "—"
    return f"{t.warmup_s - t.median_s:.1f}"


def compile_note(row: rp.Row) -> str:
    """Why a compiled row has no time (the failure's reason in full)."""
    t = row.timing(FWD)
    return t.note if t is not None and t.note and t.note != "dry run" else ""


COMPILED_TABLE = rp.Table(
    (
        rp.field("n", "N"),
        rp.impl_column(),
        rp.time_column(FWD, "prefill ms"),
        rp.ratio_column(FWD, "sdpa", "×compiled SDPA"),
        rp.Column("first call s", compile_s),
        rp.Column("note", compile_note, "l"),
    ),
    lambda r: rp.rows(r, "compiled"),
    "Compiled: `torch.compile(model, fullgraph=True)`, prefill",
)


# --------------------------------------------------------------------------- targets


@dataclasses.dataclass(frozen=True)
class CaseTarget(Target):
    """`qkv` against `sdpa` on the `index`-th case of `group` in the run (the run's sizes, so a
    `--quick` run evaluates its own); the name's `{case}` becomes that case."""

    group: str = ""
    index: int = 0
    label: Callable[[Any], str] = str

    def case(self, r: Results) -> Any:
        found = [c for c in r.case_objects(self.group)]
        return found[self.index] if self.index < len(found) else None

    def evaluate(self, results: Any) -> dict[str, Any]:
        out = super().evaluate(results)
        case = self.case(results)
        if case is None:
            case = CASES[self.group](FULL)[self.index]
        out["name"] = self.name.format(case=self.label(case))
        return out


CASES: dict[str, Callable[[Settings], list[Any]]] = {
    g.name: g.cases for g in (PREFILL, SLIDING, DECODE, TRAIN, NANOGPT, COMPILED)
}


def ratio_of(group: str, index: int) -> Callable[[Results], float | None]:
    def value(r: Results) -> float | None:
        cases = list(r.case_objects(group))
        if index >= len(cases):
            return None
        if group == "decode":
            return step_ratio(rp.Row(r, group, cases[index], "qkv"))
        pass_ = FWD_BWD if group in ("train", "nanogpt") else FWD
        return r.ratio(group, cases[index], "qkv", pass_, "sdpa")

    return value


def target(group: str, index: int, text: str, threshold: float, label: Callable) -> CaseTarget:
    return CaseTarget(
        f"{text}: `qkv` ×SDPA",
        ratio_of(group, index),
        threshold,
        group=group,
        index=index,
        label=label,
    )


def train_threshold(n: int, dtype: str) -> float:
    """×SDPA a training step promises: bf16 1.3; fp32 1.1 at its largest N, else 1.0."""
    if dtype == "bf16":
        return 1.3
    return 1.1 if n == max(m for m, dt in FULL.train if dt == "fp32") else 1.0


def train_label(case: Any) -> str:
    """`N=8192` for fp32 (the names the fp32 rows always had), `bf16 N=8192` otherwise."""
    dtype = dtype_of(case)
    return f"N={case.n}" if dtype == "fp32" else f"{dtype} N={case.n}"


TARGETS = (
    *(
        target(
            "prefill",
            i,
            "prefill {case}",
            1.1 if n == max(m for m, _ in FULL.prefill) else 1.0,
            lambda c: f"{c.dtype} N={c.n}",
        )
        for i, (n, _) in enumerate(FULL.prefill)
    ),
    *(
        target(
            "decode",
            i,
            "decoding step {case}",
            1.5 if c.prompt == max(FULL.decode) else 1.1,
            lambda c: f"after {c.prompt} tokens, {c.cache} cache",
        )
        for i, c in enumerate(DECODE.cases(FULL))
    ),
    target("sliding", 0, "sliding window {case} prefill", 2.0, lambda c: f"w={c.window}, N={c.n}"),
    *(
        target("train", i, "training step {case}", train_threshold(n, dt), train_label)
        for i, (n, dt) in enumerate(FULL.train)
    ),
    *(
        target("nanogpt", i, "nanoGPT training step {case}", 1.0, lambda c: f"N={c.n}")
        for i in range(len(FULL.nanogpt))
    ),
    *(
        target("compiled", i, "compiled prefill {case}", 1.0, lambda c: f"N={c.n}")
        for i in range(len(FULL.compiled))
    ),
)


# --------------------------------------------------------------------------- the suite


def requires() -> str | None:
    if importlib.util.find_spec("transformers") is None:
        return "needs transformers: pip install -e '.[hf]'"
    return None


def facts(_: Settings) -> dict[str, object]:
    import transformers

    return {"software": {"transformers": transformers.__version__}}


def method(r: Results) -> list[str]:
    s = r.settings
    steps = [(limit, n) for limit, n in s["repeats"]]
    rounds = ", ".join(
        f"{n} up to N={limit}" if limit < steps[-1][0] else f"{n} beyond" for limit, n in steps
    )
    if len(steps) == 1:
        rounds = str(steps[0][1])
    return [
        f"- This run: {s['layers']} layers (nanoGPT {s['nanogpt_layers']}); timed rounds: "
        f"{rounds}; {s['decode_repeats']} for decoding; `eager` up to N={s['eager_max']} "
        f"forward, N={s['eager_train_max']} training.",
    ]


SUITE = Suite(
    name="e2e",
    title="End to end: real-model shapes through transformers",
    settings={"full": FULL, "quick": QUICK},
    steps=(
        Stage("outputs", check_outputs),
        PREFILL,
        Stage("attention prefill", collect("prefill")),
        SLIDING,
        Stage("attention sliding", collect("sliding")),
        DECODE,
        Stage("attention decode", collect("decode")),
        TRAIN,
        Stage("attention train", collect("train")),
        NANOGPT,
        Stage("attention nanogpt", collect("nanogpt")),
        COMPILED,
    ),
    targets=TARGETS,
    report=(
        outputs_block,
        timed_table("prefill", "Prefill", FWD, (rp.field("n", "N"), rp.field("dtype", align="l"))),
        timed_table(
            "sliding",
            "Sliding window (MistralForCausalLM), prefill",
            FWD,
            (rp.field("n", "N"), rp.field("window")),
        ),
        DECODE_TABLE,
        timed_table(
            "train",
            "Training step (forward + backward of the LM loss)",
            FWD_BWD,
            (rp.field("n", "N"), rp.Column("dtype", lambda r: dtype_of(r.case), "l")),
        ),
        timed_table("nanogpt", "nanoGPT training step", FWD_BWD, (rp.field("n", "N"),)),
        COMPILED_TABLE,
    ),
    doc=__doc__,
    method=method,
    ceiling=True,
    requires=requires,
    prepare=prepare,
    facts=facts,
)
