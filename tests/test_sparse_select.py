"""Content-selected blocks (`qkv.sparse`): the choice itself, and exact attention over it on the
compiled CPU kernel (each (b, kv head) over its own tiles), decoding from a KV cache's pooled
keys, and `qkv.nn.MultiHeadAttention(select=...)`."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

import qkv
from qkv import masks
from qkv.kernels.cpu import op as cpu_op
from qkv.kernels.cpu.tile_encoding import BLOCK_K, TILE_FULL, chosen_layouts, kernel_layout
from qkv.nn import KVCache, MultiHeadAttention
from qkv.pairs import Pairs
from qkv.sparse import BlockSelector, pool_keys, select_blocks

from .helpers import assert_error_ratio, cpu_kernel_or, golden, make_qkv

needs_kernel = pytest.mark.skipif(cpu_kernel_or("x") != "cpu", reason="no compiled CPU kernel")


def brute_choice(q, k, block, topk, threshold, causal, local, sink):
    """The choice written out block by block, in float64: {(b, g, r): set of key blocks}."""
    B, H, Nq, D = q.shape
    hkv, Nk = k.shape[1], k.shape[2]
    G, off = H // hkv, Nk - Nq
    nqs, nks = max(1, -(-Nq // block)), -(-Nk // block)
    out = {}
    for b in range(B):
        for g in range(hkv):
            heads = q[b, g * G : (g + 1) * G].double()
            keys = k[b, g].double()
            for r in range(nqs):
                rows = heads[:, r * block : min(Nq, (r + 1) * block)]
                qp = rows.mean((0, 1))
                last = min(Nq, (r + 1) * block) - 1 + off
                may = [j for j in range(nks) if not causal or j * block <= last]
                own = min(last // block, nks - 1)
                forced = {j for j in may if own - local < j <= own or j < sink}
                s = {j: float(qp @ keys[j * block : (j + 1) * block].mean(0)) for j in may}
                order = sorted((j for j in may if j not in forced), key=lambda j: -s[j])
                if topk is not None:
                    order = order[:topk]
                if threshold is not None:
                    z = [x / math.sqrt(D) for x in s.values()]
                    lse = max(z) + math.log(sum(math.exp(x - max(z)) for x in z))
                    mass = sum(math.exp(s[j] / math.sqrt(D) - lse) for j in forced)
                    kept = []
                    for j in order:
                        if mass >= threshold:
                            break
                        kept.append(j)
                        mass += math.exp(s[j] / math.sqrt(D) - lse)
                    order = kept
                out[(b, g, r)] = forced | set(order)
    return out


CHOICES = [
    # B, H, Hkv, Nq, Nk, block, topk, threshold, causal, local, sink
    (2, 4, 2, 300, 300, 32, 3, None, True, 1, 1),
    (1, 2, 1, 200, 333, 64, 2, None, False, 1, 0),
    (2, 4, 1, 5, 1000, 64, 4, None, True, 2, 1),
    (1, 3, 3, 130, 130, 16, None, 0.6, True, 1, 0),
    (1, 2, 2, 100, 100, 16, 2, 0.5, False, 0, 2),
    (1, 2, 1, 64, 64, 64, 16, None, True, 1, 0),  # one block: only the local one
]


@pytest.fixture(params=["kernel", "torch"])
def choice_path(request, monkeypatch):
    """The choice from the scores by the compiled kernel's `choose_blocks`, or by its torch
    twin (any device, or no compiler)."""
    if request.param == "kernel":
        if cpu_kernel_or("x") != "cpu":
            pytest.skip("no compiled CPU kernel")
        cpu_op.load()
    else:
        monkeypatch.setattr(qkv.sparse, "loaded", lambda: None)
    return request.param


@pytest.mark.parametrize("case", CHOICES)
def test_the_choice_is_the_pooled_scores_top_blocks(case, choice_path):
    B, H, hkv, Nq, Nk, block, topk, threshold, causal, local, sink = case
    q, k, _ = make_qkv(B=B, H=H, Hkv=hkv, Nq=Nq, Nk=Nk, D=16, seed=3)
    chosen = select_blocks(q, k, block=block, topk=topk, threshold=threshold, causal=causal,
                           local=local, sink=sink)  # fmt: skip
    want = brute_choice(q, k, block, topk, threshold, causal, local, sink)
    for (b, g, r), blocks in want.items():
        row = chosen.index[b, g, r]
        got = row[row >= 0].tolist()
        assert got == sorted(got), "ascending"
        assert set(got) == blocks, ((b, g, r), got, sorted(blocks))
        assert (row[len(got) :] == -1).all(), "−1 past the count"
    assert chosen.counts().max() == chosen.index.shape[-1]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernels_choice_reads_any_float_queries_in_place(dtype, monkeypatch):
    """`choose_blocks` pools bfloat16/float16 queries itself, from (B, N, H, D) storage (as
    transformers holds them), D not a multiple of its 16 running sums: the twin's choice."""
    q, k, _ = make_qkv(B=2, H=4, Hkv=2, Nq=300, Nk=300, D=24, seed=5)
    q = q.to(dtype).transpose(1, 2).contiguous().transpose(1, 2)
    k = k.to(dtype)
    cpu_op.load()
    got = select_blocks(q, k, block=32, topk=3, sink=1)
    monkeypatch.setattr(qkv.sparse, "loaded", lambda: None)
    assert torch.equal(got.index, select_blocks(q, k, block=32, topk=3, sink=1).index)


