"""Choose a backend for a plan, and say why every other one was not chosen.

Two operations are dispatched the same way: attention (`choose`: every backend runs it) and
received attention, the column sums of A (`choose_received`: the backends that override
`Backend.why_not_received` and `received`). `auto` takes the first backend in `BACKENDS` order that
runs the request exactly; a named backend that cannot is an error, never a silent fallback.

The policy is here, in one place, after PyTorch's `select_sdp_backend`: each backend states
its own facts (what it runs, `why_not`; a preference, `auto_skip`; what it measured against
another backend, `crossover`), and `auto` orders them (`BACKENDS`) and decides between the pairs
of backends in `CROSSOVERS`; no backend asks another one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from .kernels import BACKENDS, Backend, dispatch_state, received_refusal
from .plan import AttentionPlan

AUTO = "auto"

# auto's measured choices between two backends that both run a request exactly: a backend ->
# the later one in `BACKENDS` order whose times its own table holds (`Backend.crossover`).
# Where the later one would take the request (it runs it exactly and `auto_skip` does not pass
# it over), that table decides between the two (and is the decision's `basis`); elsewhere the
# first runs whatever it runs.
CROSSOVERS: dict[str, str] = {"cpu": "sdpa"}


@dataclass(frozen=True)
class Decision:
    """The outcome of dispatch: the chosen backend and a reason for each one passed over."""

    backend: Backend  # the backend that will run
    reasons: Mapping[str, str]  # name of each backend not chosen -> why (printable)
    # which measured crossovers decided, where a size did (asked only when shown: `basis`)
    basis_of: Callable[[], str | None] | None = field(default=None, repr=False, compare=False)

    @property
    def basis(self) -> str | None:
        """Where the size crossover that decided came from (calibrated / default), or None."""
        return None if self.basis_of is None else self.basis_of()

    @property
    def name(self) -> str:
        return self.backend.name

    def __str__(self) -> str:
        lines = [f"chosen: {self.name}"]
        lines += [f"  not {name}: {why}" for name, why in self.reasons.items()]
        if self.basis is not None:
            lines.append(f"  size crossovers: {self.basis}")
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
    if isinstance(backend, Backend):
        return backend
    raise TypeError(  # a backend object: a qkv.kernels.Backend
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
        return _named(wanted, wanted.why_not(plan, q, k, v), "run this request")
    key = _plain_key(plan)
    found = _REMEMBERED.get(key) if key is not None else None
    if found is not None:
        return found
    decision = _auto(plan, q, k, v)
    if key is not None:  # remembered without the plan (whose mask it would keep alive)
        if len(_REMEMBERED) >= REMEMBER_MAX:
            _REMEMBERED.clear()
        basis = decision.basis
        reasons = MappingProxyType(dict(decision.reasons))  # read-only: callers share it
        _REMEMBERED[key] = Decision(decision.backend, reasons, lambda: basis)
    return decision


def choose_received(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, backend: object = AUTO
) -> Decision:
    """Pick the backend for received attention (`qkv.received_attention`'s plan, canonical q
    and k): `auto` takes the first backend in `BACKENDS` order that declares the operation and
    accepts the plan (`received_refusal`); a named backend that cannot is an error
    (`NotImplementedError` with its reason)."""
    wanted = resolve_backend(backend)
    if wanted is not None:
        why = received_refusal(wanted, plan, q, k)
        return _named(wanted, why, "compute received attention")
    chosen, reasons = _first(lambda c: received_refusal(c, plan, q, k), ask_all=True)
    assert chosen is not None, "the tiled backend computes received attention for every plan"
    return Decision(chosen, reasons)


def _named(wanted: Backend, why: str | None, what: str) -> Decision:
    """The decision for a backend asked for by name, or the error saying why it cannot."""
    if why is not None:
        raise NotImplementedError(f"backend={wanted.name!r} cannot {what}: {why}")
    others = {n: f"backend={wanted.name!r} was asked for" for n in BACKENDS if n != wanted.name}
    return Decision(wanted, others)


def _first(
    refusal: Callable[[Backend], str | None], ask_all: bool = False
) -> tuple[Backend | None, dict[str, str]]:
    """The first backend in `BACKENDS` order that `refusal` accepts (None if none does), and
    a reason for every other one. The backends after the chosen one are asked too when
    `ask_all` (cheap questions: each keeps its own reason), else only told they come later."""
    reasons: dict[str, str] = {}
    chosen: Backend | None = None
    for name, candidate in BACKENDS.items():
        why = refusal(candidate) if chosen is None or ask_all else None
        if chosen is not None:
            reasons[name] = why or f"{chosen.name} is preferred (faster) and can run it"
        elif why is None:
            chosen = candidate
        else:
            reasons[name] = why
    return chosen, reasons


# auto's decisions on plain requests (no structured mask, float bias, score modifier or
# dropout), by everything they depend on: a call costs a dictionary lookup instead of asking
# every backend (a visible share of a short call: docs/cpu.md, Measurements behind the code).
_REMEMBERED: dict[tuple, Decision] = {}
REMEMBER_MAX = 4096  # emptied when full (a decoding loop meets a new Nk every step)


def forget() -> None:
    """Forget auto's remembered decisions (after changing what backends see: tests do)."""
    _REMEMBERED.clear()


def _plain_key(plan: AttentionPlan) -> tuple | None:
    """The decision's key, or None for requests that are not remembered (and under
    torch.compile, where the decision is traced)."""
    if (
        plan.pairs.rule is not None
        or plan.pairs.layout is not None
        or plan.score_mod is not None
        or plan.pairs.bias is not None
        or plan.dropout_p > 0
        or torch.compiler.is_compiling()
    ):
        return None
    return (
        plan.device, plan.dtype, plan.batch, plan.heads, plan.kv_heads, plan.q_len,
        plan.kv_len, plan.head_dim, plan.v_dim, plan.pairs.causal, plan.pairs.mask is None,
        plan.finite_inputs, plan.return_lse, plan.return_weights, plan.wants_grad,
        dispatch_state(),
    )  # fmt: skip


def _auto(plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Decision:
    """auto's choice, asking every backend in order."""
    basis = None

    def refusal(candidate: Backend) -> str | None:
        nonlocal basis
        why = candidate.why_not(plan, q, k, v)
        if why is None:
            why = candidate.auto_skip(plan)
        rival = CROSSOVERS.get(candidate.name)
        if why is None and rival is not None and _would_take(BACKENDS[rival], plan, q, k, v):
            found = candidate.crossover(rival, plan)
            if found is not None:
                basis = functools.partial(candidate.crossover_basis, rival)
                why = None if found[0] == candidate.name else found[1]
        return why

    chosen, reasons = _first(refusal)
    assert chosen is not None, "the reference backend accepts every valid plan"
    return Decision(chosen, reasons, basis)


def _would_take(
    backend: Backend, plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> bool:
    """Whether `auto` would hand `backend` this request were it first: it runs it exactly and
    does not pass it over (float32 gradients, for one, never go to SDPA: the next backend
    would then be `tiled`, and the crossover has nothing to decide)."""
    return backend.why_not(plan, q, k, v) is None and backend.auto_skip(plan) is None
