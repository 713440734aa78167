"""ToMe: merge / unmerge conserve the token mass; proportional attention is a key-side bias."""

from __future__ import annotations

import math

import pytest
import torch

import qkv
from qkv import masks
from qkv.kernels import TiledBackend
from qkv.plan import make_plan
from qkv.vision import (
    bipartite_soft_matching,
    log_size_bias,
    merge,
    proportional_attention,
    unmerge,
)

from ..helpers import assert_error_ratio


def _tome_reference(x, metric, r, size, class_token=False):
    """ToMe's published algorithm (facebookresearch/ToMe, tome/merge.py: bipartite_soft_matching
    and merge_wavg), transcribed as the oracle."""
    metric = metric / metric.norm(dim=-1, keepdim=True)
    a, b = metric[..., ::2, :], metric[..., 1::2, :]
    scores = a @ b.transpose(-1, -2)
    if class_token:
        scores[..., 0, :] = -math.inf
    node_max, node_idx = scores.max(dim=-1)
    edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
    unm_idx, src_idx = edge_idx[..., r:, :], edge_idx[..., :r, :]
    dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)
    if class_token:
        unm_idx = unm_idx.sort(dim=1)[0]

    def do_merge(t, mode):
        src, dst = t[..., ::2, :], t[..., 1::2, :]
        n, t1, c = src.shape
        unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
        src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
        dst = dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce=mode)
        return torch.cat([unm, dst], dim=1)

    x = do_merge(x * size, "sum")
    size = do_merge(size, "sum")
    return x / size, size


MERGES = [(16, 8, False), (17, 8, False), (17, 3, False), (50, 0, False), (2, 1, False)]
MERGES += [(16, 7, True), (17, 8, True), (17, 3, True), (3, 1, True)]


@pytest.mark.parametrize("N,r,class_token", MERGES)
def test_merge_equals_tome_and_conserves_mass(N, r, class_token):
    g = torch.Generator().manual_seed(N + r)
    x = torch.randn(3, N, 5, generator=g, dtype=torch.float64)
    metric = torch.randn(3, N, 4, generator=g, dtype=torch.float64)
    size = torch.randint(1, 4, (3, N), generator=g).double()
    merged, new_size, _matching = merge(x, metric, r, size=size, class_token=class_token)
    ref_x, ref_size = _tome_reference(x, metric, r, size[..., None], class_token)
    assert merged.shape == (3, N - r, 5) and new_size.shape == (3, N - r)
    torch.testing.assert_close(merged, ref_x, rtol=0, atol=1e-12)
    torch.testing.assert_close(new_size, ref_size[..., 0], rtol=0, atol=0)
    # the token mass is conserved: Σ s and Σ s·x
    torch.testing.assert_close(new_size.sum(1), size.sum(1), rtol=0, atol=0)
    torch.testing.assert_close(
        (new_size[..., None] * merged).sum(1), (size[..., None] * x).sum(1), rtol=1e-12, atol=1e-12
    )
    if class_token:
        torch.testing.assert_close(merged[:, 0], x[:, 0])  # the CLS token stays first, alone
        assert bool((new_size[:, 0] == size[:, 0]).all())


def test_unmerge_sends_every_token_back_to_where_it_went():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 20, 3, generator=g)
    merged, size, m = merge(x, x, 7)
    back = unmerge(merged, m)
    assert back.shape == x.shape
    # every original position holds its merged token; unmerged tokens come back unchanged
    torch.testing.assert_close(back, merged.gather(1, m.source[..., None].expand(-1, -1, 3)))
    kept = (size.gather(1, m.source) == 1)[..., None]
    torch.testing.assert_close(torch.where(kept, back, x), x)
    # unmerging the sizes and summing 1/s over the positions of a merged token gives 1 each
    inv = unmerge((1.0 / size)[..., None], m)[..., 0]
    counts = torch.zeros_like(size).scatter_add_(1, m.source, inv)
    torch.testing.assert_close(counts, torch.ones_like(size))


def test_repeated_merges_track_sizes():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 64, 8, generator=g)
    size = None
    for r in (16, 12, 8):
        x, size, _ = merge(x, x, r, size=size)
    assert x.shape == (1, 28, 8)
    assert size.sum().item() == 64 and size.max().item() > 1


