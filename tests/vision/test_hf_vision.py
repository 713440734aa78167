"""The drop-in vision attention on tiny random Qwen2-VL / Qwen2.5-VL towers, against "eager"."""

from __future__ import annotations

import copy

import pytest
import torch

from qkv.integrations.hf_vision import PackedVisionAttention, use_packed_vision_attention

from ..helpers import assert_error_ratio

tf = pytest.importorskip("transformers")
q2 = pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")
q25 = pytest.importorskip("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")

# images of different sizes (patch grids), a two-frame video, windows cut at the edges
GRID = torch.tensor([[1, 6, 10], [2, 4, 4], [1, 8, 8], [1, 2, 14]])


def _qwen2_vl():
    config = tf.Qwen2VLConfig().vision_config.__class__(
        depth=2, embed_dim=32, hidden_size=24, num_heads=4, mlp_ratio=2
    )
    return q2.Qwen2VisionTransformerPretrainedModel._from_config(
        config, attn_implementation="eager"
    )


def _qwen2_5_vl():
    config = tf.Qwen2_5_VLConfig().vision_config.__class__(
        depth=3,
        hidden_size=32,
        out_hidden_size=24,
        intermediate_size=48,
        num_heads=4,
        fullatt_block_indexes=[1],
        window_size=56,  # 4×4 patches: several windows per image
    )
    return q25.Qwen2_5_VisionTransformerPretrainedModel._from_config(
        config, attn_implementation="eager"
    )


TOWERS = {"qwen2-vl": _qwen2_vl, "qwen2.5-vl": _qwen2_5_vl}


def _run(model, x):
    out = model(x, grid_thw=GRID).pooler_output
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    params = [p for _, p in sorted(model.named_parameters())]
    grads = torch.autograd.grad(out, [x, *params], dout)
    return out, grads


@pytest.mark.parametrize("tower", list(TOWERS))
@pytest.mark.parametrize("layout", ["auto", "padded", "varlen"])
def test_tower_equals_eager_forward_and_backward(tower, layout):
    torch.manual_seed(0)
    eager = TOWERS[tower]()
    ours = copy.deepcopy(eager)
    n = use_packed_vision_attention(ours, layout=layout)
    assert n == len(eager.blocks)
    assert all(isinstance(b.attn, PackedVisionAttention) for b in ours.blocks)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(int(GRID.prod(-1).sum()), 3 * 2 * 14 * 14, generator=g)

    gold = _run(copy.deepcopy(eager).double(), x.double().requires_grad_())
    ref = _run(eager, x.clone().requires_grad_())
    got = _run(ours, x.clone().requires_grad_())
    assert_error_ratio(got[0], ref[0], gold[0], what="pooler_output")
    for i, (a, r, gd) in enumerate(zip(got[1], ref[1], gold[1], strict=True)):
        assert_error_ratio(a, r, gd, factor=3.0, what=f"gradient {i}")


@pytest.mark.parametrize("tower", list(TOWERS))
def test_weights_and_state_dict_are_shared_not_copied(tower):
    model = TOWERS[tower]()
    before = model.state_dict()
    qkv_layer = model.blocks[0].attn.qkv
    use_packed_vision_attention(model)
    assert model.blocks[0].attn.qkv is qkv_layer  # the same layer object
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[key] is before[key] or torch.equal(after[key], before[key]) for key in after)


def test_only_the_vision_tower_of_a_full_model_changes():
    config = tf.Qwen2VLConfig(
        text_config=dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
            vocab_size=100,
            bos_token_id=0,
            eos_token_id=1,
        ),
        vision_config=dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2),
    )
    model = q2.Qwen2VLModel(config)
    text_before = [type(m) for m in model.language_model.modules()]
    assert use_packed_vision_attention(model) == 2
    assert [type(m) for m in model.language_model.modules()] == text_before
    assert model.config._attn_implementation == config._attn_implementation


def test_refuses_a_model_without_vision_attention():
    with pytest.raises(ValueError, match="has no vision attention module"):
        use_packed_vision_attention(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"must be a torch\.nn\.Module"):
        use_packed_vision_attention("model")
    with pytest.raises(ValueError, match="layout must be one of"):
        use_packed_vision_attention(_qwen2_vl(), layout="dense")


def test_the_module_on_its_own_matches_transformers_module():
    torch.manual_seed(0)
    config = tf.Qwen2VLConfig().vision_config.__class__(embed_dim=32, num_heads=4)
    theirs = q2.VisionAttention(config)
    theirs.config._attn_implementation = "eager"
    ours = PackedVisionAttention(32, 4)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(30, 32)
    cu = torch.tensor([0, 12, 30], dtype=torch.int32)
    cos, sin = torch.randn(30, 8).cos(), torch.randn(30, 8).sin()
    torch.testing.assert_close(ours(x, cu, (cos, sin)), theirs(x, cu, (cos, sin)))
    with pytest.raises(ValueError, match="must divide dim"):
        PackedVisionAttention(30, 4)
