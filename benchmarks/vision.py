"""Vision benchmark: packed vision attention vs transformers' per-chunk loop; received attention.

What it measures, all in one run on one machine (fp32, CPU, random inputs, no download):

- (a) **Qwen2.5-VL-shaped vision attention, forward.** Four images, 1344×1344, 1344×756,
  640×480 and 448×448, resized by Qwen2.5-VL's rule (`smart_resize`, max_pixels 12845056) to
  96×96, 54×96, 34×46 and 32×32 patches of 14 pixels: N = 16988 patches, 16 heads of 80
  (Qwen2.5-VL-7B's encoder: hidden 1280). Two kinds of block, on the window-ordered sequence:
  *windowed* (`cu_window_seqlens`: 274 windows of up to 8×8 = 64 patches) and *full* (one
  segment per image). For each: transformers' own non-flash path (the vision attention's loop:
  `torch.split` by the lengths, one `sdpa_attention_forward` call per chunk, `torch.cat`) vs
  `qkv.vision.packed_attention` (one qkv call); the median of interleaved rounds and the median
  per-round ratio; accuracy of both against the float64 per-chunk reference, next to transformers'
  "eager" loop (the error-ratio rule: max |x − golden| against eager's). A Qwen2.5-VL-7B tower
  runs 28 windowed and 4 full blocks: the per-tower estimate is 28·t_windowed + 4·t_full.
- (b) **received attention at N = 16384** (B=1, H=8, D=64): `qkv.received_attention(q, k)`
  (and with `causal=True`) against the forward `qkv.attention(q, k, v)` of the same problem, time
  interleaved; and its peak memory beyond the inputs, VmHWM of a fresh process after resetting
  it through /proc/self/clear_refs (the dense weights would be 8 GiB).
- the targets, each with PASS/FAIL: windowed blocks ≥ 2× faster than the loop; received
  attention ≤ 2× the forward's time and ≤ 64 MiB beyond the inputs.

Run it from the repository root:

    python benchmarks/vision.py --out docs/benchmarks.md   # full run: its section, JSON beside
    python benchmarks/vision.py --quick                    # smoke test (small shapes)

The section between `<!-- BEGIN vision -->` and `<!-- END vision -->` of the Markdown file is
replaced (or appended), nothing else in it is touched; the JSON goes to
`docs/benchmarks-vision.json` (or `--json`). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from _harness import (
    ProbeResult,
    cpu_pressure_total_s,
    limit_address_space,
    machine_info,
    matmul_gflops,
    measure_in_process,
    peak_rss_mib,
    print_probe_result,
    progress,
    reset_peak_rss,
    write_section,
)

SECTION = "vision"
WINDOW_TARGET = 2.0  # packed windowed blocks at least this many times faster than the loop
RECEIVED_TIME_TARGET = 2.0  # received attention at most this many forward times
RECEIVED_MEMORY_TARGET_MIB = 64.0  # received attention's peak beyond its inputs
TOWER = {"windowed": 28, "full": 4}  # Qwen2.5-VL-7B's 32 vision blocks
PROBE_ADDRESS_LIMIT = 16 * 2**30  # a runaway probe fails instead of pushing the machine to OOM


@dataclasses.dataclass(frozen=True)
class Settings:
    images: tuple[tuple[int, int], ...]  # (width, height) of the packed images
    heads: int
    head_dim: int
    rounds: dict[str, int]  # timed rounds per block kind
    received_n: int
    received_heads: int
    received_dim: int
    received_rounds: int


FULL = Settings(
    images=((1344, 1344), (1344, 756), (640, 480), (448, 448)),
    heads=16,
    head_dim=80,
    rounds={"windowed": 7, "full": 3},
    received_n=16384,
    received_heads=8,
    received_dim=64,
    received_rounds=3,
)
QUICK = Settings(
    images=((448, 448), (336, 224)),
    heads=4,
    head_dim=80,
    rounds={"windowed": 2, "full": 2},
    received_n=2048,
    received_heads=8,
    received_dim=64,
    received_rounds=2,
)


@dataclasses.dataclass
class Row:
    block: str  # "windowed" or "full"
    impl: str  # "transformers sdpa loop" or "qkv packed"
    segments: int
    ms: float  # median forward time
    speedup: float  # median over rounds of time_loop / time_impl
    speedup_min: float
    speedup_max: float
    err_vs_golden: float  # max |out − golden| (golden: float64 per-chunk reference)
    eager_err_vs_golden: float  # the same for transformers' eager loop, in fp32
    rounds: int


@dataclasses.dataclass
class Target:
    name: str
    threshold: str
    measured: float | None
    passed: bool | None


def interleave_alternating(runners: dict, rounds: int, label: str) -> dict[str, list[float]]:
    """Seconds per call of every runner: one untimed warm-up round, then `rounds` rounds in which
    the runners take turns, in reverse order every other round."""
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


# --------------------------------------------------------------------------- (a) the encoder


def encoder_shapes(settings: Settings):
    """Patch grids of the images, their window partition, and N."""
    from qkv.vision import smart_resize, window_partition

    grids = []
    for w, h in settings.images:
        rh, rw = smart_resize(h, w, max_pixels=12845056)
        grids.append((1, rh // 14, rw // 14))
    part = window_partition(grids)
    return grids, part, int(part.cu_seqlens[-1])


class _Module:
    """What transformers' attention functions read from the calling module."""

    is_causal = False
    num_key_value_groups = 1
    training = False


