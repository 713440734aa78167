"""Dispatch regret: `auto` against the fastest exact backend, request by request.

- Requests: decoding (Nq ∈ {1, 4, 16} against Nk from 256 to 65536; H = 32 on Hkv = 8 at
  D = 128, and H = Hkv = 8 at D = 64), prefill (Nq = Nk = N from 16 to 16384, dense and causal,
  D = 64 and 128, H = 4; forward and forward + backward up to N = 4096, forward alone beyond),
  masks at N = 1024 and 4096 (sliding window 256, Longformer = window 256 | 16 global tokens,
  4 documents, padding of the last quarter of the keys as a bool key mask with
  `finite_inputs=True`, the way the transformers integration passes it) and small calls;
  float32 and bfloat16, B = 1, CPU.
- Implementations: `auto` = `qkv.attention(...)` as a user calls it; `cpu`, `sdpa`, `tiled` = the
  same call with `backend=` that name, wherever that backend computes exactly the request's
  semantics (`why_not` is None; torch SDPA is left out of float32 gradients, which `auto` keeps
  from it for accuracy, and asked by name it builds the dense mask of a structured one). `tiled`
  (qkv's pure-PyTorch loop) runs up to 4096 scores per row.
- **Regret** = auto's median time ÷ the smallest median of the backends at the request
  (≥ 1; 1.00 means auto was as fast as the fastest). "auto runs" names the backend `auto`
  picked, and "crossovers" which table decided between the kernel and SDPA (`qkv tune`'s
  calibration or qkv's default).
- Run with the quiet gate off (`--gate off`) on a quiet machine, the load recorded: the gate
  samples the CPUs over a 0.2 s sleep before each round, after which the round's first call
  paid up to ~10 ms of waking idle vCPUs (a 0.5 ms forward + backward took 1.4–12 ms after such
  a sleep, 0.4–0.7 ms without), and that call is `auto`'s in three rounds of five.
- **Fixed cost** of a decoding call (q (1, 32, 1, 128), k/v (1, 8, 4096, 128), fp32) around the
  kernel: `qkv.attention` and the transformers integration's `attention_forward` timed with the
  compiled op replaced by a stub returning its results, as a share of that plus the op's own
  time (the op called with its layout already built).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable

import torch

import qkv
from qkv import masks

from .. import report as rp
from ..results import Results
from ..suite import FWD, FWD_BWD, Group, Impl, Stage, Suite, Target

BACKENDS = ("cpu", "sdpa", "tiled")
TILED_MAX_NK = 4096
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
REGRET_MAX = 1.05


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # "decode", "prefill", "mask" or "small"
    dtype: str  # "fp32" or "bf16"
    nq: int
    nk: int
    h: int
    hkv: int
    d: int
    causal: bool = False
    mask: str = ""  # "", "window", "longformer", "documents", "padding"


@dataclasses.dataclass(frozen=True)
class Settings:
    decode_nq: tuple[int, ...]
    decode_nk: tuple[int, ...]
    prefill_n: tuple[int, ...]
    grad_max_n: int
    long_n: tuple[int, ...]
    mask_n: tuple[int, ...]
    repeats: int


FULL = Settings(
    (1, 4, 16),
    (256, 1024, 4096, 16384, 65536),
    (16, 64, 256, 1024, 4096),
    4096,
    (16384,),
    (1024, 4096),
    5,
)
QUICK = Settings((1,), (256, 1024), (16, 256), 256, (), (256,), 2)  # fmt: skip


def mask_of(case: Case):
    """The `mask=` of a case (a `Mask`, a bool key mask, or None)."""
    n = case.nk
    if case.mask == "window":
        return masks.sliding_window(256)
    if case.mask == "longformer":
        return masks.sliding_window(256) | masks.global_tokens(range(16))
    if case.mask == "documents":
        return masks.document([n // 4] * 3 + [n - 3 * (n // 4)])
    if case.mask == "padding":
        keep = torch.ones(1, 1, 1, n, dtype=torch.bool)
        keep[..., n - n // 4 :] = False
        return keep
    return None


def kwargs_of(case: Case) -> dict:
    return dict(causal=case.causal, mask=mask_of(case), finite_inputs=case.mask == "padding")


def shapes(case: Case):
    return (1, case.h, case.nq, case.d), (1, case.hkv, case.nk, case.d)


def inputs(case: Case, backward: bool):
    gen = torch.Generator().manual_seed(case.nq * 7919 + case.nk)
    qs, ks = shapes(case)
    dtype = DTYPES[case.dtype]
    q, k, v = (torch.randn(s, generator=gen).to(dtype) for s in (qs, ks, ks))
    if not backward:
        return (q, k, v), None
    grad = torch.randn(qs, generator=gen).to(dtype)
    return (q.requires_grad_(), k.requires_grad_(), v.requires_grad_()), grad


def _stand_ins(case: Case, grad: bool):
    """q, k, v of the case's shapes and dtype that hold one element each (for dispatch only)."""
    qs, ks = shapes(case)
    dtype = DTYPES[case.dtype]
    return [torch.zeros(1, dtype=dtype).expand(s).requires_grad_(grad) for s in (qs, ks, ks)]


