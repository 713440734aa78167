"""M-RoPE ids and rotations, and the ViT's 2-D RoPE, equal transformers' on random input."""

from __future__ import annotations

import random

import pytest
import torch

from qkv.vision import (
    apply_rotary,
    mrope_cos_sin,
    mrope_position_ids,
    vision_cos_sin,
    vision_position_ids,
)
from qkv.vision.mrope import IMAGE, TEXT, VIDEO, frequency_axes

tf = pytest.importorskip("transformers")
q2 = pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")
q25 = pytest.importorskip("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")

TINY_TEXT = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=64,
    vocab_size=100,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=0,
)


def _sequences(seed: int, batch: int = 3):
    """Random mixed text / image / video sequences with left padding, and their grids."""
    rnd = random.Random(seed)
    rows, images, videos = [], [], []
    for _ in range(batch):
        types: list[int] = []
        for _ in range(rnd.randint(1, 4)):
            types += [TEXT] * rnd.randint(1, 9)
            kind = rnd.choice([IMAGE, VIDEO, TEXT])
            if kind == TEXT:
                continue
            t = 1 if kind == IMAGE else rnd.randint(1, 5)
            h, w = 2 * rnd.randint(1, 7), 2 * rnd.randint(1, 7)
            (images if kind == IMAGE else videos).append((t, h, w))
            types += [kind] * (t * h * w // 4)
        types += [TEXT] * rnd.randint(0, 3)
        rows.append(types)
    length = max(len(r) for r in rows)
    token_types = torch.zeros(batch, length, dtype=torch.long)
    mask = torch.zeros(batch, length, dtype=torch.long)
    for b, r in enumerate(rows):  # left padding, as generation uses
        token_types[b, length - len(r) :] = torch.tensor(r)
        mask[b, length - len(r) :] = 1
    as_grid = lambda g: torch.tensor(g, dtype=torch.long) if g else None  # noqa: E731
    return token_types, mask, as_grid(images), as_grid(videos)


@pytest.mark.parametrize("seed", range(6))
def test_ids_equal_qwen2_vl_get_rope_index(seed):
    cfg = tf.Qwen2VLConfig(text_config=TINY_TEXT, vision_config=dict(depth=1, embed_dim=16))
    model = q2.Qwen2VLModel(cfg)
    types, mask, images, videos = _sequences(seed)
    input_ids = torch.randint(2, 100, types.shape)
    theirs, their_deltas = model.get_rope_index(
        input_ids, types, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask
    )
    ours, deltas = mrope_position_ids(types, images, videos, attention_mask=mask)
    assert torch.equal(ours, theirs)
    assert torch.equal(deltas, their_deltas)


@pytest.mark.parametrize("seed", range(4))
def test_ids_equal_qwen2_5_vl_with_video_time_intervals(seed):
    cfg = tf.Qwen2_5_VLConfig(
        text_config=TINY_TEXT, vision_config=dict(depth=1, hidden_size=16, tokens_per_second=2)
    )
    model = q25.Qwen2_5_VLModel(cfg)
    types, mask, images, videos = _sequences(100 + seed)
    n_videos = 0 if videos is None else len(videos)
    seconds = torch.tensor([0.5, 1.0, 1.5, 2.0, 0.25, 3.0, 0.75][:n_videos] * 4)[:n_videos]
    input_ids = torch.randint(2, 100, types.shape)
    theirs, their_deltas = model.get_rope_index(
        input_ids,
        types,
        image_grid_thw=images,
        video_grid_thw=videos,
        second_per_grid_ts=seconds if n_videos else None,
        attention_mask=mask,
    )
    ours, deltas = mrope_position_ids(
        types, images, videos, attention_mask=mask, video_intervals=(2 * seconds).tolist()
    )
    assert torch.equal(ours, theirs)
    assert torch.equal(deltas, their_deltas)


def test_text_only_ids_are_plain_positions():
    ids, deltas = mrope_position_ids(torch.zeros(2, 7, dtype=torch.long))
    assert torch.equal(ids, torch.arange(7).expand(3, 2, 7))
    assert deltas.tolist() == [[0], [0]]


def test_an_image_then_text_continues_after_the_longest_side():
    # 1 text token, an image of 4×6 LLM tokens (8×12 patches), then 2 text tokens
    types = torch.tensor([[TEXT] + [IMAGE] * 24 + [TEXT] * 2])
    ids, deltas = mrope_position_ids(types, torch.tensor([[1, 8, 12]]))
    t, h, w = ids[:, 0]
    assert t[1:25].unique().tolist() == [1]
    assert h[1:25].view(4, 6)[:, 0].tolist() == [1, 2, 3, 4]
    assert w[1:25].view(4, 6)[0].tolist() == [1, 2, 3, 4, 5, 6]
    assert ids[:, 0, 25:].tolist() == [[7, 8]] * 3  # 1 + max(4, 6)
    assert deltas.item() == 8 + 1 - 27


def _their_rotary(head_dim, sections, cls):
    config = tf.Qwen2VLTextConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections},
    )
    return cls(config)


