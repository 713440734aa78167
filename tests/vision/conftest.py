"""transformers' processors and models, built offline from their classes (no Hub)."""

from __future__ import annotations

import pytest


def _tokenizer(specials: list[str]):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "hi": 1, **{s: i + 2 for i, s in enumerate(specials)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, unk_token="[UNK]", additional_special_tokens=specials
    )


@pytest.fixture(scope="session")
def qwen_image_processor():
    """Qwen2-VL's image processor with its defaults (the PIL backend: no torchvision needed)."""
    pytest.importorskip("PIL")
    mod = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    return mod.Qwen2VLImageProcessorPil


@pytest.fixture(scope="session")
def llava_processor():
    """llava-v1.6's processor: 336-pixel crops, patch 14, the default grid pinpoints, the
    "default" feature strategy with one CLS token."""
    pytest.importorskip("PIL")
    ip = pytest.importorskip("transformers.models.llava_next.image_processing_pil_llava_next")
    pr = pytest.importorskip("transformers.models.llava_next.processing_llava_next")

    def make(strategy: str = "default"):
        image_processor = ip.LlavaNextImageProcessorPil(
            size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}
        )
        return pr.LlavaNextProcessor(
            image_processor=image_processor,
            tokenizer=_tokenizer(["<image>"]),
            patch_size=14,
            vision_feature_select_strategy=strategy,
            num_additional_image_tokens=1,
        )

    return make
