"""qkv under `torch.compile(dynamic=True, fullgraph=True)`: `auto` decides between the compiled
CPU kernel and torch SDPA from the crossover table's bands (`crossover.Table.bands`), comparing
the symbolic work with each band's bound (a guard torch keeps), never by calling into the table
with a symbolic size. So: no graph break, and a new graph only where a size crosses a crossover
(the decision changes); otherwise as many graphs as plain SDPA or transformers' "eager" take.

Each case writes its own calibration (the machine's is left alone), so where the crossovers lie
does not depend on the machine the tests run on."""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import qkv
from qkv.kernels.cpu import crossover
from qkv.kernels.cpu.backend import kernel_status
from qkv.plan import make_plan

from .helpers import assert_error_ratio, golden

ISA, WHY = kernel_status()
needs_kernel = pytest.mark.skipif(ISA is None, reason=f"no compiled CPU kernel: {WHY}")

SDPA_FIRST = [[1e2, 0.5], [1e3, 0.5], [1e4, 0.5], [1e5, 2.0], [1e6, 2.0]]  # the kernel from ~3e4
KERNEL_FAR = [[1e1, 2.0], [1e3, 2.0], [1e9, 0.5], [1e10, 0.5]]  # the kernel below ~3e7


@pytest.fixture
def calibration(monkeypatch, tmp_path):
    """`write(points)`: a calibration of our own for the kernel's path, read afresh."""
    path = tmp_path / crossover.CALIBRATED
    monkeypatch.setattr(crossover, "calibrated_path", lambda: path)
    monkeypatch.delenv(crossover.ENV, raising=False)

    def write(points: dict) -> None:
        data = {"qkv_version": crossover.qkv_version()}
        data["paths"] = {ISA: {"measured_on": "a test", "points": points}}
        path.write_text(json.dumps(data))
        crossover.clear()
        torch._dynamo.reset()

    yield write
    crossover.clear()


def _graph_ops(gm) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


class Graphs(CompileCounterWithBackend):
    """Counts the graphs compiled and keeps which attention each one runs."""

    def __init__(self):
        super().__init__("eager")
        self.runs: list[str] = []

    def __call__(self, gm, example_inputs):
        ops = " ".join(_graph_ops(gm))
        self.runs.append(
            "cpu" if "qkv.cpu_forward" in ops else "sdpa" if "scaled_dot" in ops else "?"
        )
        return super().__call__(gm, example_inputs)


def _compiled(fn, calls, backend="auto"):
    """Outputs and graph counter of `fn` compiled with dynamic shapes and fullgraph=True."""
    torch._dynamo.reset()
    counter = Graphs()
    cf = torch.compile(fn, dynamic=True, fullgraph=True, backend=counter)
    with torch.no_grad():
        return [cf(*args, backend=backend) for args in calls], counter


def _decisions(fn_kwargs, calls) -> list[str]:
    """auto's eager decision for each call, and its runs (a new one where it changes)."""
    names = [qkv.dispatch(*args, **fn_kwargs).name for args in calls]
    return [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]


def _square(ns, H=2, D=16):
    g = torch.Generator().manual_seed(0)
    return [tuple(torch.randn(1, H, n, D, generator=g) for _ in range(3)) for n in ns]


def _decoding(nks, H=2, D=16):
    g = torch.Generator().manual_seed(1)
    calls = []
    for nk in nks:
        q = torch.randn(1, H, 1, D, generator=g)
        calls.append(
            (q, torch.randn(1, H, nk, D, generator=g), torch.randn(1, H, nk, D, generator=g))
        )
    return calls


CASES = {  # name -> (keyword arguments, calls, the class the table is written for)
    # dense: work = 2·n²·32 crosses ~3.2e4 between n = 20 and 33
    "dense": ({}, _square((20, 33, 47, 64, 90, 128, 150)), "dense/float32/fwd/D64"),
    # causal: half of it, crossing between n = 20 and 47
    "causal": ({"causal": True}, _square((20, 47, 64, 97, 128, 160)), "causal/float32/fwd/D64"),
    # one query over a growing cache: work = 2·Nk·32 crosses ~3.2e4 between Nk = 400 and 600
    "decoding": (
        {"causal": True},
        _decoding((17, 40, 100, 250, 400, 600, 900, 1300)),
        "decode-mha-q1/float32/fwd/D64",
    ),
}


