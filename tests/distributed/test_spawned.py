"""ring_attention, ulysses_attention, shard/unshard and the sharded Transformer block on 2 and 4
processes (gloo over loopback), against single-process attention on the whole sequence.

One spawn per world size runs every check (spawning costs seconds); each check is reported as
its own test. The checks themselves are in `_checks.py`.
"""

from __future__ import annotations

import pytest

from . import _checks, _spawn

WORLDS = (2, 4)
_results: dict[int, list[dict]] = {}


def _run(world: int) -> list[dict]:
    if world not in _results:
        _results[world] = _spawn.run(world, _checks.worker, timeout_s=180)
    return _results[world]


CASES = [
    pytest.param(world, name, id=f"P{world}-{name}")
    for world in WORLDS
    for name, (_, worlds) in _checks.CHECKS.items()
    if world in worlds
]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "name"), CASES)
def test_spawned(world, name):
    per_rank = _run(world)
    crashes = [r["__crash__"] for r in per_rank if "__crash__" in r]
    assert not crashes, crashes[0]
    failures = [f"rank {i}:\n{r[name]}" for i, r in enumerate(per_rank) if r.get(name)]
    assert not failures, "\n".join(failures)