def test_a_causal_choice_never_reads_the_future_and_keeps_its_own_block(choice_path):
    q, k, _ = make_qkv(B=1, H=2, Nq=512, D=8, seed=1)
    chosen = select_blocks(q, k, block=32, topk=4, sink=1)
    for r in range(16):
        row = chosen.index[0, 0, r]
        got = row[row >= 0]
        assert got.max() == r and 0 in got.tolist()
    dense = chosen.to_dense(512, 512)
    assert not dense[0].triu(1).any()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        # B, H, Hkv, Nq, Nk, D, block, causal
        (2, 4, 2, 300, 300, 32, 64, True),
        (2, 4, 2, 300, 300, 32, 32, True),  # blocks narrower than a tile: the intervals' path
        (1, 6, 2, 200, 333, 64, 128, False),
        (2, 2, 1, 5, 1000, 16, 64, True),  # decoding rows over a cache
        (1, 2, 2, 256, 256, 256, 96, True),
        (1, 4, 1, 1000, 1300, 64, 64, True),
    ],
    ids=lambda s: "x".join(map(str, s)),
)
def test_cpu_attention_over_chosen_blocks_is_exact(shape, dtype):
    B, H, hkv, Nq, Nk, D, block, causal = shape
    q, k, v = make_qkv(B=B, H=H, Hkv=hkv, Nq=Nq, Nk=Nk, D=D, dtype=dtype, requires_grad=True)
    chosen = select_blocks(q, k, block=block, topk=3, sink=1, causal=causal)
    dense = chosen.dense4(Nq, Nk)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    gold = qkv.attention(qd, kd, vd, mask=dense, backend="reference")
    same = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = qkv.attention(*same, mask=dense, backend="reference")
    out = qkv.attention(q, k, v, mask=chosen, backend="cpu")
    grad = torch.randn_like(gold)
    assert_error_ratio(out, ref, gold)
    for name, got, r, g in zip(
        "qkv",
        torch.autograd.grad(out, (q, k, v), grad.to(dtype)),
        torch.autograd.grad(ref, same, grad.to(dtype)),
        torch.autograd.grad(gold, (qd, kd, vd), grad),
        strict=True,
    ):
        assert_error_ratio(got, r, g, factor=3.0 if dtype != torch.float32 else 2.0,
                           what=f"d{name}")  # fmt: skip


