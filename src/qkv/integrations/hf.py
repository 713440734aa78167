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
| packed sequences (position_ids restart) [*]   | `masks.varlen(cu, cu, causal=True)` [& window] |
| anything else (chunked, blocks, custom)       | dense bool `(B, 1, Nq, Nk)` (fallback)      |

[*] What `DataCollatorWithFlattening` makes: one row, sequences end to end, `position_ids`
    restarting at 0, no padding mask. transformers looks for it only without a cache (pass
    `use_cache=False`) and then hands over `and_masks(remap_positions_for_packed_sequence(p,
    position_ids), packed_sequence_mask_function(ids))`: `p` on positions, within a sequence.
    Positions rise by 1 inside a sequence (that is where transformers cuts them), so `p` means
    the same on token indices there, and the sequences' lengths (read from `ids`, a host sync)
    become qkv's varlen mask; rows packed differently get the dense mask.

A padding-only mask is an O(B·Nk) tensor rather than a `Mask`, so that `qkv.attention`'s
`auto` can run it on torch SDPA; every other structured pattern goes to the block-sparse `tiled`
kernel, which skips the tiles a causal or sliding-window mask leaves empty. qkv's masks are
bottom-right aligned (query row i has position `i + Nk − Nq`), which is where every dynamic
cache puts the queries (`q_offset − kv_offset = Nk − Nq`, also when a sliding-window cache has
dropped old keys). Static caches break that (their key slots run ahead of the queries) and are
given a dense tensor. Each recognised pattern is also checked against `mask_function` itself on
a few query rows, and a disagreement falls back to the dense mask with a warning.

Under `torch.compile(model, fullgraph=True)` the integration traces without a graph break
(prefill, padded or not; a StaticCache decode step; packed batches; training) and never reads a
tensor's values there: the spot check is replaced by one `register()` runs on transformers'
predicates, a padding mask is not tested for being all real, and a padded causal layer gets
`_CausalKeys` (run as `mask=valid (B, 1, 1, Nk), causal=True`) instead of a `key_mask`. Only the
module-level predicates (causal, bidirectional) are recognised while tracing: the others are
closures built inside the traced forward, whose cells dynamo cannot read, so sliding windows
and packed batches get transformers' dense mask there, as "sdpa" does. A structured `Mask` a
compiled graph uses is built once and kept (`_Shelf`): a Mask built while tracing reaches the
kernel uninitialised. `output_attentions=True` still breaks the graph (qkv's `reference`
backend reads /proc/meminfo).

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
    _TRUSTED = _predicates_agree(mu)
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
) -> Mask | torch.Tensor | _CausalKeys | None:
    """transformers' mask function for qkv (its `sdpa_mask` signature; see the module docstring).

    Returns None (no mask: the attention layer's `is_causal` decides, as for SDPA), a
    `qkv.masks.Mask`, a bool `(B, 1, 1, Nk)` padding-only mask, or, for patterns it cannot
    express that way, a dense bool `(B, 1, Nq, Nk)` mask. Two callers get a tensor instead of a
    `Mask`: generate()'s pre-build for static caches (a dense bool mask), and a model family
    that never calls qkv (its "eager" float mask, with a warning). Under torch.compile, where
    nothing reads tensor values, a causal mask over a padded batch is a `_CausalKeys`.
    """
    mu = _MU if _MU is not None else _masking_utils()
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
    result = _translate(call, mu, allow_is_causal_skip, allow_is_bidirectional_skip)
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
_routes._dynamo_marked_constant = True  # type: ignore[attr-defined]


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

    def arguments(self) -> dict[str, object]:
        return dict(
            batch_size=self.batch_size,
            q_length=self.q_length,
            kv_length=self.kv_length,
            q_offset=self.q_offset,
            kv_offset=self.kv_offset,
            mask_function=self.mask_function,
            attention_mask=self.attention_mask,
            use_vmap=self.use_vmap,
            device=self.device,
        )

    def dense(self, mu: ModuleType) -> torch.Tensor:
        """transformers' own construction, materialised: bool `(B, 1, Nq, Nk)`."""
        return mu.sdpa_mask(
            **self.arguments(), allow_is_causal_skip=False, allow_is_bidirectional_skip=False
        )


