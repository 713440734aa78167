"""Key blocks chosen per query block, batch element and kv head (`ChosenBlocks`): what
`qkv.sparse.select_blocks` chooses from the content, as a mask the kernels run one (b, kv head)
at a time."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import check_int
from .mask import Mask


@dataclass(frozen=True, eq=False)
class _Chosen:
    """`ChosenBlocks`: `index` int64 `(Bi, Hi, nqs, kmax)`, the key blocks query block r (rows
    r·block …) of batch element b and kv head g reads, ascending, −1 past its count; `groups`
    query heads share a kv head's choice. Bi, Hi are 1 in a view of one (b, g)."""

    index: torch.Tensor
    block: int
    groups: int
    causal: bool
    q_len: int
    kv_len: int

    def _blocks(self, b, h, qb, device):
        """`index[b, g, qb]` as `kmax` tensors of the broadcast shape (no (..., kmax) one)."""
        idx = self.index.to(device)
        zero = torch.zeros((), dtype=torch.long, device=device)
        bi = torch.as_tensor(b, device=device) if idx.shape[0] > 1 else zero
        g = torch.as_tensor(h, device=device) // self.groups if idx.shape[1] > 1 else zero
        bi, g, qb = torch.broadcast_tensors(bi, g, qb.clamp(0, idx.shape[2] - 1))
        return [idx[..., t][bi, g, qb] for t in range(idx.shape[3])]

    def chosen(self, b, h, qb, kb):
        """Whether key block kb is among query block qb's (broadcastable tensors)."""
        ok = torch.zeros(torch.broadcast_shapes(qb.shape, kb.shape, torch.as_tensor(b).shape,
                                                torch.as_tensor(h).shape), dtype=torch.bool,
                         device=qb.device)  # fmt: skip
        for picks in self._blocks(b, h, qb, qb.device):
            ok |= picks == kb
        return ok

    def rule(self, b, h, q, kv, n):
        row = q - (n - self.q_len)
        ok = self.chosen(b, h, row // self.block, kv // self.block)
        if self.causal:
            ok = ok & (kv <= q)
        return ok

    def bounds(self, b, h, ql, qh, kl, kh, n):
        off, block = n - self.q_len, self.block
        i0, i1 = ((ql - off) // block).clamp(min=0), ((qh - off) // block).clamp(min=0)
        j0, j1 = kl // block, kh // block
        si = int((i1 - i0).max()) + 1 if ql.numel() else 1
        sj = int((j1 - j0).max()) + 1 if kl.numel() else 1
        shape = torch.broadcast_shapes(torch.as_tensor(b).shape, torch.as_tensor(h).shape,
                                       i0.shape, j0.shape)  # fmt: skip
        if si * sj > 64:  # tiles of many blocks: bounded loosely (the kernels evaluate pairs)
            any_, all_ = torch.ones(shape, dtype=torch.bool), torch.zeros(shape, dtype=torch.bool)
        else:
            any_, all_ = torch.zeros(shape, dtype=torch.bool), torch.ones(shape, dtype=torch.bool)
            for di in range(si):
                for dj in range(sj):
                    i, j = i0 + di, j0 + dj
                    inside = (i <= i1) & (j <= j1)
                    ok = self.chosen(b, h, i, j)
                    any_ |= inside & ok
                    all_ &= ~inside | ok
        if self.causal:
            any_ = any_ & (kl <= qh)
            all_ = all_ & (kh <= ql)
        return any_, all_

    def check(self, nq, nk):
        if (nq, nk) != (self.q_len, self.kv_len):
            raise ValueError(
                f"these blocks were chosen for (Nq, Nk)=({self.q_len}, {self.kv_len}), got "
                f"({nq}, {nk})"
            )

    def ranges(self, ql, qh, n):
        """The chosen blocks of every (b, g) and every query block the tiles span."""
        idx, block, off = self.index, self.block, n - self.q_len
        i0 = ((ql - off) // block).clamp(0, idx.shape[2] - 1)
        i1 = ((qh - off) // block).clamp(0, idx.shape[2] - 1)
        lo, hi = [], []
        for d in range(int((i1 - i0).max()) + 1 if ql.numel() else 0):
            i = (i0 + d).clamp(max=idx.shape[2] - 1)
            picks = idx[:, :, i].reshape(-1, ql.numel(), idx.shape[3])  # (Bi·Hi, tiles, kmax)
            picks = picks.permute(0, 2, 1).reshape(-1, ql.numel())
            live = (picks >= 0) & ((i0 + d) <= i1)
            top = torch.clamp((picks + 1) * block, max=n) - 1
            if self.causal:
                top = torch.minimum(top, qh)
            lo.append(torch.where(live, picks * block, n))
            hi.append(torch.where(live, top, -1))
        if not lo:
            return torch.full((1, ql.numel()), n), torch.full((1, ql.numel()), -1)
        return torch.cat(lo), torch.cat(hi)


class ChosenBlocks(Mask):
    """Key blocks chosen per query block, batch element and kv head (`qkv.sparse.select_blocks`
    chooses them from the content; any other chooser may build one): query row i of batch
    element b and query head h attends key j when j's block is among `index[b, h // G, i //
    block]` (G = H / Hkv: the heads of a GQA group share their kv head's choice), and, with
    `causal`, j ≤ i + Nk − Nq.

    `index` int64 `(B, Hkv, ceil(Nq / block), kmax)`: ascending key-block indices, −1 past each
    row's count. Kernels run it one (b, kv head) at a time, each over its own kept tiles
    (`group`); a chosen block never costs a tile of another head."""

    def __init__(
        self,
        index: torch.Tensor,
        block: int,
        *,
        heads: int,
        q_len: int,
        kv_len: int,
        causal: bool = True,
        name: str | None = None,
        one_group: bool = False,
    ):
        block, heads = check_int("block", block, 1), check_int("heads", heads, 1)
        q_len, kv_len = check_int("q_len", q_len, 0), check_int("kv_len", kv_len, 0)
        if not isinstance(index, torch.Tensor) or index.dim() != 4:
            raise ValueError("index must be an int64 (B, Hkv, query blocks, kmax) tensor")
        if index.dtype.is_floating_point or index.dtype == torch.bool:
            raise TypeError(f"index must hold ints, got {index.dtype}")
        B, hkv, nqs, _ = index.shape
        if nqs != max(1, -(-q_len // block)):
            raise ValueError(
                f"index has {nqs} query blocks; Nq={q_len} with block={block} needs "
                f"{max(1, -(-q_len // block))}"
            )
        if hkv < 1 or heads % hkv:
            raise ValueError(f"heads={heads} is not a multiple of the index's {hkv} kv heads")
        nks = -(-kv_len // block)
        index = index.detach().to("cpu", torch.long).contiguous()
        low, high = index.aminmax() if index.numel() else (-1, -1)
        if not one_group and (int(high) >= nks or int(low) < -1):
            raise ValueError(f"index holds a key block outside [-1, {nks})")
        self.index = index
        self.block = block
        self.causal = bool(causal)
        self.kv_heads = hkv
        if one_group and (B, hkv) != (1, 1):
            raise ValueError("a one-group view holds one batch element and one kv head")
        rule = _Chosen(index, block, heads // hkv, self.causal, q_len, kv_len)
        super().__init__(
            rule=rule.rule, bounds=rule.bounds, ranges=rule.ranges, check=rule.check,
            batch=None if one_group else B, heads=None if one_group else heads,
            exact_ranges=one_group, name=name or f"chosen_blocks(block={block})",
        )  # fmt: skip
        self.one_group = one_group
        self.group_heads = heads  # query heads: all of them, or a view's group
        self._views: dict[tuple[int, int], ChosenBlocks] = {}
        self._shape = (q_len, kv_len)

    def group(self, b: int, hkv: int) -> ChosenBlocks:
        """The blocks of batch element b and kv head hkv alone (`one_group`): the mask of a
        one-(b, kv head) problem of its G query heads, independent of batch and head, whose key
        ranges are exact: what a kernel runs."""
        view = self._views.get((b, hkv))
        if view is None:
            q_len, kv_len = self._shape
            view = ChosenBlocks(
                self.index[b : b + 1, hkv : hkv + 1], self.block,
                heads=self.group_heads // self.kv_heads, q_len=q_len, kv_len=kv_len,
                causal=self.causal, name=f"{self!r}[b={b}, kv head={hkv}]", one_group=True,
            )  # fmt: skip
            self._views[(b, hkv)] = view
        return view

    def counts(self) -> torch.Tensor:
        """int64 `(B, Hkv, query blocks)`: how many key blocks each query block reads."""
        return (self.index >= 0).sum(-1)

    def show(self, b: int = 0, hkv: int = 0) -> str:
        """A text picture of one (b, kv head)'s choice: a row per query block, '#' a chosen key
        block, '.' one left out."""
        nks = -(-self._shape[1] // self.block)
        grid = torch.zeros(self.index.shape[2], nks + 1, dtype=torch.bool)
        picks = self.index[b, hkv]
        grid.scatter_(1, torch.where(picks >= 0, picks, nks), True)
        return "\n".join("".join("#" if x else "." for x in row[:nks].tolist()) for row in grid)

    def __reduce__(self):
        q_len, kv_len = self._shape
        return (_rebuild_chosen, (self.index, self.block, self.group_heads, q_len, kv_len,
                                  self.causal, self.name, self.one_group))  # fmt: skip


def _rebuild_chosen(index, block, heads, q_len, kv_len, causal, name, one) -> ChosenBlocks:
    return ChosenBlocks(index, block, heads=heads, q_len=q_len, kv_len=kv_len, causal=causal,
                        name=name, one_group=one)  # fmt: skip


def chosen_blocks(
    index: torch.Tensor,
    block: int,
    *,
    heads: int,
    q_len: int,
    kv_len: int,
    causal: bool = True,
) -> ChosenBlocks:
    """Key blocks chosen per query block, batch element and kv head, as a mask (`ChosenBlocks`:
    `index` `(B, Hkv, ceil(Nq / block), kmax)`, ascending, −1 past each row's count)."""
    return ChosenBlocks(index, block, heads=heads, q_len=q_len, kv_len=kv_len, causal=causal)