@needs_kernel
@pytest.mark.parametrize("case", list(CASES))
def test_auto_compiles_across_lengths_with_a_graph_per_crossover(calibration, case):
    kwargs, calls, cls = CASES[case]
    kwargs = {**kwargs, "finite_inputs": True}  # as qkv.nn and the transformers backend pass
    calibration({cls: SDPA_FIRST})
    runs = _decisions(kwargs, calls)
    assert runs == ["sdpa", "cpu"], runs  # the table's crossover lies inside the lengths

    def f(q, k, v, backend):
        return qkv.attention(q, k, v, backend=backend, **kwargs)

    got, counter = _compiled(f, calls)  # fullgraph=True: a graph break raises
    assert counter.runs == runs  # one graph per side of the crossover, deciding as eager does
    _, sdpa = _compiled(f, calls, backend="sdpa")
    assert (counter.frame_count, sdpa.frame_count) == (2, 1)  # +1: the crossover, and only it
    for out, (q, k, v) in zip(got, calls, strict=True):
        ref = qkv.attention(q, k, v, backend="reference", **kwargs)
        assert_error_ratio(out, ref, golden(q, k, v, **kwargs))


@needs_kernel
def test_without_a_crossover_in_range_auto_takes_as_many_graphs_as_sdpa(calibration):
    kwargs, calls, cls = CASES["decoding"]
    calibration({cls: KERNEL_FAR})

    def f(q, k, v, backend):
        return qkv.attention(q, k, v, finite_inputs=True, backend=backend, **kwargs)

    _, counter = _compiled(f, calls)
    _, sdpa = _compiled(f, calls, backend="sdpa")
    assert counter.runs == ["cpu"] and counter.frame_count == sdpa.frame_count == 1


def test_bands_decide_as_the_nearest_point_in_log_work():
    pts = ((1e3, 0.5), (1e4, 0.8), (1e5, 1.3), (1e6, 1.6), (1e7, 1.2), (3e7, 0.1), (1e8, 0.2))
    t = crossover.Table("x", "default", "-", {"c": pts})

    def nearest(work: float) -> str:  # the rule as the module docstring states it
        x = math.log(max(work, 1.0))
        i = min(range(len(pts)), key=lambda j: abs(math.log(pts[j][0]) - x))
        near = [r for _, r in pts[max(i - 1, 0) : i + 2]]
        return "cpu" if statistics.median(near) >= 1.0 else "sdpa"

    bands = t.bands("c")
    assert [who for _, who in bands] == ["sdpa", "cpu", "sdpa"]  # neighbours merged
    assert t.bands("other") is None
    for e in range(0, 400):
        work = 1.07**e
        assert t.winner("c", work) == nearest(work), work
    # the traced rule (integer 2·work against integer bounds) decides as the eager one
    for work2 in (1, 2, 3, 63245, 63246, 63247, 10**7, 2 * 10**8, 10**12):
        want = t.winner("c", work2 / 2)
        bands2 = [
            (None if b is None else math.floor(2 * b), who) for b, who in bands
        ]  # as _bands_of keeps them
        got = next(who for last, who in bands2 if last is None or work2 <= last)
        assert got == want, work2


def test_twice_work_is_the_work_doubled_as_an_integer():
    for q, k, causal in (
        (torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8), True),
        (torch.randn(2, 4, 1, 8), torch.randn(2, 2, 300, 8), True),
        (torch.randn(1, 2, 20, 8), torch.randn(1, 2, 33, 8), False),
    ):
        plan = make_plan(q, k, k, causal=causal)
        twice = crossover.twice_work(plan)
        assert isinstance(twice, int) and twice == 2 * crossover.work_of(plan)


