"""Every suite's declaration, through the one entry point: it dry-runs (cases × implementations
listed, nothing built or timed), its section renders and re-renders from its JSON; and the
arithmetic of the suites' own figures on synthetic results."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
from benchmarks.report import MemoryRow, Row, Table, read_sections
from benchmarks.results import CaseRecord, MemoryResult, Results, Timing, type_path
from benchmarks.run import load_suite, main, suite_names
from benchmarks.suite import FWD, FWD_BWD, Group
from benchmarks.suites import _attention as A
from benchmarks.suites import cpu, decode, distributed, e2e, sparse

SUITES = (
    "core",
    "cpu",
    "decode",
    "dispatch",
    "distributed",
    "e2e",
    "gpu",
    "hf",
    "hostile",
    "sparse",
    "vision",
)


def test_the_suites_are_found_by_name(capsys):
    assert set(SUITES) <= set(suite_names())
    assert main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in SUITES)
    with pytest.raises(SystemExit, match="no suite 'nope'"):
        load_suite("nope")


@pytest.mark.slow
@pytest.mark.parametrize("name", SUITES)
def test_each_suite_dry_runs_and_renders(name: str, tmp_path):
    out = tmp_path / "benchmarks.md"
    assert main([name, "--dry-run", "--out", str(out)]) == 0
    section = read_sections(out.read_text())[name]
    assert "**Dry run: nothing was measured.**" in section
    results = Results.read(tmp_path / f"benchmarks-{name}.json")
    assert results.dry_run and results.complete
    suite = load_suite(name)
    settings = suite.settings["full"]
    for group in (s for s in suite.steps if isinstance(s, Group)):
        cases = list(group.cases(settings))
        assert [c.params for c in results.cases if c.group == group.name] == [
            dict(vars(c)) for c in cases
        ]
        for case in cases:  # every implementation that belongs has a row, and no figure
            for impl in (i for i in group.impls if i.when(case)):
                for pass_ in group.passes:
                    t = results.timing(group.name, case, impl.name, pass_)
                    assert t is not None and t.median_s is None
    assert len(results.targets) == len(suite.targets)
    again = tmp_path / "again.md"
    assert (
        main([name, "--from-json", str(tmp_path / f"benchmarks-{name}.json"), "--out", str(again)])
        == 0
    )
    assert read_sections(again.read_text())[name] == section


def test_sparse_flex_mask_mods_and_tile_densities_match_the_masks():
    sparse.prepare(sparse.QUICK)  # raises where a mask_mod or a density differs
    figures = sparse.sparsity(sparse.PATTERNS["sliding"].mask(4096), 4096)
    assert figures == {
        "density": pytest.approx(0.1213, abs=1e-4),
        "kept_tiles": 556,
        "total_tiles": 4096,
    }


def test_sparse_cases_run_the_slowest_comparison_last():
    cases = sparse.cases(sparse.FULL)
    tail = [c for c in cases if c.pattern == "causal" and c.n > sparse.SDPA_MAX_N]
    assert cases[-len(tail) :] == tail and len(cases) == 25


def results_for(group: str, case, medians: dict[str, float]) -> Results:
    res = Results(suite="x", mode="full", command="", machine={})
    res.cases.append(CaseRecord(group, type_path(case), dict(vars(case))))
    for impl, seconds in medians.items():
        res.timings.append(Timing(group, dict(vars(case)), impl, FWD, median_s=seconds))
    return res


def test_decode_per_token_and_speed_up():
    case = decode.Case(512, 32)
    res = results_for("decode", case, {"prompt forward": 0.1, "qkv cache": 0.42, "re-forward": 3.3})
    row = Row(res, "decode", case)
    assert decode.per_token(row, "qkv cache") == pytest.approx(0.01)
    assert decode.speedup(row) == pytest.approx(10.0)
    assert decode.SUITE.targets[0].evaluate(res)["passed"] is True
    assert "| 512 | 32 | 100.0 | 10.00 | 100.00 | — | 10.0× |" in decode.TABLE.render(res)


def test_distributed_shares_and_balance():
    res = Results(suite="distributed", mode="full", command="", machine={})
    row = {"name": "", "world": 4, "method": "ring", "tiles": [10, 10, 11, 10]}
    res.stages["configs"] = [
        {
            **row,
            "name": distributed.SINGLE,
            "world": 1,
            "method": "single",
            "peak_mib": 100.0,
            "inputs_mib": 100.0,
        },
        {**row, "name": "ring zigzag P=4", "peak_mib": 30.0, "inputs_mib": 25.0},
    ]
    zigzag = res.stages["configs"][1]
    assert distributed.share(res, zigzag, False) == pytest.approx(0.3)
    assert distributed.share(res, zigzag, True) == pytest.approx(0.275)
    assert distributed.balance(zigzag) == pytest.approx(1.1)
    targets = [t.evaluate(res) for t in distributed.SUITE.targets]
    assert [t["passed"] for t in targets] == [True, None, True]


def test_cpu_says_when_the_compiled_kernel_is_missing(monkeypatch, capsys):
    import qkv.kernels

    monkeypatch.delattr(qkv.kernels, "cpu", raising=False)
    monkeypatch.setitem(sys.modules, "qkv.kernels.cpu", None)  # import fails
    assert "compiled CPU kernel" in cpu.requires()
    assert main(["cpu", "--quick"]) == 2
    assert "benchmarks: cpu needs qkv's compiled CPU kernel" in capsys.readouterr().err


def test_cpu_quick_is_small_and_its_targets_name_the_run_sizes(tmp_path):
    q, f = cpu.QUICK, cpu.FULL
    assert q.dense_n <= 1024 and q.sparse_n <= 2048 and q.decode_nk <= 4096
    assert max(n for _, n, _ in q.memory) <= 16384 and q.slow_on == (("sliding", "fp32"),)
    assert f.dense_n == 4096 and f.sparse_n == 16384 and f.decode_nk == 32768
    assert f.memory == (("longformer", 65536, "fp32"), ("sliding", 1_048_576, "bf16"))
    assert set(f.patterns) == {
        ("sliding", "fp32"), ("longformer", "fp32"), ("bigbird", "fp32"), ("document", "fp32"),
        ("sliding", "bf16"),
    }  # fmt: skip
    out = tmp_path / "b.md"
    assert main(["cpu", "--quick", "--dry-run", "--out", str(out)]) == 0
    results = Results.read(tmp_path / "b-cpu.json")
    names = [t["name"] for t in results.targets]
    assert "dense fp32, N=512, fwd: `cpu` ×SDPA" in names
    assert "sliding window bf16, N=8192, fwd+bwd: MiB beyond the caller's tensors" in " ".join(
        names
    )
    assert all("{" not in name for name in names)
    groups = {c.group for c in results.cases}
    assert groups == {"dense", "patterns", "decode", "small"}


def test_cpu_decode_bandwidth_memory_and_load_figures():
    case = cpu.Decode(1, 32768, 32, 8, 128)
    assert case.kv_bytes == 256 * 2**20
    res = results_for("decode", case, {"cpu": 0.02, "sdpa": 0.04, "copy": 0.05})
    res.settings = {
        **vars(cpu.FULL),
        "memory": cpu.FULL.memory,
        "load_n": cpu.FULL.load_n,
    }
    t = res.timing("decode", case, "cpu", FWD)
    t.ratios = {
        "sdpa": {"median": 2.0, "lo": 2.0, "hi": 2.0},
        "copy": {"median": 2.5, "lo": 2.5, "hi": 2.5},
    }
    # 256 MiB read in 0.02 s against 512 MiB moved in 0.05 s: 1.25 of the copy's bandwidth
    assert cpu.kv_share(Row(res, "decode", case, "cpu")) == pytest.approx(1.25)
    assert cpu.kv_share(Row(res, "decode", case, "copy")) is None
    long = cpu.Pattern("longformer", 65536, "fp32")
    res.memory.append(MemoryResult("patterns", dict(vars(long)), "cpu", FWD_BWD, peak_mib=600.0))
    row = MemoryRow(long, "cpu", res.memory[0])
    assert cpu.returned_mib(row) == 512  # out, dq, dk, dv: 128 MiB each
    assert cpu.beyond_callers(row) == pytest.approx(88.0)
    slow = {"median": 1.2, "lo": 1.1, "hi": 1.3}
    res.stages["load"] = [
        {"case": "dense fp32", "n": 4096, "impls": {"cpu": {"slowdown": slow},
                                                    "sdpa": {"slowdown": {**slow, "median": 1.5}}}},
    ]  # fmt: skip
    shown = {t["name"]: t for t in (target.evaluate(res) for target in cpu.SUITE.targets)}
    assert shown["decoding, Nk=32768: `cpu` ×SDPA (enable_gqa)"]["passed"] is True
    assert shown["decoding, Nk=32768: `cpu` K/V read as % of copy bandwidth"]["shown"] == "125%"
    assert shown["Longformer fp32, N=65536, fwd+bwd: MiB beyond the caller's tensors"][
        "measured"
    ] == pytest.approx(88.0)
    load = shown["dense fp32, N=4096, fwd under load: `cpu` slowdown ÷ SDPA's"]
    assert load["measured"] == pytest.approx(0.8) and load["passed"] is True
    assert (
        shown["sliding window fp32, N=16384, fwd under load: `cpu` slowdown ÷ SDPA's"]["passed"]
        is None
    )


def test_cpu_load_stage_runs_the_kernel_with_and_without_its_thread_placement(monkeypatch):
    seen = []
    call = cpu.unpinned(lambda *args: seen.append(os.environ.get(cpu.PIN_ENV)) or len(args))
    monkeypatch.delenv(cpu.PIN_ENV, raising=False)
    assert call(1, 2) == 2 and seen == ["0"] and cpu.PIN_ENV not in os.environ
    monkeypatch.setenv(cpu.PIN_ENV, "1")
    call()
    assert seen[-1] == "0" and os.environ[cpu.PIN_ENV] == "1"
    for _, _, calls in cpu.load_cases(cpu.QUICK):
        assert list(calls) == ["cpu", cpu.UNPINNED, "sdpa"]


def test_cpu_bf16_spread_samples_and_its_table():
    from benchmarks import machine

    rates = machine.matmul_spread(size=32, samples=3, sample_s=0.001)
    assert len(rates) == 3 and all(r > 0 for r in rates)
    res = Results(suite="cpu", mode="full", command="", machine={})
    assert cpu.spread_block(res)[-2] == "Not run."
    res.stages["bf16 start"] = {"size": 1024, "gflops": [500.0, 250.0, 1000.0]}
    lines = cpu.spread_block(res)
    assert "| start | 250 | 500 | 1000 | 4.00 |" in lines
    assert "| end | — | — | — | — |" in lines  # a run cut short before its last stage


def limits_results() -> Results:
    """A cpu run at the quick sizes on the amx path: dense fp32 and bf16 `cpu` rows with both
    passes, a forward-only row of the dot-product path, the sliding window's kept tiles, and
    the limits 240 (FMA), 100 (dot products) and 1000 (tiles) GFLOP/s over 2 threads."""
    res = Results(suite="cpu", mode="quick", command="", machine={})
    res.settings = dict(vars(cpu.QUICK))
    res.facts = {"software": {"qkv CPU kernel path": "amx"}}
    res.stages["peaks start"] = {"threads": 2, "fma_f32": [100.0, 120.0], "dp_bf16": [50.0],
                                 "amx_bf16": [500.0]}  # fmt: skip
    res.stages["peaks end"] = {"threads": 2, "fma_f32": [110.0], "dp_bf16": [40.0],
                               "amx_bf16": [450.0]}  # fmt: skip

    def timed(group: str, case, impl: str, count: float, fwd: float, bwd: float | None) -> None:
        """`impl` at `case` timed at `fwd` GFLOP/s forward and `bwd` backward (`count` FLOPs
        forward; None: no forward + backward timing)."""
        t_fwd = count / 1e9 / fwd
        res.timings.append(Timing(group, dict(vars(case)), impl, FWD, times_s=[t_fwd]))
        if bwd is not None:
            t_both = t_fwd + 2.5 * count / 1e9 / bwd
            res.timings.append(Timing(group, dict(vars(case)), impl, FWD_BWD, times_s=[t_both]))

    n = cpu.QUICK.dense_n
    fp32, bf16 = cpu.Dense("dense", "fp32", n), cpu.Dense("dense", "bf16", n)
    window = cpu.Pattern("sliding", cpu.QUICK.sparse_n, "fp32")
    for case in (fp32, bf16):
        res.cases.append(CaseRecord("dense", type_path(case), dict(vars(case))))
    extras = {"density": 0.25, "kept_tiles": 300, "total_tiles": 1024}
    res.cases.append(CaseRecord("patterns", type_path(window), dict(vars(window)), extras=extras))
    flops = A.flops(n, FWD)
    timed("dense", fp32, "cpu", flops, 120.0, 60.0)
    timed("dense", bf16, "cpu", flops, 500.0, 250.0)
    timed("dense", bf16, cpu.DP_IMPL, flops, 80.0, None)
    timed("patterns", window, "cpu", A.flops(1, FWD) * 64 * 64 * 300, 180.0, 120.0)
    res.derive(cpu.DENSE)
    res.derive(cpu.PATTERN_GROUP)
    return res


def limit_row(res: Results, case: str, impl: str = "cpu") -> str:
    """The limits block's row of `case` and `impl`."""
    return next(line for line in cpu.limits_block(res) if line.startswith(f"| {case} | {impl} |"))


