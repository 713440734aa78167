"""Content-selected blocks in a transformers model: `attn_implementation="qkv_sparse"`.

    import qkv.integrations.hf_sparse
    qkv.integrations.hf_sparse.register("qkv_sparse", block=64, topk=16)   # or threshold=0.9
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="qkv_sparse")
    model.set_attn_implementation("qkv_sparse")                       # or switch a loaded model

Every call of a causal self-attention layer, prefill and each decoding step alike, chooses its
key blocks from that call's own queries and keys (`qkv.sparse.select_blocks`: each query block
reads its `local` nearest key blocks, the `sink` first ones and the `topk` others whose mean
keys score highest against its mean query, or with `threshold` the fewest holding that share of
the pooled softmax mass; the heads of a GQA group share a choice) and then runs exact attention
over exactly the chosen pairs, causal inside: `qkv.integrations.hf.attention_forward` with the
choice (a `qkv.masks.ChosenBlocks`) as its mask, so scaling, dropout, softcap, attention sinks
and `output_attentions` are honoured as under `"qkv"`. A decoding step is one query block over
the whole cache; transformers' `DynamicCache` keeps no pooled keys, so each step pools the
cache's keys again (one read of K) before reading the chosen blocks of K and V.

What runs where (decided per call, on the call's shapes; `register` fills transformers'
attention and mask registries under the name, and `"qkv"` as well):

| the call                                              | runs                               |
| ---                                                   | ---                                |
| causal layer, ≥ `min_len` keys                        | selection, then exact attention    |
| causal layer, fewer keys                              | qkv's dense causal path (`"qkv"`)  |
| sliding-window layer (Mistral, Qwen2/Gemma's local)   | its window, as `"qkv"` runs it     |
| padded batch, each row's real tokens one run          | each row alone, as above           |
| static cache, bidirectional or cross-attention, a     | refused (`NotImplementedError`)    |
| pattern of the model's own on a full-attention layer  |                                    |
| (packed sequences, chunked, custom), a position bias  |                                    |
| padding that splits a row's tokens (right padding     | refused (`ValueError`)             |
| followed by new tokens)                               |                                    |

`min_len` (default `(topk + local + sink) · block + 1` keys; `(local + sink) · block + 1` with
`threshold` alone): below it a query block could read every block it sees anyway (at most
`topk + local + sink` of them), so selection would keep everything and only cost its scoring;
the dense path gives the same attention. `min_len=0` selects on every call.

Padding. The choice of a row depends on where its blocks start, so a padded row is run on its
own real tokens: row b's real keys (transformers' 2-D `attention_mask`) must be one contiguous
run `[s, e)`, which left padding (what `generate()` uses for a batch) and right padding without
a cache are; the row then gets what it gets alone in a batch of one (the same choice, blocks
counted from its first real token), and its padding positions get zeros. Right padding followed by
decoding puts padding between a row's tokens and is refused.

Under `torch.compile` both functions run outside the graph (`torch.compiler.disable`: the
choice reads tensor values on the host), so `fullgraph=True` is refused by torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import sparse
from ..masks import Mask
from . import hf

NAME = "qkv_sparse"

__all__ = [
    "NAME",
    "SELECTIONS",
    "Plain",
    "Selection",
    "attention_forward",
    "make_mask",
    "register",
]

# The Selection registered under each name (what `register` was given).
SELECTIONS: dict[str, Selection] = {}


DEFAULT = sparse.BlockSelector()  # select_blocks's defaults: blocks of 64, top 16, local 1


@dataclass(frozen=True)
class Selection:
    """How a registration chooses blocks: a `qkv.sparse.BlockSelector` (`select_blocks`'s
    `block`, `topk`, `threshold`, `local`, `sink`) and `min_len`, the fewest keys a call (or
    padded row) needs for selection to run (None: the default of the module docstring)."""

    selector: sparse.BlockSelector = DEFAULT
    min_len: int | None = None

    def __post_init__(self) -> None:
        if self.min_len is not None and (
            isinstance(self.min_len, bool) or not isinstance(self.min_len, int) or self.min_len < 0
        ):
            raise ValueError(f"min_len must be an int ≥ 0 or None, got {self.min_len!r}")

    @property
    def shortest(self) -> int:
        """The fewest keys on which selection runs: `min_len`, or one key past the blocks a
        query block may keep (`topk + local + sink`), where selection starts to leave any out."""
        if self.min_len is not None:
            return self.min_len
        s = self.selector
        return (s.local + s.sink + (s.topk or 0)) * s.block + 1

    def choose(self, query: torch.Tensor, key: torch.Tensor) -> Mask:
        """The blocks this call reads (causal `select_blocks` on its queries and keys)."""
        return self.selector(query, key, causal=True)


def register(
    name: str = NAME,
    *,
    block: int = 64,
    topk: int | None = 16,
    threshold: float | None = None,
    local: int = 1,
    sink: int = 0,
    min_len: int | None = None,
) -> str:
    """Register content-selected attention with transformers under `name` (both its attention
    and its mask function; also `qkv.integrations.hf.register()`, the dense path it falls back
    to). The arguments are `qkv.sparse.select_blocks`'s; `min_len` is the fewest keys a call
    needs for selection to run (default: `(topk + local + sink) · block + 1`, see the module
    docstring). Registering a name again replaces its settings. Returns `name`, to pass as
    `attn_implementation`. Raises ValueError for arguments select_blocks refuses."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    selection = Selection(sparse.BlockSelector(block, topk, threshold, local, sink), min_len)
    hf.register()
    import transformers

    def attention(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(
            module, query, key, value, attention_mask, selection=selection, **kwargs
        )

    attention.__name__ = attention.__qualname__ = f"{name}_attention_forward"
    transformers.AttentionInterface.register(name, torch.compiler.disable(attention))
    transformers.masking_utils.AttentionMaskInterface.register(
        name, torch.compiler.disable(make_mask)
    )
    SELECTIONS[name] = selection
    return name


# ---------------------------------------------------------------------------------------------
# The mask function
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plain:
    """What `make_mask` returns for a plain causal call (no pattern beyond causality, the
    queries the last keys): the real keys `valid (B, Nk)` of a padded batch (True = a real
    token; it may be all True), or None without a padding mask. The attention function chooses
    the blocks itself."""

    valid: torch.Tensor | None


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
    **kwargs,
) -> Plain | Mask | torch.Tensor | hf.CausalKeys | None:
    """transformers' mask function for content-selected attention (`sdpa_mask`'s signature).

    A call that `qkv.integrations.hf.make_mask` finds plain without its padding (causal, the
    queries the last keys) gets a `Plain` holding the padding; any other gets what
    `hf.make_mask` gives it (a sliding window's `Mask`, a dense tensor, ...), which the attention
    function runs on a sliding-window layer and refuses on a full-attention one. A model that
    asks for its mask materialised (`allow_is_causal_skip=False`: it adds to the mask or reads
    it itself) is given hf's mask too.

    Raises NotImplementedError for a static cache's decoding step (a tensor `q_offset`): its
    empty key slots would be pooled into the choice. (Its prefill, whose key slots run ahead of
    the queries, gets hf's dense mask, which the attention function refuses.)"""
    if isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor):
        raise NotImplementedError(
            "qkv_sparse: a static cache (StaticCache, cache_implementation='static') is not "
            "supported: its unfilled key slots would be scored and pooled into the block "
            "choice. Use generate()'s default DynamicCache, or attn_implementation='qkv'"
        )
    given = dict(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        **kwargs,
    )
    plain = (
        allow_is_causal_skip
        and (attention_mask is None or attention_mask.dim() == 2)
        and hf.make_mask(**given, allow_is_causal_skip=True) is None
    )
    if not plain:
        return hf.make_mask(
            **given,
            attention_mask=attention_mask,
            allow_is_causal_skip=allow_is_causal_skip,
            allow_is_bidirectional_skip=allow_is_bidirectional_skip,
        )
    return Plain(hf.real_keys(attention_mask, int(kv_offset), kv_length, compiling=True))