def transformers_loop(impl: str):
    """The non-flash branch of transformers' Qwen2.5-VL vision attention, verbatim: split the
    packed (1, H, N, D) tensors by the segment lengths, one attention call per chunk, concatenate
    (modeling_qwen2_5_vl.Qwen2_5_VLVisionAttention.forward)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import eager_attention_forward

    interface = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
    module = _Module()

    def run(q, k, v, cu_seqlens, scaling):
        query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        splits = [torch.split(t, lengths.tolist(), dim=2) for t in (query, key, value)]
        outs = [
            interface(module, a, b, c, attention_mask=None, scaling=scaling, dropout=0.0,
                      is_causal=False)[0]
            for a, b, c in zip(*splits, strict=True)
        ]  # fmt: skip
        return torch.cat(outs, dim=1)[0]  # (N, H, D)

    return run


def golden(q, k, v, cu_seqlens, scaling: float, rows: int = 2048) -> torch.Tensor:
    """float64 reference, one segment, head and band of query rows at a time (the scores of a
    whole 9216-patch image would be 10 GiB in float64)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    cu = cu_seqlens.tolist()
    for a, b in itertools.pairwise(cu):
        for h in range(q.shape[1]):
            kh, vh = k[a:b, h].double(), v[a:b, h].double()
            for r in range(a, b, rows):
                s = (q[r : min(b, r + rows), h].double() @ kh.T) * scaling
                out[r : min(b, r + rows), h] = torch.softmax(s, dim=-1) @ vh
    return out


def eager_by_heads(eager_loop, q, k, v, cu_seqlens, scaling, heads: int = 2) -> torch.Tensor:
    """transformers' eager loop, `heads` heads at a time: the same computation per head, with
    its N×N weights for 2 heads instead of all 16 at once."""
    parts = [
        eager_loop(
            q[:, h : h + heads], k[:, h : h + heads], v[:, h : h + heads], cu_seqlens, scaling
        )
        for h in range(0, q.shape[1], heads)
    ]
    return torch.cat(parts, dim=1)


