"""Process-group plumbing: who am I, the up-front agreement check, ring transfers, all-to-all.

Everything that talks to `torch.distributed` lives here, so that the attention code reads as
the algorithm. Every byte this process sends is added to `COUNTERS`.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist

from ..plan import SUPPORTED_DTYPES

Group = dist.ProcessGroup | None  # a validated group (`rank_world`); None: the default group


@dataclasses.dataclass
class Counters:
    """What this process did since the last `reset_counters()` (one process = one rank)."""

    bytes_sent: int = 0  # payload bytes this rank sent (point-to-point and all-to-all)
    bytes_received: int = 0  # payload bytes this rank received
    messages: int = 0  # point-to-point sends posted
    tiles: int = 0  # forward tiles (block_q × block_k of the tiled kernel) this rank computed
    blocks: int = 0  # forward (query shard piece × key shard piece) blocks computed
    blocks_skipped: int = 0  # forward blocks skipped because causality or the mask emptied them


COUNTERS = Counters()


def counters() -> Counters:
    """A snapshot of this process's communication and work counters."""
    return dataclasses.replace(COUNTERS)


def reset_counters() -> None:
    """Zero this process's counters."""
    for f in dataclasses.fields(Counters):
        setattr(COUNTERS, f.name, 0)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------- the group


def rank_world(group: object) -> tuple[int, int]:
    """(this process's rank in `group`, the group's size). Without an initialised default
    process group and with `group=None`, a single process is rank 0 of 1."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup or None (the default group), got "
            f"{type(group).__name__}"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the process group it was given")
    return rank, dist.get_world_size(group)


def global_rank(group: Group, rank: int) -> int:
    """The global rank of `rank` of `group` (what point-to-point ops address)."""
    if group is None or group is dist.GroupMember.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def _collective_device(group: Group) -> torch.device:
    """Where a small control tensor must live for this group's backend (NCCL needs CUDA)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------- agreement


def dtype_code(x: object) -> int:
    """A small int naming a tensor's dtype for the agreement check (-1: not a tensor)."""
    if not isinstance(x, torch.Tensor):
        return -1
    return SUPPORTED_DTYPES.index(x.dtype) if x.dtype in SUPPORTED_DTYPES else 99


def dtype_name(code: int) -> str:
    if code == -1:
        return "not a tensor"
    return str(SUPPORTED_DTYPES[code]) if 0 <= code < len(SUPPORTED_DTYPES) else "unsupported"


def shape4(x: object) -> tuple[int, ...]:
    """A tensor's shape padded on the left to 4 dims with 1s ((-1,)*4: not a tensor / > 4-D)."""
    if not isinstance(x, torch.Tensor) or x.dim() > 4:
        return (-1, -1, -1, -1)
    return (1,) * (4 - x.dim()) + tuple(x.shape)


def float_bits(x: float | None) -> int:
    """The bits of a float (None → 0), so that ranks can compare scales exactly."""
    return 0 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def text_code(s: str) -> int:
    """A checksum of a string (a mask's name), to notice ranks that pass different masks."""
    return zlib.crc32(s.encode())


def agree(
    group: Group,
    what: str,
    fields: dict[str, tuple[int, ...]],
    error: BaseException | None,
    hint: dict[str, str] | None = None,
) -> None:
    """Check, with one small all-gather, that every rank passed the same problem.

    `fields` (the same names and lengths on every rank) describe this rank's arguments;
    `error` is a TypeError/ValueError this rank's own checks raised, or None. Afterwards every
    rank raises the same exception (the first failing rank's error, or a ValueError naming the
    first field on which ranks disagree), or none does; so no rank is left waiting for a peer
    that gave up. `hint` adds advice to the message of a disagreeing field.
    """
    _, world = rank_world(group)
    if world == 1:
        if error is not None:
            raise error
        return
    flat = [1 if error is not None else 0]
    for values in fields.values():
        flat.extend(int(x) for x in values)
    device = _collective_device(group)
    mine = torch.tensor(flat, dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(table, mine, group=group)
    rows = [t.tolist() for t in table]
    if any(r[0] for r in rows):
        errors: list[object] = [None] * world
        mine_err = None if error is None else (type(error).__name__, str(error))
        dist.all_gather_object(errors, mine_err, group=group)
        first = next(i for i, e in enumerate(errors) if e is not None)
        kind, message = cast(tuple[str, str], errors[first])  # a rank's (type name, text)
        exc = TypeError if kind == "TypeError" else ValueError
        raise exc(f"{what}: rank {first} of {world}: {message}")
    at = 1
    for name, values in fields.items():
        n = len(values)
        seen = [tuple(r[at : at + n]) for r in rows]
        if any(s != seen[0] for s in seen):
            by_rank = ", ".join(f"rank {i}: {_show(name, s)}" for i, s in enumerate(seen))
            extra = f" {hint[name]}" if hint and name in hint else ""
            raise ValueError(f"{what}: the ranks disagree on {name} ({by_rank}).{extra}")
        at += n


def _show(name: str, values: tuple[int, ...]) -> str:
    if "dtype" in name:
        return "/".join(dtype_name(v) for v in values)
    if name.endswith("shape"):
        return "not a tensor" if values[0] == -1 else str(values)
    if len(values) == 1:
        return str(values[0])
    return str(values)


# --------------------------------------------------------------------------- the ring


class Pending:
    """Transfers in flight; `wait()` returns the received tensors."""

    def __init__(self, requests: list, received: list[torch.Tensor], sent: list[torch.Tensor]):
        self._requests = requests
        self._received = received
        self._sent = sent  # kept alive until the sends complete

    def wait(self) -> list[torch.Tensor]:
        for r in self._requests:
            r.wait()
        self._requests, self._sent = [], []
        return self._received


class Ring:
    """Point-to-point transfers to the next rank and from the previous one, as one batch."""

    def __init__(self, group: Group, rank: int, world: int):
        self.group = group
        self.next = global_rank(group, (rank + 1) % world)
        self.prev = global_rank(group, (rank - 1) % world)

    def shift(self, tensors: Sequence[torch.Tensor], tag: int) -> Pending:
        """Post the sends of `tensors` to the next rank and the receives of their like from the
        previous rank; return at once (the caller computes while they travel)."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t in received]
        requests = dist.batch_isend_irecv(ops)
        size = sum(nbytes(t) for t in sent)
        COUNTERS.bytes_sent += size
        COUNTERS.bytes_received += size
        COUNTERS.messages += len(sent)
        return Pending(requests, received, sent)


# --------------------------------------------------------------------------- all-to-all


def all_to_all(x: torch.Tensor, group: Group) -> torch.Tensor:
    """`x (P, …)`: slice p goes to rank p; slice p of the result came from rank p."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    world = x.shape[0]
    moved = nbytes(x) * (world - 1) // world
    COUNTERS.bytes_sent += moved
    COUNTERS.bytes_received += moved
    return out


def all_gather(x: torch.Tensor, group: Group, world: int) -> list[torch.Tensor]:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    COUNTERS.bytes_sent += nbytes(x) * (world - 1)
    COUNTERS.bytes_received += nbytes(x) * (world - 1)
    return parts


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x
