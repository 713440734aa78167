"""Vision: packed vision attention against transformers' per-chunk loop; received attention.

- (a) Qwen2.5-VL-shaped vision attention, forward, fp32, no gradient: images resized by
  Qwen2.5-VL's rule (`smart_resize`) to patches of 14 px, in the window order; *windowed*
  blocks attend within windows of up to 8×8 patches (`cu_window_seqlens`), *full* blocks within
  each image. q and k contiguous (rotated), v a strided view of the (N, 3, H, D) projection, as
  in the model. *transformers sdpa loop*: the non-flash branch of
  `Qwen2_5_VLVisionAttention.forward` verbatim (`torch.split` by the lengths, one
  `sdpa_attention_forward` call per chunk (*calls*), `torch.cat`); *qkv packed*:
  `qkv.vision.packed_attention(q, k, v, cu_seqlens)`, one qkv call; *precision high*: the same
  under `torch.set_float32_matmul_precision("high")` (the compiled kernel's float32 scores as one
  float gemm instead of sums in double); *fresh memory*: `qkv packed` after
  `qkv.kernels.cpu.release_cached_results()`, so its output is mapped afresh instead of reusing
  the block of a freed one (what every call paid before the kernel kept them; docs/cpu.md).
  *max |x − golden|*: against
  the float64 per-chunk reference; *eager's*: the same for transformers' eager loop in fp32.
  A Qwen2.5-VL-7B tower runs 28 windowed and 4 full blocks.
- (b) `qkv.received_attention(q, k)` (column sums of A, bands of query rows) against the forward
  `qkv.attention(q, k, v)` of the same problem, B=1, H=8, D=64, fp32; its peak memory in a fresh
  process.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
from typing import Any

import torch

import qkv

from .. import report as rp
from ..results import Results
from ..suite import FWD, Group, Impl, Memory, Probe, Suite, Target

LOOP, PACKED = "transformers sdpa loop", "qkv packed"
PACKED_HIGH = "qkv packed, precision high"
PACKED_FRESH = "qkv packed, fresh memory"
TOWER = {"windowed": 28, "full": 4}  # Qwen2.5-VL-7B's 32 vision blocks
MAX_PIXELS, PATCH = 12845056, 14


@dataclasses.dataclass(frozen=True)
class Encoder:
    block: str  # "windowed" or "full"
    images: str  # "W×H W×H ...": the packed images
    heads: int
    head_dim: int


@dataclasses.dataclass(frozen=True)
class Received:
    n: int
    heads: int
    head_dim: int


@dataclasses.dataclass(frozen=True)
class Settings:
    images: str
    heads: int
    head_dim: int
    rounds: dict[str, int]  # timed rounds per block kind
    received_n: int
    received_rounds: int


FULL = Settings("1344x1344 1344x756 640x480 448x448", 16, 80, {"windowed": 7, "full": 3}, 16384, 3)
QUICK = Settings("448x448 336x224", 4, 80, {"windowed": 2, "full": 2}, 2048, 2)


# --------------------------------------------------------------------------- (a) the encoder


@functools.cache
def partition(images: str):
    """Patch grids of the images and their window partition."""
    from qkv.vision import smart_resize, window_partition

    grids = []
    for size in images.split():
        w, h = map(int, size.split("x"))
        rh, rw = smart_resize(h, w, max_pixels=MAX_PIXELS)
        grids.append((1, rh // PATCH, rw // PATCH))
    return grids, window_partition(grids)


@functools.cache
def projections(images: str, heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as the vision attention holds them: one (N, 3, H, D) projection, q and k rotated
    (new tensors), v a strided view of the projection."""
    _, part = partition(images)
    n = int(part.cu_seqlens[-1])
    proj = torch.randn(n, 3, heads, head_dim, generator=torch.Generator().manual_seed(0))
    return proj[:, 0].contiguous(), proj[:, 1].contiguous(), proj[:, 2]


def encoder_inputs(c: Encoder, backward: bool):
    _, part = partition(c.images)
    cu = part.cu_window_seqlens if c.block == "windowed" else part.cu_seqlens
    return (*projections(c.images, c.heads, c.head_dim), cu, c.head_dim**-0.5), None


