"""qkv's benchmarks: one runner, one reporter, and a declaration per suite (`benchmarks.suites`).

Run a suite from the repository root with `python -m benchmarks.run <suite>`; see
benchmarks/README.md for the layout and how to add a suite.
"""
