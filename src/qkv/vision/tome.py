"""Token merging (ToMe, Bolya et al. 2023): fewer visual tokens by averaging similar ones.

Bipartite soft matching, once per layer: split the tokens alternately into sets A (even
positions) and B (odd), link every A token to its most similar B token (cosine similarity of a
`metric`, usually the keys), and merge the `r` A tokens with the strongest links into their B
partners. A merged token is the size-weighted average of what it absorbed, and its *size* s (how
many original tokens it stands for) is tracked::

    x' = Σ s_i x_i / Σ s_i,   s' = Σ s_i      (so Σ s·x and Σ s are conserved)

**Proportional attention.** A merged token should weigh in the softmax as much as the s tokens it
replaced, so attention adds log s to the scores of its *key*::

    softmax(q·kᵀ · scale + log s)  =  s_j · exp(q·k_j · scale) / Σ_j' s_j' · exp(...)

That bias depends on the key only: `log_size_bias(size)` returns it as a `(B, 1, 1, N)` float
mask, which `qkv.attention` accepts as is (torch SDPA and the tiled kernel read it broadcast,
tile by tile; no N×N bias is ever built). With a structured `qkv.masks.Mask` as well,
`size_score_mod(size)` adds it inside the tiles as a score modifier.

`unmerge` sends every merged token back to the positions it absorbed (for dense outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..functional import attention
from ..masks import Mask
from ..scores import ScoreMod


@dataclass(frozen=True)
class Matching:
    """One bipartite soft matching of N tokens merging r of them: what `merge` applies and
    `unmerge` undoes. Merged order: the unmerged A tokens, then all of B."""

    unmerged: torch.Tensor  # (B, |A| − r) int64: A tokens kept, as indices into A
    src: torch.Tensor  # (B, r) int64: A tokens merged away, as indices into A
    dst: torch.Tensor  # (B, r) int64: the B token each of them merges into, as indices into B
    source: torch.Tensor  # (B, N) int64: the merged token each original token ends up in
    n_tokens: int  # N before merging
    r: int  # tokens removed

    @property
    def n_merged(self) -> int:
        """Tokens after merging: N − r."""
        return self.n_tokens - self.r

    def apply(self, x: torch.Tensor, reduce: str = "sum") -> torch.Tensor:
        """Merge `x (B, N, C)` → `(B, N − r, C)`, combining merged tokens by `reduce`
        ("sum", "mean", "amax", …; see `torch.Tensor.scatter_reduce`)."""
        _check_tokens("x", x, self.n_tokens, self.unmerged.shape[0])
        a, b = x[:, ::2], x[:, 1::2]
        c = x.shape[-1]
        keep = a.gather(1, self.unmerged[..., None].expand(-1, -1, c))
        moved = a.gather(1, self.src[..., None].expand(-1, -1, c))
        b = b.scatter_reduce(1, self.dst[..., None].expand(-1, -1, c), moved, reduce=reduce)
        return torch.cat([keep, b], dim=1)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        """Spread merged tokens `x (B, N − r, C)` back to the N original positions `(B, N, C)`:
        each position gets the merged token it ended up in."""
        _check_tokens("x", x, self.n_merged, self.source.shape[0])
        return x.gather(1, self.source[..., None].expand(-1, -1, x.shape[-1]))


def _check_tokens(name: str, x: object, n: int, batch: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must have shape (B, N, C), got {got}")
    if x.shape[0] != batch or x.shape[1] != n:
        raise ValueError(f"{name} must have shape ({batch}, {n}, C), got {tuple(x.shape)}")


def bipartite_soft_matching(metric: torch.Tensor, r: int, *, class_token: bool = False) -> Matching:
    """Match the tokens of `metric (B, N, C)` and choose `r` to merge (see the module docstring).

    `class_token`: token 0 (a CLS token) is never merged away and stays first. Raises ValueError
    when r exceeds half the mergeable tokens, ⌊(N − class_token) / 2⌋."""
    if not isinstance(metric, torch.Tensor) or metric.dim() != 3:
        got = tuple(metric.shape) if isinstance(metric, torch.Tensor) else type(metric).__name__
        raise ValueError(f"metric must have shape (B, N, C), got {got}")
    if isinstance(r, bool) or not isinstance(r, int):
        raise TypeError(f"r must be an int, got {type(r).__name__} {r!r}")
    B, N, _ = metric.shape
    limit = (N - int(class_token)) // 2
    if r < 0 or r > limit:
        raise ValueError(
            f"r={r} must be in [0, {limit}]: bipartite matching merges at most half of the "
            f"{N - int(class_token)} mergeable tokens"
        )
    with torch.no_grad():
        m = metric / metric.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(metric.dtype).tiny)
        a, b = m[:, ::2], m[:, 1::2]
        scores = a @ b.transpose(-1, -2)  # (B, |A|, |B|) cosine similarities
        if class_token:
            scores[:, 0, :] = -torch.inf
        best, best_b = scores.max(dim=-1)  # each A token's closest B token
        order = best.argsort(dim=-1, descending=True)
        src, unmerged = order[:, :r], order[:, r:]
        if class_token:
            unmerged = unmerged.sort(dim=-1).values  # the CLS token stays first
        dst = best_b.gather(1, src)
        n_a, n_keep = a.shape[1], a.shape[1] - r
        # source: where each original token goes in the merged order [unmerged A, B]
        source_a = torch.empty(B, n_a, dtype=torch.long, device=metric.device)
        source_a.scatter_(1, unmerged, torch.arange(n_keep, device=metric.device).expand(B, -1))
        source_a.scatter_(1, src, n_keep + dst)
        source = torch.empty(B, N, dtype=torch.long, device=metric.device)
        source[:, ::2] = source_a
        source[:, 1::2] = n_keep + torch.arange(N // 2, device=metric.device)
    return Matching(unmerged=unmerged, src=src, dst=dst, source=source, n_tokens=N, r=r)


def merge(
    x: torch.Tensor,
    metric: torch.Tensor,
    r: int,
    *,
    size: torch.Tensor | None = None,
    class_token: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, Matching]:
    """Merge `r` of the N tokens of `x (B, N, C)` by bipartite soft matching on `metric
    (B, N, Cm)`, as a size-weighted average.

    Args:
        size: `(B, N)` sizes of the incoming tokens (default all 1: original tokens).
        class_token: keep token 0 unmerged and first.

    Returns:
        `(x (B, N − r, C), size (B, N − r), matching)`; `matching.unmerge` undoes the layout.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must have shape (B, N, C), got {got}")
    matching = bipartite_soft_matching(metric, r, class_token=class_token)
    _check_tokens("x", x, matching.n_tokens, metric.shape[0])
    B, N, _ = x.shape
    if size is None:
        size = torch.ones(B, N, dtype=x.dtype, device=x.device)
    elif not isinstance(size, torch.Tensor) or tuple(size.shape) != (B, N):
        got = tuple(size.shape) if isinstance(size, torch.Tensor) else type(size).__name__
        raise ValueError(f"size must have shape (B, N)=({B}, {N}), got {got}")
    s = size.to(x.dtype)[..., None]  # (B, N, 1)
    total = matching.apply(x * s, "sum")
    new_size = matching.apply(s, "sum")
    return total / new_size, new_size[..., 0].to(size.dtype), matching


