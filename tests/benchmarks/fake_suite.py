"""A tiny suite for the runner's and reporter's tests: cases × implementations that do almost
nothing, one that allocates a known amount (for the memory probe), one that fails."""

from __future__ import annotations

import dataclasses

import torch
from benchmarks.report import (
    MEMORY_COLUMNS,
    Column,
    Table,
    field,
    impl_column,
    memory_rows,
    ratio_column,
    rows,
    time_column,
)
from benchmarks.suite import FWD, FWD_BWD, Group, Impl, Memory, Probe, Stage, Suite, Target

ALLOC_MIB = 64


@dataclasses.dataclass(frozen=True)
class Case:
    n: int


def inputs(c: Case, backward: bool):
    x = torch.ones(c.n, requires_grad=backward)
    return (x,), (torch.ones(()) if backward else None)


def allocate(c: Case):
    """Holds ALLOC_MIB of filled memory at its peak, returns a scalar."""

    def run(x: torch.Tensor) -> torch.Tensor:
        big = torch.ones(ALLOC_MIB * 2**20 // 4)
        return (x.sum() + big[0]) * 1.0

    return run


def fail(c: Case):
    def run(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no kernel for this case\nsecond line")

    return run


GROUP = Group(
    name="toy",
    cases=lambda s: [Case(n) for n in s["sizes"]],
    inputs=inputs,
    impls=(
        Impl("fast", lambda c: lambda x: x.sum()),
        Impl("slow", lambda c: lambda x: (x * 2).sum()),
        Impl("alloc", allocate),
        Impl("broken", fail, when=lambda c: c.n > 8),
        Impl("fwd-only", lambda c: lambda x: x.sum(), passes=(FWD,)),
    ),
    anchors=("fast",),
    repeats=lambda s, c: 3,
    rates={"work": lambda c, pass_, _: 1e9 * c.n},
    warm=lambda c: Case(4),
    drop=lambda s, c: "too big for a toy" if c.n > 100 else None,
)


def probes(s) -> list[Probe]:
    return [Probe("toy", Case(16), "alloc", FWD, timeout_s=120)]


SUITE = Suite(
    name="toy",
    title="Toy suite",
    settings={"full": {"sizes": (8, 16, 1000)}, "quick": {"sizes": (8,)}},
    steps=(GROUP, Memory(probes), Stage("extra", lambda s, r: {"answer": 42})),
    targets=(
        Target("fast ×fast at 16", lambda r: r.ratio("toy", Case(16), "fast", FWD, "fast"), 1.0),
        Target("a | pipe in a name", lambda r: None, 1.0, at_least=False, unit=" MiB"),
    ),
    report=(
        Table(
            (
                field("n", "N"),
                impl_column(),
                time_column(FWD, "fwd ms"),
                ratio_column(FWD, "fast", "fwd ×fast"),
                time_column(FWD_BWD, "fwd+bwd ms"),
            ),
            lambda r: rows(r, "toy"),
            "Times",
        ),
        Table(
            (Column("impl", lambda m: m.impl, "l"), *MEMORY_COLUMNS),
            memory_rows("toy"),
            "Memory",
        ),
        lambda r: [f"The answer is {r.stages.get('extra', {}).get('answer')}.", ""],
    ),
    doc="""A toy.

- First bullet,
  continued.
- Second bullet.

Not a bullet.
""",
    method=lambda r: ["- Computed."],
)
