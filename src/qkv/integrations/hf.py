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

What `make_mask` gets and returns, the table of transformers' patterns and the qkv masks they
become, and what changes under `torch.compile`: `qkv.integrations.hf_masks`, the translation
(this module is the glue: registering, choosing who gets a dense mask, the attention function).
Under `torch.compile(model, fullgraph=True)` the integration traces without a graph break;
`output_attentions=True` still breaks the graph (qkv's `reference` backend reads
/proc/meminfo).

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
    `KeyError: 'qkv'` before any qkv code runs (in older transformers). Forced afterwards
    (`model.config._attn_implementation = "qkv"`), it runs on qkv, ALiBi included: an ALiBi
    model adds its bias onto the mask it asks to have materialised, so `make_mask` gives it
    the dense mask.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from types import FrameType, ModuleType

import torch

import qkv

from .. import scores
from ..masks import Mask
from .hf_masks import CausalKeys, MaskCall, predicates_agree, real_keys, shelved, translate
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
    "real_keys",
    "register",
    "routes_attention",
    "verify",
]

# Looked up once, not per call (and never while torch.compile traces: an import there breaks
# the graph). `register()` fills them; the functions below fall back to a lookup if it did not.
_MU: ModuleType | None = None  # transformers.masking_utils
_COLLECTOR: list = []  # [transformers' output collector, or None when it has none]
_TRUSTED: bool | None = None  # transformers' predicates checked against qkv's masks (register)


def _import(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"qkv.integrations.hf needs the transformers library ({module} could not be "
            f"imported: {e}); install it with: {_INSTALL_HINT}"
        ) from e


def _masking_utils() -> ModuleType:
    global _MU
    if _MU is None:
        _MU = _import("transformers.masking_utils")
    return _MU