def measure_encoder(settings: Settings) -> tuple[list[Row], dict]:
    from qkv.vision import packed_attention
    from qkv.vision.packed import plan_layout

    grids, part, n = encoder_shapes(settings)
    H, D = settings.heads, settings.head_dim
    g = torch.Generator().manual_seed(0)
    # As the vision attention holds them: one (N, 3, H, D) projection, q and k rotated (new
    # tensors), v a strided view of the projection.
    qkv_proj = torch.randn(n, 3, H, D, generator=g)
    q, k = qkv_proj[:, 0].contiguous(), qkv_proj[:, 1].contiguous()
    v = qkv_proj[:, 2]
    scaling = D**-0.5
    sdpa_loop, eager_loop = transformers_loop("sdpa"), transformers_loop("eager")
    shapes = {
        "grids": grids,
        "n": n,
        "window_lengths": part.window_lengths,
        "image_lengths": (part.cu_seqlens[1:] - part.cu_seqlens[:-1]).tolist(),
    }
    rows = []
    for block, cu in (("windowed", part.cu_window_seqlens), ("full", part.cu_seqlens)):
        layout = plan_layout(cu, n).layout
        shapes[f"{block}_layout"] = layout
        outs: dict[str, torch.Tensor] = {}

        def runner(name, fn, cu=cu, outs=outs):
            def run():
                with torch.no_grad():
                    outs[name] = fn(q, k, v, cu, scaling)

            return run

        def packed(q, k, v, cu, scaling):
            return packed_attention(q, k, v, cu, scale=scaling)

        impls = {
            "transformers sdpa loop": runner("loop", sdpa_loop),
            "qkv packed": runner("qkv", packed),
        }
        times = interleave_alternating(impls, settings.rounds[block], f"[{block}]")
        progress(f"[{block}] accuracy: float64 golden and transformers' eager loop")
        with torch.no_grad():
            gold = golden(q, k, v, cu, scaling)
            eager = eager_by_heads(eager_loop, q, k, v, cu, scaling)
        eager_err = (eager.double() - gold).abs().max().item()
        errs = {
            "transformers sdpa loop": (outs["loop"].double() - gold).abs().max().item(),
            "qkv packed": (outs["qkv"].double() - gold).abs().max().item(),
        }
        del gold, eager
        base = times["transformers sdpa loop"]
        for impl, t in times.items():
            ratios = [a / b for a, b in zip(base, t, strict=True)]
            rows.append(
                Row(
                    block=block,
                    impl=impl,
                    segments=len(cu) - 1,
                    ms=statistics.median(t) * 1e3,
                    speedup=statistics.median(ratios),
                    speedup_min=min(ratios),
                    speedup_max=max(ratios),
                    err_vs_golden=errs[impl],
                    eager_err_vs_golden=eager_err,
                    rounds=len(t),
                )
            )
    return rows, shapes


# --------------------------------------------------------------------------- (b) received


def received_inputs(settings: Settings):
    g = torch.Generator().manual_seed(1)
    shape = (1, settings.received_heads, settings.received_n, settings.received_dim)
    return tuple(torch.randn(shape, generator=g) for _ in range(3))


def measure_received_time(settings: Settings) -> dict[str, list[float]]:
    import qkv

    q, k, v = received_inputs(settings)

    def call(fn):
        def run():
            with torch.no_grad():
                fn()

        return run

    runners = {
        "forward": call(lambda: qkv.attention(q, k, v)),
        "received": call(lambda: qkv.received_attention(q, k)),
        "forward causal": call(lambda: qkv.attention(q, k, v, causal=True)),
        "received causal": call(lambda: qkv.received_attention(q, k, causal=True)),
    }
    return interleave_alternating(runners, settings.received_rounds, "[received]")


def probe_received(spec: dict) -> ProbeResult:
    """Body of the memory probe process: peak RSS of one received_attention call beyond q, k."""
    import qkv
    from qkv.inspect.bench import release_freed_memory

    torch.set_num_threads(spec["threads"])
    settings = Settings(**{**dataclasses.asdict(FULL), **spec["settings"]})
    q, k, _ = received_inputs(settings)
    inputs_mib = sum(t.numel() * t.element_size() for t in (q, k)) / 2**20
    small = tuple(t[:, :, :256] for t in (q, k))  # lazy set-up is not the call's memory
    qkv.received_attention(*small, causal=spec["causal"])
    release_freed_memory()
    baseline = reset_peak_rss()
    start = time.perf_counter()
    with torch.no_grad():
        qkv.received_attention(q, k, causal=spec["causal"])
    wall = time.perf_counter() - start
    return ProbeResult(peak_mib=peak_rss_mib() - baseline, inputs_mib=inputs_mib, wall_s=wall)


