"""TransformerBlock and Transformer: structure, generation, padding and a training run."""

from __future__ import annotations

import pytest
import torch

from qkv import nn as qnn


@pytest.mark.parametrize(
    "ffn,norm,pre",
    [("gelu", "layernorm", True), ("swiglu", "rmsnorm", True), ("gelu", "layernorm", False)],
)
def test_block_is_residual_norm_and_ffn(ffn, norm, pre):
    torch.manual_seed(0)
    blk = qnn.TransformerBlock(32, 4, 2, ffn=ffn, norm=norm, pre_norm=pre).double().eval()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    if pre:
        h = x + blk.attn(blk.norm1(x), causal=True)
        want = h + blk.ffn(blk.norm2(h))
    else:
        h = blk.norm1(x + blk.attn(x, causal=True))
        want = blk.norm2(h + blk.ffn(h))
    torch.testing.assert_close(blk(x, causal=True), want, rtol=0, atol=1e-12)
    assert isinstance(blk.norm1, torch.nn.RMSNorm if norm == "rmsnorm" else torch.nn.LayerNorm)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_generate_through_caches_equals_greedy_full_forward(positions):
    torch.manual_seed(1)
    model = qnn.Transformer(40, 32, 2, 4, 2, positions=positions).eval()
    ids = torch.randint(0, 40, (2, 6))
    got = model.generate(ids, 8, temperature=0)
    cur = ids
    for _ in range(8):
        cur = torch.cat([cur, model(cur)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, cur)
    sampled = model.generate(
        ids, 5, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(0)
    )
    again = model.generate(
        ids, 5, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(sampled, again) and sampled.shape == (2, 11)


def test_bidirectional_encoder_ignores_padding():
    torch.manual_seed(2)
    model = qnn.Transformer(30, 16, 2, 2, causal=False).double().eval()
    ids = torch.randint(0, 30, (2, 9))
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, 5:] = False
    padded = ids.clone()
    padded[1, 5:] = 0
    out = model(padded, attention_mask=pad)
    alone = model(ids[1:, :5])
    torch.testing.assert_close(out[1, :5], alone[0], rtol=0, atol=1e-12)
    other = padded.clone()
    other[1, 5:] = 7  # different padding tokens change nothing that is real
    torch.testing.assert_close(
        model(other, attention_mask=pad)[1, :5], out[1, :5], rtol=0, atol=1e-12
    )


def test_training_learns_a_copy_task():
    # Copy: the second half repeats the first. A 2-layer decoder must learn it.
    torch.manual_seed(0)
    model = qnn.Transformer(12, 32, 2, 4, positions="rope", ffn="swiglu", norm="rmsnorm")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(300):
        first = torch.randint(2, 12, (16, 8), generator=g)
        seq = torch.cat([first, first], dim=1)
        logits = model(seq[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits[:, 8:].reshape(-1, 12), seq[:, 9:].reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-20:]) / 20 < 0.2 * sum(losses[:20]) / 20, (losses[:3], losses[-3:])


def test_errors():
    model = qnn.Transformer(10, 16, 1, 2, max_len=8)
    with pytest.raises(ValueError, match=r"sequence of 9 tokens exceeds max_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of ids \(1, 4\)"):
        model(torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 5))
    with pytest.raises(ValueError, match="positions must be 'learned' or 'rope'"):
        qnn.Transformer(10, 16, 1, 2, positions="alibi")
    with pytest.raises(ValueError, match="ffn must be 'gelu' or 'swiglu'"):
        qnn.TransformerBlock(16, 2, ffn="relu")
    with pytest.raises(ValueError, match="norm must be 'layernorm' or 'rmsnorm'"):
        qnn.TransformerBlock(16, 2, norm="batchnorm")
    with pytest.raises(ValueError, match="generate needs a causal"):
        qnn.Transformer(10, 16, 1, 2, causal=False).generate(torch.zeros(1, 2, dtype=torch.long), 2)
