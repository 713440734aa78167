"""The one rule for a seed: an integer in 0..2**64 − 1, what `torch.Generator.manual_seed` takes.
A lab derives its runs' seeds as `seed · 1000 + …` (and offsets of a few million), so a lab's
seed stays in 0..2**32 − 1, where those derived seeds are still in range."""

from __future__ import annotations

import argparse
from collections.abc import Callable

SEED_MAX = 2**64 - 1
LAB_SEED_MAX = 2**32 - 1


def seed_arg(limit: int = SEED_MAX) -> Callable[[str], int]:
    """An argparse `type`: the text as an integer seed in 0..limit (limit + 1 a power of two),
    else a one-line error naming the range."""
    bits = (limit + 1).bit_length() - 1

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
        if not 0 <= value <= limit:
            raise argparse.ArgumentTypeError(f"the seed must be in 0..2**{bits}-1, got {value}")
        return value

    return parse
