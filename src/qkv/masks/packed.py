"""Packed sequences: `document` (lengths, the queries the last Nq keys) and `varlen`
(FlashAttention's `cu_seqlens`). No pair crosses a sequence, and both tell the kernels where the
sequences start (`Mask.segments`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .checks import check_ints, check_queries_within_keys
from .mask import Mask, span


def _doc_ids(bounds_t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    flat = p.reshape(-1).contiguous()
    return torch.searchsorted(bounds_t.to(p.device), flat, right=True).view(p.shape)


@dataclass(frozen=True, eq=False)
class _Document:
    """`document(lengths)`: doc d covers positions [starts[d], ends[d]); `total` keys."""

    ends: torch.Tensor
    starts: torch.Tensor
    total: int

    def rule(self, b, h, q, kv, n):
        return _doc_ids(self.ends, q) == _doc_ids(self.ends, kv)

    def bounds(self, b, h, ql, qh, kl, kh, n):
        dql, dqh, dkl, dkh = (_doc_ids(self.ends, x) for x in (ql, qh, kl, kh))
        return (dkl <= dqh) & (dkh >= dql), (dql == dqh) & (dkl == dkh) & (dql == dkl)

    def check(self, nq, nk):
        if self.total != nk:
            raise ValueError(
                f"document lengths sum to {self.total}, but the sequence has {nk} keys"
            )
        check_queries_within_keys("document", nq, nk)

    def ranges(self, ql, qh, n):
        starts, ends = self.starts, self.ends
        return span(starts[_doc_ids(ends, ql)], starts[_doc_ids(ends, qh) + 1] - 1, ql)

    def segments(self, nq, nk):  # query row i sits at position i + nk − nq
        return (self.starts - (nk - nq)).clamp(0, nq), self.starts


def document(lengths: Sequence[int] | torch.Tensor) -> Mask:
    """Packed sequences: positions attend only within their own document (block diagonal).
    `lengths` must sum to the key length."""
    lens = check_ints("lengths", lengths)
    if any(n < 0 for n in lens):
        raise ValueError(f"document lengths must be ≥ 0, got {lens}")
    ends = torch.tensor(lens, dtype=torch.long).cumsum(0)  # doc d covers [ends[d-1], ends[d])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), ends])
    rule = _Document(ends, starts, sum(lens))
    return Mask(
        rule=rule.rule,
        bounds=rule.bounds,
        ranges=rule.ranges,
        exact_ranges=True,
        segments=rule.segments,
        name=f"document({lens})",
        check=rule.check,
    )


def _check_cu(name: str, cu: object) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor) or cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32/int64 tensor, got {cu!r}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D with at least one entry, got {tuple(cu.shape)}")
    cu = cu.detach().to("cpu", torch.long, copy=True)  # a copy: the Mask never goes stale
    if cu[0] != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must start at 0 and never decrease, got {cu.tolist()[:8]}")
    return cu


@dataclass(frozen=True, eq=False)
class _Varlen:
    """`varlen(cu_q, cu_k, causal)`: `tq`, `tk` query and key tokens in all."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    causal: bool
    tq: int
    tk: int

    @property
    def ends_q(self) -> torch.Tensor:
        return self.cu_q[1:]

    @property
    def ends_k(self) -> torch.Tensor:
        return self.cu_k[1:]

    def seq_q(self, row):
        return _doc_ids(self.ends_q, row)

    def rule(self, b, h, q, kv, n):
        cu_q, cu_k = self.cu_q, self.cu_k
        row = q - (self.tk - self.tq)
        d = self.seq_q(row)
        same = d == _doc_ids(self.ends_k, kv)
        if not self.causal:
            return same
        dc = d.clamp(max=cu_q.numel() - 2)
        cq, ck = cu_q.to(q.device), cu_k.to(q.device)
        off = (ck[dc + 1] - ck[dc]) - (cq[dc + 1] - cq[dc])
        return same & (kv - ck[dc] <= row - cq[dc] + off)

    def bounds(self, b, h, ql, qh, kl, kh, n):
        cu_q, cu_k = self.cu_q, self.cu_k
        rl, rh = ql - (self.tk - self.tq), qh - (self.tk - self.tq)
        dql, dqh = self.seq_q(rl), self.seq_q(rh)
        dkl, dkh = _doc_ids(self.ends_k, kl), _doc_ids(self.ends_k, kh)
        maybe_any = (dkl <= dqh) & (dkh >= dql)
        surely_all = (dql == dqh) & (dkl == dkh) & (dql == dkl)
        if self.causal:
            d = dql.clamp(max=cu_q.numel() - 2)
            off = (cu_k[d + 1] - cu_k[d]) - (cu_q[d + 1] - cu_q[d])
            surely_all = surely_all & (kh - cu_k[d] <= rl - cu_q[d] + off)
        return maybe_any, surely_all

    def check(self, nq, nk):
        tq, tk = self.tq, self.tk
        if (nq, nk) != (tq, tk):
            raise ValueError(
                f"cu_seqlens describe {tq} query and {tk} key tokens, got Nq={nq}, Nk={nk}"
            )

    def ranges(self, ql, qh, n):  # the keys of the sequences the tile's query rows belong to
        last = self.cu_q.numel() - 2
        d0 = self.seq_q(ql - (self.tk - self.tq)).clamp(max=last)
        d1 = self.seq_q(qh - (self.tk - self.tq)).clamp(max=last)
        return span(self.cu_k[d0], self.cu_k[d1 + 1] - 1, ql)

    def segments(self, nq, nk):
        return self.cu_q, self.cu_k


def varlen(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, causal: bool = False) -> Mask:
    """Packed variable-length sequences (FlashAttention's `cu_seqlens`): query row i of
    sequence s attends only keys of sequence s; with `causal`, bottom-right aligned within each
    sequence. Sequence s holds query rows `cu_seqlens_q[s] … cu_seqlens_q[s+1]` and keys
    `cu_seqlens_k[s] … cu_seqlens_k[s+1]`."""
    cu_q, cu_k = _check_cu("cu_seqlens_q", cu_seqlens_q), _check_cu("cu_seqlens_k", cu_seqlens_k)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"{cu_q.numel() - 1} and {cu_k.numel() - 1}"
        )
    rule = _Varlen(cu_q, cu_k, bool(causal), int(cu_q[-1]), int(cu_k[-1]))
    n_seq = cu_q.numel() - 1
    return Mask(
        rule=rule.rule,
        bounds=rule.bounds,
        ranges=rule.ranges,
        segments=rule.segments,
        name=f"varlen({n_seq} sequences, causal={causal})",
        check=rule.check,
    )