def test_cpu_limits_block_shares_each_pass_of_its_units_limit():
    res = limits_results()
    assert cpu.peak_limits(res) == {"fma_f32": 240.0, "dp_bf16": 100.0, "amx_bf16": 1000.0}
    lines = cpu.limits_block(res)
    text = "\n".join(lines)
    assert "`fma_f32` (float32 FMA) **240 GFLOP/s**" in text and "`cpu` ran the amx path." in text
    assert "forward + backward median minus its forward median" in text
    assert len([line for line in lines if line.startswith("| ") and "N=" in line]) == 4
    # the backward's rate from the difference of the medians; forward + backward
    # 3.5 / (1/120 + 2.5/60) = 70 GFLOP/s, 29% of 240
    assert "| dense fp32, N=512 | cpu | `fma_f32` | 120 (50%) | 60 (25%) | 70 (29%) |" in lines
    assert "| dense bf16, N=512 | cpu | `amx_bf16` | 500 (50%) | 250 (25%) | 292 (29%) |" in lines
    assert "| dense bf16, N=512 | cpu avx512bf16 | `dp_bf16` | 80 (80%) | — | — |" in lines
    assert limit_row(res, "sliding window fp32, N=2048").endswith(
        "| 180 (75%) | 120 (50%) | 133 (55%) |"
    )
    res.facts["software"]["qkv CPU kernel path"] = "avx512bf16"
    assert "| `dp_bf16` | 500 (500%) |" in limit_row(res, "dense bf16, N=512")
    res.facts["software"]["qkv CPU kernel path"] = "avx512"  # bfloat16 widened to float32
    assert "| `fma_f32` | 500 (208%) |" in limit_row(res, "dense bf16, N=512")
    res.facts = {}  # the path unknown: no unit for bfloat16, float32 still on the FMAs
    assert "| — | 500 (—) | 250 (—) |" in limit_row(res, "dense bf16, N=512")
    assert "| `fma_f32` | 120 (50%) |" in limit_row(res, "dense fp32, N=512")