@dataclass(frozen=True)
class _CausalKeys:
    """Causal attention (bottom-right) over the real keys `valid`, bool `(B, 1, 1, Nk)`: what
    make_mask returns for a causal layer over a padded batch under torch.compile, where the
    padding cannot become a `masks.key_mask` (that reads the mask's values) and is not checked
    for being all True (an all-True key mask changes nothing). `attention_forward` runs it as
    `mask=valid, causal=True`: O(B·Nk), no N² tensor."""

    valid: torch.Tensor


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
) -> Mask | torch.Tensor | _CausalKeys | None:
    """transformers' description in qkv terms (the table of the module docstring).

    Every decision is on metadata (sizes, offsets that are ints, which predicate); tensor values
    are read only outside torch.compile: the spot check against the predicate, whether a
    padding mask has padding, and the sequence boundaries of a packed batch."""
    nq, nk, mask_function = call.q_length, call.kv_length, call.mask_function
    attention_mask, device = call.attention_mask, call.device
    compiling = torch.compiler.is_compiling()
    if compiling and not _TRUSTED:
        return call.dense(mu)  # the predicates were not checked (register() does)
    if attention_mask is not None and attention_mask.dim() != 2:
        return call.dense(mu)  # not the 2-D padding mask this function is documented to get
    if isinstance(call.q_offset, torch.Tensor) or isinstance(call.kv_offset, torch.Tensor):
        return call.dense(mu)  # a static cache (a tensor q_offset is its mark): see the docstring
    # transformers' query i has position q_off + i, key j position kv_off + j; qkv's query row
    # i has position i + Nk − Nq and key j position j. The two agree on q − kv (all that the
    # patterns below look at) exactly when the queries are the last Nq keys.
    q_off, kv_off = int(call.q_offset), int(call.kv_offset)
    if q_off - kv_off != nk - nq:
        return call.dense(mu)
    if compiling:  # a closure built while tracing cannot be read: transformers' own mask
        packed, interval = None, _plain_interval(mask_function, mu)
    else:
        packed = _packed(mask_function, mu)
        interval = _interval(mask_function if packed is None else packed[0], mu)
    if interval is None:
        return call.dense(mu)  # a predicate we do not know (chunks, blocks, custom)
    structure, kind = _structure(interval, nq, nk)
    if kind == "dense":
        return call.dense(mu)
    if packed is not None:
        # Packed sequences: where one sequence ends is in the position ids (tensor values).
        if compiling or attention_mask is not None:
            return call.dense(mu)
        cu = _sequences(packed[1], packed[2], nq, nk, q_off, kv_off)
        if cu is None:
            return call.dense(mu)
        structure = _within(cu, structure, kind, causal=interval[0] == 0)
        kind = "packed"
    if not compiling and not _agrees(mask_function, structure, q_off, kv_off, nq, nk, device):
        _warn_once(
            repr(interval),
            f"qkv: transformers' mask function {getattr(mask_function, '__qualname__', '?')} "
            f"did not match the qkv mask {structure!r} built for it; using a dense mask",
        )
        return call.dense(mu)

    valid = real_keys(attention_mask, kv_off, nk, compiling)
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
    if compiling:  # no key_mask: it reads the mask's values (and traced kinds are plain)
        return _CausalKeys(valid[:, None, None, :]) if kind == "causal" else call.dense(mu)
    return structure & masks.key_mask(valid)


def real_keys(
    attention_mask: torch.Tensor | None, kv_off: int, kv_length: int, compiling: bool
) -> torch.Tensor | None:
    """The real-key mask `(B, Nk)` of this call's keys (keys `kv_off …` of transformers' 2-D
    padding mask, True = a real token), or None when there is no padding. With `compiling`
    the mask's values are not read, and an all-True mask is returned as it is; otherwise an
    all-True mask is None too. (Public for `qkv.integrations.hf_sparse`.)"""
    if attention_mask is None:
        return None
    valid = attention_mask if attention_mask.dtype == torch.bool else attention_mask.bool()
    need = kv_off + kv_length
    if valid.shape[-1] < need:  # keys beyond the 2-D mask count as padding, as in transformers
        valid = torch.nn.functional.pad(valid, (0, need - valid.shape[-1]), value=False)
    valid = valid[:, kv_off:need]
    if compiling:
        return valid
    return None if bool(valid.all()) else valid.contiguous()