def packed(q, k, v, cu_seqlens, scaling: float) -> torch.Tensor:
    """`qkv.vision.packed_attention`: the whole packed sequence in one qkv call."""
    from qkv.vision import packed_attention

    return packed_attention(q, k, v, cu_seqlens, scale=scaling)


def packed_high(q, k, v, cu_seqlens, scaling: float) -> torch.Tensor:
    """`packed` under `torch.set_float32_matmul_precision("high")`."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        return packed(q, k, v, cu_seqlens, scaling)
    finally:
        torch.set_float32_matmul_precision(before)


def packed_fresh(q, k, v, cu_seqlens, scaling: float) -> torch.Tensor:
    """`packed` with no freed result kept to reuse: the output's memory is mapped afresh."""
    from qkv.kernels.cpu import release_cached_results

    release_cached_results()
    return packed(q, k, v, cu_seqlens, scaling)


class _Module:
    """What transformers' attention functions read from the calling module."""

    is_causal = False
    num_key_value_groups = 1
    training = False


def transformers_loop(impl: str):
    """The non-flash branch of Qwen2_5_VLVisionAttention.forward, verbatim: split the packed
    (1, H, N, D) tensors by the segment lengths, one attention call per chunk, concatenate."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import eager_attention_forward

    interface = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)

    def run(q, k, v, cu_seqlens, scaling):
        query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        splits = [torch.split(t, lengths, dim=2) for t in (query, key, value)]
        outs = [
            interface(
                _Module(),
                a,
                b,
                c,
                attention_mask=None,
                scaling=scaling,
                dropout=0.0,
                is_causal=False,
            )[0]
            for a, b, c in zip(*splits, strict=True)
        ]  # fmt: skip
        return torch.cat(outs, dim=1)[0]  # (N, H, D)

    return run


def golden(q, k, v, cu_seqlens, scaling: float, rows: int = 2048) -> torch.Tensor:
    """float64 reference, one segment, head and band of query rows at a time."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for a, b in itertools.pairwise(cu_seqlens.tolist()):
        for h in range(q.shape[1]):
            kh, vh = k[a:b, h].double(), v[a:b, h].double()
            for r in range(a, b, rows):
                s = (q[r : min(b, r + rows), h].double() @ kh.T) * scaling
                out[r : min(b, r + rows), h] = torch.softmax(s, dim=-1) @ vh
    return out


def accuracy(c: Encoder, outs: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """max |out − golden| of each implementation and of transformers' eager loop (run two heads
    at a time: its N×N weights for all heads of the largest image would be 5 GiB)."""
    (q, k, v, cu, scaling), _ = encoder_inputs(c, False)
    eager = transformers_loop("eager")
    with torch.no_grad():
        gold = golden(q, k, v, cu, scaling)
        parts = [
            eager(q[:, h : h + 2], k[:, h : h + 2], v[:, h : h + 2], cu, scaling)
            for h in range(0, q.shape[1], 2)
        ]
    eager_err = (torch.cat(parts, dim=1).double() - gold).abs().max().item()
    return {
        name: {"err": (out.double() - gold).abs().max().item(), "eager_err": eager_err}
        for name, out in outs.items()
    }


ENCODER = Group(
    name="encoder",
    cases=lambda s: [Encoder(b, s.images, s.heads, s.head_dim) for b in ("windowed", "full")],
    inputs=encoder_inputs,
    impls=(
        Impl(LOOP, lambda c: transformers_loop("sdpa"), passes=(FWD,)),
        Impl(PACKED, lambda c: packed, passes=(FWD,)),
        Impl(PACKED_HIGH, lambda c: packed_high, passes=(FWD,)),
        Impl(PACKED_FRESH, lambda c: packed_fresh, passes=(FWD,)),
    ),
    passes=(FWD,),
    anchors=(LOOP,),
    repeats=lambda s, c: s.rounds[c.block],
    check=accuracy,
)


# --------------------------------------------------------------------------- (b) received


def received_inputs(c: Received, backward: bool):
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randn(1, c.heads, c.n, c.head_dim, generator=gen) for _ in range(3)), None