def runs(case: Case, backend: str, grad: bool) -> bool:
    """Does `backend` compute exactly this request (and belong in the race)?"""
    if backend == "tiled" and case.nk > TILED_MAX_NK:
        return False
    if backend == "sdpa" and grad and case.dtype == "fp32":
        return False  # auto keeps float32 gradients from SDPA: not within qkv's error rule
    q, k, v = _stand_ins(case, grad)
    try:
        qkv.dispatch(q, k, v, backend=backend, **kwargs_of(case))
    except NotImplementedError:
        return False
    return True


def auto_choice(case: Case, grad: bool) -> dict:
    with torch.set_grad_enabled(grad):
        d = qkv.dispatch(*_stand_ins(case, grad), **kwargs_of(case))
    return {"runs": d.name, "basis": d.basis}


def impl(name: str) -> Impl:
    def make(case: Case) -> Callable:
        kw = kwargs_of(case)
        if name != "auto":
            kw["backend"] = name
        return lambda q, k, v: qkv.attention(q, k, v, **kw)

    return Impl(
        name,
        make,
        when=lambda c: name == "auto" or runs(c, name, False) or runs(c, name, True),
        skip=lambda c, r: None,
    )


def describe(case: Case) -> dict:
    return {"fwd": auto_choice(case, False), "fwd+bwd": auto_choice(case, True)}


def group(name: str, cases: Callable[[Settings], list[Case]], passes=(FWD, FWD_BWD)) -> Group:
    return Group(
        name=name,
        cases=cases,
        inputs=inputs,
        impls=(impl("auto"), *(impl(b) for b in BACKENDS)),
        passes=passes,
        repeats=lambda s, c: s.repeats,
        describe=describe,
    )


def decode_cases(s: Settings) -> list[Case]:
    return [
        Case("decode", dt, nq, nk, h, hkv, d)
        for dt in DTYPES
        for h, hkv, d in ((32, 8, 128), (8, 8, 64))
        for nq in s.decode_nq
        for nk in s.decode_nk
    ]


def prefill_cases(s: Settings, sizes: tuple[int, ...], heads: tuple[int, ...] = (64, 128)):
    return [
        Case("prefill", dt, n, n, 4, 4, d, causal)
        for dt in DTYPES
        for causal in (False, True)
        for d in heads
        for n in sizes
    ]


def mask_cases(s: Settings) -> list[Case]:
    names = ("window", "longformer", "documents", "padding")
    return [
        Case("mask", dt, n, n, 4, 4, 64, False, m) for dt in DTYPES for m in names for n in s.mask_n
    ]


def small_cases(s: Settings) -> list[Case]:
    hnd = ((1, 8, 16), (4, 32, 32), (8, 1, 64))  # (H, Nq, D); Nk = max(Nq, 8)
    return [Case("small", dt, n, max(n, 8), h, h, d) for dt in DTYPES for h, n, d in hnd]


