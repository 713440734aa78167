"""Sparse attention chosen by the content (MoBA, Quest): which key blocks each query block reads.

`select_blocks(q, k, block=64, topk=16)` scores every (query block, key block) pair by the
pooled (mean) queries and keys of the blocks, keeps the `topk` best key blocks of each query
block (or, with `threshold`, the fewest holding that share of the pooled softmax mass), always
keeps the `local` nearest and `sink` first blocks, and returns the choice as a mask
(`qkv.masks.ChosenBlocks`) that `qkv.attention(q, k, v, mask=...)` runs exactly: attention over
exactly the chosen pairs (causal inside), per batch element and kv head. The heads of a GQA group
share one choice (their pooled queries are averaged), so each K/V tile is read once per group.

The choice itself is not differentiated (as in MoBA): gradients flow through the attention over
the chosen blocks. Kernels (compiled CPU, tiled, Triton) run each (batch element, kv head) over
its own kept tiles, so a block one head chose costs no other head a tile.

Decoding (Quest): pass the cache's pooled keys (`qkv.nn.KVCache(pool_block=...).pooled_keys()`,
kept as tokens arrive) as `pooled_k`, and a step scores the cache's blocks without re-reading its
keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .kernels.cpu.build import loaded
from .masks import ChosenBlocks

SCORE_CHUNK = 1 << 22  # pooled scores held at once (floats): 16 MB


POOL_CHUNK = 1 << 22  # elements of q or k read (as float32) at once while pooling


def _block_means(x: torch.Tensor, groups: int, block: int) -> torch.Tensor:
    """float32 `(B, H / groups, ceil(N / block), D)`: the mean of each block of rows over its
    rows (the last block's over those it holds) and over each run of `groups` heads, read a
    chunk of blocks at a time (never a float32 copy of all of x)."""
    B, H, N, D = x.shape
    h = H // groups
    if 0 < N <= block:  # one block (a decoding step's queries): a mean over rows and heads
        return x.detach().float().reshape(B, h, groups * N, D).mean(2, keepdim=True)
    nb = -(-N // block)
    out = torch.empty(B, h, nb, D, dtype=torch.float32, device=x.device)
    step = max(1, POOL_CHUNK // max(1, B * H * block * D))
    for c0 in range(0, nb, step):
        c1 = min(nb, c0 + step)
        part = x[:, :, c0 * block : min(N, c1 * block)].detach().float()
        n = part.shape[2]
        part = part.reshape(B, h, groups, n, D).sum(2)
        full = (n // block) * block
        out[:, :, c0 : c0 + n // block] = part[:, :, :full].reshape(B, h, -1, block, D).sum(3)
        if full < n:  # the last, shorter block
            out[:, :, c1 - 1] = part[:, :, full:].sum(2)
    counts = torch.full((nb,), float(block * groups), dtype=torch.float32, device=x.device)
    if nb:
        counts[-1] = (N - (nb - 1) * block) * groups
    return out / counts.view(1, 1, nb, 1)


def pool_keys(k: torch.Tensor, block: int) -> torch.Tensor:
    """float32 `(B, Hkv, ceil(Nk / block), D)`: each key block's mean key (the last block's over
    the keys it holds)."""
    return _block_means(k, 1, block)


def _check(q, k, block, topk, threshold, local, sink) -> None:
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a (B, H, N, D) tensor")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in B or D")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q's {q.shape[1]} heads are not a multiple of k's {k.shape[1]}")
    for name, x, least in (("block", block, 1), ("local", local, 0), ("sink", sink, 0)):
        if isinstance(x, bool) or not isinstance(x, int) or x < least:
            raise ValueError(f"{name} must be an int ≥ {least}, got {x!r}")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 0):
        raise ValueError(f"topk must be an int ≥ 0 or None, got {topk!r}")
    if threshold is not None and not (isinstance(threshold, (int, float)) and 0 < threshold <= 1):
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    if topk is None and threshold is None:
        raise ValueError("give topk, threshold or both")


def select_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block: int = 64,
    topk: int | None = 16,
    threshold: float | None = None,
    causal: bool = True,
    local: int = 1,
    sink: int = 0,
    pooled_k: torch.Tensor | None = None,
) -> ChosenBlocks:
    """The key blocks each query block reads, chosen by the content (module docstring).

    q `(B, H, Nq, D)`, k `(B, Hkv, Nk, D)`. Query block r holds query rows r·block …; key
    block j keys j·block …. A query block reads its `local` nearest blocks (the one holding its
    last position and those before it), the `sink` first blocks, and the `topk` others whose
    pooled keys score highest against its pooled query; with `threshold`, the fewest of those
    that bring the pooled softmax mass (over the blocks it may read, scaled by 1/√D) to that
    share (at most `topk` when both are given). With `causal`, a block past the query block's
    last position is never chosen, and the pairs inside are causal (bottom-right: query row i
    sits at position i + Nk − Nq). `pooled_k` `(B, Hkv, ceil(Nk / block), D)`: the key blocks'
    means, when the caller keeps them (a KV cache); otherwise they are pooled from k."""
    _check(q, k, block, topk, threshold, local, sink)
    B, H, Nq, D = q.shape
    hkv, Nk = k.shape[1], k.shape[2]
    nqs, nks = max(1, -(-Nq // block)), -(-Nk // block)
    if pooled_k is None:
        pooled_k = pool_keys(k, block)
    elif tuple(pooled_k.shape) != (B, hkv, nks, D):
        raise ValueError(
            f"pooled_k must be (B, Hkv, ceil(Nk / block), D) = {(B, hkv, nks, D)}, got "
            f"{tuple(pooled_k.shape)}"
        )
    if Nk == 0:  # nothing to choose from
        index = torch.full((B, hkv, nqs, 0), -1, dtype=torch.long)
        return ChosenBlocks(index, block, heads=H, q_len=Nq, kv_len=Nk, causal=causal)
    # each query block's last position; the block holding it (its own) and the last it may
    # read: some key at or before that position (causal), every block (not)
    last = [min((r + 1) * block, max(Nq, 1)) - 1 + (Nk - Nq) for r in range(nqs)]
    own = [min(x // block, nks - 1) for x in last]
    reach = own if causal else [nks - 1] * nqs
    scale = 1 / math.sqrt(max(D, 1))
    with torch.no_grad():
        kp = pooled_k.float()
        ops = loaded() if _kernel_chooses(q, kp) else None
        if ops is not None:  # one call: pooled queries, scores and the choice
            cap, share = -1 if topk is None else topk, 0.0 if threshold is None else threshold
            index = ops.choose_blocks(q, kp, block, own, reach, cap, share, scale, local, sink)
        else:
            index = _choose_torch(q, kp, block, own, reach, topk, threshold, scale, local, sink)
    how = f"topk={topk}" if threshold is None else f"threshold={threshold}, topk={topk}"
    return ChosenBlocks(
        index.cpu(), block, heads=H, q_len=Nq, kv_len=Nk, causal=causal,
        name=f"select_blocks(block={block}, {how}, local={local}, sink={sink}, causal={causal})",
    )  # fmt: skip


def _kernel_chooses(q: torch.Tensor, kp: torch.Tensor) -> bool:
    """Whether the compiled kernel's `choose_blocks` (csrc/chosen_blocks.cpp) makes the choice:
    CPU tensors, float32 pooled keys, queries in a float type of at most 32 bits (a float64
    problem keeps float64 scores in the torch twin), some queries. A decoding step then pays
    one call instead of a few dozen small torch calls."""
    return (
        q.device.type == "cpu"
        and kp.dtype == torch.float32
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and q.shape[2] > 0
    )


def _choose_torch(q, kp, block, own, reach, topk, threshold, scale, local, sink) -> torch.Tensor:
    """The choice (`select_blocks`) in torch operations, on any device: the queries pooled,
    scored against the key blocks' means a chunk of query blocks at a time (at most
    SCORE_CHUNK scores held), `choose_blocks`'s twin (tested equal). int64 `(B, Hkv, query
    blocks, width)`, ascending, −1 past each row's count."""
    B, H, Nq, D = q.shape
    hkv, nks = kp.shape[1], kp.shape[2]
    qp = _block_means(q, H // hkv, block) if Nq else torch.zeros(B, hkv, 1, D, device=q.device)
    step = max(1, SCORE_CHUNK // max(1, B * hkv * nks))
    parts = []
    for r in range(0, len(own), step):
        scores = torch.matmul(qp[:, :, r : r + step], kp.transpose(-1, -2)) * scale
        rows = (own[r : r + step], reach[r : r + step])
        parts.append(_choose_rows(scores, *rows, topk, threshold, local, sink))
    width = max(p.shape[-1] for p in parts)
    return parts[0] if len(parts) == 1 else torch.cat(
        [torch.nn.functional.pad(p, (0, width - p.shape[-1]), value=-1) for p in parts], dim=2
    )  # fmt: skip


def _choose_rows(scores, own, reach, topk, threshold, local, sink) -> torch.Tensor:
    """The choice of a chunk of query blocks from their scaled scores `(B, Hkv, rows, nks)`."""
    B, hkv, rows, nks = scores.shape
    dev = scores.device
    own_t = torch.tensor(own, device=dev)[:, None]
    reach_t = torch.tensor(reach, device=dev)[:, None]
    j = torch.arange(nks, device=dev)
    visible = j <= reach_t
    # the blocks each query block always reads: its `local` nearest, the `sink` first
    near = own_t - torch.arange(local, device=dev)  # (rows, local): own block and before
    first_ones = torch.arange(min(sink, nks), device=dev).expand(rows, -1)
    fixed = torch.cat([near, first_ones], 1)
    fixed = torch.where((fixed >= 0) & (fixed <= reach_t), fixed, nks)
    fixed = fixed.sort(-1).values
    dup = torch.zeros_like(fixed, dtype=torch.bool)
    dup[:, 1:] = fixed[:, 1:] == fixed[:, :-1]
    fixed = torch.where(dup, nks, fixed).sort(-1).values  # each forced block once, ascending
    forced = torch.zeros(rows, nks + 1, dtype=torch.bool, device=dev)
    forced.scatter_(1, fixed, True)
    forced = forced[:, :nks]
    scores = scores.masked_fill(~visible, -math.inf)
    free = scores.masked_fill(forced, -math.inf)
    n_free = int((visible & ~forced).sum(1).max()) if rows else 0
    want = n_free if topk is None else min(topk, n_free)
    vals, picks = free.topk(want, dim=-1) if want else (free[..., :0], free[..., :0].long())
    keep = vals > -math.inf
    if threshold is not None and want:
        mass = torch.softmax(scores, dim=-1)
        before = (mass * forced).sum(-1, keepdim=True)
        cum = before + torch.cumsum(torch.exp(vals - torch.logsumexp(scores, -1, keepdim=True))
                                    .nan_to_num(0.0), -1)  # fmt: skip
        reached = torch.cat([before, cum[..., :-1]], -1) >= threshold  # mass before this pick
        keep &= ~reached
    picks = torch.where(keep, picks, nks)
    both = torch.cat([fixed.expand(B, hkv, rows, -1), picks], -1).sort(-1).values
    width = int((both < nks).sum(-1).max()) if both.numel() else 0
    both = both[..., :width]
    return torch.where(both < nks, both, -1)


@dataclass(frozen=True)
class BlockSelector:
    """`select_blocks`'s settings, held: `selector(q, k, causal=..., pooled_k=...)` chooses.
    `qkv.nn.MultiHeadAttention(select=BlockSelector(...))` runs its self-attention over the
    blocks it chooses at every call (with a `KVCache(pool_block=block)`, from the cache's
    pooled keys)."""

    block: int = 64
    topk: int | None = 16
    threshold: float | None = None
    local: int = 1
    sink: int = 0

    def __post_init__(self):
        probe = torch.empty(1, 1, 0, 1)
        _check(probe, probe, self.block, self.topk, self.threshold, self.local, self.sink)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        causal: bool = True,
        pooled_k: torch.Tensor | None = None,
    ) -> ChosenBlocks:
        return select_blocks(
            q, k, block=self.block, topk=self.topk, threshold=self.threshold, causal=causal,
            local=self.local, sink=self.sink, pooled_k=pooled_k,
        )  # fmt: skip