def call(name: str) -> Impl:
    causal = name.endswith("causal")
    if name.startswith("received"):
        return Impl(
            name,
            lambda c: lambda q, k, v: qkv.received_attention(q, k, causal=causal),
            passes=(FWD,),
        )
    return Impl(
        name, lambda c: lambda q, k, v: qkv.attention(q, k, v, causal=causal), passes=(FWD,)
    )


RECEIVED = Group(
    name="received",
    cases=lambda s: [Received(s.received_n, 8, 64)],
    inputs=received_inputs,
    impls=tuple(call(n) for n in ("forward", "received", "forward causal", "received causal")),
    passes=(FWD,),
    anchors=("forward", "forward causal"),
    repeats=lambda s, c: s.received_rounds,
    warm=lambda c: Received(256, c.heads, c.head_dim),
)


def probes(s: Settings) -> list[Probe]:
    return [
        Probe("received", Received(s.received_n, 8, 64), name, FWD, 1800)
        for name in ("received", "received causal")
    ]


# --------------------------------------------------------------------------- the report


def requires() -> str | None:
    if importlib.util.find_spec("transformers") is None:
        return "needs transformers: pip install -e '.[hf]'"
    return None


def prepare(_: Settings) -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def facts(s: Settings) -> dict[str, Any]:
    import transformers

    from qkv.vision.packed import plan_layout

    grids, part = partition(s.images)
    n = int(part.cu_seqlens[-1])
    return {
        "software": {"transformers": transformers.__version__},
        "grids": grids,
        "n": n,
        "window_lengths": list(part.window_lengths),
        "image_lengths": (part.cu_seqlens[1:] - part.cu_seqlens[:-1]).tolist(),
        "layouts": {
            "windowed": plan_layout(part.cu_window_seqlens, n).layout,
            "full": plan_layout(part.cu_seqlens, n).layout,
        },
    }


def method(r: Results) -> list[str]:
    f, s = r.facts, r.settings
    if "n" not in f:
        return []
    wl = f["window_lengths"]
    hist = ", ".join(f"{wl.count(x)} of {x}" for x in sorted(set(wl), reverse=True))
    grids = ", ".join(f"{h}×{w}" for _, h, w in f["grids"])
    return [
        f"- (a) Images {s['images'].replace('x', '×').replace(' ', ', ')} → {grids} patches: "
        f"N = {f['n']}, {s['heads']} heads of {s['head_dim']}; {len(wl)} windows ({hist} "
        f"patches; qkv layout `{f['layouts']['windowed']}`); {len(f['image_lengths'])} images "
        f"({', '.join(map(str, f['image_lengths']))} patches; qkv layout "
        f"`{f['layouts']['full']}`).",
        f"- (b) N = {s['received_n']}: the dense weights would be "
        f"{8 * s['received_n'] ** 2 * 4 / 2**30:.3g} GiB.",
    ]


def calls(r: rp.Row) -> str:
    """Attention calls per block: one per chunk for the loop, one for qkv."""
    if r.impl != LOOP:
        return "1"
    lengths = r.results.facts.get(
        "window_lengths" if r.case.block == "windowed" else "image_lengths"
    )
    return "—" if lengths is None else str(len(lengths))


ENCODER_TABLE = rp.Table(
    (
        rp.Column("block", lambda r: r.case.block, "l"),
        rp.impl_column(),
        rp.Column("calls", calls),
        rp.time_column(FWD, "forward ms"),
        rp.ratio_column(FWD, LOOP, "×loop"),
        rp.ratio_column(FWD, LOOP, "×loop range", span=True),
        rp.Column("max \\|x − golden\\|", lambda r: rp.fmt(r.extra("err"), ".1e")),
        rp.Column("eager's", lambda r: rp.fmt(r.extra("eager_err"), ".1e")),
        rp.Column("rounds", lambda r: str(r.timing(FWD).rounds)),
    ),
    lambda r: rp.rows(r, "encoder"),
    "(a) Qwen2.5-VL-shaped vision attention, forward",
)


