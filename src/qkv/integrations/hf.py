"""qkv as a transformers attention backend: `attn_implementation="qkv"`.

    import qkv.integrations.hf
    qkv.integrations.hf.register()
    model = AutoModel.from_pretrained(name, attn_implementation="qkv")
    model.set_attn_implementation("qkv")          # or switch a loaded model
    print(qkv.integrations.hf.verify(model, inputs))   # does qkv run in every attention layer?

transformers looks a backend up by name in two registries, and `register()` fills both:

- `AttentionMaskInterface` → `make_mask`, called once per forward (per mask type: full layers,
  sliding layers) by `create_causal_mask`, `create_sliding_window_causal_mask` and
  `create_bidirectional_mask`. Without an entry there transformers hands the backend
  `attention_mask=None`, and a padded batch silently attends to its padding.
- `AttentionInterface` → `attention_forward`, called by every attention layer with
  `query (B, H, S, D)`, `key`/`value (B, Hkv, Sk, D)` (grouped heads not repeated) and the mask
  `make_mask` returned; it returns `(out (B, S, H, Dv), weights or None)`.

What `make_mask` gets and returns. transformers describes the mask, rather than building it:
`q_length`, `kv_length`, the absolute positions of the first query and key (`q_offset`,
`kv_offset`: with a cache the queries sit after the cached keys, and a sliding-window cache
drops old keys), the 2-D padding mask `attention_mask (B, ≥ kv_offset + kv_length)` (True = a
real token), and `mask_function(b, h, q_pos, kv_pos)`, a composition of transformers' own
predicates (`causal_mask_function`, `bidirectional_mask_function`, `sliding_window_overlay(w)`,
`and_masks(...)`). `make_mask` recognises those predicates, which all depend only on
`q_pos − kv_pos`, and turns the composition into qkv terms without an N² tensor:

| transformers pattern (and shape)              | returned                                    |
| ---                                           | ---                                         |
| causal, no padding                            | `None` → `causal=True` (bottom-right)       |
| causal + padding                              | `masks.causal() & masks.key_mask(valid)`    |
| sliding window w (causal), window binds       | `masks.sliding_window(w − 1, 0)` [& key_mask] |
| bidirectional (BERT), no padding              | `None`                                      |
| bidirectional + padding                       | bool `(B, 1, 1, Nk)` padding-only mask      |
| static cache (key slots ahead of the queries) | dense bool `(B, 1, Nq, Nk)`                 |
| generate()'s pre-build for a static cache     | dense bool `(B, 1, Nq, Nk)`                 |
| anything else (packed, chunked, custom)       | dense bool `(B, 1, Nq, Nk)` (fallback)      |

A padding-only mask is an O(B·Nk) tensor rather than a `Mask`, so that `qkv.attention`'s
`auto` can run it on torch SDPA; every other structured pattern goes to the block-sparse `tiled`
kernel, which skips the tiles a causal or sliding-window mask leaves empty. qkv's masks are
bottom-right aligned (query row i has position `i + Nk − Nq`), which is where every dynamic
cache puts the queries (`q_offset − kv_offset = Nk − Nq`, also when a sliding-window cache has
dropped old keys). Static caches break that (their key slots run ahead of the queries) and are
given a dense tensor. Each recognised pattern is also checked against `mask_function` itself on
a few query rows, and a disagreement falls back to the dense mask with a warning.

Who reads the mask. A model's forward hands make_mask's result to its attention layers, that is
to `attention_forward`, which takes a `Mask`. One caller is different: for a compileable
(static) cache, generate() pre-builds the masks before each step (`create_masks_for_generate`)
and passes them back into the model as its `attention_mask` input; the model's `create_*_mask`
then uses a 4-D tensor as it is and reads `.ndim` of anything else. make_mask's arguments are
the same in both calls (a static sliding-window cache reports the sizes a dynamic one does), so
make_mask looks for `create_masks_for_generate` among its callers and there returns the dense
tensor. Models whose layers never call the attention interface read the mask themselves: for
them make_mask returns the float mask transformers builds for "eager" (see Families).

`output_attentions=True`. transformers records attention weights with hooks on the attention
layers, and decides once per model forward whether to record (its output collector). Llama and
most families also pass the flag to the attention function; GPT-2, OPT and SigLIP do not, so
`attention_forward` asks the collector, and computes the weights (with qkv's `reference`
backend) exactly when transformers is going to record them.

Families. qkv runs where a layer calls transformers' attention interface; `verify(model,
inputs)` counts qkv's calls per attention layer on one forward and says where it does not run
(`verify(model)` reads the code and configs instead; `verify(ModelClass)` checks a family before
loading). Tested against "eager" on tiny random configs (tests/integrations/test_hf_zoo.py):

| family                                           | qkv runs | tested                           |
| ---                                              | ---      | ---                              |
| BERT, ModernBERT (local layers: a window)        | yes      | forward, padding, weights        |
| GPT-2, GPT-NeoX, OPT, Llama, Qwen3, Gemma        | yes      | + generate (dynamic and static)  |
| Mistral, Mixtral, Phi3 (every layer sliding)     | yes      | + generate, prompt > window      |
| Qwen2, Gemma 2, Gemma 3 text, gpt-oss (mixed)    | yes      | + generate (softcap, sinks)      |
| T5, BART, Whisper                                | yes      | + generate (cross-attention)     |
| ViT, CLIP, SigLIP, Qwen2-VL vision tower         | yes [1]  | forward, weights                 |
| BLOOM                                            | no [2]   | runs as "eager", with a warning  |
| Falcon                                           | no [3]   | `verify(FalconForCausalLM)`      |

[1] SigLIP's vision pooling head is a `torch.nn.MultiheadAttention` (one learned query), which
    stays torch's; `verify` lists it.
[2] BLOOM computes attention (with ALiBi) in its own code. Loaded with "qkv" it gets the mask
    it reads under "eager" and a RuntimeWarning on its first forward; `set_attn_implementation
    ("qkv")` is refused by transformers with a log line and the model stays "eager".
[3] Falcon picks its attention class by name: building it with "qkv" raises transformers'
    `KeyError: 'qkv'` before any qkv code runs.
"""