# ---------------------------------------------------------------------------------------------
# The attention function
# ---------------------------------------------------------------------------------------------


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Plain | Mask | torch.Tensor | None,
    *,
    selection: Selection,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention function with content-selected blocks (what `register` binds to
    its `selection`). Arguments and result as `qkv.integrations.hf.attention_forward`'s;
    `attention_mask` is what `make_mask` returned (or None: plain, the layer's `is_causal`).

    Raises NotImplementedError for what it cannot select on (module docstring): a bidirectional
    or cross-attention layer, a position bias, a mask pattern of the model's own on a
    full-attention layer; ValueError for padding that splits a row's tokens."""
    if not bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        raise NotImplementedError(
            f"qkv_sparse: {type(module).__name__} is not causal (bidirectional or "
            "cross-attention); blocks are chosen for causal self-attention (decoders) only. Use "
            "attn_implementation='qkv' for this model"
        )
    sliding = kwargs.get("sliding_window") is not None
    if attention_mask is not None and not isinstance(attention_mask, Plain):
        if sliding:  # a window layer: its window, as "qkv" runs it
            return hf.attention_forward(
                module, query, key, value, attention_mask, is_causal=is_causal,
                position_bias=position_bias, **kwargs,
            )  # fmt: skip
        raise NotImplementedError(
            f"qkv_sparse: {type(module).__name__}'s mask is {_describe(attention_mask)}, a "
            "pattern beyond causal attention over the last keys (a static cache, packed "
            "sequences, chunked or custom masks, a model that edits its mask, ...); blocks are "
            "chosen only over plain causal attention. Use generate()'s default DynamicCache, or "
            "attn_implementation='qkv' for this model"
        )
    if position_bias is not None:
        raise NotImplementedError(
            "qkv_sparse: a position bias (T5-style) is not supported; use attn_implementation='qkv'"
        )
    valid = attention_mask.valid if isinstance(attention_mask, Plain) else None
    chooser = None if sliding else selection
    if valid is None or bool(valid.all()):
        return _attend(module, query, key, value, chooser, kwargs)
    return _attend_rows(module, query, key, value, valid, chooser, kwargs)


def _attend(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selection: Selection | None,
    kwargs: dict,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of queries that are the last keys, every row real: over the blocks
    `selection` chooses, or dense (qkv's causal path) below its `shortest` or without one."""
    if selection is None or key.shape[2] < selection.shortest:
        return hf.attention_forward(module, query, key, value, None, is_causal=True, **kwargs)
    chosen = selection.choose(query, key)
    return hf.attention_forward(module, query, key, value, chosen, **kwargs)


def _attend_rows(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    selection: Selection | None,
    kwargs: dict,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A padded batch, row by row: row b's real tokens `[s, e)` (its keys and the queries at
    those positions) as a problem of their own, as `_attend` runs it; padding positions get
    zeros (output and weights)."""
    B, H, n_q, _ = query.shape
    n_k = key.shape[2]
    before = n_k - n_q  # query row i sits at position i + before
    out = query.new_zeros(B, n_q, H, value.shape[-1])
    weights = None
    for b, real in enumerate(valid.tolist()):
        if True not in real:
            continue
        s = real.index(True)
        e = n_k - real[::-1].index(True)
        if not all(real[s:e]):
            raise ValueError(
                f"qkv_sparse: row {b}'s real tokens are not one contiguous run (padding between "
                "them: right padding followed by new tokens?); blocks are counted from a row's "
                "first real token. Pad on the left (tokenizer.padding_side='left'), as "
                "generate() expects"
            )
        q0, q1 = max(s - before, 0), e - before
        if q1 <= q0:
            continue  # none of this call's queries is a real token of the row
        o, w = _attend(
            module, query[b : b + 1, :, q0:q1], key[b : b + 1, :, s:e],
            value[b : b + 1, :, s:e], selection, kwargs,
        )  # fmt: skip
        out[b, q0:q1] = o[0]
        if w is not None:
            if weights is None:
                weights = w.new_zeros(B, H, n_q, n_k)
            weights[b, :, q0:q1, s:e] = w[0]
    return out, weights


def _describe(mask: object) -> str:
    if isinstance(mask, torch.Tensor):
        return f"a {mask.dtype} tensor {tuple(mask.shape)}"
    return repr(mask)
