"""The `qkv` command: explain prints the reference numbers; bad input exits non-zero cleanly."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qkv.cli import main
from qkv.inspect import walkthrough


def test_explain_prints_the_reference_matrices(capsys):
    assert main(["explain", "--n", "3", "--d", "5", "--dk", "2", "--seed", "7"]) == 0
    text = capsys.readouterr().out
    w = walkthrough(n=3, d=5, d_k=2, seed=7)
    a = w.A.tolist()
    assert f"{a[1][0]:8.3f}" in text and "shape (3, 3)" in text
    torch.testing.assert_close(w.A.sum(-1), torch.ones(3, dtype=torch.float64))


def test_explain_in_chinese_and_causal(capsys):
    assert main(["explain", "--lang", "zh", "--causal"]) == 0
    text = capsys.readouterr().out
    assert "因果掩码" in text and "-inf" in text


@pytest.mark.parametrize(
    "argv,message",
    [
        (["explain", "--n", "0"], "expected a positive integer, got 0"),
        (["explain", "--dk", "x"], "expected a positive integer, got 'x'"),
        (["explain", "--lang", "fr"], "invalid choice: 'fr'"),
        ([], "the following arguments are required: command"),
    ],
)
def test_bad_input_is_a_clear_message_and_exit_code(argv, message):
    res = subprocess.run(
        [sys.executable, "-m", "qkv.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2
    assert message in res.stderr and "Traceback" not in res.stderr
