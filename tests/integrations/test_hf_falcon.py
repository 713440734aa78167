"""Falcon forced onto "qkv" (`config._attn_implementation = "qkv"` on a model built as eager):
with ALiBi, Falcon adds its position bias onto the mask it asked to have materialised and
passes the float sum to the attention function. qkv's mask function hands it a dense mask
there (it raised "'Mask' object has no attribute 'dtype'" inside the model before), and the
result is eager's, by the error-ratio rule against eager in float64."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="needs: pip install -e '.[hf]'")

from qkv.integrations import hf  # noqa: E402

from ..helpers import assert_error_ratio  # noqa: E402

hf.register()


def _falcon(alibi: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.FalconConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=alibi,
        new_decoder_architecture=False,
    )  # fmt: skip
    return transformers.FalconForCausalLM(config).eval()


def _logits(model, impl: str, dtype: torch.dtype, inputs: dict) -> torch.Tensor:
    model = model.to(dtype)
    model.config._attn_implementation = impl  # forced: Falcon picks its classes by name
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("alibi", [True, False])
def test_falcon_forced_onto_qkv_matches_eager(alibi):
    model = _falcon(alibi)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    padding = torch.ones_like(ids)
    padding[1, :3] = 0  # a left-padded row
    inputs = {"input_ids": ids, "attention_mask": padding}
    got = _logits(model, "qkv", torch.float32, inputs)
    ref = _logits(model, "eager", torch.float32, inputs)
    gold = _logits(model, "eager", torch.float64, inputs)
    real = padding.bool()  # the padded positions' logits are not compared
    assert_error_ratio(got[real], ref[real], gold[real], what=f"Falcon alibi={alibi}")