def _closure(fn: Callable) -> dict[str, object]:
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    cells = getattr(fn, "__closure__", None) or ()
    return {n: c.cell_contents for n, c in zip(names, cells, strict=False)}


def _is(fn: object, mu: ModuleType, qualname: str) -> bool:
    """Is `fn` transformers' masking_utils function (or closure) of that name?"""
    return (
        getattr(fn, "__module__", None) == mu.__name__
        and getattr(fn, "__qualname__", None) == qualname
    )


def _plain_interval(fn: Callable, mu: ModuleType) -> tuple[int | None, int | None] | None:
    """`_interval` of transformers' module-level predicates (causal, bidirectional), recognised
    by identity: all that torch.compile can see of a predicate. The others are closures
    (`and_masks(...)`, `sliding_window_overlay(w)`) that transformers builds on every forward,
    inside the traced code, and dynamo cannot read the closure of a function built while it
    traces (`__closure__` raises there)."""
    if fn is mu.causal_mask_function:
        return (0, None)
    if fn is mu.bidirectional_mask_function:
        return (None, None)
    return None


def _interval(fn: Callable, mu: ModuleType) -> tuple[int | None, int | None] | None:
    """transformers' predicate as an interval `lo ≤ q_pos − kv_pos ≤ hi` (None = unbounded), or
    None when it is not one of the relative-position predicates we know."""
    plain = _plain_interval(fn, mu)
    if plain is not None or getattr(fn, "__module__", None) != mu.__name__:
        return plain
    name, cells = getattr(fn, "__qualname__", ""), _closure(fn)
    if name == "and_masks.<locals>.and_mask":
        parts = [_interval(f, mu) for f in cells.get("mask_functions", ())]  # type: ignore[union-attr]
        if not parts or any(p is None for p in parts):
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


# transformers' packed-sequence predicate (create_*_mask, when position_ids restart inside a
# row and there is neither a padding mask nor a cache):
#     and_masks(remap_positions_for_packed_sequence(inner, position_ids),
#               packed_sequence_mask_function(sequence_ids))
_REMAP = "remap_positions_for_packed_sequence.<locals>.inner_mask"
_SAME_SEQUENCE = "packed_sequence_mask_function.<locals>.inner_mask"


def _packed(fn: Callable, mu: ModuleType) -> tuple[Callable, torch.Tensor, torch.Tensor] | None:
    """`(inner predicate, position_ids, sequence ids)` of the packed-sequence predicate, or None
    when `fn` is not it."""
    if not _is(fn, mu, "and_masks.<locals>.and_mask"):
        return None
    parts = tuple(_closure(fn).get("mask_functions", ()))  # type: ignore[arg-type]
    if len(parts) != 2 or not (_is(parts[0], mu, _REMAP) and _is(parts[1], mu, _SAME_SEQUENCE)):
        return None
    remap, same = _closure(parts[0]), _closure(parts[1])
    inner, positions = remap.get("mask_function"), remap.get("position_ids")
    ids = same.get("packed_sequence_mask")
    if not callable(inner) or not isinstance(positions, torch.Tensor):
        return None
    if not isinstance(ids, torch.Tensor):
        return None
    return inner, positions, ids