def test_duplicates_merged_with_proportional_attention_change_nothing():
    # s identical keys/values merged into one key of size s give exactly the same attention
    g = torch.Generator().manual_seed(2)
    B, H, D = 1, 2, 8
    base_k = torch.randn(B, H, 5, D, generator=g, dtype=torch.float64)
    base_v = torch.randn(B, H, 5, D, generator=g, dtype=torch.float64)
    counts = torch.tensor([3, 1, 2, 1, 4])
    k, v = (t.repeat_interleave(counts, dim=2) for t in (base_k, base_v))
    q = torch.randn(B, H, 6, D, generator=g, dtype=torch.float64)
    full = qkv.attention(q, k, v, backend="reference")
    size = counts.double()[None]
    for backend in ("reference", "tiled", "auto"):
        merged = proportional_attention(q, base_k, base_v, size, backend=backend)
        torch.testing.assert_close(merged, full, rtol=0, atol=1e-12)


def _golden_bias(q, k, v, size, **kwargs):
    n = k.shape[2]
    bias = size.log()[:, None, None, :].double().expand(q.shape[0], 1, q.shape[2], n)
    return qkv.attention(
        q.double(), k.double(), v.double(), mask=bias, backend="reference", **kwargs
    )


@pytest.mark.parametrize(
    "backend", ["auto", "sdpa", "tiled", TiledBackend(16, 16, max_rows=16, max_cols=16)]
)
def test_proportional_attention_is_a_key_side_bias_on_fast_backends(backend):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 37, 16, generator=g)
    k, v = torch.randn(2, 2, 41, 16, generator=g), torch.randn(2, 2, 41, 16, generator=g)
    size = torch.randint(1, 9, (2, 41), generator=g).float()
    bias = log_size_bias(size)
    assert bias.shape == (2, 1, 1, 41)  # O(B·N), broadcast by the kernels; never N×N
    assert make_plan(q, k, v, mask=bias).pairs.bias.shape == (2, 1, 1, 41)
    gold = _golden_bias(q, k, v, size)
    ref = qkv.attention(q, k, v, mask=bias.expand(2, 1, 37, 41).clone(), backend="reference")
    out = proportional_attention(q, k, v, size, backend=backend, finite_inputs=True)
    assert_error_ratio(out, ref, gold)


def test_proportional_attention_with_a_structured_mask_and_gradients():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 50, 8, generator=g, requires_grad=True) for _ in range(3))
    size = torch.randint(1, 5, (1, 50), generator=g).float()
    window = masks.sliding_window(7)
    out = proportional_attention(q, k, v, size, mask=window, backend="tiled")
    dense = window.to_dense(50, 50)
    bias = size.log()[:, None, None, :].double().masked_fill(~dense, -math.inf)
    gold = qkv.attention(*(t.detach().double() for t in (q, k, v)), mask=bias, backend="reference")
    ref = qkv.attention(q, k, v, mask=bias.float(), backend="reference")
    assert_error_ratio(out, ref, gold)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_matching_apply_and_errors():
    x = torch.randn(2, 10, 3)
    m = bipartite_soft_matching(x, 4)
    assert m.apply(x).shape == (2, 6, 3) and m.n_merged == 6
    with pytest.raises(ValueError, match=r"r=6 must be in \[0, 5\]"):
        bipartite_soft_matching(x, 6)
    with pytest.raises(ValueError, match=r"r=5 must be in \[0, 4\]"):
        bipartite_soft_matching(x, 5, class_token=True)
    with pytest.raises(ValueError, match=r"r=-1 must be in"):
        merge(x, x, -1)
    with pytest.raises(TypeError, match="r must be an int"):
        merge(x, x, 2.5)
    with pytest.raises(ValueError, match="x must have shape"):
        m.unmerge(torch.randn(2, 7, 3))
    with pytest.raises(ValueError, match=r"size must have shape \(B, N\)=\(2, 10\)"):
        merge(x, x, 2, size=torch.ones(2, 9))
    with pytest.raises(ValueError, match="size must be > 0"):
        log_size_bias(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="metric must have shape"):
        merge(x, torch.randn(10, 3), 2)


def test_the_size_score_modifier_pickles_and_computes_the_same():
    import pickle

    from qkv.vision.tome import size_score_mod

    g = torch.Generator().manual_seed(0)
    size = torch.randint(1, 4, (2, 7), generator=g).float()
    mod = size_score_mod(size)
    copy = pickle.loads(pickle.dumps(mod))
    q = torch.randn(2, 2, 7, 8, generator=g)
    want = qkv.attention(q, q, q, score_mod=mod, backend="tiled")
    assert torch.equal(qkv.attention(q, q, q, score_mod=copy, backend="tiled"), want)
