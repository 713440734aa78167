"""qkv's one cache (`qkv.cache`): bounded in bytes, weak on the objects it serves, clearable,
safe from several threads."""

from __future__ import annotations

import gc
import threading
import types

import pytest
import torch

import qkv
from qkv import masks
from qkv.cache import Cache
from qkv.kernels import TiledBackend

from .helpers import make_qkv


def _fwd(m, n=96):
    q, k, v = make_qkv(B=1, H=2, Nq=n, D=8)
    with torch.no_grad():
        return qkv.attention(q, k, v, mask=m, backend=TiledBackend(16, 16))


def test_entries_die_with_the_mask_they_were_built_for():
    # The fused schedule used to hold its Mask strongly (through the plan), so its weak key
    # never died: 10 masks at N=16384 kept 411 MiB.
    qkv.clear_caches()
    m = masks.sliding_window(5) | masks.global_tokens([3])
    _fwd(m)
    built = qkv.cache_info()
    assert built.entries >= 1 and built.bytes > 0  # the layout and the fused schedule
    _fwd(m)
    assert qkv.cache_info().hits > built.hits and qkv.cache_info().entries == built.entries
    del m
    gc.collect()
    assert qkv.cache_info().entries == 0 and qkv.cache_info().bytes == 0


def test_clear_caches_empties_it():
    m = masks.sliding_window(5)
    _fwd(m)
    assert qkv.cache_info().entries >= 1
    qkv.clear_caches()
    assert qkv.cache_info().entries == 0 and qkv.cache_info().bytes == 0


def test_bounded_in_bytes_least_recently_used_first():
    cache = Cache(max_bytes=3 * 4000)
    owners = [masks.causal() for _ in range(5)]
    for i, o in enumerate(owners):
        cache.get("x", lambda i=i: torch.full((1000,), float(i)), owner=o)  # 4000 bytes each
    info = cache.info()
    assert info.entries == 3 and info.bytes == 12000
    assert (info.misses, info.hits, info.evictions) == (5, 0, 2)
    # the first two were dropped: asking again builds anew
    built = []
    cache.get("x", lambda: built.append(1) or torch.zeros(1000), owner=owners[0])
    assert built == [1]
    assert cache.info().evictions == 3
    # an evicted entry's owner dying later removes nothing else (its keys were let go with it)
    del owners[1]
    gc.collect()
    assert cache.info().entries == 3 and cache.info().bytes == 12000
    # an owner's death drops exactly its own entries
    del owners[0]
    gc.collect()
    assert cache.info().entries == 2 and cache.info().bytes == 8000
    # an entry larger than the budget is returned, not kept
    big = cache.get("big", lambda: torch.zeros(10_000))
    assert big.numel() == 10_000 and cache.info().bytes <= 12000


@pytest.mark.slow
def test_owners_are_never_confused_by_a_reused_id():
    cache = Cache(max_bytes=2**20)
    for i in range(50):  # new objects often reuse a dead one's id()
        o = masks.causal()
        got = cache.get("k", lambda i=i: torch.tensor([i]), owner=o)
        assert int(got) == i
        del o
        gc.collect()
    assert cache.info().entries == 0


def _tensor_bytes_reachable(root: object) -> int:
    """Bytes of the tensors an object keeps alive (through closures, dicts, lists, ...)."""
    seen, total, todo = set(), 0, [root]
    while todo:
        x = todo.pop()
        if id(x) in seen or isinstance(x, (type, types.ModuleType)):
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            total += x.untyped_storage().nbytes()
            continue
        todo.extend(gc.get_referents(x))
    return total


def test_bigbird_memory_is_per_block_not_quadratic():
    # bigbird(block=1) kept an n_blocks² table per sequence length in its closure (+261 MB
    # over 8 lengths; here 512² + … + 8192² bools, ~90 MB).
    qkv.clear_caches()
    m = masks.bigbird(window=1, n_global=1, n_random=2, block=1, seed=0)
    for n in (512, 1024, 2048, 4096, 8192):
        m.blocks(n, n, 64, 64)
    held = _tensor_bytes_reachable(m) + qkv.cache_info().bytes
    assert held < 1 << 20, held  # the picks, O(blocks · n_random) per length


@pytest.mark.slow
def test_many_threads_share_the_cache():
    # 6 threads × many calls raised KeyError at the LRU's popitem.
    qkv.clear_caches()
    shared = [masks.sliding_window(w) for w in (3, 5, 7)]
    q, k, v = make_qkv(B=1, H=2, Nq=64, D=8)
    expected = [qkv.attention(q, k, v, mask=m, backend="reference") for m in shared]
    errors = []

    def work(t):
        try:
            for i in range(40):
                j = (t + i) % 3
                fresh = masks.sliding_window(2 + i % 4)  # entries come and go meanwhile
                with torch.no_grad():
                    out = qkv.attention(q, k, v, mask=shared[j], backend=TiledBackend(16, 16))
                    qkv.attention(q, k, v, mask=fresh, backend=TiledBackend(16, 16))
                torch.testing.assert_close(out, expected[j], rtol=1e-5, atol=1e-6)
                if i % 13 == 0:
                    qkv.clear_caches()
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]


def test_budget_from_the_environment(monkeypatch):
    from qkv import cache as cache_mod

    monkeypatch.setenv("QKV_CACHE_MB", "1.5")
    assert cache_mod.budget() == int(1.5 * 2**20)
    monkeypatch.setenv("QKV_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="QKV_CACHE_MB must be a number of MiB"):
        cache_mod.budget()


def test_latest_keeps_one_entry_per_key_whatever_the_version():
    c = Cache(max_bytes=1 << 20)
    owner = masks.causal()
    built = []

    def build(n):
        built.append(n)
        return torch.zeros(n)

    for n in (3, 3, 4, 4, 4, 3):
        assert c.latest("step", n, lambda n=n: build(n), owner=owner).numel() == n
    assert built == [3, 4, 3]  # rebuilt when the version changes, reused while it holds
    info = c.info()
    assert (info.entries, info.bytes, info.hits, info.misses) == (1, 3 * 4, 3, 3)
    del owner
    gc.collect()
    assert c.info().entries == 0 and c.info().bytes == 0