# --------------------------------------------------------------------------- the report


def evaluate(rows: list[Row], received: dict, memory: dict) -> list[Target]:
    targets = []
    for r in rows:
        if r.impl == "qkv packed" and r.block == "windowed":
            targets.append(
                Target(
                    "windowed blocks, forward: qkv packed ×(transformers sdpa loop)",
                    f"≥ {WINDOW_TARGET}",
                    r.speedup,
                    r.speedup >= WINDOW_TARGET,
                )
            )
    for r in rows:
        if r.impl == "qkv packed":
            ok = r.err_vs_golden <= 2 * r.eager_err_vs_golden + 1e-7
            targets.append(
                Target(
                    f"{r.block} blocks: max |qkv − golden| ≤ 2·max |eager − golden| + 1e-7",
                    "exact",
                    r.err_vs_golden,
                    ok,
                )
            )
    for mode in ("", " causal"):
        ratio = received[f"received{mode} / forward{mode}"]
        targets.append(
            Target(
                f"received attention{mode} time / forward{mode} time at N={received['n']}",
                f"≤ {RECEIVED_TIME_TARGET}",
                ratio,
                ratio <= RECEIVED_TIME_TARGET,
            )
        )
    for mode, res in memory.items():
        peak = res.get("peak_mib")
        targets.append(
            Target(
                f"received attention{mode} peak memory beyond the inputs (MiB)",
                f"≤ {RECEIVED_MEMORY_TARGET_MIB:.0f}",
                peak,
                None if peak is None else peak <= RECEIVED_MEMORY_TARGET_MIB,
            )
        )
    return targets