def test_cpu_limits_name_a_missing_unit_and_an_older_run():
    res = limits_results()
    res.stages["peaks start"]["amx_bf16"] = [0.0]
    del res.stages["peaks end"]
    del res.stages["peaks start"]["dp_bf16"]  # a run from before the probe
    assert cpu.peak_limits(res) == {"fma_f32": 240.0, "dp_bf16": None, "amx_bf16": 0.0}
    text = "\n".join(cpu.limits_block(res))
    assert "`amx_bf16` (bfloat16 AMX tiles) not on this CPU" in text
    assert "`dp_bf16` (bfloat16 dot products, VDPBF16PS) not sampled in this run" in text
    assert "| dense bf16, N=512 | cpu | `amx_bf16` | 500 (—) | 250 (—) | 292 (—) |" in text
    del res.stages["peaks start"]
    assert cpu.limits_block(res)[-2] == "Not run."


def test_cpu_core_peaks_tolerate_a_kernel_without_a_probe(monkeypatch):
    def peak(kind: str, seconds: float) -> float:
        if kind == "amx_bf16":
            raise RuntimeError("qkv_cpu: peak_gflops takes fma_f32 or dp_bf16, got 'amx_bf16'")
        return 10.0

    monkeypatch.setattr(torch.ops, "qkv_cpu", types.SimpleNamespace(peak_gflops=peak))
    got = cpu.core_peaks(cpu.QUICK, Results(suite="cpu", mode="quick", command="", machine={}))
    assert got["threads"] == torch.get_num_threads()
    assert got["fma_f32"] == got["dp_bf16"] == [10.0] * cpu.PEAK_SAMPLES
    assert got["amx_bf16"] == [0.0] * cpu.PEAK_SAMPLES