from __future__ import annotations

import functools
import importlib
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

import qkv

from .. import masks, scores
from ..masks import Mask
from .hf_verify import LayerReport, Report, note_call, routes_attention, verify

NAME = "qkv"
_INSTALL_HINT = "pip install 'qkv[hf]'"
_warned: set[str] = set()

__all__ = [
    "NAME",
    "LayerReport",
    "Report",
    "attention_forward",
    "make_mask",
    "register",
    "routes_attention",
    "verify",
]


def _import(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"qkv.integrations.hf needs the transformers library ({module} could not be "
            f"imported: {e}); install it with: {_INSTALL_HINT}"
        ) from e


def register(name: str = NAME) -> str:
    """Register qkv with transformers under `name` (default "qkv"): both the attention function
    and the mask function. Idempotent. Returns the name to pass as `attn_implementation`."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    transformers = _import("transformers")
    mu = _import("transformers.masking_utils")
    for interface, function in (
        (transformers.AttentionInterface, attention_forward),
        (mu.AttentionMaskInterface, make_mask),
    ):
        interface.register(name, function)
    if _output_collector() is None:
        _warn_once(
            "collector",
            f"qkv: transformers {transformers.__version__} has no output collector where qkv "
            "looks for it (transformers.utils.output_capturing._active_collector); "
            "output_attentions=True then reaches qkv only in models that pass the flag on to "
            "their attention function, and GPT-2, OPT or SigLIP would return no weights",
        )
    return name


# ---------------------------------------------------------------------------------------------
# The mask function
# ---------------------------------------------------------------------------------------------


def make_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int | torch.Tensor = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs,
) -> Mask | torch.Tensor | None:
    """transformers' mask function for qkv (its `sdpa_mask` signature; see the module docstring).

    Returns None (no mask: the attention layer's `is_causal` decides, as for SDPA), a
    `qkv.masks.Mask`, a bool `(B, 1, 1, Nk)` padding-only mask, or, for patterns it cannot
    express that way, a dense bool `(B, 1, Nq, Nk)` mask. Two callers get a tensor instead of a
    `Mask`: generate()'s pre-build for static caches (a dense bool mask), and a model family
    that never calls qkv (its "eager" float mask, with a warning).
    """
    mu = _import("transformers.masking_utils")
    call = _MaskCall(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mu.causal_mask_function if mask_function is None else mask_function,
        attention_mask=attention_mask,
        use_vmap=use_vmap,
        device=device,
    )
    config = kwargs.get("config")
    if config is not None and routes_attention(config) is False:
        # The model's own attention code reads this mask (qkv never runs there): give it the
        # mask it reads under "eager", and say so.
        family = type(config).__name__.removesuffix("Config")
        _warn_once(
            f"family:{family}",
            f"qkv: {family} models compute attention in their own code and never call "
            "transformers' attention interface, so attn_implementation='qkv' does not run qkv "
            "in them (their masks are built as for 'eager'); check a model with "
            "qkv.integrations.hf.verify(model)",
        )
        return mu.eager_mask(**vars(call), **kwargs)
    result = _translate(call, mu, allow_is_causal_skip, allow_is_bidirectional_skip)
    if isinstance(result, Mask) and _prebuilt_for_generate():
        # generate() hands this mask back to the model as its `attention_mask` input, which
        # transformers reads as a tensor: the same mask, dense.
        return call.dense(mu)
    return result


@dataclass(frozen=True)
class _MaskCall:
    """What transformers describes to a mask function (the arguments of `sdpa_mask`)."""

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int | torch.Tensor  # position of the first query (a 0-d tensor: static cache)
    kv_offset: int | torch.Tensor  # position of the first key
    mask_function: Callable  # transformers' predicate (b, h, q_pos, kv_pos) -> bool
    attention_mask: torch.Tensor | None  # the 2-D padding mask, True = a real token
    use_vmap: bool
    device: torch.device | str

    def dense(self, mu: ModuleType) -> torch.Tensor:
        """transformers' own construction, materialised: bool `(B, 1, Nq, Nk)`."""
        return mu.sdpa_mask(
            **vars(self), allow_is_causal_skip=False, allow_is_bidirectional_skip=False
        )


# generate()'s hook that pre-builds masks (the generic one in masking_utils, and the methods of
# that name some models define); what it returns becomes the model's `attention_mask` input.
_PREBUILD = "create_masks_for_generate"
_PREBUILD_DEPTH = 16  # frames between make_mask and that hook: a few decorators and mask helpers


def _prebuilt_for_generate() -> bool:
    """Is this call part of generate()'s pre-build of masks for a compileable (static) cache?

    Everywhere else a model hands make_mask's result straight to its attention layers, which
    call qkv. generate() instead calls `create_masks_for_generate` before each step and feeds
    the result back into the model as `attention_mask`; the model's `create_*_mask` then passes
    a 4-D tensor through unchanged and reads `.ndim` of anything else. Nothing in make_mask's
    arguments tells the two apart (a static sliding-window cache reports the same sizes as a
    dynamic one), so the caller is looked up on the stack. generate() never compiles the
    pre-build, so a compiled forward is not one (and is not traced through the stack walk)."""
    if torch.compiler.is_compiling():
        return False
    frame = sys._getframe(2)
    for _ in range(_PREBUILD_DEPTH):
        if frame is None:
            return False
        if frame.f_code.co_name == _PREBUILD:
            return True
        frame = frame.f_back
    return False


def _translate(
    call: _MaskCall, mu: ModuleType, allow_is_causal_skip: bool, allow_is_bidirectional_skip: bool
) -> Mask | torch.Tensor | None:
    """transformers' description in qkv terms (the table of the module docstring)."""
    nq, nk, mask_function = call.q_length, call.kv_length, call.mask_function
    attention_mask, device = call.attention_mask, call.device
    if attention_mask is not None and attention_mask.dim() != 2:
        return call.dense(mu)  # not the 2-D padding mask this function is documented to get
    # transformers' query i has position q_off + i, key j position kv_off + j; qkv's query row
    # i has position i + Nk − Nq and key j position j. The two agree on q − kv (all that the
    # patterns below look at) exactly when the queries are the last Nq keys.
    q_off, kv_off = int(call.q_offset), int(call.kv_offset)
    if isinstance(call.q_offset, torch.Tensor) or q_off - kv_off != nk - nq:
        return call.dense(mu)  # a static cache (a tensor q_offset is its mark): see the docstring
    interval = _interval(mask_function, mu)
    if interval is None:
        return call.dense(mu)  # a predicate we do not know (packed sequences, chunks, custom)
    structure, kind = _structure(interval, nq, nk)
    if kind == "dense":
        return call.dense(mu)
    if not _agrees(mask_function, structure, q_off, kv_off, nq, nk, device):
        _warn_once(
            repr(interval),
            f"qkv: transformers' mask function {getattr(mask_function, '__qualname__', '?')} "
            f"did not match the qkv mask {structure!r} built for it; using a dense mask",
        )
        return call.dense(mu)

    valid = _padding(attention_mask, kv_off, nk)
    if valid is None:
        causal_shape = kind == "causal" or (kind == "full" and nq <= 1)
        if causal_shape and allow_is_causal_skip:
            return None  # the layer's is_causal (bottom-right in qkv) is exactly this
        if kind == "full" and interval[0] is None and allow_is_bidirectional_skip:
            return None  # bidirectional: the layer is not causal either (as for SDPA)
        if kind == "full":
            return torch.ones(call.batch_size, 1, 1, nk, dtype=torch.bool, device=device)
        return structure
    if kind == "full":
        return valid[:, None, None, :]  # padding only: (B, 1, 1, Nk), and SDPA can run it
    return structure & masks.key_mask(valid)


def _padding(attention_mask: torch.Tensor | None, kv_off: int, kv_length: int):
    """The real-key mask `(B, Nk)` of this call's keys, or None when every key is real."""
    if attention_mask is None:
        return None
    valid = attention_mask.to(torch.bool)
    need = kv_off + kv_length
    if valid.shape[-1] < need:  # keys beyond the 2-D mask count as padding, as in transformers
        valid = torch.nn.functional.pad(valid, (0, need - valid.shape[-1]), value=False)
    valid = valid[:, kv_off:need]
    return None if bool(valid.all()) else valid.contiguous()


def _closure(fn: Callable) -> dict[str, object]:
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    cells = getattr(fn, "__closure__", None) or ()
    return {n: c.cell_contents for n, c in zip(names, cells, strict=False)}


def _interval(fn: Callable, mu: ModuleType) -> tuple[int | None, int | None] | None:
    """transformers' predicate as an interval `lo ≤ q_pos − kv_pos ≤ hi` (None = unbounded), or
    None when it is not one of the relative-position predicates we know."""
    if fn is mu.causal_mask_function:
        return (0, None)
    if fn is mu.bidirectional_mask_function:
        return (None, None)
    if getattr(fn, "__module__", None) != mu.__name__:
        return None
    name, cells = getattr(fn, "__qualname__", ""), _closure(fn)
    if name == "and_masks.<locals>.and_mask":
        parts = [_interval(f, mu) for f in cells.get("mask_functions", ())]  # type: ignore[union-attr]
        if any(p is None for p in parts):
            return None
        los = [p[0] for p in parts if p[0] is not None]  # type: ignore[index]
        his = [p[1] for p in parts if p[1] is not None]  # type: ignore[index]
        return (max(los) if los else None, min(his) if his else None)
    window = cells.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int):
        return None
    if name == "sliding_window_overlay.<locals>.inner_mask":
        return (None, window - 1)  # kv > q − w
    if name == "sliding_window_bidirectional_overlay.<locals>.inner_mask":
        return (-window, window)  # |q − kv| ≤ w
    return None


