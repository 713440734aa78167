"""`python -m qkv` is the `qkv` command (`python -m qkv demo`, `python -m qkv explain`, ...)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
