"""The prepared GPU check, by its well-known path: `python benchmarks/gpu.py [options]` is
`python -m benchmarks.run gpu [options]` (correctness, speed and tile sweep of the triton
backend on a CUDA machine; `--dry-run` lists what it would run, anywhere)."""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.run import main

    sys.exit(main(["gpu", *sys.argv[1:]]))