@needs_kernel
def test_multi_head_attention_with_a_kv_cache_decodes_in_as_many_graphs_as_sdpa(calibration):
    calibration({"causal/float32/fwd/D64": KERNEL_FAR, "decode-gqa-q1/float32/fwd/D64": KERNEL_FAR})
    torch.manual_seed(0)
    prompt = torch.randn(1, 17, 64)
    steps = [torch.randn(1, 1, 64) for _ in range(10)]

    def decode(backend, compiled):
        m = qkv.nn.MultiHeadAttention(64, 8, n_kv_heads=2, backend=backend).eval()
        m.load_state_dict(state)
        cache = qkv.nn.KVCache(1, 64, 2, 8)
        counter = Graphs()
        torch._dynamo.reset()
        fn = (
            (lambda x: m(x, cache=cache))
            if not compiled
            else torch.compile(
                lambda x: m(x, cache=cache), dynamic=True, fullgraph=True, backend=counter
            )
        )
        with torch.no_grad():
            return [fn(x) for x in (prompt, *steps)], counter

    state = qkv.nn.MultiHeadAttention(64, 8, n_kv_heads=2).state_dict()
    got, counter = decode("auto", True)
    _, sdpa = decode("sdpa", True)
    want, _ = decode("auto", False)
    assert counter.frame_count == sdpa.frame_count == 2  # the prompt, then every step
    assert set(counter.runs) == {"cpu"}
    for g, w in zip(got, want, strict=True):  # the same ops on the same inputs
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.slow
@needs_kernel
def test_a_transformers_model_prefills_and_decodes_in_as_many_graphs_as_eager(calibration):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers", reason="needs: pip install -e '.[hf]'")
    from qkv.integrations import hf

    from .integrations.hf_helpers import Float64Everywhere, tiny_llama

    hf.register()
    calibration({"causal/float32/fwd/D64": KERNEL_FAR, "decode-gqa-q1/float32/fwd/D64": KERNEL_FAR})
    model = tiny_llama()
    g = torch.Generator().manual_seed(0)
    # prompts of 20 and 17 tokens, then 10 fixed tokens each through a DynamicCache: every step
    # sees ≥ 16 keys (below that the sdpa backend runs torch's math kernel, a graph of its own)
    prompts = [torch.randint(3, 97, (2, n), generator=g) for n in (20, 17)]
    tokens = torch.randint(3, 97, (2, 10), generator=g)

    def decode(m, step):
        out = []
        for ids in prompts:
            cache = transformers.DynamicCache(config=m.config)
            out.append(step(m, ids, cache))
            out += [step(m, tokens[:, i : i + 1], cache) for i in range(tokens.shape[1])]
        return out

    def step(m, ids, cache):
        return m(ids, cache=cache, use_cache=True).logits

    def compiled(impl, dtype=torch.float32):
        m = copy.deepcopy(model).to(dtype)
        m.set_attn_implementation(impl)
        torch._dynamo.reset()
        counter = Graphs()
        cstep = torch.compile(step, dynamic=True, fullgraph=True, backend=counter)
        with torch.no_grad():
            return decode(m, cstep), counter

    got, counter = compiled("qkv")
    _, eager = compiled("eager")
    assert counter.frame_count == eager.frame_count, (counter.frame_count, eager.frame_count)
    with torch.no_grad():
        m = copy.deepcopy(model)
        m.set_attn_implementation("qkv")
        want = decode(m, step)
        m.set_attn_implementation("eager")
        ref = decode(m, step)
        gold_m = copy.deepcopy(model).double()
        gold_m.set_attn_implementation("eager")
        with Float64Everywhere():
            gold = decode(gold_m, step)
    for i, (a, w, r, o) in enumerate(zip(got, want, ref, gold, strict=True)):
        torch.testing.assert_close(a, w, rtol=0, atol=0)  # the same ops on the same inputs
        assert_error_ratio(a, r, o, what=f"logits of call {i}")


def test_a_misspelt_qkv_crossovers_warns_once_naming_the_variable(monkeypatch):
    crossover.clear()
    monkeypatch.setenv(crossover.ENV, "defualt")
    with pytest.warns(RuntimeWarning, match=r"QKV_CROSSOVERS='defualt'.*calibrated, default"):
        crossover.table("avx2")  # first use: the table's reading
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert crossover.setting() == "calibrated"  # read as unset, and warned once only
        for good in ("default", " Default ", "calibrated", ""):
            monkeypatch.setenv(crossover.ENV, good)
            assert crossover.setting() == (good.strip().lower() or "calibrated")
    monkeypatch.setenv(crossover.ENV, "calibrate")
    with pytest.warns(RuntimeWarning, match="QKV_CROSSOVERS='calibrate'"):
        crossover.setting()
    crossover.clear()