@needs_kernel
def test_the_cpu_kernel_runs_each_kv_head_over_its_own_tiles(monkeypatch):
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=1024, D=16, requires_grad=True)
    chosen = select_blocks(q, k, block=64, topk=2)
    union = qkv.layout.layout_for(Pairs(1024, 1024, rule=chosen), 64, BLOCK_K).nnz
    seen = []
    real = cpu_op.group_layouts

    def spy(pairs, batch, kv_heads, block_q):
        layouts = real(pairs, batch, kv_heads, block_q)
        seen.extend(lay.kept_tiles for lay in layouts)
        return layouts

    monkeypatch.setattr(cpu_op, "group_layouts", spy)
    out = qkv.attention(q, k, v, mask=chosen, backend="cpu")
    forward = cpu_op.forward_layout(Pairs(1024, 1024, rule=chosen), 2, 2, 64)
    assert forward.row_ptr.numel() == 4 * (1024 // 64 + 1)  # a tile list per group
    assert forward.kept_tiles == sum(seen) or not seen
    out.sum().backward()
    assert len(seen) == 4  # 4 (b, kv head) groups in the backward
    assert max(seen) < union
    assert forward.kept_tiles == sum(seen)


@needs_kernel
@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("nq,nk,block,block_q", [(300, 300, 64, 64), (700, 900, 128, 32),
                                                 (7, 1000, 64, 16), (1, 1000, 64, 64),
                                                 (900, 700, 128, 32)])  # fmt: skip
def test_the_direct_tile_lists_hold_exactly_the_chosen_pairs(nq, nk, block, block_q, causal, flag):
    # `flag`: the problem's causal flag beside the choice's own (either makes the rows causal)
    q, k, _ = make_qkv(B=1, H=4, Hkv=2, Nq=nq, Nk=nk, D=8, seed=5)
    chosen = select_blocks(q, k, block=block, topk=3, sink=1, causal=causal)
    pairs = Pairs(nq, nk, causal=flag, rule=chosen)
    layouts = chosen_layouts(pairs, pairs.kv_choice(1, 2), block_q)
    assert layouts is not None and len(layouts) == 2
    view, lay = chosen.group(0, 1), layouts[1]
    allowed = torch.zeros(nq, nk, dtype=torch.bool)
    bits = lay.bits.view(-1, block_q)
    for i in range(-(-nq // block_q)):
        for e in range(int(lay.row_ptr[i]), int(lay.row_ptr[i + 1])):
            j, code = int(lay.col_idx[e]), int(lay.code[e])
            rows = slice(i * block_q, min(nq, (i + 1) * block_q))
            cols = slice(j * BLOCK_K, min(nk, (j + 1) * BLOCK_K))
            if code == TILE_FULL:
                allowed[rows, cols] = True
                continue
            for r in range(rows.stop - rows.start):
                word = int(bits[code, r]) & (2**64 - 1)
                for c in range(cols.stop - cols.start):
                    allowed[rows.start + r, cols.start + c] = bool(word >> c & 1)
    want = view.to_dense(nq, nk)
    if flag:
        want &= torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
    assert torch.equal(allowed, want)
    # the backward's columns hold the same tiles
    assert sorted(zip(lay.row_idx.tolist(), lay.code_t.tolist(), strict=True)) == sorted(
        zip(torch.repeat_interleave(torch.arange(lay.row_ptr.numel() - 1),
                                    lay.row_ptr.diff()).tolist(), lay.code.tolist(), strict=True)
    )  # fmt: skip


@needs_kernel
def test_blocks_narrower_than_a_tile_take_the_intervals():
    q, k, _ = make_qkv(B=1, H=1, Nq=200, D=8)
    chosen = select_blocks(q, k, block=32, topk=2)
    pairs = Pairs(200, 200, rule=chosen)
    assert chosen_layouts(pairs, pairs.kv_choice(1, 1), 64) is None
    assert kernel_layout(Pairs(200, 200, rule=chosen.group(0, 0)), 64).kept_tiles > 0


def test_kv_cache_keeps_the_pooled_keys_as_tokens_arrive():
    cache = KVCache(2, 300, 3, 8, pool_block=32)
    g = torch.Generator().manual_seed(0)
    for n in (50, 1, 1, 31, 60, 1):
        k = torch.randn(2, 3, n, 8, generator=g)
        cache.update(k, torch.zeros_like(k))
        want = pool_keys(cache.keys[:, :, : cache.length], 32)
        assert torch.allclose(cache.pooled_keys(), want, rtol=0, atol=1e-6)
    cache.reset()
    assert cache.pooled_keys().shape[2] == 0
    with pytest.raises(ValueError, match="window"):
        KVCache(1, 10, 1, 4, window=4, pool_block=2)
    with pytest.raises(ValueError, match="pool_block"):
        KVCache(1, 10, 1, 4).pooled_keys()


@needs_kernel
@pytest.mark.parametrize("nq", [1, 4, 16])
def test_a_decoding_step_over_cached_pooled_keys_is_exact(nq):
    q, k, v = make_qkv(B=1, H=4, Hkv=2, Nq=nq, Nk=3000, D=32, seed=nq)
    cache = KVCache(1, 3000, 2, 32, pool_block=64)
    cache.update(k, v)
    chosen = select_blocks(q, k, block=64, topk=8, sink=1, pooled_k=cache.pooled_keys())
    again = select_blocks(q, k, block=64, topk=8, sink=1)
    assert torch.equal(chosen.index, again.index)
    assert chosen.counts().max() == 8 + 2
    dense = chosen.dense4(nq, 3000)
    out = qkv.attention(q, k, v, mask=chosen)
    assert_error_ratio(out, qkv.attention(q, k, v, mask=dense, backend="reference"),
                       golden(q, k, v, mask=dense))  # fmt: skip


@needs_kernel
def test_multi_head_attention_with_a_selector_decodes_as_it_prefills():
    torch.manual_seed(0)
    mha = MultiHeadAttention(64, 4, 2, rope=True, select=BlockSelector(block=16, topk=2)).eval()
    x = torch.randn(1, 100, 64)
    whole = mha(x, causal=True)
    cache = KVCache(1, 200, 2, 16, pool_block=16)
    assert torch.equal(mha(x[:, :90], cache=cache), whole[:, :90])
    step = mha(x[:, 90:91], cache=cache)
    # one query row: its block reads its own key block and the top 2 others by pooled keys
    q = mha._heads(mha.q_proj(x[:, 90:91]), 4)
    q = mha.rope(q, torch.tensor([90]))
    chosen = select_blocks(q, cache.keys[:, :, :91], block=16, topk=2)
    k, v = cache.keys[:, :, :91], cache.values[:, :, :91]
    attn = qkv.attention(q, k, v, mask=chosen.dense4(1, 91), backend="reference")
    want = mha.o_proj(attn.transpose(1, 2).reshape(1, 1, 64))
    torch.testing.assert_close(step, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="mask"):
        mha(x, mask=masks.causal())
    with pytest.raises(ValueError, match="windowed"):
        mha(x[:, :1], cache=KVCache(1, 10, 2, 16, window=4))


def test_a_choice_pickles_and_checks_its_shape():
    q, k, _ = make_qkv(B=2, H=4, Hkv=2, Nq=100, D=8)
    chosen = select_blocks(q, k, block=16, topk=2)
    back = pickle.loads(pickle.dumps(chosen))
    assert torch.equal(back.to_dense(100, 100), chosen.to_dense(100, 100))
    assert repr(back) == repr(chosen) and back.group(1, 1).exact_ranges
    with pytest.raises(ValueError, match="chosen for"):
        qkv.attention(q[:, :, :50], k[:, :, :50], k[:, :, :50], mask=chosen)
    with pytest.raises(ValueError, match="batch size"):
        qkv.attention(q[:1], k[:1], k[:1], mask=chosen)
    assert chosen.show(1, 0).count("\n") == 6


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"block": 0}, "block"),
        ({"topk": -1}, "topk"),
        ({"topk": None}, "topk, threshold"),
        ({"threshold": 1.5}, "threshold"),
        ({"local": -1}, "local"),
        ({"pooled_k": torch.zeros(1, 1, 1, 8)}, "pooled_k"),
    ],
)
def test_bad_settings_are_refused_clearly(kwargs, match):
    q, k, _ = make_qkv(B=1, H=2, Nq=40, D=8)
    with pytest.raises(ValueError, match=match):
        select_blocks(q, k, **kwargs)
    with pytest.raises(ValueError, match="multiple"):
        select_blocks(q, k[:, :1].expand(1, 3, 40, 8)[:, :3])


