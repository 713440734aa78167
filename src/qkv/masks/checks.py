"""Argument checks the mask constructors share (their errors name the argument)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be ≥ {minimum}")
    return value


def check_ints(name: str, values: object) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    out = []
    for x in values:
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must hold ints, got {type(x).__name__} {x!r}")
        out.append(x)
    return out


def check_queries_within_keys(name: str, nq: int, nk: int) -> None:
    if nq > nk:
        raise ValueError(
            f"{name} needs Nq ≤ Nk (queries are the last Nq key positions), got Nq={nq}, Nk={nk}"
        )