def tower(r: Results) -> list[str]:
    """The per-tower estimate: 28 windowed + 4 full blocks, from the medians."""
    total = {}
    for impl in (LOOP, PACKED):
        times = [(c.block, r.median("encoder", c, impl, FWD)) for c in r.case_objects("encoder")]
        if any(t is None for _, t in times) or len(times) < len(TOWER):
            return []
        total[impl] = sum(TOWER[b] * t for b, t in times)
    return [
        f"Per Qwen2.5-VL-7B tower ({TOWER['windowed']} windowed + {TOWER['full']} full blocks, "
        f"attention only): transformers sdpa loop {total[LOOP]:.2f} s, qkv packed "
        f"{total[PACKED]:.2f} s (×{total[LOOP] / total[PACKED]:.2f}), from the medians above.",
        "",
    ]


def over_forward(row: rp.Row) -> float | None:
    """time_received / time_forward (same mode), the median over rounds."""
    anchor = "forward causal" if row.impl.endswith("causal") else "forward"
    ratio = row.ratio(FWD, anchor)
    return 1 / ratio["median"] if ratio else None


RECEIVED_TABLE = rp.Table(
    (
        rp.impl_column("call"),
        rp.time_column(FWD, "median s", scale=1.0, spec=".2f"),
        rp.Column("÷ forward", lambda r: rp.fmt(over_forward(r), ".2f")),
        rp.Column(
            "peak beyond inputs (MiB)",
            lambda r: rp.fmt(m.peak_mib if (m := r.memory(FWD)) else None, ".1f"),
        ),
    ),
    lambda r: rp.rows(r, "received"),
    lambda r: f"(b) Received attention at N = {r.settings['received_n']}",
    lambda r: (
        "Peak memory: one call in a fresh process (`benchmarks/probe.py`), beyond the inputs "
        "q, k, v."
    ),
)


def received_ratio(name: str) -> Target:
    return Target(
        f"{name} time / {name.replace('received', 'forward')} time at N=16384",
        lambda r: over_forward(rp.Row(r, "received", Received(16384, 8, 64), name)),
        2.0,
        at_least=False,
        unit="",
    )


def received_peak(name: str) -> Target:
    def peak(r: Results) -> float | None:
        m = r.memory_of("received", Received(16384, 8, 64), name, FWD)
        return m.peak_mib if m else None

    return Target(
        f"{name} attention peak memory beyond the inputs",
        peak,
        64.0,
        at_least=False,
        unit=" MiB",
        digits=1,
    )


def accuracy_target(block: str, impl: str = PACKED) -> Target:
    def value(r: Results) -> float | None:
        c = next((c for c in r.case_objects("encoder") if c.block == block), None)
        row = rp.Row(r, "encoder", c, impl) if c else None
        err, eager = (row.extra("err"), row.extra("eager_err")) if row else (None, None)
        return None if err is None else err / (2 * eager + 1e-7)

    what = "qkv" if impl == PACKED else f"qkv ({impl.split(', ')[-1]})"
    return Target(
        f"{block} blocks: max |{what} − golden| / (2·max |eager − golden| + 1e-7)",
        value,
        1.0,
        at_least=False,
        unit="",
    )


SUITE = Suite(
    name="vision",
    title="Vision: packed encoder attention and received attention",
    settings={"full": FULL, "quick": QUICK},
    steps=(ENCODER, RECEIVED, Memory(probes)),
    targets=(
        Target(
            "windowed blocks, forward: qkv packed ×(transformers sdpa loop)",
            lambda r: next(
                (
                    r.ratio("encoder", c, PACKED, FWD, LOOP)
                    for c in r.case_objects("encoder")
                    if c.block == "windowed"
                ),
                None,
            ),
            2.0,
        ),
        accuracy_target("windowed"),
        accuracy_target("full"),
        accuracy_target("windowed", PACKED_HIGH),
        received_ratio("received"),
        received_ratio("received causal"),
        received_peak("received"),
        received_peak("received causal"),
    ),
    report=(ENCODER_TABLE, tower, RECEIVED_TABLE),
    doc=__doc__,
    method=method,
    ceiling=True,
    requires=requires,
    prepare=prepare,
    facts=facts,
)
