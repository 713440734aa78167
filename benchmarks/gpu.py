"""GPU benchmark of the `triton` backend: correctness on real shapes first, then speed.

Prepared to run once on a CUDA machine (an H200 in the issue), well under 10 minutes:

1. correctness, bf16, against the fp64 golden under the error rule of docs/design.md
   (forward, lse and gradients): dense, causal (Nq = Nk and Nq < Nk), sliding window, document,
   GQA, D ∈ {40, 64, 128, 256}, ALiBi + softcap, dropout; and int64 offsets: a sliding-window
   problem whose tensors hold more than 2³¹ elements, checked on its last rows;
2. speed: B·N = 16384 tokens, H·D = 2048, D ∈ {64, 128}, N ∈ {1024 … 16384}, bf16, dense,
   causal and sliding window (1024 each side), forward and forward + backward, for
   qkv's triton backend, each torch SDPA backend that runs (flash, cuDNN, efficient; selected
   with `torch.nn.attention.sdpa_kernel`), and compiled FlexAttention (at the N in `--flex-n`,
   since every new shape recompiles it); median of CUDA-event timings after a warm-up;
   TFLOP/s by FlashAttention's count (forward 4·B·H·N²·D, halved for causal, × density for the
   window; backward 2.5× the forward); peak memory beyond the inputs;
3. a small sweep of the triton backend's tile sizes at N = 8192, D = 128;
4. the issue's targets with PASS/FAIL.

It writes `gpu.json` (every figure) and `gpu.md` (the tables) into `--out-dir` (default `$OUT`
when set, else `benchmarks/out`), after every stage, so a run cut short keeps what it measured.
`--budget-s` bounds the timing stages; cases left over are recorded as skipped.

    python benchmarks/gpu.py                 # on a CUDA machine
    python benchmarks/gpu.py --dry-run       # anywhere: list the cases, write empty tables

Without CUDA (and without --dry-run) it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
try:
    import qkv
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(ROOT / "src"))
    import qkv
from qkv import masks, scores  # noqa: E402
from qkv.kernels import TritonBackend  # noqa: E402

TOKENS = 16384  # B · N
WIDTH = 2048  # H · D
HEAD_DIMS = (64, 128)
SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
WINDOW = 1024  # sliding window: 1024 keys each side
PATTERNS = ("dense", "causal", "window")
SDPA_BACKENDS = ("flash", "cudnn", "efficient")
DTYPE = torch.bfloat16
SWEEP = (  # (fwd block, bwd block, warps, stages) for the triton backend at N = 8192, D = 128
    ((128, 64), (64, 64), 8, 2),
    ((128, 64), (64, 64), 4, 3),
    ((128, 128), (64, 64), 8, 2),
    ((64, 64), (64, 64), 4, 3),
    ((128, 64), (32, 64), 8, 2),
    ((128, 64), (64, 128), 8, 2),
)
TARGETS = (  # (description, D, N, pattern, pass, anchor, ratio ≥)
    ("forward ≥ 0.9× best SDPA, dense", 128, 8192, "dense", "fwd", "sdpa-best", 0.9),
    ("forward ≥ 0.9× best SDPA, causal", 128, 8192, "causal", "fwd", "sdpa-best", 0.9),
    ("fwd+bwd ≥ 0.8× best SDPA, dense", 128, 8192, "dense", "fwd+bwd", "sdpa-best", 0.8),
    ("fwd+bwd ≥ 0.8× best SDPA, causal", 128, 8192, "causal", "fwd+bwd", "sdpa-best", 0.8),
    ("window forward ≥ 1.0× Flex", 128, 16384, "window", "fwd", "flex", 1.0),
    ("window fwd+bwd ≥ 1.0× Flex", 128, 16384, "window", "fwd+bwd", "flex", 1.0),
)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- cases and FLOPs


def shape_of(n: int, d: int) -> tuple[int, int, int, int]:
    """(B, H, N, D) with B·N = TOKENS and H·D = WIDTH."""
    return TOKENS // n, WIDTH // d, n, d


def density(pattern: str, n: int) -> float:
    """Fraction of the N×N pairs a pattern allows."""
    if pattern == "dense":
        return 1.0
    if pattern == "causal":
        return (n + 1) / (2 * n)
    w = WINDOW
    allowed = sum(min(n - 1, i + w) - max(0, i - w) + 1 for i in range(n))
    return allowed / (n * n)


def flops(pattern: str, n: int, d: int, which: str) -> float:
    """FlashAttention's count: forward 4·B·H·N²·D (× 1/2 causal, × density for the window);
    backward 2.5× the forward."""
    b, h, _, _ = shape_of(n, d)
    fwd = 4.0 * b * h * n * n * d
    fwd *= 0.5 if pattern == "causal" else density(pattern, n) if pattern == "window" else 1.0
    return fwd if which == "fwd" else 3.5 * fwd


def cases() -> list[dict]:
    return [dict(d=d, n=n, pattern=p) for d in HEAD_DIMS for n in SEQ_LENS for p in PATTERNS]


# --------------------------------------------------------------------------- implementations


def qkv_kwargs(pattern: str) -> dict:
    # The inputs are random and finite: masked requests may run on triton and sdpa.
    if pattern == "causal":
        return dict(causal=True, finite_inputs=True)
    if pattern == "window":
        return dict(mask=masks.sliding_window(WINDOW), finite_inputs=True)
    return {}


def make_triton(pattern: str, backend: object = "triton") -> Callable:
    kw = qkv_kwargs(pattern)
    return lambda q, k, v: qkv.attention(q, k, v, backend=backend, **kw)


def make_sdpa(pattern: str, which: str, n: int, device) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[which]
    mask = None
    if pattern == "window":
        mask = masks.sliding_window(WINDOW).to_dense(n, n, device=device)  # (N, N) bool

    def run(q, k, v):
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=pattern == "causal"
            )

    return run


def make_flex(pattern: str, n: int, device) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    block_mask = None
    if pattern == "causal":
        block_mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, n, n, device)
    elif pattern == "window":
        block_mask = create_block_mask(
            lambda b, h, qi, ki: (ki - qi <= WINDOW) & (qi - ki <= WINDOW), None, None, n, n, device
        )
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


# --------------------------------------------------------------------------- timing


def cuda_median_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median milliseconds per call, by CUDA events, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def inputs(n: int, d: int, device, requires_grad: bool):
    b, h, _, _ = shape_of(n, d)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (
        torch.randn(b, h, n, d, generator=g, device=device, dtype=DTYPE) for _ in range(4)
    )
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v, do


def measure(impl: Callable, n: int, d: int, device) -> dict:
    """Forward and forward + backward times (ms) and the fwd+bwd peak memory beyond inputs."""
    q, k, v, do = inputs(n, d, device, requires_grad=False)
    with torch.no_grad():
        fwd = cuda_median_ms(lambda: impl(q, k, v), warmup=3, reps=10)
    q, k, v, do = inputs(n, d, device, requires_grad=True)

    def step():
        impl(q, k, v).backward(do)
        q.grad = k.grad = v.grad = None

    both = cuda_median_ms(step, warmup=2, reps=6)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return {"fwd_ms": fwd, "fwd+bwd_ms": both, "peak_mib": peak}


# --------------------------------------------------------------------------- correctness


def error_ratio(got, ref, gold, factor: float) -> tuple[bool, float, float]:
    """The error rule (docs/design.md): max|got − gold| ≤ factor · max|ref − gold| + floor
    (finite where gold is)."""
    finite = torch.isfinite(gold)
    if not torch.isfinite(got[finite]).all():
        return False, float("inf"), 0.0
    err = (got.double() - gold)[finite].abs().max().item()
    ref_err = (ref.double() - gold)[finite].abs().max().item()
    g = gold[finite].to(got.dtype)
    floor = 2 * ((g + 0.3 - 0.3) - g).abs().max().item()
    bound = factor * ref_err + floor
    return err <= bound, err, bound


def run_attention(backend, q, k, v, do, dlse, kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    kw = {"finite_inputs": True, **kw}  # random, finite inputs
    out, lse = qkv.attention(*leaves, backend=backend, return_lse=True, **kw)
    loss = (out.double() * do).sum() + (torch.where(torch.isinf(lse), 0, lse).double() * dlse).sum()
    grads = torch.autograd.grad(loss, leaves)
    return [out.detach(), lse.detach(), *grads]


CHECKS = (  # name, (B, H, Hkv, Nq, Nk, D), kwargs
    ("dense D=128", (2, 8, 8, 2048, 2048, 128), {}),
    ("causal D=64", (2, 8, 8, 2048, 2048, 64), dict(causal=True)),
    ("causal Nq<Nk D=128", (1, 8, 8, 700, 3000, 128), dict(causal=True)),
    ("window D=128", (1, 8, 8, 4096, 4096, 128), dict(mask=masks.sliding_window(WINDOW))),
    ("document D=64", (1, 8, 8, 3000, 3000, 64), dict(mask=masks.document([1000, 37, 1963]))),
    ("GQA 16/4 causal D=128", (1, 16, 4, 2048, 2048, 128), dict(causal=True)),
    ("D=40 dense", (1, 4, 4, 1500, 1500, 40), {}),
    ("D=256 causal", (1, 4, 4, 1024, 1024, 256), dict(causal=True)),
    (
        "alibi+softcap causal D=128",
        (1, 8, 8, 2048, 2048, 128),
        dict(
            causal=True,
            score_mod=scores.compose(scores.alibi(scores.alibi_slopes(8)), scores.softcap(30.0)),
        ),
    ),
    ("dropout 0.1 causal D=64", (1, 8, 8, 1024, 1024, 64), dict(causal=True, dropout_p=0.1)),
)


def correctness(device, report: dict) -> None:
    results = []
    for name, (b, h, hkv, nq, nk, d), kw in CHECKS:
        g = torch.Generator(device=device).manual_seed(1)
        q = torch.randn(b, h, nq, d, generator=g, device=device).to(DTYPE)
        k = torch.randn(b, hkv, nk, d, generator=g, device=device).to(DTYPE)
        v = torch.randn(b, hkv, nk, d, generator=g, device=device).to(DTYPE)
        do = torch.randn(b, h, nq, d, generator=g, device=device, dtype=torch.float64)
        dlse = torch.randn(b, h, nq, generator=g, device=device, dtype=torch.float64)
        runs = {}
        for label, backend, args in (
            ("triton", "triton", (q, k, v)),
            ("ref", "reference", (q, k, v)),
            ("gold", "reference", tuple(t.double() for t in (q, k, v))),
        ):
            torch.manual_seed(7)  # the dropout seed
            runs[label] = run_attention(backend, *args, do, dlse, kw)
        row = {"check": name, "pass": True}
        for i, what in enumerate(("out", "lse", "dq", "dk", "dv")):
            ok, err, bound = error_ratio(
                runs["triton"][i], runs["ref"][i], runs["gold"][i], 2.0 if i < 2 else 3.0
            )
            row[what] = {"ok": ok, "err": err, "bound": bound}
            row["pass"] &= ok
        results.append(row)
        progress(f"check {name}: {'ok' if row['pass'] else 'FAIL'}")
        del runs
        torch.cuda.empty_cache()
    results.append(int64_offsets(device))
    report["correctness"] = results


def int64_offsets(device) -> dict:
    """Sliding window (128 each side) over tensors of > 2³¹ elements: the last 512 query rows
    of the last head, forward and gradients, against fp32 math on the slice."""
    b, h, n, d, w = 1, 72, 2**18, 128, 128
    elements = b * h * n * d
    try:
        g = torch.Generator(device=device).manual_seed(3)
        q, k, v = (
            torch.randn(b, h, n, d, generator=g, device=device, dtype=DTYPE) for _ in range(3)
        )
        for t in (q, k, v):
            t.requires_grad_(True)
        out = qkv.attention(
            q, k, v, backend="triton", mask=masks.sliding_window(w), finite_inputs=True
        )
        rows = 512
        do = torch.zeros_like(out)
        do[:, -1, -rows:] = torch.randn(rows, d, device=device, dtype=DTYPE)
        out.backward(do)
        qs = q.detach()[0, -1, -rows:].float().requires_grad_(True)
        ks = k.detach()[0, -1, -(rows + w) :].float().requires_grad_(True)
        vs = v.detach()[0, -1, -(rows + w) :].float().requires_grad_(True)
        pos_q = torch.arange(n - rows, n, device=device).view(-1, 1)
        pos_k = torch.arange(n - rows - w, n, device=device)
        s = (qs @ ks.T) / d**0.5
        s = s.masked_fill((pos_k - pos_q).abs() > w, -torch.inf)
        ref = torch.softmax(s, -1) @ vs
        ref.backward(do[0, -1, -rows:].float())
        errs = {
            "out": (out.detach()[0, -1, -rows:].float() - ref).abs().max().item(),
            "dq": (q.grad[0, -1, -rows:].float() - qs.grad).abs().max().item(),
            "dk": (k.grad[0, -1, -(rows + w) :].float() - ks.grad).abs().max().item(),
            "dv": (v.grad[0, -1, -(rows + w) :].float() - vs.grad).abs().max().item(),
        }
        scale = max(ref.abs().max().item(), 1.0)
        ok = all(e <= 0.05 * scale for e in errs.values())  # bf16 inputs and output
        result = {"check": f"int64 offsets ({elements:,} elements per tensor)", "pass": ok, **errs}
    except torch.cuda.OutOfMemoryError as e:
        result = {"check": "int64 offsets", "pass": None, "skipped": f"out of memory: {e}"}
    progress(f"check int64 offsets: {result['pass']}")
    torch.cuda.empty_cache()
    return result


# --------------------------------------------------------------------------- stages


def timing(device, report: dict, args, deadline: float) -> None:
    rows = []
    report["timing"] = rows
    for case in cases():
        d, n, pattern = case["d"], case["n"], case["pattern"]
        impls: dict[str, Callable] = {"triton": make_triton(pattern)}
        for which in SDPA_BACKENDS:
            impls[f"sdpa-{which}"] = make_sdpa(pattern, which, n, device)
        if n in args.flex_n and d in args.flex_d:
            impls["flex"] = make_flex(pattern, n, device)
        for name, impl in impls.items():
            row = {**case, "impl": name, "shape": shape_of(n, d)}
            if time.monotonic() > deadline:
                row["skipped"] = "time budget spent"
            else:
                try:
                    row.update(measure(impl, n, d, device))
                    for which in ("fwd", "fwd+bwd"):
                        row[f"{which}_tflops"] = (
                            flops(pattern, n, d, which) / row[f"{which}_ms"] / 1e9
                        )
                except Exception as e:  # a backend that does not run this case says why
                    row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            shown = (
                row.get("skipped")
                or f"fwd {row['fwd_ms']:.2f} ms, fwd+bwd {row['fwd+bwd_ms']:.2f} ms"
            )
            progress(f"D={d} N={n} {pattern} {name}: {shown}")
            torch.cuda.empty_cache()
        write(report, args.out_dir)


def sweep(device, report: dict, args, deadline: float) -> None:
    rows = []
    report["sweep"] = rows
    n, d = 8192, 128
    for fwd_block, bwd_block, warps, stages in SWEEP:
        be = TritonBackend(
            *fwd_block,
            bwd_block_m=bwd_block[0],
            bwd_block_n=bwd_block[1],
            num_warps=warps,
            num_stages=stages,
        )
        for pattern in ("dense", "causal"):
            row = dict(d=d, n=n, pattern=pattern, config=repr(be))
            if time.monotonic() > deadline:
                row["skipped"] = "time budget spent"
            else:
                try:
                    row.update(measure(make_triton(pattern, be), n, d, device))
                except Exception as e:
                    row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            progress(f"sweep {be!r} {pattern}: {row.get('skipped') or row['fwd_ms']}")
    write(report, args.out_dir)


def targets(report: dict) -> None:
    rows = report.get("timing", [])
    out = []
    for desc, d, n, pattern, which, anchor, want in TARGETS:
        here = [r for r in rows if (r["d"], r["n"], r["pattern"]) == (d, n, pattern)]
        timed = {r["impl"]: r[f"{which}_ms"] for r in here if f"{which}_ms" in r}
        mine = timed.get("triton")
        if anchor == "sdpa-best":
            sdpa = [t for name, t in timed.items() if name.startswith("sdpa-")]
            other = min(sdpa) if sdpa else None
        else:
            other = timed.get(anchor)
        if mine is None or other is None:
            out.append({"target": desc, "result": "not measured"})
            continue
        ratio = other / mine  # speed relative to the anchor
        out.append({"target": desc, "ratio": ratio, "result": "PASS" if ratio >= want else "FAIL"})
    report["targets"] = out


# --------------------------------------------------------------------------- report


def fmt(row: dict, which: str) -> str:
    if "skipped" in row:
        return "—"
    if f"{which}_ms" not in row:
        return "not measured"
    return f"{row[f'{which}_ms']:.2f} ms · {row[f'{which}_tflops']:.0f}"


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "## GPU: the triton backend",
        "",
        f"Generated by `python benchmarks/gpu.py` on {env.get('device', '?')}, {env['date']}; "
        f"torch {env['torch']}, triton {env.get('triton', '?')}, bf16, B·N = {TOKENS}, "
        f"H·D = {WIDTH}, window = {WINDOW} each side. Cells: median time · TFLOP/s "
        "(FlashAttention's count; × density for the window).",
        "",
    ]
    if report.get("dry_run"):
        lines += ["**Dry run: nothing was measured.**", ""]
    checks = report.get("correctness", [])
    if checks:
        lines += ["### Correctness (error-ratio rule against the fp64 golden)", ""]
        lines += ["| check | result |", "| --- | --- |"]
        for c in checks:
            result = {True: "ok", False: "FAIL", None: c.get("skipped", "skipped")}[c["pass"]]
            lines.append(f"| {c['check']} | {result} |")
        lines.append("")
    rows = report.get("timing", [])
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    for d in HEAD_DIMS:
        for which in ("fwd", "fwd+bwd"):
            lines += [f"### D = {d}, {which}", ""]
            lines += ["| N | pattern | " + " | ".join(impls) + " |"]
            lines += ["| --- | --- |" + " --- |" * len(impls)]
            for n in SEQ_LENS:
                for p in PATTERNS:
                    here = {
                        r["impl"]: r for r in rows if (r["d"], r["n"], r["pattern"]) == (d, n, p)
                    }
                    cells = [fmt(here[i], which) if i in here else "" for i in impls]
                    lines.append(f"| {n} | {p} | " + " | ".join(cells) + " |")
            lines.append("")
    skipped = {(r["impl"], r["skipped"]) for r in rows if "skipped" in r}
    if skipped:
        lines += ["Not run (—):", ""]
        lines += [f"- {impl}: {why}" for impl, why in sorted(skipped)]
        lines.append("")
    if report.get("sweep"):
        lines += ["### Tile sweep (triton, N = 8192, D = 128)", ""]
        lines += ["| config | pattern | fwd ms | fwd+bwd ms |", "| --- | --- | --- | --- |"]
        for r in report["sweep"]:
            f1 = f"{r['fwd_ms']:.2f}" if "fwd_ms" in r else r.get("skipped", "")
            f2 = f"{r['fwd+bwd_ms']:.2f}" if "fwd+bwd_ms" in r else ""
            lines.append(f"| `{r['config']}` | {r['pattern']} | {f1} | {f2} |")
        lines.append("")
    if report.get("targets"):
        lines += ["### Targets", "", "| target | speed vs anchor | result |", "| --- | --- | --- |"]
        for t in report["targets"]:
            ratio = f"{t['ratio']:.2f}×" if "ratio" in t else ""
            lines.append(f"| {t['target']} | {ratio} | {t['result']} |")
        lines.append("")
    return "\n".join(lines)


def write(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu.json").write_text(json.dumps(report, indent=1, default=str))
    (out_dir / "gpu.md").write_text(markdown(report))


def environment(device) -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device is not None:
        env["device"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    default_out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks" / "out"
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", type=Path, default=default_out, help="where gpu.json/gpu.md go")
    ap.add_argument("--dry-run", action="store_true", help="list the cases; measure nothing")
    ap.add_argument("--budget-s", type=float, default=420.0, help="seconds for all timing")
    ap.add_argument(
        "--flex-n", type=int, nargs="*", default=[8192, 16384], help="N at which Flex runs"
    )
    ap.add_argument("--flex-d", type=int, nargs="*", default=[128], help="D at which Flex runs")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    if args.dry_run:
        report = {"environment": environment(None), "dry_run": True, "timing": []}
        for case in cases():
            impls = ["triton", *(f"sdpa-{w}" for w in SDPA_BACKENDS)]
            if case["n"] in args.flex_n and case["d"] in args.flex_d:
                impls.append("flex")
            for impl in impls:
                report["timing"].append(
                    {**case, "impl": impl, "shape": shape_of(case["n"], case["d"])}
                )
        targets(report)
        write(report, args.out_dir)
        n_rows = len(report["timing"])
        print(f"dry run: {n_rows} timing cases listed in {args.out_dir}/gpu.md, nothing measured")
        return 0
    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py needs a CUDA GPU: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}). Run it on a CUDA machine, or --dry-run to check it.",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda")
    report = {"environment": environment(device), "dry_run": False}
    progress(f"device: {report['environment']['device']}")
    if not args.skip_correctness:
        correctness(device, report)
        write(report, args.out_dir)
    deadline = start + args.budget_s
    timing(device, report, args, deadline)
    if not args.skip_sweep:
        sweep(device, report, args, deadline)
    targets(report)
    report["elapsed_s"] = time.monotonic() - start
    write(report, args.out_dir)
    print(markdown(report))
    failed = [c["check"] for c in report.get("correctness", []) if c["pass"] is False]
    if failed:
        print(f"correctness FAILED: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