def encoder_table(rows: list[Row]) -> list[str]:
    lines = [
        "| block | impl | calls | forward ms | ×loop | ×loop range | max \\|x − golden\\| "
        "| eager's | rounds |",
        "|:---|:---|---:|---:|---:|:---|---:|---:|---:|",
    ]
    for r in rows:
        calls = r.segments if r.impl.startswith("transformers") else 1
        lines.append(
            f"| {r.block} | {r.impl} | {calls} | {r.ms:.0f} | {r.speedup:.2f} "
            f"| {r.speedup_min:.2f} – {r.speedup_max:.2f} | {r.err_vs_golden:.1e} "
            f"| {r.eager_err_vs_golden:.1e} | {r.rounds} |"
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
    shapes, rec, tower = report["encoder_shapes"], report["received"], report["tower"]
    wl = shapes["window_lengths"]
    hist = ", ".join(f"{wl.count(x)} of {x}" for x in sorted(set(wl), reverse=True))
    images = ", ".join(f"{w}×{h}" for w, h in s["images"])
    grids = ", ".join(f"{h}×{w}" for _, h, w in shapes["grids"])
    lines = [
        "## Vision: packed encoder attention and received attention (`benchmarks/vision.py`)",
        "",
        "Generated by `benchmarks/vision.py`; regenerate it, never edit the numbers by hand.",
        "",
        f"- **Date:** {info['date_utc']}",
        f"- **Machine:** {info['uname']}; CPU {info['cpu_model']}; nproc {info['nproc']}; "
        f"CPU capability {info['cpu_capability']}",
        f"- **Software:** torch {info['torch']}, transformers {report['transformers']}, "
        f"`torch.get_num_threads()` = {info['torch_threads']}, Python {info['python']}",
        f"- **Command:** `{report['command']}` (total runtime {report['runtime_s'] / 60:.1f} min)",
        f"- **Load:** 1-minute load average {load['start']:.2f} at the start, {load['end']:.2f} "
        f"at the end, on {info['nproc']} CPUs{pressure_text}. On a shared machine the many small "
        "parallel regions of a per-chunk loop or a banded computation suffer more from other "
        "processes than one large call; the ratios are measured interleaved.",
        f"- **matmul ceiling:** torch fp32 2048³ matmul {report['matmul_gflops']:.1f} GFLOP/s "
        "in the same run (for scale).",
        "",
        "### (a) Qwen2.5-VL-shaped vision attention, forward",
        "",
        f"Images {images}, resized by `smart_resize` (max_pixels 12845056) to {grids} patches "
        f"of 14 px: N = {shapes['n']} patches in the window order, {s['heads']} heads of "
        f"{s['head_dim']}, fp32, no gradient. *windowed* blocks attend within "
        f"{len(wl)} windows ({hist} patches; `cu_window_seqlens`, qkv layout "
        f"`{shapes['windowed_layout']}`); *full* blocks within the {len(shapes['image_lengths'])} "
        f"images ({', '.join(map(str, shapes['image_lengths']))} patches; qkv layout "
        f"`{shapes['full_layout']}`). q and k contiguous (rotated), v a strided view of the "
        "(N, 3, H, D) projection, as in the model.",
        "",
        "- *transformers sdpa loop*: the non-flash branch of `Qwen2_5_VLVisionAttention.forward` "
        "verbatim: `torch.split` by the lengths, one `sdpa_attention_forward` call per chunk "
        "(*calls*), `torch.cat`. *qkv packed*: `qkv.vision.packed_attention(q, k, v, cu_seqlens)`, "
        "one qkv call.",
        "- *×loop*: median over rounds of `time_loop / time_impl` within the round; the range "
        "is the lowest and highest per-round ratio. *max |x − golden|*: against the float64 "
        "per-chunk reference; *eager's*: the same for transformers' eager loop in fp32 (run two "
        "heads at a time: its N×N weights for all 16 heads of the largest image are 5 GiB).",
        "",
        *encoder_table(rows),
        "",
        f"Per Qwen2.5-VL-7B tower ({TOWER['windowed']} windowed + {TOWER['full']} full blocks, "
        f"attention only): transformers sdpa loop {tower['loop_s']:.2f} s, qkv packed "
        f"{tower['qkv_s']:.2f} s (×{tower['speedup']:.2f}), from the medians above.",
        "",
        f"### (b) Received attention at N = {rec['n']}",
        "",
        f"B=1, H={s['received_heads']}, D={s['received_dim']}, fp32: "
        "`qkv.received_attention(q, k)` (column sums of A, bands of query rows of "
        "`received.BAND_BYTES`) against the forward `qkv.attention(q, k, v)` of the same problem "
        "(auto: torch SDPA), interleaved, median of "
        f"{s['received_rounds']} rounds. The dense weights would be "
        f"{rec['dense_weights_gib']:.0f} GiB.",
        "",
        "| call | median s | ÷ forward |",
        "|:---|---:|---:|",
    ]
    for mode in ("", " causal"):
        fwd, got = rec["median_s"][f"forward{mode}"], rec["median_s"][f"received{mode}"]
        lines.append(f"| forward{mode} | {fwd:.2f} | 1 |")
        lines.append(
            f"| received{mode} | {got:.2f} | {rec[f'received{mode} / forward{mode}']:.2f} |"
        )
    lines += [
        "",
        "Memory: peak RSS (VmHWM, reset through `/proc/self/clear_refs` after a small warm-up "
        "call) of one `received_attention` call in a fresh process, minus what it held before "
        f"the call; inputs q and k hold {report['received_memory_inputs_mib']:.0f} MiB.",
        "",
        "| call | peak beyond inputs (MiB) |",
        "|:---|---:|",
    ]
    for mode, res in report["received_memory"].items():
        peak = res.get("peak_mib")
        lines.append(f"| received{mode} | {'failed' if peak is None else f'{peak:.1f}'} |")
    lines += [
        "",
        "### Targets",
        "",
        "| target | threshold | measured | result |",
        "|:---|:---|---:|:---|",
    ]
    for t in targets:
        result = {True: "PASS", False: "**FAIL**", None: "not measured"}[t.passed]
        measured = "—" if t.measured is None else f"{t.measured:.3g}"
        lines.append(f"| {t.name} | {t.threshold} | {measured} | {result} |")
    lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, for a smoke test")
    parser.add_argument("--out", type=Path, help="write this script's section of this Markdown")
    parser.add_argument("--json", type=Path, help="default: docs/benchmarks-vision.json")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # internal: one memory probe
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.probe:
        limit_address_space(PROBE_ADDRESS_LIMIT)
        print_probe_result(probe_received(json.loads(args.probe)))
        return
    try:
        import transformers
    except ImportError as e:
        sys.exit(f"{e}\nthis benchmark needs transformers: pip install -e '.[hf]'")
    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)

    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    pressure_start = cpu_pressure_total_s()
    settings = QUICK if args.quick else FULL
    command = shlex.join(["python", *sys.argv])
    progress(f"{command}: torch {torch.__version__}, {torch.get_num_threads()} threads")
    gflops = matmul_gflops()
    progress(f"[ceiling] fp32 matmul {gflops:.1f} GFLOP/s")

    rows, shapes = measure_encoder(settings)
    med = {(r.block, r.impl): r.ms / 1e3 for r in rows}
    loop_s = sum(TOWER[b] * med[(b, "transformers sdpa loop")] for b in TOWER)
    qkv_s = sum(TOWER[b] * med[(b, "qkv packed")] for b in TOWER)
    tower = {"loop_s": loop_s, "qkv_s": qkv_s, "speedup": loop_s / qkv_s}

    times = measure_received_time(settings)
    received = {"n": settings.received_n, "median_s": {}}
    for name, t in times.items():
        received["median_s"][name] = statistics.median(t)
    for mode in ("", " causal"):
        ratios = [
            a / b for a, b in zip(times[f"received{mode}"], times[f"forward{mode}"], strict=True)
        ]
        received[f"received{mode} / forward{mode}"] = statistics.median(ratios)
    received["dense_weights_gib"] = settings.received_heads * settings.received_n**2 * 4 / 2**30
    memory, inputs_mib = {}, None
    spec_settings = {
        "received_n": settings.received_n,
        "received_heads": settings.received_heads,
        "received_dim": settings.received_dim,
    }
    for mode, causal in (("", False), (" causal", True)):
        progress(f"[received{mode}] memory probe in a fresh process")
        spec = {"settings": spec_settings, "causal": causal, "threads": torch.get_num_threads()}
        res = measure_in_process(Path(__file__), spec, timeout_s=1800)
        memory[mode] = dataclasses.asdict(res)
        inputs_mib = res.inputs_mib if res.inputs_mib is not None else inputs_mib
        progress(f"[received{mode}] peak {res.peak_mib} MiB beyond {res.inputs_mib} MiB of inputs")
    targets = evaluate(rows, received, memory)

    elapsed = time.perf_counter() - started
    pressure_end = cpu_pressure_total_s()
    report = {
        "machine": machine_info(),
        "transformers": transformers.__version__,
        "command": command,
        "settings": dataclasses.asdict(settings),
        "matmul_gflops": gflops,
        "encoder_shapes": shapes,
        "encoder": [dataclasses.asdict(r) for r in rows],
        "tower": tower,
        "received": received,
        "received_times_s": times,
        "received_memory": memory,
        "received_memory_inputs_mib": inputs_mib or 0.0,
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
    print(markdown)
    if args.out is not None:
        write_section(args.out, SECTION, markdown)
        json_path = args.json or args.out.with_name("benchmarks-vision.json")
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        progress(f"wrote {args.out} (section {SECTION}) and {json_path}")
    progress(f"total runtime {elapsed:.0f} s")


if __name__ == "__main__":
    main()