GROUPS = (
    group("decode", decode_cases, passes=(FWD,)),
    group("prefill", lambda s: prefill_cases(s, s.prefill_n)),
    group("prefill-long", lambda s: prefill_cases(s, s.long_n, (64,)), passes=(FWD,)),
    group("masks", mask_cases),
    group("small", small_cases),
)


# --------------------------------------------------------------------------- the fixed cost


def _median_s(call: Callable[[], object], rounds: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fixed_cost(settings: Settings, results: Results) -> dict:
    """What a decoding call costs around the kernel: the compiled op alone (its layout built
    once, outside the timing), and `qkv.attention` and the transformers wrapper with the op
    replaced by a stub that returns the op's results (so the time is the path alone: timing
    the whole call and subtracting the op's time leaves noise ten times the difference). The
    share is path ÷ (path + op)."""
    from qkv.kernels.cpu import kernel_layout, load
    from qkv.kernels.cpu import op as cpu_op
    from qkv.kernels.cpu.backend import default_block_q, kernel_status
    from qkv.plan import make_plan

    isa, why = kernel_status()
    if isa is None:
        return {"error": why}
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 1, 128, generator=g)
    k, v = (torch.randn(1, 8, 4096, 128, generator=g) for _ in range(2))
    plan = make_plan(q, k, v)
    lay = kernel_layout(plan.pairs, default_block_q(plan.groups, False))
    ops = load()

    def op():
        return ops.forward(
            q, k, v, lay.row_ptr, lay.col_idx, lay.code, lay.bits, lay.q_starts, lay.k_starts,
            lay.block_q, plan.scale, None, 0.0, False, 0.0, 0, True, isa,
        )  # fmt: skip

    with torch.no_grad():
        done = op()
        med = {"op": statistics.median(_median_s(op, 10) for _ in range(7))}

        class Stub:  # the op's namespace, answering with the results computed above
            def forward(self, *args):
                return done

        paths = {"qkv.attention": lambda: qkv.attention(q, k, v)}
        try:
            from qkv.integrations import hf

            layer = torch.nn.Module()
            layer.is_causal = True
            paths["transformers"] = lambda: hf.attention_forward(layer, q, k, v, None)
        except ImportError:
            pass
        real = cpu_op.load
        cpu_op.load = lambda: Stub()  # type: ignore[assignment]
        try:
            for name, call in paths.items():
                med[name] = statistics.median(_median_s(call, 200) for _ in range(7))
        finally:
            cpu_op.load = real
    return {
        "median_s": med,
        "share": {n: t / (t + med["op"]) for n, t in med.items() if n != "op"},
    }


ANCHOR_NK = (1024, 4096)


def decoding_anchor(settings: Settings, results: Results) -> dict:
    """The issue's decoding comparison: q 1×32×1×128, k/v 1×8×Nk×128, fp32, `auto` against
    torch SDPA called as a user calls it with grouped heads (`enable_gqa=True`) and against
    qkv's `sdpa` backend (the same SDPA with the heads packed as rows), in interleaved rounds."""
    import torch.nn.functional as F

    out: dict[str, dict[str, float]] = {}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for nk in ANCHOR_NK:
            q = torch.randn(1, 32, 1, 128, generator=g)
            k, v = (torch.randn(1, 8, nk, 128, generator=g) for _ in range(2))
            calls = {
                "auto": functools.partial(qkv.attention, q, k, v),
                "torch SDPA (enable_gqa)": functools.partial(
                    F.scaled_dot_product_attention, q, k, v, enable_gqa=True
                ),
                "qkv sdpa (packed)": functools.partial(qkv.attention, q, k, v, backend="sdpa"),
            }
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(7):
                for name, call in calls.items():
                    times[name].append(_median_s(call, 20))
            out[str(nk)] = {name: statistics.median(ts) for name, ts in times.items()}
    return out


