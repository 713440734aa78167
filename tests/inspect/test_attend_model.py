"""`qkv attend --model FOLDER`: any local transformers encoder, a Chinese-capable one included."""

from __future__ import annotations

import pytest

from qkv.cli import main

CHINESE = "猫坐在垫子上，因为它累了"


@pytest.fixture(scope="module")
def chinese_bert(tmp_path_factory):
    """A tiny BERT whose vocabulary spells every character of `CHINESE` (random weights)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("tiny-chinese-bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(CHINESE), "the", "cat"]
    tok = transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_a_chinese_capable_model_reads_every_character(chinese_bert, capsys, tmp_path):
    out = tmp_path / "out"
    code = main([
        "attend", CHINESE, "--token", "它", "--model", str(chinese_bert), "--out", str(out),
        "--lang", "zh",
    ])  # fmt: skip
    assert code == 0
    said = capsys.readouterr().out
    assert said.startswith(f"{chinese_bert.name}（2 层 × 4 个头）处理的文本：{CHINESE}")
    assert "“它”（编号 10 的词）看向哪里？" in said and "[UNK]" not in said
    assert (out / "viewer.html").stat().st_size > 0


def test_the_models_weights_are_what_transformers_gives(chinese_bert):
    import torch
    import transformers

    from qkv.inspect.attend import load_encoder, model_attention

    model, tok, name = load_encoder(str(chinese_bert))
    amap = model_attention(CHINESE, model, tok, name)
    assert amap.layers == 2 and amap.heads == 4 and name == chinese_bert.name
    assert "[UNK]" not in " ".join(amap.words) and "猫" in amap.words
    eager = transformers.AutoModel.from_pretrained(chinese_bert, attn_implementation="eager")
    with torch.no_grad():
        gold = eager(**tok(CHINESE, return_tensors="pt"), output_attentions=True).attentions
    gold = torch.stack([a[0] for a in gold]).double()  # (L, H, N, N); one character per word
    err = (amap.weights.double() - gold).abs().max().item()
    assert err < 1e-5, err  # fp32 weights of two backends, each row summing to 1


@pytest.mark.parametrize(
    "make,why",
    [
        (lambda p: p / "nothing-here", "no such folder"),
        (lambda p: p, ""),  # an empty folder
    ],
)
def test_a_folder_that_is_not_a_model_is_one_line(make, why, tmp_path, capsys):
    pytest.importorskip("transformers")
    folder = make(tmp_path)
    assert main(["attend", "the cat", "--model", str(folder), "--no-files"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"qkv attend: error: {str(folder)!r} is not a transformers model folder")
    assert why in err and "\n" not in err
