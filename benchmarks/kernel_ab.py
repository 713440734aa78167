"""The compiled CPU kernel of two source trees, timed in alternating processes: does a change to
the kernel (its C++ or its Python) move its speed?

    python -m benchmarks.kernel_ab --base REV [--isa amx,avx512] [--rounds 3]

REV (a commit) is checked out into a temporary git worktree; each tree's kernel is built (once
per source hash, in the usual cache), then every round runs a fixed set of calls (dense and
causal N=4096 fp32/bf16 forward and forward + backward, a fp32/bf16 sliding window of 256 at
N=16384, decoding at Nk=32768) in a fresh process per tree and path, the trees' order reversed
every other round. Per call: the minimum of a few calls in a process, then the minimum over rounds;
printed as base ms, this tree's ms and their ratio (< 1: this tree is faster), with each tree's
range over the rounds, the width of the noise. Run it on a quiet machine.
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

CALLS = r"""
import json, time, torch, qkv
from qkv import masks
torch.manual_seed(0)
def best(fn, n):
    fn(); t = 1e9
    for _ in range(n):
        t0 = time.perf_counter(); fn(); t = min(t, time.perf_counter() - t0)
    return t * 1e3
out = {}
for dt in (torch.float32, torch.bfloat16):
    for causal in (False, True):
        name = f"{str(dt)[6:]} {'causal' if causal else 'dense'} N=4096"
        q, k, v = (torch.randn(1, 8, 4096, 64).to(dt) for _ in range(3))
        with torch.no_grad():
            fwd = lambda: qkv.attention(q, k, v, causal=causal, backend="cpu")
            out[name + " fwd"] = best(fwd, 3)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        def fwd_bwd():
            o = qkv.attention(*leaves, causal=causal, backend="cpu")
            o.backward(torch.ones_like(o))
        out[name + " fwd+bwd"] = best(fwd_bwd, 2)
window = masks.sliding_window(256)
for dt in (torch.float32, torch.bfloat16):
    q, k, v = (torch.randn(1, 8, 16384, 64).to(dt) for _ in range(3))
    with torch.no_grad():
        fwd = lambda: qkv.attention(q, k, v, mask=window, backend="cpu")
        out[f"{str(dt)[6:]} window 256 N=16384 fwd"] = best(fwd, 3)
q = torch.randn(1, 32, 1, 128)
k, v = (torch.randn(1, 8, 32768, 128) for _ in range(2))
with torch.no_grad():
    out["float32 decoding Nk=32768"] = best(lambda: qkv.attention(q, k, v, backend="cpu"), 15)
print(json.dumps(out))
"""


def run_tree(src: Path, isa: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src), "QKV_CPU_ISA": isa}
    proc = subprocess.run([sys.executable, "-c", CALLS], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"the calls failed in {src}:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build(src: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "qkv", "build", "--no-tune"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"building {src} failed:\n{proc.stdout[-1000:]}{proc.stderr[-2000:]}")


def report(times: dict[tuple[str, str], dict[str, list[float]]]) -> list[str]:
    lines = ["| path | call | base ms | this ms | this ÷ base | base range | this range |",
             "|:---|:---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for (isa, call), t in times.items():
        b, n = min(t["base"]), min(t["this"])
        spans = [f"{min(t[k]):.1f}–{max(t[k]):.1f}" for k in ("base", "this")]
        lines.append(
            f"| {isa} | {call} | {b:.1f} | {n:.1f} | {n / b:.3f} | {spans[0]} | {spans[1]} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernel_ab", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--base", required=True, help="the commit to compare this tree against")
    parser.add_argument(
        "--isa", default="auto", help="comma-separated QKV_CPU_ISA paths (default: auto)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="qkv-ab-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.base],
            check=True,
        )
        try:
            trees = {"base": base / "src", "this": ROOT / "src"}
            for src in trees.values():
                build(src)
            times: dict[tuple[str, str], dict[str, list[float]]] = {}
            for r in range(args.rounds):
                for isa in args.isa.split(","):
                    for name in ("base", "this") if r % 2 == 0 else ("this", "base"):
                        print(
                            f"round {r + 1}/{args.rounds} {isa} {name}", file=sys.stderr, flush=True
                        )
                        for call, ms in run_tree(trees[name], isa).items():
                            times.setdefault((isa, call), {"base": [], "this": []})[name].append(ms)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False
            )
    print("\n".join(report(times)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
