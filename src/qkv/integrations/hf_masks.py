"""transformers' mask descriptions in qkv terms, for `qkv.integrations.hf.make_mask`.

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
`CausalKeys` (run as `mask=valid (B, 1, 1, Nk), causal=True`) instead of a `key_mask`. Only the
module-level predicates (causal, bidirectional) are recognised while tracing: the others are
closures built inside the traced forward, whose cells dynamo cannot read, so sliding windows
and packed batches get transformers' dense mask there, as "sdpa" does. A structured `Mask` a
compiled graph uses is built once and kept (`_Shelf`): a Mask built while tracing reaches the
kernel uninitialised.

Where the mask goes once built (generate()'s pre-build, models that never call qkv, ALiBi
models that want it dense) is decided in `qkv.integrations.hf.make_mask`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from .. import masks
from ..masks import Mask


@dataclass(frozen=True)
class MaskCall:
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
class CausalKeys:
    """Causal attention (bottom-right) over the real keys `valid`, bool `(B, 1, 1, Nk)`: what
    make_mask returns for a causal layer over a padded batch under torch.compile, where the
    padding cannot become a `masks.key_mask` (that reads the mask's values) and is not checked
    for being all True (an all-True key mask changes nothing). `attention_forward` runs it as
    `mask=valid, causal=True`: O(B·Nk), no N² tensor."""

    valid: torch.Tensor


def translate(
    call: MaskCall,
    mu: ModuleType,
    allow_is_causal_skip: bool,
    allow_is_bidirectional_skip: bool,
    *,
    trusted: bool | None,
    warn: Callable[[str, str], None],
) -> Mask | torch.Tensor | CausalKeys | None:
    """transformers' description in qkv terms (the table of the module docstring).

    `trusted`: whether `predicates_agree` held when `register()` ran (what stands in for the
    spot check under torch.compile); `warn(key, message)`: the caller's warn-once, told when the
    spot check fails.

    Every decision is on metadata (sizes, offsets that are ints, which predicate); tensor values
    are read only outside torch.compile: the spot check against the predicate, whether a
    padding mask has padding, and the sequence boundaries of a packed batch."""
    nq, nk, mask_function = call.q_length, call.kv_length, call.mask_function
    attention_mask, device = call.attention_mask, call.device
    compiling = torch.compiler.is_compiling()
    if compiling and not trusted:
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
        warn(
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
        return CausalKeys(valid[:, None, None, :]) if kind == "causal" else call.dense(mu)
    assert structure is not None  # only "full" and "dense" have none, both returned above
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


def _closure_fns(cells: dict[str, object]) -> tuple[Callable, ...]:
    """The mask functions an `and_masks`/`or_masks` closure combines (a tuple there)."""
    fns = cells.get("mask_functions", ())
    return tuple(fns) if isinstance(fns, tuple | list) else ()


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
        found = [_interval(f, mu) for f in _closure_fns(cells)]
        parts = [p for p in found if p is not None]
        if not parts or len(parts) < len(found):
            return None
        los = [p[0] for p in parts if p[0] is not None]
        his = [p[1] for p in parts if p[1] is not None]
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
    parts = _closure_fns(_closure(fn))
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
    if kind != "window":
        return packed
    assert structure is not None  # a window's interval is its structure
    return packed & structure


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
        return shelved("causal"), "causal"
    # A dropped bound is as good as the widest one that still excludes nothing on this shape.
    left = nk - 1 if left is None else left
    right = max(nq - 1, 0) if right is None else right
    if left < 0 or right < 0:
        return None, "dense"
    return shelved("window", left, right), "window"


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


_shelve._dynamo_marked_constant = True  # type: ignore[attr-defined]  # dynamo's marker on a function


def shelved(kind: str, left: int = 0, right: int = 0) -> Mask:
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


def predicates_agree(mu: ModuleType) -> bool:
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