def unmerge(x: torch.Tensor, matching: Matching) -> torch.Tensor:
    """`matching.unmerge(x)`: merged tokens `(B, N − r, C)` back to `(B, N, C)`."""
    return matching.unmerge(x)


def _check_size(size: object) -> torch.Tensor:
    if not isinstance(size, torch.Tensor) or size.dim() != 2:
        got = tuple(size.shape) if isinstance(size, torch.Tensor) else type(size).__name__
        raise ValueError(f"size must have shape (B, N), got {got}")
    if not bool((size > 0).all()):
        raise ValueError("size must be > 0 everywhere (a token stands for at least itself)")
    return size


def log_size_bias(size: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Proportional attention's key-side bias: `log size` as a `(B, 1, 1, N)` float mask for
    `qkv.attention(q, k, v, mask=...)` (added to the scaled scores of every query)."""
    size = _check_size(size)
    return size.log().to(dtype or torch.get_default_dtype())[:, None, None, :]


def size_score_mod(size: torch.Tensor) -> ScoreMod:
    """Proportional attention as a score modifier: adds `log size[b, key]` inside every tile
    (to combine with a structured `qkv.masks.Mask`)."""
    table = _check_size(size).log()
    return ScoreMod(_LogSize(table), f"log_size(B={table.shape[0]}, N={table.shape[1]})")


class _LogSize:
    """`score + log size[b, key]`: a named rule (not a closure), so the modifier pickles."""

    def __init__(self, table: torch.Tensor):
        self.table = table  # (B, N) log sizes

    def __call__(self, score, b, h, q, kv):
        return score + self.table.to(score)[b, kv]


def proportional_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    size: torch.Tensor,
    *,
    mask: Mask | None = None,
    causal: bool = False,
    scale: float | None = None,
    backend: object = "auto",
    finite_inputs: bool = False,
) -> torch.Tensor:
    """`qkv.attention` over merged tokens with proportional attention: `q (B, H, Nq, D)`,
    `k, v (B, Hkv, N, ·)` and the keys' `size (B, N)`. Without `mask` the log-size bias is a
    `(B, 1, 1, N)` float mask; with a `qkv.masks.Mask` it is a score modifier in the tiles.
    `finite_inputs`: as in `qkv.attention`."""
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(f"mask must be a qkv.masks.Mask or None, got {type(mask).__name__}")
    if mask is None:
        bias = log_size_bias(size, q.dtype)
        return attention(
            q, k, v, mask=bias, causal=causal, scale=scale, backend=backend,
            finite_inputs=finite_inputs,
        )  # fmt: skip
    return attention(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        scale=scale,
        backend=backend,
        score_mod=size_score_mod(size),
        finite_inputs=finite_inputs,
    )
