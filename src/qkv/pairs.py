"""Which (query, key) pairs may attend: the one description of a problem's masking.

A `Pairs` holds what the caller asked for — the causal flag (bottom-right aligned), a structured
`qkv.masks.Mask`, a bool or float mask tensor, a `BlockLayout` passed as the mask — for an
Nq × Nk problem, validated once by `qkv.plan.make_plan` and carried by the plan as
`plan.pairs`. Every consumer reads it: `qkv.layout.layout_for(pairs, ...)` builds the kept
tiles from it, the reference backend takes its dense mask (`dense`) and the sdpa backend its
`attn_mask`, received attention asks it about a band of query rows (`band`), and the custom ops
carry it in the plan's `qkv.plan.OpPlan`, read back by its `pairs`. The rule itself is written
once, in `qkv.layout.allowed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import limits
from .layout import BlockLayout, allowed, causal_hidden, dense_allowed
from .masks import ChosenBlocks, Mask


class Band(NamedTuple):
    """Which pairs of a band of query rows `r0:r1` and keys `c0:c1` may not attend (`Pairs.band`):
    keys before `start` are allowed to every row, `hidden` (bool, broadcastable to
    `(H, r1 − r0, c1 − start)`, or None when nothing is hidden) is True where a pair from
    `start` on may not attend."""

    start: int  # keys c0:start are visible to every row of the band (c0 ≤ start ≤ c1)
    hidden: torch.Tensor | None  # True = may not attend
    empty_rows: bool  # a row may attend nowhere (a bool mask, a rule, a bias's −inf, Nq > Nk)


@dataclass(frozen=True, eq=False)
class Pairs:
    """Which pairs of an (Nq × Nk) problem may attend; see the module docstring."""

    q_len: int  # Nq
    kv_len: int  # Nk
    causal: bool = False  # bottom-right aligned: query i sees keys j ≤ i + Nk − Nq
    rule: Mask | None = None  # a structured mask, evaluated tile by tile
    mask: torch.Tensor | None = None  # bool, 4-D, broadcastable to (B, H, Nq, Nk); True = may
    bias: torch.Tensor | None = None  # float, 4-D, broadcastable; added to the scaled scores
    layout: BlockLayout | None = None  # a layout the caller built and passed as the mask

    @property
    def causal_offset(self) -> int:
        """Query i may see key j when j ≤ i + causal_offset (bottom-right alignment)."""
        return self.kv_len - self.q_len

    @property
    def restricted(self) -> bool:
        """True when some pair may be excluded from the softmax (a float bias counts: it may
        hold −inf; decided on metadata, never by reading values)."""
        return self.causal or any(
            x is not None for x in (self.mask, self.bias, self.rule, self.layout)
        )

    @property
    def causal_only(self) -> bool:
        """True when the causal flag is all that restricts the pairs (no rule, mask or bias)."""
        return self.causal and all(x is None for x in (self.mask, self.bias, self.rule))

    def allowed(
        self, b: torch.Tensor | int, h: torch.Tensor | int, rows: torch.Tensor, cols: torch.Tensor
    ) -> torch.Tensor | None:
        """Which pairs (query rows `rows`, keys `cols`) may attend for batch `b` and heads `h`
        (broadcastable int64 tensors), by the causal flag, the rule and the bool mask; None when
        nothing restricts them. The float bias is not a yes/no and is left to the caller."""
        return allowed(
            b, h, rows, cols, q_len=self.q_len, kv_len=self.kv_len, causal=self.causal,
            rule=self.rule, mask=self.mask,
        )  # fmt: skip

    def dense(self, device: torch.device | str | None = None) -> torch.Tensor | None:
        """`allowed` over the whole problem, bool `(Bm, Hm, Nq, Nk)`, or None. Raises
        `qkv.limits.MemoryRefusal` first when that cannot fit (`check_dense`)."""
        self.check_dense(device)
        return dense_allowed(
            self.q_len, self.kv_len, causal=self.causal, rule=self.rule, mask=self.mask,
            device=device,
        )  # fmt: skip

    def check_dense(self, device: torch.device | str | None = None) -> None:
        """Refuse, before allocating, a dense mask (and the rule's temporaries, ~3 bytes a pair;
        a float bias's masked copy) larger than what the process may still allocate."""
        if not (self.causal or self.rule is not None or self.mask is not None):
            return
        nb = max((self.rule.batch or 1 if self.rule is not None else 1, *self._dims(0)))
        nh = max((self.rule.heads or 1 if self.rule is not None else 1, *self._dims(1)))
        pairs = nb * nh * self.q_len * self.kv_len
        per_pair = 1 + (2 if self.rule is not None else 0)
        if self.bias is not None:
            per_pair += self.bias.element_size()
        limits.check(
            pairs * per_pair,
            device or "cpu",
            f"the mask would be materialised as a dense (B|1, H|1, Nq, Nk) = "
            f"{(nb, nh, self.q_len, self.kv_len)} tensor",
            "Use backend='auto', 'tiled' or 'cpu', which evaluate the mask tile by tile and skip "
            "the empty tiles, or a shorter sequence",
        )

    def _dims(self, i: int) -> tuple[int, ...]:
        return tuple(t.shape[i] for t in (self.mask, self.bias) if t is not None)

    def attn_mask(self, device: torch.device | str | None = None) -> torch.Tensor | None:
        """The pairs as one mask tensor, in the form torch SDPA's `attn_mask` takes: the
        caller's bool mask or float bias as given when nothing else restricts (a broadcast
        shape, no copy), else `dense()`, which a float bias takes as −inf where it forbids a
        pair; None when nothing restricts the pairs."""
        if not self.causal and self.rule is None:
            return self.mask if self.mask is not None else self.bias
        ok = self.dense(device)
        assert ok is not None  # causal or a rule restricts
        return ok if self.bias is None else self.bias.masked_fill(~ok, -torch.inf)

    def band(
        self,
        b: int,
        heads: int,
        r0: int,
        r1: int,
        c0: int,
        c1: int,
        device: torch.device | str | None = None,
    ) -> Band:
        """`allowed` for query rows `r0:r1` and keys `c0:c1` of batch element `b`, all `heads`
        heads, as a `Band` of hidden pairs for a kernel that masks a band of scores in place.
        The causal flag alone hides only the triangle past the band's first row."""
        if self.causal_only:
            start, hidden, blind = causal_hidden(r0, r1, c0, c1, self.q_len, self.kv_len, device)
            return Band(start, hidden, blind)
        rule, mask = self.rule, self.mask
        per_head = (rule is not None and bool(rule.heads)) or (
            mask is not None and mask.shape[1] > 1
        )
        bi = torch.full((1, 1, 1), b, device=device)
        hi = torch.arange(heads if per_head else 1, device=device).view(-1, 1, 1)
        rows = torch.arange(r0, r1, device=device).unsqueeze(1)
        cols = torch.arange(c0, c1, device=device)
        ok = self.allowed(bi, hi, rows, cols)
        tensors_or_rule = any(x is not None for x in (mask, self.bias, rule))
        return Band(c0, None if ok is None else ~ok, tensors_or_rule)

    def kv_choice(self, batch: int, kv_heads: int) -> torch.Tensor | None:
        """For blocks chosen per batch element and kv head (`qkv.masks.ChosenBlocks`, with at
        most the causal flag beside them), in a problem of `batch` elements and `kv_heads` kv
        heads: the choice of each (b, kv head), int64 `(batch, kv_heads, query blocks, kmax)`
        (its `index`; a choice made for fewer kv heads serves each of theirs, and a batch larger
        than the choice's, as vmap folds its dimension into the batch, repeats it). None for
        every other description, and for a choice whose heads of one kv group differ (made for
        more kv heads than k has): one layout, the union, serves all heads then, exactly."""
        rule = self.rule
        if (
            not isinstance(rule, ChosenBlocks)
            or rule.one_group
            or any(x is not None for x in (self.mask, self.bias, self.layout))
        ):
            return None
        nb, ng = rule.index.shape[:2]
        if kv_heads % ng or batch % nb:
            return None
        if (nb, ng) == (batch, kv_heads):
            return rule.index
        return rule.index.repeat_interleave(kv_heads // ng, 1).repeat(batch // nb, 1, 1, 1)

    def kv_groups(self, batch: int, kv_heads: int) -> list[tuple[int, int, Pairs]] | None:
        """Where `kv_choice` applies: `(b, kv head, pairs)` of each one-(b, kv head) problem,
        b-major, whose kept tiles are that head's alone (its rule a one-group `ChosenBlocks`),
        for a kernel that runs them one at a time; None where it does not."""
        if self.kv_choice(batch, kv_heads) is None:
            return None
        rule = self.rule
        assert isinstance(rule, ChosenBlocks)  # kv_choice found one
        nb, ng = rule.index.shape[:2]
        per = kv_heads // ng
        return [
            (b, g, Pairs(self.q_len, self.kv_len, self.causal, rule.group(b % nb, g // per)))
            for b in range(batch)
            for g in range(kv_heads)
        ]