def _sequences(
    positions: torch.Tensor, ids: torch.Tensor, nq: int, nk: int, q_off: int, kv_off: int
) -> torch.Tensor | None:
    """`cu_seqlens` (int64, from 0 to N) of a packed batch, or None where qkv cannot express it
    as one set of sequences for every row. Reads the ids (a host sync, outside torch.compile).

    Within one sequence the position ids rise by exactly 1 per token (transformers starts a new
    sequence wherever they do not), so a predicate on `q_pos − kv_pos` means the same on token
    indices there: what lets the inner predicate become a mask on indices, cut at sequence
    boundaries."""
    if (q_off, kv_off) != (0, 0) or nq != nk or ids.dim() != 2 or ids.shape[-1] != nk:
        return None
    if positions.shape != ids.shape:
        return None
    row, pos = ids[0], positions[0]
    if ids.shape[0] > 1 and not (bool((ids == row).all()) and bool((positions == pos).all())):
        return None  # rows packed differently: one qkv mask serves every row
    same = row[1:] == row[:-1]
    if not bool((row[1:] >= row[:-1]).all()) or not bool((pos[1:] - pos[:-1] == 1)[same].all()):
        return None  # not how transformers builds the ids from the positions
    counts = torch.unique_consecutive(row, return_counts=True)[1]
    return torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.long).cpu()


def _within(cu: torch.Tensor, structure: Mask | None, kind: str, causal: bool) -> Mask:
    """The interval's mask restricted to each packed sequence (`masks.varlen`, whose segments
    let the kernels cut their tiles at the sequence boundaries)."""
    packed = masks.varlen(cu, cu, causal=causal)
    return packed if kind != "window" else packed & structure  # type: ignore[operator]


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
        return _shelved("causal"), "causal"
    # A dropped bound is as good as the widest one that still excludes nothing on this shape.
    left = nk - 1 if left is None else left
    right = max(nq - 1, 0) if right is None else right
    if left < 0 or right < 0:
        return None, "dense"
    return _shelved("window", left, right), "window"


class _Shelf:
    """The masks that depend only on numbers (causal, a window), one object per kind and size,
    built once and kept (attributes named by `_shelve`).

    A compiled graph names a `Mask` by a handle and looks the object up when it runs, so a Mask
    must outlive the graph and must not be built while torch.compile traces (an object created
    during tracing reaches the kernel uninitialised). `_shelve` runs as a plain call at trace
    time (its name is a constant of the graph), and the trace reads the built object off the
    shelf, as it reads any module global."""


_SHELF = _Shelf()
_SHELF_LIMIT = 1024  # distinct windows kept; past that the shelf starts over


def _shelve(kind: str, left: int = 0, right: int = 0) -> str:
    name = "causal" if kind == "causal" else f"window_{left}_{right}"
    shelf = vars(_SHELF)
    if name not in shelf:
        if len(shelf) >= _SHELF_LIMIT:
            shelf.clear()  # a compiled graph guards on the object it read: it recompiles
        shelf[name] = masks.causal() if kind == "causal" else masks.sliding_window(left, right)
    return name


_shelve._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _shelved(kind: str, left: int = 0, right: int = 0) -> Mask:
    """`masks.causal()` or `masks.sliding_window(left, right)`, built once (see `_Shelf`)."""
    return getattr(_SHELF, _shelve(kind, left, right))


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


def _predicates_agree(mu: ModuleType) -> bool:
    """`_agrees` for each predicate qkv translates, on a few shapes: what stands in for the
    per-call spot check under torch.compile (which cannot read the values it compares)."""
    predicates = (
        mu.causal_mask_function,
        mu.bidirectional_mask_function,
        mu.sliding_window_causal_mask_function(3),
        mu.sliding_window_bidirectional_mask_function(2),
    )
    # (Nq, Nk, q_offset, kv_offset): no cache, decode, chunked prefill, a sliding-window cache
    shapes = ((7, 7, 0, 0), (1, 9, 8, 0), (3, 9, 6, 0), (2, 4, 11, 9))
    for fn in predicates:
        interval = _interval(fn, mu)
        if interval is None:
            return False
        for nq, nk, q_off, kv_off in shapes:
            structure, kind = _structure(interval, nq, nk)
            if kind != "dense" and not _agrees(fn, structure, q_off, kv_off, nq, nk, "cpu"):
                return False
    return True


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
    attention_mask: Mask | torch.Tensor | _CausalKeys | None,
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
            mask, causal = _shelved("window", left, 0 if causal else left), False
    elif isinstance(mask, _CausalKeys):
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
