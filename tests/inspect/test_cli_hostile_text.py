"""`qkv attend` on hostile text: a 300-letter word, bytes that are not UTF-8, a 300-character
`--out`, terminal escape sequences. Each is answered in one line or handled, before the model
runs where it can be."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qkv.cli import main
from qkv.inspect.outputs import NAME_MAX, SLUG_MAX, slug, terminal_safe


def test_a_long_word_names_its_pictures_by_a_bounded_slug():
    long = "a" * 300
    s = slug(long)
    assert len(s) <= SLUG_MAX and s.startswith("a" * 20) and s != slug("a" * 301)
    assert slug("it") == "it" and slug("猫") == "猫"
    assert slug("") and slug("!!") == "__"


@pytest.mark.slow
def test_a_long_word_writes_its_pictures(minilm, tmp_path, capsys):
    word = "b" * 300
    out = tmp_path / "out"
    assert main(["attend", f"The {word} sat", "--token", word, "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert len(names) == 4 and all(len(n) <= NAME_MAX for n in names), names


def test_a_too_long_out_is_refused_before_the_model_runs(tmp_path, capsys, monkeypatch):
    import qkv.inspect.attend as attend

    monkeypatch.setattr(attend, "model_attention", lambda *a, **k: pytest.fail("ran the model"))
    assert main(["attend", "--out", str(tmp_path / ("c" * 300))]) == 2
    err = capsys.readouterr().err
    assert "a name of 300 bytes" in err and f"at most {NAME_MAX}" in err
    assert err.count("\n") == 1


def test_bytes_that_are_not_utf8_are_one_line():
    """argv as a terminal in a UTF-8 locale passes an invalid byte: one line, exit 2."""
    env = {**os.environ, "LC_ALL": "C.UTF-8", "PYTHONUTF8": "1"}
    script = "import sys; from qkv.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable.encode(), b"-c", script.encode(), b"attend", b"x\xff", b"--no-files"],
        capture_output=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.decode().strip() == (
        "qkv: error: argument 2 is not valid UTF-8 text; give it in UTF-8"
    )


def test_escape_sequences_in_the_text_are_shown_escaped(minilm, capsys):
    title = "\x1b]0;pwned\x07"  # would retitle the terminal
    assert main(["attend", f"The cat {title} sat", "--token", "cat", "--no-files"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;pwned\\x07" in out
    assert terminal_safe("a\tb\nc\rd") == "a\tb\nc\\x0dd"
