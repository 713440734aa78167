"""transformers benchmark: a model's forward with attn_implementation "qkv" vs "sdpa" vs "eager".

What it measures, all in one run on one machine (fp32, B=1, CPU, random weights, no download):

- dense: a Llama-like `LlamaModel` (hidden 512, 8 query heads, 2 key/value heads, head dim 64,
  MLP 1376 = Llama-2's 2.6875×, 4 layers) at N ∈ {512, 1024, 2048, 4096, 8192} tokens: the
  median time of `model(input_ids)` under `torch.no_grad()` for each implementation, the three
  taking turns round after round, and the speed relative to "sdpa" (`time_sdpa / time_impl`).
  "eager" materialises the N×N scores of every head and is skipped above N=4096;
- sliding window: the same model as `MistralModel` with `sliding_window=512` at N=8192, "qkv"
  (which gets `qkv.masks.sliding_window(511, 0)` and runs the block-sparse tiled kernel) vs
  "sdpa" (which gets transformers' dense N×N bool mask);
- the outputs agree: max |qkv − sdpa| relative to max |sdpa| at each shape;
- the targets, each with PASS/FAIL: dense "qkv" at least 0.95× "sdpa" at every N; the
  sliding-window model at N=8192 at least 3× faster with "qkv" than with "sdpa".

Run it from the repository root:

    python benchmarks/hf.py --out docs/benchmarks.md   # full run: writes its section, JSON beside
    python benchmarks/hf.py --quick                    # smoke test (small N), prints

The section between `<!-- BEGIN hf -->` and `<!-- END hf -->` of the Markdown file is replaced
(or appended), nothing else in it is touched; the JSON goes to `docs/benchmarks-hf.json` (or
`--json`). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from _harness import cpu_pressure_total_s, machine_info, matmul_gflops, progress

SECTION = "hf"
ANCHOR = "sdpa"
DENSE_TARGET = 0.95  # "qkv" at least this fraction of "sdpa"'s speed
SLIDING_TARGET = 3.0  # the sliding-window model at least this many times faster than "sdpa"
MODEL = dict(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=16384,
)


@dataclasses.dataclass(frozen=True)
class Settings:
    dense_sizes: tuple[int, ...]
    eager_max: int  # eager runs up to this N
    window: int
    sliding_n: int
    repeats: dict[int, int]  # timed rounds by N


FULL = Settings(
    dense_sizes=(512, 1024, 2048, 4096, 8192),
    eager_max=4096,
    window=512,
    sliding_n=8192,
    repeats={512: 31, 1024: 21, 2048: 11, 4096: 5, 8192: 5},
)
QUICK = Settings(
    dense_sizes=(128, 256),
    eager_max=256,
    window=64,
    sliding_n=1024,
    repeats={128: 2, 256: 2, 1024: 2},
)


@dataclasses.dataclass
class Row:
    model: str  # "dense" (LlamaModel) or "sliding" (MistralModel with a window)
    n: int
    impl: str
    ms: float  # median forward time
    vs_sdpa: float  # median over rounds of time_sdpa / time_impl (> 1: faster than sdpa)
    vs_sdpa_min: float  # the lowest of the per-round ratios
    vs_sdpa_max: float  # the highest
    rel_diff_vs_sdpa: float  # max |out − out_sdpa| / max |out_sdpa|
    repeats: int


@dataclasses.dataclass
class Target:
    name: str
    threshold: str
    measured: float | None
    passed: bool | None


def build(kind: str, window: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "dense":
        return transformers.LlamaModel(transformers.LlamaConfig(**MODEL)).eval()
    config = transformers.MistralConfig(**MODEL, sliding_window=window)
    return transformers.MistralModel(config).eval()


def interleave_alternating(runners: dict, rounds: int, label: str) -> dict[str, list[float]]:
    """Seconds per call of every runner: one untimed warm-up round, then `rounds` rounds in
    which the runners take turns, in reverse order every other round (so that no runner is
    always the one that follows a particular other, or always comes first)."""
    names = list(runners)
    for name in names:
        runners[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - start)
        latest = ", ".join(f"{n} {times[n][-1] * 1e3:.0f}" for n in names)
        progress(f"{label} round {r + 1}/{rounds}: {latest} ms")
    return times


def measure(kind: str, n: int, impls: list[str], settings: Settings) -> list[Row]:
    base = build(kind, settings.window)
    models = {}
    for impl in impls:
        m = copy.deepcopy(base)
        m.set_attn_implementation(impl)
        models[impl] = m
    del base
    ids = torch.randint(0, MODEL["vocab_size"], (1, n), generator=torch.Generator().manual_seed(1))
    outs: dict[str, torch.Tensor] = {}

    def runner(impl):
        def run():
            with torch.no_grad():
                outs[impl] = models[impl](ids).last_hidden_state

        return run

    repeats = settings.repeats.get(n, 3)
    times = interleave_alternating({i: runner(i) for i in impls}, repeats, f"[{kind} N={n}]")
    scale = outs[ANCHOR].abs().max().item()
    rows = []
    for i in impls:
        # Round r runs every implementation back to back, so the ratio within a round sees
        # (nearly) the same load from other processes: the median of the per-round ratios.
        ratios = [a / b for a, b in zip(times[ANCHOR], times[i], strict=True)]
        rows.append(
            Row(
                model=kind,
                n=n,
                impl=i,
                ms=statistics.median(times[i]) * 1e3,
                vs_sdpa=statistics.median(ratios),
                vs_sdpa_min=min(ratios),
                vs_sdpa_max=max(ratios),
                rel_diff_vs_sdpa=(outs[i] - outs[ANCHOR]).abs().max().item() / scale,
                repeats=repeats,
            )
        )
    return rows


def evaluate(rows: list[Row], settings: Settings) -> list[Target]:
    dense = [r for r in rows if r.model == "dense" and r.impl == "qkv"]
    targets = [
        Target(
            f'dense LlamaModel forward, "qkv" ×SDPA at N={r.n}',
            f"≥ {DENSE_TARGET}",
            r.vs_sdpa,
            r.vs_sdpa >= DENSE_TARGET,
        )
        for r in dense
    ]
    sliding = [r for r in rows if r.model == "sliding" and r.impl == "qkv"]
    for r in sliding:
        targets.append(
            Target(
                f'sliding-window (w={settings.window}) MistralModel forward at N={r.n}, "qkv" '
                "×SDPA",
                f"≥ {SLIDING_TARGET}",
                r.vs_sdpa,
                r.vs_sdpa >= SLIDING_TARGET,
            )
        )
    return targets


# --------------------------------------------------------------------------- the report


def table(rows: list[Row]) -> list[str]:
    lines = [
        "| N | impl | forward ms | ×SDPA | ×SDPA range over rounds | max rel. diff vs sdpa "
        "| rounds |",
        "|---:|:---|---:|---:|:---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.n} | {r.impl} | {r.ms:.1f} | {r.vs_sdpa:.3f} "
            f"| {r.vs_sdpa_min:.2f} – {r.vs_sdpa_max:.2f} | {r.rel_diff_vs_sdpa:.1e} "
            f"| {r.repeats} |"
        )
    return lines


def render(report: dict, rows: list[Row], targets: list[Target]) -> str:
    info, load, s = report["machine"], report["load_average_1min"], report["settings"]
    pressure = report.get("cpu_pressure_fraction")
    pressure_text = (
        f"; CPU pressure (Linux PSI, fraction of the run during which a runnable task waited "
        f"for a CPU) {pressure:.0%}"
        if pressure is not None
        else ""
    )
    model = report["model"]
    lines = [
        '## transformers: a model\'s forward with `attn_implementation="qkv"` (`benchmarks/hf.py`)',
        "",
        "Generated by `benchmarks/hf.py`; regenerate it, never edit the numbers by hand.",
        "",
        f"- **Date:** {info['date_utc']}",
        f"- **Machine:** {info['uname']}; CPU {info['cpu_model']}; nproc {info['nproc']}; "
        f"CPU capability {info['cpu_capability']}",
        f"- **Software:** torch {info['torch']}, transformers {report['transformers']}, "
        f"`torch.get_num_threads()` = {info['torch_threads']}, Python {info['python']}",
        f"- **Command:** `{report['command']}` (total runtime {report['runtime_s'] / 60:.1f} min)",
        f"- **Load:** 1-minute load average {load['start']:.2f} at the start, {load['end']:.2f} "
        f"at the end, on {info['nproc']} CPUs{pressure_text}. The machine is shared (other "
        "benchmarks run on it at times); load from other processes hurts absolute times more "
        "than the ratios, which are measured interleaved.",
        f"- **Model:** random weights, fp32, B=1, CPU; hidden {model['hidden_size']}, "
        f"{model['num_attention_heads']} query heads and {model['num_key_value_heads']} "
        f"key/value heads (head dim {model['hidden_size'] // model['num_attention_heads']}), "
        f"MLP {model['intermediate_size']}, {model['num_hidden_layers']} layers, vocabulary "
        f"{model['vocab_size']}; `LlamaModel` (no LM head) for dense, `MistralModel` with "
        f"`sliding_window={s['window']}` for the sliding-window rows.",
        f"- **matmul ceiling:** torch fp32 2048³ matmul {report['matmul_gflops']:.1f} GFLOP/s "
        "in the same run (for scale).",
        "",
        "### Method",
        "",
        '- `qkv` = `qkv.integrations.hf.register()` then `set_attn_implementation("qkv")`: '
        "every attention layer calls `qkv.attention`. Without padding a causal model gets "
        "no mask and `causal=True`, which qkv's `auto` runs on torch SDPA (grouped heads not "
        "repeated); the sliding-window model gets `qkv.masks.sliding_window(w − 1, 0)`, which "
        "`auto` runs on qkv's block-sparse `tiled` kernel. `sdpa` and `eager` are transformers' "
        "own (for the window, `sdpa` gets transformers' dense N×N bool mask).",
        "- Time: `model(input_ids)` under `torch.no_grad()`, after one warm-up call; at each "
        "shape the implementations take turns, round after round (in reverse order every "
        "other round), so that load from other processes hits them alike. *forward ms* is "
        "the median over the rounds.",
        "- **×SDPA** = the median over the rounds of `time_sdpa / time_impl` within the round "
        "(> 1: faster than `sdpa`); a ratio within one round sees nearly the same load on both "
        "sides, so it is steadier than a ratio of medians on a shared machine. The range "
        "shows the lowest and highest per-round ratio. Max rel. diff = max |out − out_sdpa| / "
        "max |out_sdpa| of the last hidden state (a sanity check that the rows compute the "
        "same thing; 0 means bit-identical).",
        f"- `eager` is skipped above N={s['eager_max']}: its N×N fp32 scores are "
        f"{model['num_attention_heads']}·N²·4 B per layer (2 GiB at N=8192) and it takes tens "
        "of seconds there.",
        "",
        "### Dense (causal) forward",
        "",
        *table([r for r in rows if r.model == "dense"]),
        "",
        f"### Sliding window (w={s['window']}) forward",
        "",
        *table([r for r in rows if r.model == "sliding"]),
        "",
        "### Targets",
        "",
        "| target | threshold | measured | result |",
        "|:---|:---|---:|:---|",
    ]
    for t in targets:
        result = {True: "PASS", False: "**FAIL**", None: "not measured"}[t.passed]
        measured = "—" if t.measured is None else f"{t.measured:.3f}"
        lines.append(f"| {t.name} | {t.threshold} | {measured} | {result} |")
    lines.append("")
    return "\n".join(lines)


def write_own_section(path: Path, body: str) -> None:
    """Replace this script's section of `path` (between its BEGIN/END markers), or append it;
    everything else in the file is left as it is."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"<!-- BEGIN {SECTION} -->\n{body.rstrip()}\n<!-- END {SECTION} -->\n"
    pattern = re.compile(rf"<!-- BEGIN {SECTION} -->\n.*?<!-- END {SECTION} -->\n?", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small N, 2 repeats, for a smoke test")
    parser.add_argument("--out", type=Path, help="write this script's section of this Markdown")
    parser.add_argument(
        "--json", type=Path, help="where the JSON goes (default: docs/benchmarks-hf.json)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import transformers

        import qkv.integrations.hf
    except ImportError as e:
        sys.exit(f"{e}\nthis benchmark needs transformers: pip install -e '.[hf]'")
    qkv.integrations.hf.register()
    transformers.logging.set_verbosity_error()

    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    pressure_start = cpu_pressure_total_s()
    settings = QUICK if args.quick else FULL
    command = shlex.join(["python", *sys.argv])
    progress(f"{command}: torch {torch.__version__}, {torch.get_num_threads()} threads")
    gflops = matmul_gflops()
    progress(f"[ceiling] fp32 matmul {gflops:.1f} GFLOP/s")

    rows: list[Row] = []
    for n in settings.dense_sizes:
        impls = ["qkv", "sdpa"] + (["eager"] if n <= settings.eager_max else [])
        rows += measure("dense", n, impls, settings)
    rows += measure("sliding", settings.sliding_n, ["qkv", "sdpa"], settings)
    targets = evaluate(rows, settings)

    elapsed = time.perf_counter() - started
    pressure_end = cpu_pressure_total_s()
    report = {
        "machine": machine_info(),
        "transformers": transformers.__version__,
        "command": command,
        "model": MODEL,
        "settings": dataclasses.asdict(settings),
        "matmul_gflops": gflops,
        "results": [dataclasses.asdict(r) for r in rows],
        "targets": [dataclasses.asdict(t) for t in targets],
        "runtime_s": elapsed,
        "load_average_1min": {"start": load_start, "end": os.getloadavg()[0]},
        "cpu_pressure_fraction": (
            (pressure_end - pressure_start) / elapsed
            if pressure_start is not None and pressure_end is not None
            else None
        ),
    }
    markdown = render(report, rows, targets)
    if args.out is None:
        print(markdown)
    else:
        write_own_section(args.out, markdown)
        json_path = args.json or args.out.with_name("benchmarks-hf.json")
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        progress(f"wrote {args.out} (section {SECTION}) and {json_path}")
    progress(f"total runtime {elapsed:.0f} s")


if __name__ == "__main__":
    main()