def e2e_results(group: str, cases: list, timed, times: dict, attention: dict) -> Results:
    """Results of e2e's `group`: `cases` recorded in order, one of them `timed` (seconds per
    round by implementation) with its attention seconds per call in the group's stage."""
    res = Results(suite="e2e", mode="full", command="", machine={})
    pass_ = FWD_BWD if group in ("train", "nanogpt") else FWD
    for case in cases:
        res.cases.append(CaseRecord(group, type_path(case), dict(vars(case))))
    for impl, seconds in times.items():
        res.timings.append(Timing(group, dict(vars(timed)), impl, pass_, times_s=seconds))
    res.derive(e2e.SUITE.group(group))
    res.stages[f"attention {group}"] = [
        {"case": dict(vars(timed)), "impl": impl, "attention_s": s, "calls": 2}
        for impl, s in attention.items()
    ]
    return res


def test_e2e_decoding_step_attention_share_and_target():
    case = e2e.Decode(4096, "dynamic", 64)
    one = e2e.ONE
    res = e2e_results(
        "decode",
        [case],
        case,
        {"qkv": [1.33, 1.36], f"qkv{one}": [0.07, 0.10], "sdpa": [1.96, 2.0],
         f"sdpa{one}": [0.07, 0.11]},
        # warm-up calls first (two: the group keeps outputs), then one per timed round
        {"qkv": [9, 9, 0.64, 0.62], f"qkv{one}": [9, 9, 0, 0], "sdpa": [9, 9, 1.26, 1.26],
         f"sdpa{one}": [9, 9, 0, 0]},
    )  # fmt: skip
    row = Row(res, "decode", case, "qkv")
    assert e2e.step_s(row) == pytest.approx(0.02)  # (1.345 − 0.085) / 63
    assert e2e.step_s(row, "sdpa") == pytest.approx(0.03)
    assert e2e.step_ratio(row) == pytest.approx(1.5)  # per round: 0.03 / 0.02 twice
    assert e2e.attention_s(row) == pytest.approx(0.01)  # (0.63 − 0) / 63
    assert e2e.attention_share(row) == pytest.approx(0.5)
    assert e2e.attention_ratio(row) == pytest.approx(2.0)
    assert e2e.ceiling(row) == pytest.approx(3.0)  # 0.03 / (0.03 − sdpa's 0.02 of attention)
    assert (
        "| 4096 | dynamic | 64 | qkv | 1345.0 | 85.0 | 20.00 | 50.0 | 1.50 | 50% | 2.00 | 3.00 "
        "| — |" in (e2e.DECODE_TABLE.render(res))
    )
    shown = {t["name"]: t for t in (target.evaluate(res) for target in e2e.SUITE.targets)}
    first = shown["decoding step after 4096 tokens, dynamic cache: `qkv` ×SDPA"]
    assert first["measured"] == pytest.approx(1.5) and first["passed"] is True
    assert shown["decoding step after 16384 tokens, static cache: `qkv` ×SDPA"]["passed"] is None


