"""The one cache qkv keeps: derived structures (tile schedules, masks per tile, layouts) that are
expensive to build and cheap to reuse, as FlexAttention users keep a `BlockMask`.

- **Bounded in bytes** (`QKV_CACHE_MB`, default 256 MiB): least recently used entries go first;
  an entry larger than the whole budget is built and returned but not kept.
- **Releases what the user dropped**: an entry built for an object (a `qkv.masks.Mask`) is held
  against a weak reference to it and dropped when that object is garbage collected; the cache
  never keeps the object itself alive. Owners are told apart by a counter, never by `id()`,
  which Python reuses.
- **Thread-safe**: one lock; two threads asking for the same missing entry may both build it
  (the first one stored wins), but never see a half-built one.
- **Clearable**: `qkv.clear_caches()`; `qkv.cache_info()` says what it holds, its hits, misses
  and evictions. Lookup, insertion and eviction are O(1) amortised at the bound, and an owner's
  death costs O(its own entries).

Owners are numbered by `handle`, qkv's one registry of weak object → number: the same number
names a `Mask` or a held `BlockLayout` in the cache's keys and in the custom ops' arguments
(`lookup` turns it back into the object while it lives).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch


def nbytes(*objs: Any) -> int:
    """Bytes held by tensors inside (nested lists, tuples, dicts, dataclass-like objects)."""
    seen: set[int] = set()
    total = 0

    def walk(x: Any) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            key = x.untyped_storage().data_ptr() if x.device.type != "meta" else id(x)
            if key not in seen:
                seen.add(key)
                total += x.untyped_storage().nbytes()
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        elif hasattr(x, "__dict__"):
            for y in vars(x).values():
                walk(y)

    for o in objs:
        walk(o)
    return total


_handles_lock = threading.Lock()
_numbers = itertools.count(1)
_handle_of: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_object_of: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def handle(obj: object) -> int:
    """A number for `obj` (0 for None), the same for as long as `obj` lives, never reused.
    torch.compile calls it while tracing and keeps the number as a constant of the graph."""
    if obj is None:
        return 0
    with _handles_lock:
        h = _handle_of.get(obj)
        if h is None:
            h = _handle_of[obj] = next(_numbers)
            _object_of[h] = obj
        return h


# What `torch.compiler.assume_constant_result(handle)` does, without importing torch._dynamo
# (which doubles the time of `import qkv`); tests/test_compile.py fails if that ever changes.
handle._dynamo_marked_constant = True  # type: ignore[attr-defined]  # dynamo's marker on a function


def lookup(h: int) -> Any:
    """The live object numbered `h` by `handle` (None for 0)."""
    if h == 0:
        return None
    obj = _object_of.get(h)
    if obj is None:
        raise RuntimeError(
            f"qkv: object handle {h} is gone (its Mask or BlockLayout was garbage collected "
            f"while a compiled graph still used it); keep it alive"
        )
    return obj


@dataclass(frozen=True)
class CacheInfo:
    entries: int  # values held
    bytes: int  # bytes of tensors they hold
    max_bytes: int  # the budget
    hits: int
    misses: int
    evictions: int  # entries dropped to stay within the budget


class Cache:
    """A byte-bounded, thread-safe LRU of derived structures, optionally owned (weakly) by an
    object; see the module docstring."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._lock = threading.RLock()
        self._entries: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._live: set[int] = set()  # owners' handles whose death this cache will hear of
        # owner token → its keys, so that an owner's death costs O(its own entries)
        self._owned: dict[int, set] = {}
        self.hits = self.misses = self.evictions = 0

    def _token(self, owner: object) -> int:
        """`owner`'s handle; its entries are dropped when it dies. Lock held."""
        token = handle(owner)
        if token not in self._live:
            self._live.add(token)
            weakref.finalize(owner, self._forget, token)
        return token

    def _forget(self, token: int) -> None:
        with self._lock:
            self._live.discard(token)
            for key in self._owned.pop(token, ()):
                self._bytes -= self._entries.pop(key)[1]

    def _drop(self, key: tuple, n: int) -> None:
        self._bytes -= n
        owned = self._owned.get(key[0])
        if owned is not None:
            owned.discard(key)

    def get(
        self,
        key: Hashable,
        build: Callable[[], Any],
        owner: object | None = None,
        size: Callable[[Any], int] = nbytes,
    ) -> Any:
        """The value cached under (owner, key), built by `build()` if missing. `build` and the
        value must not refer to `owner` (that would keep it alive)."""
        with self._lock:
            full_key = (0 if owner is None else self._token(owner), key)
            hit = self._entries.get(full_key)
            if hit is not None:
                self._entries.move_to_end(full_key)
                self.hits += 1
                return hit[0]
            self.misses += 1
        value = build()  # outside the lock: building may take a while
        n = size(value)
        with self._lock:
            if full_key in self._entries:  # another thread built it meanwhile
                return self._entries[full_key][0]
            self._store(full_key, value, n, owner)
        return value

    def latest(
        self,
        key: Hashable,
        version: Hashable,
        build: Callable[[], Any],
        owner: object | None = None,
        size: Callable[[Any], int] = nbytes,
    ) -> Any:
        """Like `get`, but one entry per (owner, key) whatever the `version`: the value if it
        was built for this version, else `build()`, which replaces it. For what changes at
        every call of a loop (a decoding step's key length) and is reused within the step."""
        with self._lock:
            full_key = (0 if owner is None else self._token(owner), key)
            hit = self._entries.get(full_key)
            if hit is not None and hit[0][0] == version:
                self._entries.move_to_end(full_key)
                self.hits += 1
                return hit[0][1]
            self.misses += 1
        value = build()
        n = size(value)
        with self._lock:
            old = self._entries.pop(full_key, None)
            if old is not None:
                self._drop(full_key, old[1])
            self._store(full_key, (version, value), n, owner)
        return value

    def _store(self, full_key: tuple, value: Any, n: int, owner: object | None) -> None:
        """Keep `value` (n bytes) under `full_key` and evict down to the budget; lock held."""
        if n > self.max_bytes or (owner is not None and full_key[0] not in self._live):
            return
        self._entries[full_key] = (value, n)
        self._bytes += n
        if full_key[0]:
            self._owned.setdefault(full_key[0], set()).add(full_key)
        while self._bytes > self.max_bytes:
            old, (_, m) = self._entries.popitem(last=False)
            self._drop(old, m)
            self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._owned.clear()
            self._bytes = 0

    def info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(
                len(self._entries),
                self._bytes,
                self.max_bytes,
                self.hits,
                self.misses,
                self.evictions,
            )


def budget() -> int:
    """The cache's size in bytes, from `QKV_CACHE_MB` (MiB, default 256; 0 turns it off). A
    value that is not a finite number ≥ 0 raises ValueError naming the variable."""
    raw = os.environ.get("QKV_CACHE_MB", "256")
    try:
        mb = float(raw)
    except ValueError:
        mb = math.nan
    if not (math.isfinite(mb) and mb >= 0):
        raise ValueError(
            f"QKV_CACHE_MB must be a number of MiB, finite and >= 0 (0 turns qkv's cache "
            f"off; unset, 256), got {raw!r}"
        )
    return int(mb * 2**20)


CACHE = Cache(budget())


def clear_caches() -> None:
    """Drop everything qkv has cached (schedules, tile masks, layouts)."""
    CACHE.clear()


def cache_info() -> CacheInfo:
    """How many entries and bytes qkv's cache holds, its budget, hits, misses and evictions."""
    return CACHE.info()
