"""What a learner types first: `--word` for the word, `| head` on a long answer."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qkv.cli import main


@pytest.mark.slow
def test_a_closed_pipe_ends_the_command_quietly_with_code_0():
    """`qkv explain | head -1`: the reader leaves after one line; no "Broken pipe", code 0."""
    script = (
        "import sys, _qkv_entry; sys.argv = ['qkv', 'explain', '--dk', '64', '--full'];"
        " sys.exit(_qkv_entry.main())"
    )
    for _ in range(3):  # the pipe can close before or after the last write: both are quiet
        proc = subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        first = proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 0, err
        assert first.startswith(b"Self-attention") and err == ""


def test_word_is_the_same_flag_as_token(minilm, capsys):
    assert main(["attend", "--word", "it", "--no-files"]) == 0
    by_word = capsys.readouterr().out
    assert main(["attend", "--token", "it", "--no-files"]) == 0
    assert by_word == capsys.readouterr().out and 'Where does "it"' in by_word


def test_target_names_the_head_specific_to_the_pair(minilm, cat_map, capsys):
    from qkv.inspect.specific import specific_head

    assert main(["attend", "--word", "it", "--target", "cat", "--no-files"]) == 0
    best = specific_head(cat_map, "it", "cat")
    out = capsys.readouterr().out
    assert 'Which head links "it" to "cat"?' in out
    assert f'layer {best.layer} head {best.head}: "it" → "cat" {best.weight:.3f}' in out