def test_e2e_prefill_share_and_targets_name_the_runs_cases():
    cases = [e2e.Prefill(n, dt) for n, dt in e2e.QUICK.prefill]
    res = e2e_results(
        "prefill",
        cases,
        cases[2],  # the third case of the run
        {"qkv": [10.0, 10.4, 10.2], "sdpa": [12.0, 12.6, 12.0]},
        {"qkv": [30.0, 4.0, 4.2, 4.1], "sdpa": [30.0, 6.0, 6.2, 6.15]},  # a warm-up call first
    )
    row = Row(res, "prefill", cases[2], "qkv")
    assert e2e.attention_share(row) == pytest.approx(4.1 / 10.2)
    assert e2e.attention_ratio(row) == pytest.approx(6.15 / 4.1)
    assert e2e.attention_share(Row(res, "prefill", cases[0], "qkv")) is None  # not timed
    targets = [t.evaluate(res) for t in e2e.SUITE.targets]
    third = targets[2]
    assert third["name"] == "prefill fp32 N=512: `qkv` ×SDPA" and third["threshold"] == "≥ 1.1×"
    assert third["measured"] == pytest.approx(1.2) and third["passed"] is True
    # a case the run does not have is named as in the full run
    assert targets[-1]["name"] == "compiled prefill N=4096: `qkv` ×SDPA"
    assert targets[-1]["passed"] is None


def train_table() -> Table:
    return next(t for t in e2e.SUITE.report if getattr(t, "title", "").startswith("Training"))


