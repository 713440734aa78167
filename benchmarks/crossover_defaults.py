"""Write qkv's default crossovers (`src/qkv/kernels/cpu/crossovers_default.json`) by running
`qkv tune` once per instruction-set path of the compiled kernel on this machine.

    python -m benchmarks.crossover_defaults            # every path this CPU has but amx
    python -m benchmarks.crossover_defaults --paths avx2 portable   # replace only these

Each path is tuned in a fresh process with `QKV_CPU_ISA` forcing the kernel's path and
`ATEN_CPU_CAPABILITY` giving torch's own kernels (SDPA) the same instruction set, so the avx2
table compares the two as an AVX2-only CPU would run them. The other paths' tables in the file
are kept. Run it on a quiet machine: every ratio is a race between the two backends.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = ROOT / "src" / "qkv" / "kernels" / "cpu" / "crossovers_default.json"
ATEN = {"avx512": "avx512", "avx2": "avx2", "portable": "default"}
NOTE = (
    "qkv's default crossovers between its compiled CPU kernel and torch SDPA, per kernel path: "
    "written by `python -m benchmarks.crossover_defaults` (one `qkv tune` per path); "
    "`qkv tune` measures a machine's own."
)


def tune(isa: str) -> dict:
    """One path's table, measured by `qkv tune` in a fresh process with its own cache file."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "crossovers.json"
        code = (
            "import sys; from pathlib import Path; from qkv import tune; "
            "from qkv.kernels.cpu import crossover; "
            f"crossover.calibrated_path = lambda: Path({str(out)!r}); "
            "tune.save(tune.measure(progress=lambda s: print(s, file=sys.stderr)))"
        )
        env = dict(os.environ, QKV_CPU_ISA=isa, ATEN_CPU_CAPABILITY=ATEN[isa])
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        return json.loads(out.read_text())["paths"][isa]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", nargs="+", choices=sorted(ATEN), default=sorted(ATEN))
    args = ap.parse_args(argv)
    data = json.loads(DEFAULTS.read_text()) if DEFAULTS.exists() else {}
    paths = data.get("paths", {})
    for isa in args.paths:
        print(f"== {isa}", file=sys.stderr)
        paths[isa] = tune(isa)
    DEFAULTS.write_text(json.dumps({"note": NOTE, "paths": paths}, indent=1) + "\n")
    print(f"wrote {DEFAULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
