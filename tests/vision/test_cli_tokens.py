"""`qkv tokens`: its numbers, its files, its exit codes, and the docs page that shows its output."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from qkv.cli import main
from qkv.vision import attention_cost, image_tokens, token_count, window_lengths

DOCS = Path(__file__).resolve().parents[2] / "docs" / "vision.md"


def test_prints_the_counts_grids_and_costs(capsys):
    assert main(["tokens", "--image", "1344x1344"]) == 0
    text = capsys.readouterr().out
    assert f"tokens: {token_count('qwen2-vl', 1344, 1344)}  (+2 special" in text
    assert "resized to 980×980: 70×70 patches of 14 px, 2×2 merge → 35×35 grid" in text
    ll = image_tokens("llava-next", 1344, 1344)
    assert f"tokens: {ll.tokens} = 2304 unpadded features (48×48) + 48 newlines" in text
    dense = attention_cost([70 * 70], 16, 80)
    windowed = attention_cost(window_lengths((70, 70)), 16, 80)
    assert re.search(rf"encoder, dense \(Qwen2-VL\)\s+4900\s+{dense.flops / 1e9:.2f} GFLOP", text)
    assert re.search(
        rf"112-px windows \(Qwen2.5-VL\)\s+4900\s+{windowed.flops / 1e9:.2f} GFLOP", text
    )


def test_model_and_pixel_options(capsys):
    assert (
        main(["tokens", "--image", "1344×1344", "--model", "qwen2-vl", "--max-pixels", "12845056"])
        == 0
    )
    text = capsys.readouterr().out
    assert "tokens: 2304" in text and "llava-next" not in text


def test_an_image_file_is_read_with_pillow(tmp_path, capsys):
    pil = pytest.importorskip("PIL.Image")
    path = tmp_path / "photo.png"
    pil.new("RGB", (640, 480)).save(path)
    assert main(["tokens", "--image", str(path), "--model", "llava-next"]) == 0
    text = capsys.readouterr().out
    assert "image 640×480" in text and f"tokens: {token_count('llava-next', 640, 480)} =" in text


def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "tokens.png"
    assert main(["tokens", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {out}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["tokens"], "give --image WIDTHxHEIGHT (or an image file), --plot, or both"),
        (["tokens", "--image", "big"], "--image expects WIDTHxHEIGHT such as 1344x1344"),
        (["tokens", "--image", "0x10"], "width must be a positive number of pixels, got width=0"),
        (["tokens", "--image", "10x3000"], "absolute aspect ratio must be at most 200"),
        (["tokens", "--image", "9x9", "--model", "gpt"], "invalid choice: 'gpt'"),
        (
            ["tokens", "--image", "9x9", "--max-pixels", "10"],
            "min_pixels=3136 must be ≤ max_pixels=10",
        ),
    ],
)
def test_bad_input_is_a_clear_message_and_exit_code(argv, message):
    res = subprocess.run(
        [sys.executable, "-m", "qkv.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2
    assert message in res.stderr and "Traceback" not in res.stderr


def _blocks(text: str) -> dict[str, str]:
    """Code blocks of the docs page that follow a `$ qkv tokens ...` line: command → output."""
    return {
        m["cmd"]: m["out"]
        for m in re.finditer(r"```text\n\$ (?P<cmd>qkv tokens[^\n]*)\n(?P<out>.*?)```", text, re.S)
    }


def test_the_docs_page_shows_the_commands_current_output(capsys):
    blocks = _blocks(DOCS.read_text(encoding="utf-8"))
    assert blocks, "docs/vision.md has no `$ qkv tokens` example"
    for cmd, shown in blocks.items():
        assert main(cmd.split()[1:]) == 0
        assert capsys.readouterr().out == shown, f"docs/vision.md is stale for `{cmd}`"