@pytest.mark.parametrize(
    "head_dim,sections", [(128, [16, 24, 24]), (64, [8, 12, 12]), (32, [4, 6, 6])]
)
def test_rotation_equals_qwen2_vl(head_dim, sections):
    types, mask, images, videos = _sequences(7, batch=2)
    ids, _ = mrope_position_ids(types, images, videos, attention_mask=mask)
    rotary = _their_rotary(head_dim, sections, q2.Qwen2VLRotaryEmbedding)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, types.shape[1], head_dim, generator=g)
    k = torch.randn(2, 1, types.shape[1], head_dim, generator=g)
    cos_t, sin_t = rotary(q, ids)
    q_t, k_t = q2.apply_rotary_pos_emb(q, k, cos_t, sin_t)
    cos, sin = mrope_cos_sin(ids, head_dim, sections=sections)
    torch.testing.assert_close(cos, cos_t, rtol=0, atol=0)
    torch.testing.assert_close(sin, sin_t, rtol=0, atol=0)
    torch.testing.assert_close(apply_rotary(q, cos, sin), q_t, rtol=1.3e-6, atol=1e-6)
    torch.testing.assert_close(apply_rotary(k, cos, sin), k_t, rtol=1.3e-6, atol=1e-6)


def test_interleaved_layout_equals_qwen3_vl():
    q3 = pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
    config = tf.Qwen3VLTextConfig(
        hidden_size=256,
        num_attention_heads=2,
        head_dim=128,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20]},
    )
    rotary = q3.Qwen3VLTextRotaryEmbedding(config)
    types, mask, images, videos = _sequences(3, batch=2)
    ids, _ = mrope_position_ids(types, images, videos, attention_mask=mask)
    x = torch.randn(2, 2, types.shape[1], 128)
    cos_t, sin_t = rotary(x, ids)
    cos, sin = mrope_cos_sin(ids, 128, base=5e6, sections=[24, 20, 20], interleaved=True)
    torch.testing.assert_close(cos, cos_t, rtol=0, atol=0)
    torch.testing.assert_close(sin, sin_t, rtol=0, atol=0)


def test_frequency_axes_of_both_layouts():
    assert frequency_axes(12, [2, 2, 2], False).tolist() == [0, 0, 1, 1, 2, 2]
    assert frequency_axes(12, [2, 2, 2], True).tolist() == [0, 1, 2, 0, 1, 2]
    assert frequency_axes(16, [4, 2, 2], True).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]


def test_rotation_keeps_relative_positions_on_each_axis():
    # RoPE's defining property, per axis: q·k depends on the difference of the positions
    D, sections = 24, [4, 4, 4]
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(D, generator=g), torch.randn(D, generator=g)

    def score(pq, pk):
        ids = torch.tensor([pq, pk]).T.reshape(3, 1, 2)
        cos, sin = mrope_cos_sin(ids, D, sections=sections)
        x = torch.stack([q, k]).view(1, 1, 2, D)
        r = apply_rotary(x, cos, sin)[0, 0]
        return float(r[0] @ r[1])

    assert score([3, 5, 7], [1, 2, 3]) == pytest.approx(score([13, 15, 17], [11, 12, 13]), abs=1e-4)
    assert score([3, 5, 7], [1, 2, 3]) != pytest.approx(score([3, 5, 7], [1, 3, 3]), abs=1e-3)


@pytest.mark.parametrize("merge", [1, 2])
def test_vision_position_ids_equal_transformers(merge):
    from transformers.vision_utils import get_vision_position_ids

    grid = torch.tensor([[1, 4, 6], [2, 6, 2], [3, 2, 4]])
    assert torch.equal(vision_position_ids(grid, merge), get_vision_position_ids(grid, merge))


@pytest.mark.parametrize("head_dim", [16, 80])
def test_2d_rope_equals_the_qwen2_vl_encoder(head_dim):
    config = tf.Qwen2VLConfig().vision_config.__class__(
        embed_dim=head_dim * 2, num_heads=2, spatial_merge_size=2
    )
    rotary = q2.Qwen2VLVisionRotaryEmbedding(config)
    grid = torch.tensor([[1, 6, 8], [2, 4, 4]])
    pos = vision_position_ids(grid, 2)
    n = pos.shape[0]
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(n, 2, head_dim, generator=g), torch.randn(n, 2, head_dim, generator=g)
    cos_t, sin_t = rotary(q, pos)  # (N, 2), as the encoder passes them
    cos, sin = vision_cos_sin(pos, head_dim)
    torch.testing.assert_close(cos, cos_t, rtol=0, atol=0)
    q_t, k_t = q2.apply_rotary_pos_emb_vision(q, k, cos_t, sin_t)
    torch.testing.assert_close(apply_rotary(q, cos, sin, dim=-2), q_t, rtol=0, atol=0)
    torch.testing.assert_close(apply_rotary(k, cos, sin, dim=-2), k_t, rtol=0, atol=0)


def test_plain_vit_grid_is_row_major():
    pos = vision_position_ids([(1, 2, 3)])
    assert pos.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]


def test_videos_count_in_order_across_the_batch():
    types = torch.tensor([[TEXT, VIDEO, VIDEO, TEXT], [TEXT, VIDEO, VIDEO, TEXT]])
    ids, _ = mrope_position_ids(types, video_grid_thw=[(2, 2, 2), (1, 2, 4)])
    assert ids[0, 0, 1:3].tolist() == [1, 2]  # two frames of one token each: t = 1, 2
    assert ids[2, 1, 1:3].tolist() == [1, 2]  # one frame of two tokens: w = 1, 2