def _structure(
    interval: tuple[int | None, int | None], nq: int, nk: int
) -> tuple[Mask | None, str]:
    """The interval in qkv's (bottom-right aligned) terms, as (Mask or None, kind) with kind
    "full" (nothing excluded on this shape), "causal" (exactly `masks.causal()`), "window", or
    "dense" (not expressible: a bound that excludes the diagonal itself)."""
    lo, hi = interval
    # lo ≤ q − kv ≤ hi  ⇔  q − left ≤ kv ≤ q + right
    left, right = hi, None if lo is None else -lo
    # Drop bounds that exclude nothing here: over this shape q − kv runs from 1 − Nq to Nk − 1.
    if left is not None and left >= nk - 1:
        left = None
    if right is not None and right >= nq - 1:
        right = None
    if left is None and right is None:
        return None, "full"
    if left is None and right == 0:
        return masks.causal(), "causal"
    # A dropped bound is as good as the widest one that still excludes nothing on this shape.
    left = nk - 1 if left is None else left
    right = max(nq - 1, 0) if right is None else right
    if left < 0 or right < 0:
        return None, "dense"
    return masks.sliding_window(left, right), "window"


def _agrees(
    mask_function: Callable,
    structure: Mask | None,
    q_off: int,
    kv_off: int,
    nq: int,
    nk: int,
    device: torch.device | str,
) -> bool:
    """Does our translation give what `mask_function` gives, on a few query rows × all keys?
    (A guard against transformers changing what a predicate means; padding is not involved.)"""
    if nq == 0 or nk == 0:
        return True
    rows = torch.tensor(sorted({0, nq // 2, nq - 1}), device=device).view(1, 1, -1, 1)
    cols = torch.arange(nk, device=device).view(1, 1, 1, -1)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    theirs = mask_function(zero, zero, rows + q_off, cols + kv_off)
    theirs = torch.as_tensor(theirs, device=device).to(torch.bool).expand(1, 1, rows.shape[2], nk)
    if structure is None:
        return bool(theirs.all())
    ours = structure.evaluate(zero, zero, rows, cols, nq, nk).expand(1, 1, rows.shape[2], nk)
    return torch.equal(theirs, ours.to(device))


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------
# The attention function
# ---------------------------------------------------------------------------------------------


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Mask | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention function for qkv.

    Args:
        module: the calling attention layer (its `training`, `is_causal`, `config` are read).
        query: `(B, H, Sq, D)`; key, value: `(B, Hkv, Sk, D)` / `(B, Hkv, Sk, Dv)`, the
            grouped key/value heads not repeated (qkv reads them in place).
        attention_mask: what `make_mask` returned (None, a `qkv.masks.Mask`, a bool mask), or a
            4-D bool/float mask a caller built itself (float: added to the scaled scores).
        dropout: attention dropout, applied only when `module.training`.
        scaling: multiplies Q Kᵀ (default 1/√D).
        is_causal: used only when there is no mask (else the mask holds the pattern, as for
            SDPA); default `module.is_causal`, else True. Bottom-right aligned.
        softcap: Gemma-2 logit soft-capping `cap · tanh(s / cap)` (`qkv.scores.softcap`).
        sliding_window: the layer's window; with no mask, keys further back than
            `sliding_window − 1` are excluded through `qkv.masks.sliding_window`.
        s_aux: per-head attention-sink logits `(H,)` (gpt-oss): a virtual key with that score
            and a zero value joins every row's softmax.
        position_bias: a float bias `(B|1, H|1, Sq, Sk)` added to the scaled scores (T5-style).
        **kwargs: accepted and ignored (`output_attentions` is read from here or the config).

    Returns:
        `(out (B, Sq, H, Dv) contiguous, weights (B, H, Sq, Sk) or None)`; weights are computed
        (by qkv's `reference` backend) only when the model runs with `output_attentions=True`.
    """
    note_call(module)
    cache = kwargs.get("cache")
    if cache is not None and "Paged" in type(cache).__name__:
        raise NotImplementedError(
            "qkv's transformers backend does not run paged (continuous-batching) caches; use "
            "generate() with the default cache"
        )
    n_q, n_k = query.shape[2], key.shape[2]
    mask = attention_mask
    causal = False
    if mask is None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        if sliding_window is not None and n_k > sliding_window:
            # No mask means the queries are the last keys (see make_mask), so qkv's
            # bottom-right band is the layer's window; right = 0 also makes it causal.
            left = sliding_window - 1
            mask, causal = masks.sliding_window(left, 0 if causal else left), False
    elif isinstance(mask, torch.Tensor):
        if mask.dim() == 4 and mask.shape[-1] > n_k:
            mask = mask[..., :n_k]  # a static cache's mask may cover more slots than keys
    elif not isinstance(mask, Mask):
        raise TypeError(
            f"attention_mask must be None, a tensor or a qkv.masks.Mask, got "
            f"{type(mask).__name__}; load the model with attn_implementation='qkv' after "
            f"qkv.integrations.hf.register() so that transformers builds masks with qkv"
        )
    if position_bias is not None:
        mask = _with_bias(mask, position_bias, n_q, n_k)

    want_weights = _wants_weights(module, kwargs)
    result = qkv.attention(
        query,
        key,
        value,
        mask=mask,
        causal=causal,
        scale=None if scaling is None else float(scaling),
        dropout_p=float(dropout) if module.training else 0.0,
        backend="reference" if want_weights else "auto",
        return_lse=s_aux is not None,
        return_weights=want_weights,
        score_mod=None if softcap is None else scores.softcap(float(softcap)),
        # the model's own projections: a padded or unused position holds a finite value
        finite_inputs=True,
    )
    parts = list(result) if isinstance(result, tuple) else [result]
    out = parts.pop(0)
    lse = parts.pop(0) if s_aux is not None else None
    weights = parts.pop(0) if want_weights else None
    if lse is not None:
        # A sink adds exp(s_aux[h]) to each row's denominator exp(lse): the real keys keep the
        # share sigmoid(lse − s_aux) of the mass (0 for a row with no real key: lse = −inf).
        keep = torch.sigmoid(lse - s_aux.to(lse.dtype).view(1, -1, 1)).unsqueeze(-1)
        out = (out * keep).to(out.dtype)
        if weights is not None:
            weights = (weights * keep).to(weights.dtype)
    return out.transpose(1, 2).contiguous(), weights


def _wants_weights(module: torch.nn.Module, kwargs: dict) -> bool:
    """Does the running model want this layer's attention weights?

    transformers collects `output_attentions` with forward hooks on the attention layers, which
    record what the attention function returns; it decides once per model forward (from the
    call, else the config) and keeps the answer in its output collector. Some models pass the
    flag on to the attention function as well, GPT-2, OPT and SigLIP do not, so the collector
    is the answer; the flag and the config are read only outside a model's forward."""
    collector = _output_collector()
    collecting = None if collector is None else collector.get()
    if collecting is not None:  # inside a model forward: what transformers will record
        return any(key.endswith("attentions") for key in collecting)
    flag = kwargs.get("output_attentions")
    if flag is None:
        flag = getattr(getattr(module, "config", None), "output_attentions", False)
    return bool(flag)


@functools.cache
def _output_collector():
    """transformers' per-forward record of the outputs asked for (a context variable whose
    value maps "attentions", "hidden_states", ... to lists), or None if it is not found."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return None
    collector = getattr(output_capturing, "_active_collector", None)
    return collector if callable(getattr(collector, "get", None)) else None


def _with_bias(
    mask: Mask | torch.Tensor | None, bias: torch.Tensor, n_q: int, n_k: int
) -> torch.Tensor:
    """A float mask: `bias` where the mask allows, −inf where it does not."""
    bias = bias[..., :n_k]
    if mask is None:
        return bias
    if isinstance(mask, Mask):
        mask = mask.dense4(n_q, n_k, bias.device)
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask.to(bias.dtype)
