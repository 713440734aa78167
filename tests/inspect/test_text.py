"""Padding by display width: Chinese takes two terminal columns a character."""

from __future__ import annotations

from qkv.inspect.text import columns, ljust, rjust, row


def test_wide_characters_take_two_columns():
    assert columns("attention") == 9
    assert columns("注意力") == 6
    assert columns("串行步数 LSTM/注意力") == 20
    assert columns("é") == 1 and columns("e\u0301") == 1  # a combining accent takes none


def test_padding_counts_columns_not_characters():
    assert rjust("注意力", 8) == "  注意力" and columns(rjust("注意力", 8)) == 8
    assert ljust("本例", 6) == "本例  "
    assert rjust("toolong", 3) == "toolong"  # never cut
    line = row(("N", "注意力", 4096), (6, 10, 6))
    assert columns(line) == 2 + 6 + 1 + 10 + 1 + 6
