"""A padded batch: which keys of each batch element are real (`padding` by lengths, `key_mask`
by a bool `(B, Nk)` tensor such as a transformers `attention_mask`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .checks import check_ints
from .mask import Mask, span


@dataclass(frozen=True, eq=False)
class _Padding:
    """`padding(lengths)`: key < table[b]."""

    table: torch.Tensor
    longest: int

    def rule(self, b, h, q, kv, n):
        return kv < self.table.to(kv.device)[b]

    def bounds(self, b, h, ql, qh, kl, kh, n):
        L = self.table[b]
        return kl < L, kh < L

    def check(self, nq, nk):
        if self.longest > nk:
            raise ValueError(f"padding length {self.longest} exceeds the sequence of {nk} keys")

    def ranges(self, ql, qh, n):
        return span(0, self.longest - 1, ql)


def padding(lengths: Sequence[int] | torch.Tensor) -> Mask:
    """Per batch element b, only the first `lengths[b]` keys are real (the rest is padding).
    Queries are not masked: a padded query still gets an output (ignore it)."""
    lens = check_ints("lengths", lengths)
    if any(n < 0 for n in lens):
        raise ValueError(f"padding lengths must be ≥ 0, got {lens}")
    rule = _Padding(torch.tensor(lens, dtype=torch.long), max(lens, default=0))
    return Mask(
        rule=rule.rule,
        bounds=rule.bounds,
        ranges=rule.ranges,
        name=f"padding({lens})",
        batch=len(lens),
        check=rule.check,
    )


@dataclass(frozen=True, eq=False)
class _KeyMask:
    """`key_mask(valid)`: `valid` (B, Nk) on its device, `table` on the CPU (the same tensor
    when `valid` is there), `counts` the real keys before each key, [first, last] the keys real
    in some batch element."""

    valid: torch.Tensor
    table: torch.Tensor
    counts: torch.Tensor
    first: int
    last: int

    def rule(self, b, h, q, kv, n):
        return self.valid[b, kv]

    def bounds(self, b, h, ql, qh, kl, kh, n):
        real = self.counts[b, kh + 1] - self.counts[b, kl]  # real keys in each tile, per b
        return real > 0, real == kh - kl + 1

    def check(self, nq, nk):
        if self.table.shape[1] != nk:
            raise ValueError(
                f"key_mask covers {self.table.shape[1]} keys, but the sequence has {nk}"
            )

    def ranges(self, ql, qh, n):
        return span(self.first, self.last, ql)


def key_mask(valid: torch.Tensor) -> Mask:
    """Per batch element, which keys are real: `valid` is bool `(B, Nk)` (True = a real token),
    as in a transformers `attention_mask`; padding may sit anywhere (left or right).

    The Mask holds a copy of `valid` taken here: changing `valid` in place afterwards does not
    change the Mask (build a new one for new padding)."""
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or valid.dim() != 2:
        got = f"{valid.dtype} {tuple(valid.shape)}" if isinstance(valid, torch.Tensor) else valid
        raise TypeError(f"key_mask needs a bool tensor (B, Nk), got {got}")
    valid = valid.detach().clone()
    table = valid.to("cpu")
    counts = torch.nn.functional.pad(table.long().cumsum(1), (1, 0))  # (B, Nk + 1)
    real = table.any(0).nonzero().view(-1)  # keys real in some batch element
    first, last = (int(real[0]), int(real[-1])) if real.numel() else (1, 0)
    rule = _KeyMask(valid, table, counts, first, last)
    return Mask(
        rule=rule.rule,
        bounds=rule.bounds,
        ranges=rule.ranges,
        name=f"key_mask(B={table.shape[0]}, Nk={table.shape[1]})",
        batch=table.shape[0],
        check=rule.check,
    )