def test_e2e_bf16_training_step_has_its_row_and_target():
    cases = [e2e.Train(n, dt) for n, dt in e2e.QUICK.train]
    assert cases[-1] == e2e.Train(256, "bf16")
    res = e2e_results(
        "train",
        cases,
        cases[-1],
        {"qkv": [1.0, 1.0], "sdpa": [1.4, 1.3]},
        {"qkv": [9.0, 0.2, 0.2], "sdpa": [9.0, 0.5, 0.5]},  # a warm-up call first
    )
    shown = {t["name"]: t for t in (target.evaluate(res) for target in e2e.SUITE.targets)}
    bf16 = shown["training step bf16 N=256: `qkv` ×SDPA"]
    assert bf16["threshold"] == "≥ 1.3×" and bf16["measured"] == pytest.approx(1.35)
    assert bf16["passed"] is True
    assert (
        shown["training step N=256: `qkv` ×SDPA"]["threshold"] == "≥ 1.1×"
    )  # fp32, named as before
    assert "| 256 | bf16 | qkv | 1000.0 | 1.35 | 1.30 – 1.40 | 256 | 20% | 2.50 |" in "\n".join(
        train_table().render(res)
    )


def test_e2e_training_steps_recorded_without_a_dtype_read_as_fp32():
    """A run from before the bf16 row recorded its training steps as `Step(n)`."""
    cases = [e2e.Step(2048), e2e.Step(8192)]
    res = e2e_results("train", cases, cases[1], {"qkv": [2.0], "sdpa": [2.2]}, {})
    assert "| 8192 | fp32 | qkv | 2000.0 | 1.10 |" in "\n".join(train_table().render(res))
    shown = {t["name"]: t for t in (target.evaluate(res) for target in e2e.SUITE.targets)}
    assert shown["training step N=8192: `qkv` ×SDPA"]["passed"] is True
    assert shown["training step bf16 N=8192: `qkv` ×SDPA"]["passed"] is None


def test_e2e_attention_timer_counts_forward_and_backward():
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))
    timer = e2e.Timer()
    out = timer.around(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), q, k, v)
    out.sum().backward()
    assert timer.calls == 1 and timer.forward_s > 0 and timer.backward_s > 0
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    F.scaled_dot_product_attention(q, k, v).sum().backward()
    assert all(torch.equal(g, t.grad) for g, t in zip(grads, (q, k, v), strict=True))
    with torch.no_grad():  # no gradient: nothing marked, the forward still timed
        timer.around(lambda a, b, c: a + b + c, q, k, v)
    assert timer.calls == 2


def test_e2e_compile_failure_is_one_line_with_the_reason():
    Unsupported = type("Unsupported", (Exception,), {})
    error = Unsupported(
        "Attempted to call function marked as skipped\n"
        "  Explanation: the function `import_module` in file x.py should not be traced.\n"
        "from user code:\n"
        '   File "/env/transformers/models/llama/modeling_llama.py", line 459, in forward\n'
        '  File "/repo/src/qkv/integrations/hf.py", line 123, in make_mask\n'
        '  File "/env/lib/python3.11/importlib/__init__.py", line 90, in import_module\n'
    )
    assert e2e.compile_reason(error) == (
        "Unsupported: Attempted to call function marked as skipped (`import_module`) in "
        "qkv/integrations/hf.py:123 make_mask"
    )


def test_dispatch_races_only_the_backends_that_compute_the_request_exactly():
    from benchmarks.suites import dispatch as d

    dense = d.Case("prefill", "fp32", 256, 256, 4, 4, 64)
    assert d.runs(dense, "sdpa", grad=False) and not d.runs(dense, "sdpa", grad=True)
    assert d.runs(d.Case("prefill", "bf16", 256, 256, 4, 4, 64), "sdpa", grad=True)
    assert not d.runs(d.Case("decode", "fp32", 1, 16384, 8, 8, 64), "tiled", grad=False)
    window = d.Case("mask", "fp32", 1024, 1024, 4, 4, 64, mask="window")
    # without finite_inputs a masked request is not SDPA's (0 · NaN): it sits the race out
    assert d.runs(window, "tiled", grad=True) and not d.runs(window, "sdpa", grad=False)
    assert d.kwargs_of(d.Case("mask", "fp32", 64, 64, 1, 1, 8, mask="padding"))["finite_inputs"]
