"""Runnable examples: `python -m qkv.examples.<name> --help`."""
