"""The suites: one module each, defining `SUITE` (see benchmarks/README.md)."""
