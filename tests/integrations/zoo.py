"""The transformers families qkv is tested on: tiny random models and a batch for each.

Every model has 2 layers, hidden sizes of 32-64, a vocabulary of 97 and sequences of at most 16
tokens, so that the whole zoo runs in seconds. Decoders get a left-padded batch (as generate()
pads), encoders a right-padded one; sliding-window families get a window of 4 (shorter than
every prompt, so the window binds in the forward, in the cache and in generate()).

`Family.pick(output, inputs)` returns the tensors compared with eager, at real (not padded)
positions; `real(inputs)` marks those positions. Attention weights are compared on the rows of
real tokens too: a padding token's row may see no key at all (in a left-padded decoder, or
beyond a sliding window), and there eager spreads the row uniformly while qkv gives it zeros.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers

from .hf_helpers import build, padded_ids

V, N, WINDOW = 97, 12, 4  # vocabulary, sequence length, sliding window
LENGTHS = [N, N - 4]  # two sequences: one full, one with 4 padding tokens


@dataclass(frozen=True)
class Family:
    """A model family of the zoo."""

    name: str
    make: Callable[[], torch.nn.Module]  # the tiny model, with random weights
    inputs: Callable[[], dict]  # forward() keyword arguments: a padded batch where possible
    pick: Callable[[object, dict], tuple[torch.Tensor, ...]]  # what is compared with eager
    generates: bool = False  # a generative model: generate() is tested too

    def model(self) -> torch.nn.Module:
        """The family's model, built once (callers copy it before changing it)."""
        return _model(self.name)


@functools.cache
def _model(name: str) -> torch.nn.Module:
    return FAMILIES[name].make()


def _text(side: str) -> Callable[[], dict]:
    def inputs() -> dict:
        ids, am = padded_ids(V, LENGTHS, N, side=side)
        return {"input_ids": ids, "attention_mask": am}

    return inputs


def real(inputs: dict) -> torch.Tensor | None:
    """`(B, N)` True at real tokens of the padded sequence, or None for unpadded inputs."""
    mask = inputs.get("attention_mask")
    return None if mask is None else mask.bool()


def _logits(out, inputs):
    return (out.logits[real(inputs)],)


def _hidden(out, inputs):
    return (out.last_hidden_state[real(inputs)],)


def _decoder(name: str, cls, config_cls, experts: bool = False, **kw) -> Family:
    base = dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )

    def make():
        config = config_cls(**{**base, **kw})
        if experts:
            config._experts_implementation = "eager"  # grouped_mm has no float64
        return build(cls, config)

    return Family(name, make, _text("left"), _logits, generates=True)


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=V, n_positions=64, n_embd=48, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2
    )
    return build(transformers.GPT2LMHeadModel, config)


def _gpt_neox() -> torch.nn.Module:
    config = transformers.GPTNeoXConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    return build(transformers.GPTNeoXForCausalLM, config)


def _opt() -> torch.nn.Module:
    config = transformers.OPTConfig(
        vocab_size=V,
        hidden_size=48,
        ffn_dim=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=48,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return build(transformers.OPTForCausalLM, config)


def _gpt_oss() -> torch.nn.Module:
    config = transformers.GptOssConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=WINDOW,
        max_position_embeddings=4096,  # = YaRN's original length, so it does not warn
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config._experts_implementation = "eager"  # grouped_mm has no float64
    model = build(transformers.GptOssForCausalLM, config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)  # initialised to zero otherwise
    return model


def _bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=V,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
    )
    return build(transformers.BertModel, config)


def _modernbert() -> torch.nn.Module:
    config = transformers.ModernBertConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        local_attention=WINDOW,  # layer 1 is local (a bidirectional sliding window)
        global_attn_every_n_layers=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )
    return build(transformers.ModernBertModel, config)