def register(name: str = NAME) -> str:
    """Register qkv with transformers under `name` (default "qkv"): both the attention function
    and the mask function. Idempotent. Returns the name to pass as `attn_implementation`."""
    global _TRUSTED
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    transformers = _import("transformers")
    mu = _masking_utils()
    for interface, function in (
        (transformers.AttentionInterface, attention_forward),
        (mu.AttentionMaskInterface, make_mask),
    ):
        interface.register(name, function)
    _TRUSTED = predicates_agree(mu)
    if not _TRUSTED:
        _warn_once(
            "predicates",
            f"qkv: transformers {transformers.__version__}'s mask predicates do not mean what "
            "qkv's translation expects; every mask is built dense",
        )
    _collector()
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
) -> Mask | torch.Tensor | CausalKeys | None:
    """transformers' mask function for qkv (its `sdpa_mask` signature; the patterns and what
    they become: `qkv.integrations.hf_masks`).

    Returns None (no mask: the attention layer's `is_causal` decides, as for SDPA), a
    `qkv.masks.Mask`, a bool `(B, 1, 1, Nk)` padding-only mask, or, for patterns it cannot
    express that way, a dense bool `(B, 1, Nq, Nk)` mask. Two callers get a tensor instead of a
    `Mask`: generate()'s pre-build for static caches (a dense bool mask), and a model family
    that never calls qkv (its "eager" float mask, with a warning). Under torch.compile, where
    nothing reads tensor values, a causal mask over a padded batch is a `CausalKeys`.
    """
    mu = _MU if _MU is not None else _masking_utils()
    call = MaskCall(
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
    if config is not None and _routes(type(config)) is False:
        # The model's own attention code reads this mask (qkv never runs there): give it the
        # mask it reads under "eager", and say so.
        if not torch.compiler.is_compiling():
            family = type(config).__name__.removesuffix("Config")
            _warn_once(
                f"family:{family}",
                f"qkv: {family} models compute attention in their own code and never call "
                "transformers' attention interface, so attn_implementation='qkv' does not run "
                "qkv in them (their masks are built as for 'eager'); check a model with "
                "qkv.integrations.hf.verify(model)",
            )
        return mu.eager_mask(**call.arguments(), **kwargs)
    result = translate(
        call,
        mu,
        allow_is_causal_skip,
        allow_is_bidirectional_skip,
        trusted=_TRUSTED,
        warn=_warn_once,
    )
    if isinstance(result, Mask) and not allow_is_causal_skip and _adds_to_mask(config):
        # An ALiBi model (Falcon) adds its position bias onto the mask it asked to have
        # materialised, then hands the float sum to the attention function: a dense mask.
        return call.dense(mu)
    if isinstance(result, Mask) and _prebuilt_for_generate():
        # generate() hands this mask back to the model as its `attention_mask` input, which
        # transformers reads as a tensor: the same mask, dense.
        return call.dense(mu)
    return result


def _adds_to_mask(config: object) -> bool:
    """Does the model add a bias of its own onto the mask (ALiBi: Falcon with `alibi=True`)?
    Such a model asks for the mask materialised and reads it as a tensor."""
    return bool(getattr(config, "alibi", False))


def _routes(config_class: type) -> bool | None:
    """`routes_attention` of a config class, called (and its answer kept as a constant) once
    per class while torch.compile traces, rather than traced: it reads the family's source."""
    return routes_attention(config_class)


# What `torch.compiler.assume_constant_result` does, without importing torch._dynamo here.
_routes._dynamo_marked_constant = True  # type: ignore[attr-defined]  # dynamo's marker on a function


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
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_PREBUILD_DEPTH):
        if frame is None:
            return False
        if frame.f_code.co_name == _PREBUILD:
            return True
        frame = frame.f_back
    return False


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
    attention_mask: Mask | torch.Tensor | CausalKeys | None,
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
        Contiguous as SDPA's: callers may `.view` it; the copy is the one their `.reshape`
        would otherwise make, and none at all for a single query row (decoding).
    """
    note_call(module)
    cache = kwargs.get("cache")
    if cache is not None and "Paged" in type(cache).__name__:
        raise NotImplementedError(
            "qkv's transformers backend does not run paged (continuous-batching) caches; use "
            "generate() with the default cache"
        )
    n_k = key.shape[2]
    mask = attention_mask
    causal = False
    if mask is None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        if sliding_window is not None and n_k > sliding_window:
            # No mask means the queries are the last keys (see make_mask), so qkv's
            # bottom-right band is the layer's window; right = 0 also makes it causal.
            left = sliding_window - 1
            mask, causal = shelved("window", left, 0 if causal else left), False
    elif isinstance(mask, CausalKeys):
        mask, causal = mask.valid, True
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
        mask = _with_bias(mask, position_bias, query.shape[2], n_k)

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
    if s_aux is None and not want_weights:
        return result.transpose(1, 2).contiguous(), None
    parts = list(result)
    out = parts.pop(0)
    lse = parts.pop(0) if s_aux is not None else None
    weights = parts.pop(0) if want_weights else None
    if lse is not None and s_aux is not None:  # lse is asked for exactly when there is a sink
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
    is the answer; the flag and the config are read only outside a model's forward.

    Under torch.compile the collector is a plain attribute when the model's forward (which
    sets it) is traced too; a trace that starts inside the model (a compiled layer) cannot read
    it (a context variable) and goes by the flag and the config."""
    collector = _COLLECTOR[0] if _COLLECTOR else _collector()
    if collector is not None and (
        getattr(collector, "compiling", False) or not torch.compiler.is_compiling()
    ):
        collecting = collector.get()
        if collecting is not None:  # inside a model forward: what transformers will record
            return bool(collecting) and any(key.endswith("attentions") for key in collecting)
    flag = kwargs.get("output_attentions")
    if flag is None:
        flag = getattr(getattr(module, "config", None), "output_attentions", False)
    return bool(flag)


def _collector():
    """transformers' output collector, looked up once (see `_output_collector`)."""
    if not _COLLECTOR:
        _COLLECTOR.append(_find_collector())
    return _COLLECTOR[0]


def _output_collector():
    """transformers' per-forward record of the outputs asked for (a context variable whose
    value maps "attentions", "hidden_states", ... to lists), or None if it is not found."""
    return _collector()


def _find_collector():
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
