"""Which tokens of a model's text are words: special tokens ([CLS], [SEP], <s>) are not; the
unknown token a vocabulary uses for what it cannot spell is."""

from __future__ import annotations

UNKNOWN = ("[UNK]", "<unk>")  # the token a vocabulary uses for what it cannot spell


def is_special(token: str) -> bool:
    """[CLS], [SEP], <s>, ...: not words of the text. The unknown token is a word of the text."""
    if token.startswith(UNKNOWN):
        return False
    return (token.startswith("[") and token.endswith("]")) or token in ("<s>", "</s>")