def test_index_validation():
    with pytest.raises(ValueError, match="query blocks"):
        masks.chosen_blocks(torch.zeros(1, 1, 3, 1, dtype=torch.long), 16, heads=1, q_len=16,
                            kv_len=16)  # fmt: skip
    with pytest.raises(ValueError, match="outside"):
        masks.chosen_blocks(torch.full((1, 1, 1, 1), 5), 16, heads=1, q_len=16, kv_len=16)


@pytest.mark.parametrize("nq,nk", [(0, 10), (5, 0), (0, 0), (3, 10)])
def test_empty_sequences_choose_nothing_and_attend_as_the_reference(nq, nk):
    q, k, v = make_qkv(B=1, H=2, Nq=nq, Nk=nk, D=8)
    chosen = select_blocks(q, k, block=4, topk=1)
    out = qkv.attention(q, k, v, mask=chosen)
    want = qkv.attention(q, k, v, mask=chosen.dense4(nq, nk), backend="reference")
    assert out.shape == want.shape and torch.equal(out == 0, want == 0)
    assert_error_ratio(out, want, golden(q, k, v, mask=chosen.dense4(nq, nk)))


@needs_kernel
@pytest.mark.parametrize("index_heads", [1, 4])
def test_a_choice_for_other_kv_heads_is_still_exact(index_heads):
    # chosen for 1 kv head (shared by both of k's) or for 4 (heads of one kv group differ: the
    # union layout)
    q, k, v = make_qkv(B=2, H=4, Hkv=2, Nq=300, D=16, requires_grad=True)
    keys = k.detach().repeat_interleave(2, 1)[:, :index_heads] if index_heads == 4 else k[:, :1]
    chosen = select_blocks(q, keys.detach(), block=64, topk=1)
    dense = chosen.dense4(300, 300)
    out = qkv.attention(q, k, v, mask=chosen, backend="cpu")
    ref = qkv.attention(q, k, v, mask=dense, backend="reference")
    assert_error_ratio(out, ref, golden(q, k, v, mask=dense))
    groups = Pairs(300, 300, rule=chosen).kv_groups(2, 2)
    assert (groups is None) == (index_heads == 4)
