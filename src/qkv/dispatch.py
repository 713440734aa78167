"""Choose a backend for a plan, and say why every other one was not chosen."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import BACKENDS, Backend
from .plan import AttentionPlan

AUTO = "auto"


@dataclass(frozen=True)
class Decision:
    """The outcome of dispatch: the chosen backend and a reason for each one passed over."""

    backend: Backend  # the backend that will run
    reasons: dict[str, str]  # name of each backend not chosen -> why (printable)

    @property
    def name(self) -> str:
        return self.backend.name

    def __str__(self) -> str:
        lines = [f"chosen: {self.name}"]
        lines += [f"  not {name}: {why}" for name, why in self.reasons.items()]
        return "\n".join(lines)


def resolve_backend(backend: object) -> Backend | None:
    """Map the `backend=` argument to a backend object; None means "auto"."""
    if backend == AUTO:
        return None
    if isinstance(backend, str):
        if backend in BACKENDS:
            return BACKENDS[backend]
        names = ", ".join(repr(n) for n in (AUTO, *BACKENDS))
        raise ValueError(f"backend={backend!r} is unknown; expected one of {names}")
    if callable(getattr(backend, "why_not", None)) and callable(getattr(backend, "forward", None)):
        return backend  # type: ignore[return-value]
    raise TypeError(
        f"backend must be a backend name or a backend object, got {type(backend).__name__}"
    )


def choose(
    plan: AttentionPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: object = AUTO,
) -> Decision:
    """Pick the backend for a plan.

    `auto` takes the first backend in `BACKENDS` order (fastest exact first) that computes
    exactly the requested semantics. A named backend that cannot is an error
    (`NotImplementedError` with its reason), never a silent fallback.
    """
    wanted = resolve_backend(backend)
    if wanted is not None:
        why = wanted.why_not(plan, q, k, v)
        if why is not None:
            raise NotImplementedError(f"backend={wanted.name!r} cannot run this request: {why}")
        others = {n: f"backend={wanted.name!r} was asked for" for n in BACKENDS if n != wanted.name}
        return Decision(wanted, others)
    reasons: dict[str, str] = {}
    chosen: Backend | None = None
    for name, candidate in BACKENDS.items():
        if chosen is not None:
            reasons[name] = f"{chosen.name} is preferred (faster) and can run it"
            continue
        why = candidate.why_not(plan, q, k, v)
        auto_skip = getattr(candidate, "auto_skip", None)
        if why is None and auto_skip is not None:
            why = auto_skip(plan)
        if why is None:
            chosen = candidate
        else:
            reasons[name] = why
    assert chosen is not None, "the reference backend accepts every valid plan"
    return Decision(chosen, reasons)