def _anchor(results: Results, nk: int, against: str) -> float | None:
    data = (results.stages.get("decoding anchor") or {}).get(str(nk)) or {}
    auto, other = data.get("auto"), data.get(against)
    return None if not auto or other is None else other / auto


def anchor_block(results: Results) -> list[str]:
    data = results.stages.get("decoding anchor") or {}
    if not data:
        return []
    lines = [
        "### Decoding against torch SDPA as users call it (q 1×32×1×128, k/v 1×8×Nk×128, fp32)",
        "",
        "Medians of 7 interleaved rounds of 20 calls. `torch SDPA (enable_gqa)` is "
        "`F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`; `qkv sdpa (packed)` is "
        "qkv's `sdpa` backend, which runs the grouped heads as rows of one head (the grid "
        "above compares against it).",
        "",
        "| Nk | auto µs | torch SDPA (enable_gqa) µs | qkv sdpa (packed) µs | auto ×torch SDPA "
        "| auto ×packed |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for nk, t in data.items():
        a, f, p = t["auto"], t["torch SDPA (enable_gqa)"], t["qkv sdpa (packed)"]
        lines.append(
            f"| {nk} | {a * 1e6:.0f} | {f * 1e6:.0f} | {p * 1e6:.0f} | {f / a:.2f} | {p / a:.2f} |"
        )
    return [*lines, ""]


# --------------------------------------------------------------------------- the report


def all_rows(results: Results) -> list[tuple[rp.Row, str]]:
    return [
        (rp.Row(results, g.name, c), p)
        for g in GROUPS
        for c in results.case_objects(g.name)
        for p in g.passes
    ]


def exact_times(row: rp.Row, pass_: str) -> dict[str, float]:
    """Median times of the backends that compute this request exactly in this pass."""
    grad = pass_ == FWD_BWD
    return {
        b: t
        for b in BACKENDS
        if (t := row.median(pass_, b)) is not None and runs(row.case, b, grad)
    }


def regret(row: rp.Row, pass_: str) -> float | None:
    auto, best = row.median(pass_, "auto"), exact_times(row, pass_)
    return None if auto is None or not best else auto / min(best.values())


def fastest(row: rp.Row, pass_: str) -> str:
    got = exact_times(row, pass_)
    return min(got, key=got.get) if got else "—"


def worst(results: Results) -> tuple[float | None, str]:
    found = [(r, row, p) for row, p in all_rows(results) if (r := regret(row, p)) is not None]
    if not found:
        return None, "—"
    r, row, p = max(found, key=lambda x: x[0])
    return r, f"{label(row.case)} {p}"


def what(c: Case) -> str:
    return c.mask or ("causal" if c.causal else "dense")


def label(c: Case) -> str:
    return f"{c.kind} {c.dtype} Nq={c.nq} Nk={c.nk} H={c.h}/{c.hkv} D={c.d} {what(c)}"


def _ms(t: float | None) -> str:
    return rp.fmt(None if t is None else t * 1e3, ".3g")


def grid_table(name: str, title: str) -> rp.Table:
    def rows(results: Results):
        return [(row, p) for row, p in all_rows(results) if row.group == name]

    def choice(x) -> dict:
        return x[0].extra(x[1]) or {}

    cols = (
        rp.Column("dtype", lambda x: x[0].case.dtype, "l"),
        rp.Column("Nq", lambda x: str(x[0].case.nq)),
        rp.Column("Nk", lambda x: str(x[0].case.nk)),
        rp.Column("H/Hkv", lambda x: f"{x[0].case.h}/{x[0].case.hkv}"),
        rp.Column("D", lambda x: str(x[0].case.d)),
        rp.Column("mask", lambda x: what(x[0].case), "l"),
        rp.Column("pass", lambda x: x[1], "l"),
        rp.Column("auto ms", lambda x: _ms(x[0].median(x[1], "auto"))),
        *(rp.Column(f"{b} ms", lambda x, b=b: _ms(x[0].median(x[1], b))) for b in BACKENDS),
        rp.Column("auto runs", lambda x: str(choice(x).get("runs", "—")), "l"),
        rp.Column("fastest", lambda x: fastest(*x), "l"),
        rp.Column("regret", lambda x: rp.fmt(regret(*x), ".2f")),
    )  # fmt: skip
    return rp.Table(cols, rows, title=title)


def summary(results: Results) -> list[str]:
    found = [(r, row, p) for row, p in all_rows(results) if (r := regret(row, p)) is not None]
    if not found:
        return []
    over = [x for x in found if x[0] > REGRET_MAX]
    value, where = worst(results)
    bases = sorted({b for row, p in all_rows(results) if (b := (row.extra(p) or {}).get("basis"))})
    lines = [
        "### Summary",
        "",
        f"- Requests × passes timed: {len(found)}; regret above {REGRET_MAX:.2f}: {len(over)}; "
        f"median regret {statistics.median(r for r, _, _ in found):.3f}; worst "
        f"{rp.fmt(value, '.2f')} ({where}).",
    ]
    lines += [f"- Crossovers that decided: {b}." for b in bases]
    lines += [f"- Over {REGRET_MAX:.2f}: {label(row.case)} {p}: {r:.2f}" for r, row, p in over]
    return [*lines, ""]


def fixed_cost_block(results: Results) -> list[str]:
    data = results.stages.get("fixed cost")
    if not data or "median_s" not in data:
        return []
    med, share = data["median_s"], data["share"]
    lines = [
        "### Fixed cost of a decoding call (q 1×32×1×128, k/v 1×8×4096×128, fp32)",
        "",
        "| call | median µs | share of the call |",
        "|:---|---:|---:|",
    ]
    for name, t in med.items():
        extra = "—" if name == "op" else f"{100 * share[name]:.1f}%"
        name = "the compiled op" if name == "op" else f"{name}, around the op"
        lines.append(f"| {name} | {t * 1e6:.0f} | {extra} |")
    return [*lines, ""]


def _share(results: Results, name: str) -> float | None:
    data = results.stages.get("fixed cost") or {}
    return (data.get("share") or {}).get(name)


SUITE = Suite(
    name="dispatch",
    title="Dispatch regret: `auto` against the fastest exact backend",
    settings={"full": FULL, "quick": QUICK},
    steps=(*GROUPS, Stage("fixed cost", fixed_cost), Stage("decoding anchor", decoding_anchor)),
    targets=(
        Target("worst regret over the grid", lambda r: worst(r)[0], REGRET_MAX, at_least=False),
        Target(
            "decoding auto ×torch SDPA (enable_gqa), fp32 GQA 32:8 D=128 Nk=4096",
            lambda r: _anchor(r, 4096, "torch SDPA (enable_gqa)"),
            2.0,
        ),
        Target(
            "decoding auto ×torch SDPA (enable_gqa), fp32 GQA 32:8 D=128 Nk=1024",
            lambda r: _anchor(r, 1024, "torch SDPA (enable_gqa)"),
            1.2,
        ),
        Target(
            "decoding auto ×qkv sdpa (packed), fp32 GQA 32:8 D=128 Nk=4096",
            lambda r: _anchor(r, 4096, "qkv sdpa (packed)"),
            1.0,
        ),
        Target(
            "fixed cost through qkv.attention, Nk=4096",
            lambda r: _share(r, "qkv.attention"),
            0.10,
            at_least=False,
            unit="%",
        ),
        Target(
            "fixed cost through transformers, Nk=4096",
            lambda r: _share(r, "transformers"),
            0.10,
            at_least=False,
            unit="%",
        ),
    ),
    report=(
        summary,
        fixed_cost_block,
        anchor_block,
        grid_table("decode", "Decoding"),
        grid_table("prefill", "Prefill"),
        grid_table("prefill-long", "Prefill, long"),
        grid_table("masks", "Masks"),
        grid_table("small", "Small calls"),
    ),
    doc=__doc__,
    method=lambda r: [f"- Timed rounds per request: {r.settings['repeats']} (one warm-up)."],
)