_SEQ2SEQ = dict(vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _t5() -> torch.nn.Module:
    config = transformers.T5Config(
        **_SEQ2SEQ,
        d_model=48,
        d_kv=12,
        d_ff=96,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
    )
    return build(transformers.T5ForConditionalGeneration, config)


def _bart() -> torch.nn.Module:
    config = transformers.BartConfig(
        **_SEQ2SEQ,
        d_model=48,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=96,
        decoder_ffn_dim=96,
        max_position_embeddings=64,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    return build(transformers.BartForConditionalGeneration, config)


def _seq2seq_inputs() -> dict:
    ids, am = padded_ids(V, LENGTHS, N, side="right")
    decoder = padded_ids(V, [6, 6], 6, seed=2)[0]
    return {"input_ids": ids, "attention_mask": am, "decoder_input_ids": decoder}


def _seq2seq_pick(out, inputs):
    return (out.logits, out.encoder_last_hidden_state[real(inputs)])


MELS, FRAMES = 8, 16  # Whisper: mel bins, input frames (2 × max_source_positions)


def _whisper() -> torch.nn.Module:
    config = transformers.WhisperConfig(
        **_SEQ2SEQ,
        num_mel_bins=MELS,
        d_model=48,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=96,
        decoder_ffn_dim=96,
        max_source_positions=FRAMES // 2,
        max_target_positions=32,
        decoder_start_token_id=1,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    return build(transformers.WhisperForConditionalGeneration, config)


def _whisper_inputs() -> dict:
    g = torch.Generator().manual_seed(3)
    features = torch.randn(2, MELS, FRAMES, generator=g)
    decoder = padded_ids(V, [5, 5], 5, seed=2)[0]
    return {"input_features": features, "decoder_input_ids": decoder}


def _whisper_pick(out, inputs):
    return (out.logits, out.encoder_last_hidden_state)


IMAGE, PATCH = 16, 4  # vision: image side, patch side → 16 patches


def _pixels() -> dict:
    g = torch.Generator().manual_seed(4)
    return {"pixel_values": torch.randn(2, 3, IMAGE, IMAGE, generator=g)}


_VISION = dict(
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=IMAGE,
    patch_size=PATCH,
    num_channels=3,
)


def _vit() -> torch.nn.Module:
    return build(transformers.ViTModel, transformers.ViTConfig(**_VISION))


def _vision_pick(out, inputs):
    return (out.last_hidden_state,)


def _text_config(**kw) -> dict:
    return dict(
        vocab_size=V,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        **kw,
    )


def _clip() -> torch.nn.Module:
    config = transformers.CLIPConfig(
        text_config=_text_config(pad_token_id=0, bos_token_id=1, eos_token_id=2),
        vision_config=_VISION,
        projection_dim=32,
    )
    return build(transformers.CLIPModel, config)


def _siglip() -> torch.nn.Module:
    config = transformers.SiglipConfig(text_config=_text_config(), vision_config=_VISION)
    return build(transformers.SiglipModel, config)


def _pair_inputs(side: str) -> Callable[[], dict]:
    def inputs() -> dict:
        return {**_text(side)(), **_pixels()}

    return inputs


def _pair_pick(out, inputs):
    text = out.text_model_output.last_hidden_state[real(inputs)]
    return (text, out.vision_model_output.last_hidden_state, out.logits_per_image)


QWEN_PATCH, QWEN_GRID = 4, (1, 4, 4)  # Qwen2-VL vision: 2 images of 1 × 4 × 4 patches


def _qwen2_vl_vision() -> torch.nn.Module:
    config = transformers.Qwen2VLVisionConfig(
        depth=2,
        embed_dim=32,
        hidden_size=48,
        num_heads=4,
        in_channels=3,
        patch_size=QWEN_PATCH,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    return build(modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel, config)


def _qwen2_vl_vision_inputs() -> dict:
    g = torch.Generator().manual_seed(5)
    t, h, w = QWEN_GRID
    patches = torch.randn(2 * t * h * w, 3 * 2 * QWEN_PATCH * QWEN_PATCH, generator=g)
    return {"hidden_states": patches, "grid_thw": torch.tensor([QWEN_GRID, QWEN_GRID])}


def _qwen2_vl_vision_pick(out, inputs):
    return (out.last_hidden_state, out.pooler_output)


_T = transformers
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("bert", _bert, _text("right"), _hidden),
        Family("modernbert", _modernbert, _text("right"), _hidden),
        Family("gpt2", _gpt2, _text("left"), _logits, generates=True),
        Family("gpt-neox", _gpt_neox, _text("left"), _logits, generates=True),
        _decoder("llama", _T.LlamaForCausalLM, _T.LlamaConfig),
        _decoder("mistral", _T.MistralForCausalLM, _T.MistralConfig, sliding_window=WINDOW),
        _decoder(
            "mixtral",
            _T.MixtralForCausalLM,
            _T.MixtralConfig,
            experts=True,
            sliding_window=WINDOW,
            num_local_experts=2,
            num_experts_per_tok=1,
        ),
        _decoder("phi3", _T.Phi3ForCausalLM, _T.Phi3Config, sliding_window=WINDOW),
        _decoder(
            "qwen2",
            _T.Qwen2ForCausalLM,
            _T.Qwen2Config,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,  # layer 0 full, layer 1 sliding
        ),
        _decoder("qwen3", _T.Qwen3ForCausalLM, _T.Qwen3Config, head_dim=16),
        _decoder("gemma", _T.GemmaForCausalLM, _T.GemmaConfig, head_dim=16),
        _decoder(
            "gemma2",
            _T.Gemma2ForCausalLM,
            _T.Gemma2Config,
            head_dim=16,
            sliding_window=WINDOW,
            attn_logit_softcapping=1.5,
        ),
        _decoder(
            "gemma3",
            _T.Gemma3ForCausalLM,
            _T.Gemma3TextConfig,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
        Family("gpt-oss", _gpt_oss, _text("left"), _logits, generates=True),
        Family("opt", _opt, _text("left"), _logits, generates=True),
        Family("t5", _t5, _seq2seq_inputs, _seq2seq_pick, generates=True),
        Family("bart", _bart, _seq2seq_inputs, _seq2seq_pick, generates=True),
        Family("whisper", _whisper, _whisper_inputs, _whisper_pick, generates=True),
        Family("vit", _vit, _pixels, _vision_pick),
        Family("clip", _clip, _pair_inputs("right"), _pair_pick),
        Family("siglip", _siglip, _pair_inputs("right"), _pair_pick),
        Family("qwen2-vl-vision", _qwen2_vl_vision, _qwen2_vl_vision_inputs, _qwen2_vl_vision_pick),
    ]
}
