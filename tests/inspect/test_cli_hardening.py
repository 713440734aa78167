"""The CLI never shows a traceback: outputs are checked before the work, sizes and seeds before
an allocation, user text is never markup, Ctrl-C keeps what was measured, `--json -` is JSON
alone, unreadable text is named, and no user string can change how the viewer page parses."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qkv.cli import main

UNWRITABLE = "/proc/version"  # an existing file nobody may write, root included (Linux)


def _qkv(*argv: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qkv", *argv], capture_output=True, text=True, timeout=timeout
    )


def _bad_files(tmp_path: Path, name: str = "w.json") -> list[tuple[str, str]]:
    """(path, what the message says) for every kind of place a file cannot go."""
    a_file = tmp_path / "a-file.txt"
    a_file.write_text("x")
    cases = [
        (str(tmp_path / "missing" / name), "does not exist"),
        (str(tmp_path), "is a folder; give a file name"),
        (str(a_file / name), "is a file, not a folder"),
    ]
    if Path(UNWRITABLE).exists():
        cases.append((UNWRITABLE, "cannot write there"))
    return cases


@pytest.fixture
def no_work(monkeypatch):
    """Make the expensive step of each command fail the test if it runs at all."""
    import qkv.inspect.attend as attend
    import qkv.inspect.bench as bench
    import qkv.inspect.demo as demo

    def ran(*_, **__):
        raise AssertionError("the work ran before the output was checked")

    monkeypatch.setattr(attend, "model_attention", ran)
    monkeypatch.setattr(bench, "measure", ran)
    monkeypatch.setattr(bench, "iter_measure", ran, raising=False)
    monkeypatch.setattr(demo, "run", ran)


# --------------------------------------------------------------------------- outputs first


def test_attend_json_to_a_bad_place_is_refused_before_the_model_runs(no_work, tmp_path, capsys):
    for path, message in _bad_files(tmp_path):
        assert main(["attend", "--json", path, "--no-files"]) == 2, path
        err = capsys.readouterr().err
        assert err.startswith("qkv attend: error: --json ") and message in err, err
        assert err.count("\n") == 1


@pytest.mark.parametrize("command", ["attend", "demo"])
def test_out_naming_an_existing_file_is_refused_before_the_work(command, no_work, tmp_path, capsys):
    a_file = tmp_path / "taken"
    a_file.write_text("keep me")
    assert main([command, "--out", str(a_file)]) == 2
    err = capsys.readouterr().err
    assert f"qkv {command}: error: --out " in err and "is an existing file" in err
    assert a_file.read_text() == "keep me"
    assert main([command, "--out", str(a_file / "below")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_bench_json_and_png_are_checked_before_measuring(no_work, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    for option, name in (("--json", "b.json"), ("--png", "b.png")):
        for path, message in _bad_files(tmp_path, name):
            assert main(["bench", "--quick", option, path]) == 2, (option, path)
            err = capsys.readouterr().err
            assert err.startswith(f"qkv bench: error: {option} ") and message in err, err
    assert main(["bench", "--quick", "--png", str(tmp_path / "plot.xyz")]) == 2
    err = capsys.readouterr().err
    assert "unknown image format 'xyz'; use one of" in err and "png" in err
    assert not (tmp_path / "plot.xyz").exists()  # the check leaves nothing behind


def test_an_output_check_in_a_real_process_has_no_traceback(tmp_path):
    res = _qkv("bench", "--sizes", "4096", "--json", str(tmp_path / "nowhere" / "b.json"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith("qkv bench: error: --json ")


# --------------------------------------------------------------------------- explain sizes, seed


def test_explain_too_large_for_memory_is_refused_up_front():
    res = _qkv("explain", "--n", "100000")
    assert res.returncode == 2 and "Traceback" not in res.stderr and res.stdout == ""
    assert "qkv explain: error: a walk-through with N=100000" in res.stderr
    assert "80 GB in float64" in res.stderr and "memory is available" in res.stderr


def test_explain_memory_rule(monkeypatch):
    import qkv.inspect.bench as bench
    from qkv.inspect.explain import ExplainError, memory_needed, walkthrough

    need = memory_needed(64, 8, 4)
    monkeypatch.setattr(bench, "available_mib", lambda: 2.1 * need / 2**20)
    assert walkthrough(n=64).A.shape == (64, 64)  # needs less than half of what is free
    with pytest.raises(ExplainError, match="N=96, d=8, d_k=4 needs about"):
        walkthrough(n=96)


@pytest.mark.parametrize("seed", [str(2**70), str(2**64), "-1"])
def test_explain_seed_out_of_range_is_a_clear_message(seed):
    res = _qkv("explain", "--seed", seed)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"the seed must be in 0..2**64-1, got {seed}" in res.stderr


def test_explain_largest_seed_works(capsys):
    from qkv.inspect.explain import ExplainError, walkthrough

    assert main(["explain", "--seed", str(2**64 - 1)]) == 0
    assert f"seed {2**64 - 1}" in capsys.readouterr().out
    with pytest.raises(ExplainError, match=r"the seed must be an int in 0\.\.2\*\*64-1"):
        walkthrough(seed=2**70)


# ----------------------------------------------------------------- user text is not markup


def _map(words, text):
    import torch

    from qkv.inspect.attend import AttentionMap

    n = len(words)
    w = torch.randn(1, 2, n, n, generator=torch.Generator().manual_seed(0)).softmax(-1)
    return AttentionMap.from_weights(w, words, text=text)


def test_dollar_signs_in_the_text_are_drawn_as_typed(tmp_path):
    pytest.importorskip("matplotlib")
    from qkv.inspect.figures import attention_grid, token_heads

    words = ["the", "price", "is", "$x^$", "and", "it", "$"]
    amap = _map(words, "the price is $x^$ and it $")
    grid = attention_grid(amap, tmp_path / "grid.png")
    row = token_heads(amap, "it", tmp_path / "it.png")
    assert (tmp_path / "grid.png").stat().st_size > 0 and (tmp_path / "it.png").stat().st_size > 0
    labels = [t.get_text() for t in grid.axes[0].get_yticklabels()]
    assert labels == words and "$x^$" in grid.get_suptitle()
    assert [t.get_text() for t in row.axes[0].get_xticklabels()] == words


def test_text_in_a_script_without_a_font_leaks_no_warnings(tmp_path):
    pytest.importorskip("matplotlib")
    import warnings

    from qkv.inspect.figures import attention_grid

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attention_grid(_map(["猫", "坐", "🐱"], "猫坐 🐱"), tmp_path / "cjk.png")


@pytest.mark.slow
def test_attend_with_dollar_signs_writes_its_pictures(minilm, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "attend"
    assert main(["attend", "the price is $x^$ and it", "--out", str(out)]) == 0
    assert (out / "attention-grid.png").stat().st_size > 0
    assert (out / "attention-it.png").stat().st_size > 0
    assert "viewer:" in capsys.readouterr().out


# --------------------------------------------------------------------------- --json -: JSON alone


def test_attend_json_to_stdout_is_the_document_alone(minilm, cat_map, capsys):
    assert main(["attend", "--json", "-", "--no-files"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == json.loads(json.dumps(cat_map.to_dict()))
    assert "Where does" in err  # the summary went to stderr


def test_bench_json_to_stdout_is_the_document_alone(capsys):
    argv = ["bench", "--sizes", "32,64", "--methods", "tiled", "--passes", "forward"]
    assert main([*argv, "--no-progress", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert [r["n"] for r in report["records"]] == [32, 64]
    assert "slope (time)" in err


# --------------------------------------------------------------------------- Ctrl-C


# A shell that starts a job in the background without job control starts it with SIGINT ignored,
# and the process and its children inherit that: a Ctrl-C test run so would see no
# KeyboardInterrupt at all. The tests below give SIGINT Python's own handler first, as a
# terminal's foreground process has it.
INT_HANDLER = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)"


@pytest.fixture
def sigint_raises():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _interrupt_on_run(monkeypatch, at: int) -> list:
    """Send this process a real SIGINT (what Ctrl-C does) when the `at`-th benchmark run starts."""
    import qkv.inspect.bench as bench

    started, real = [], bench._runner

    def runner(*args):
        started.append(args[:2])
        if len(started) == at:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args)

    monkeypatch.setattr(bench, "_runner", runner)
    return started


def _main_interrupted(argv: list[str]) -> int:
    try:
        return main(argv)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped from main")


def test_ctrl_c_during_bench_writes_what_was_measured(monkeypatch, tmp_path, capsys, sigint_raises):
    pytest.importorskip("matplotlib")
    _interrupt_on_run(monkeypatch, at=3)
    argv = ["bench", "--sizes", "32,64,128", "--methods", "tiled,naive", "--passes", "forward"]
    argv += ["--no-progress", "--json", str(tmp_path / "b.json"), "--png", str(tmp_path / "b.png")]
    assert _main_interrupted(argv) == 130
    out, err = capsys.readouterr()
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["complete"] is False
    assert [(r["n"], r["method"]) for r in report["records"]] == [(32, "tiled"), (32, "naive")]
    assert (tmp_path / "b.png").stat().st_size > 0
    assert "slope (time)" in out and "2 runs measured before Ctrl-C" in out
    assert err.strip().endswith("qkv bench: interrupted") and "Traceback" not in err


@pytest.mark.slow
def test_ctrl_c_in_a_real_process_exits_130_without_a_traceback(tmp_path):
    script = f"""
{INT_HANDLER}
import os, signal, sys
import qkv.inspect.bench as bench
from qkv.cli import main
real, n = bench._runner, []
def runner(*a):
    n.append(1)
    if len(n) == 2:
        os.kill(os.getpid(), signal.SIGINT)
    return real(*a)
bench._runner = runner
sys.exit(main(["bench", "--sizes", "32,64", "--methods", "tiled", "--passes", "forward",
               "--json", {str(tmp_path / "b.json")!r}]))
"""
    cmd = [sys.executable, "-c", script]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 130 and "Traceback" not in res.stderr, res.stderr
    assert len(json.loads((tmp_path / "b.json").read_text())["records"]) == 1


@pytest.mark.slow
def test_ctrl_c_during_demo_writes_the_finished_sections(
    minilm, monkeypatch, tmp_path, capsys, sigint_raises
):
    pytest.importorskip("matplotlib")
    _interrupt_on_run(monkeypatch, at=3)
    out = tmp_path / "demo"
    assert _main_interrupted(["demo", "--out", str(out), "--no-progress"]) == 130
    page = (out / "index.html").read_text()
    assert "interrupted (Ctrl-C)" in page and "Interrupted: the runs measured before" in page
    for section in ("The formula", "The backends agree", "Where does", "The cost of attention"):
        assert section in page
    assert len(json.loads((out / "bench.json").read_text())["records"]) == 2
    assert (out / "cost.png").stat().st_size > 0 and (out / "viewer.html").stat().st_size > 0
    assert "qkv demo: interrupted" in capsys.readouterr().err


# ------------------------------------------------------------- text the model cannot read

CHINESE = "猫坐在垫子上因为它累了"


def test_unknown_tokens_are_words_and_named():
    import torch

    from qkv.inspect.attend import AttentionMap, summary

    w = torch.full((1, 1, 4, 4), 0.25, dtype=torch.float64)
    amap = AttentionMap.from_weights(w, ["[CLS]", "[UNK]", "cat", "[SEP]"])
    assert set(amap.strongest_heads("cat")) == {"1:[UNK]"}
    assert amap.unknown() == [1]
    text = summary(amap, "cat")
    assert "    [UNK]  layer 0 head 0   0.250" in text
    assert "1 of the 2 words became [UNK]" in text


def test_chinese_text_shows_every_word_and_says_the_model_cannot_read_it(minilm, capsys):
    from qkv.inspect.attend import model_attention

    amap = model_attention(CHINESE, *minilm)
    assert amap.sources[1:-1] == tuple(CHINESE)  # one word per character, none dropped
    assert main(["attend", CHINESE, "--token", "它", "--no-files"]) == 0
    out = capsys.readouterr().out
    assert 'Where does "[UNK](它)"' in out
    hardest = out.split("most specific to it")[1].split("  the most focused")[0].splitlines()[1:]
    assert len(hardest) == len(CHINESE) - 1  # every other word, [UNK] ones included
    assert any(line.strip().startswith("[UNK](猫)") for line in hardest)
    assert "all-MiniLM-L6-v2 does not read Chinese characters" in out
    unknown = [w for w in amap.words if w.startswith("[UNK](")]
    assert f"{len(unknown)} of the {len(CHINESE)} words became [UNK]" in out


def test_emoji_is_named_as_such(minilm):
    from qkv.inspect.attend import model_attention, summary

    text = summary(model_attention("the cat 🐱 sat", *minilm), "cat")
    assert "[UNK](🐱)" in text and "does not read emoji and symbols" in text


# --------------------------------------------------------------------------- the command itself


def test_version_and_a_bare_command_say_what_qkv_is(capsys):
    from qkv import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"qkv {__version__}"
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: qkv") and "explain" in out and "demo" in out


def test_a_missing_image_file_is_named(capsys):
    assert main(["tokens", "--image", "nosuch.png"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "qkv tokens: error: --image: no such file: nosuch.png"
    assert main(["tokens", "--image", "big"]) == 2  # neither a size nor a file name
    assert "expects WIDTHxHEIGHT" in capsys.readouterr().err


def test_explain_shows_the_corners_of_large_matrices_unless_full(capsys):
    from qkv.inspect.explain import SHOWN, walkthrough

    assert main(["explain", "--n", "40"]) == 0
    short = capsys.readouterr().out
    assert "(40×40: corners shown; --full prints it whole)" in short
    w = walkthrough(n=40, d=8, d_k=4, seed=0)
    last = "  [" + " ".join(f"{v:8.3f}" for v in w.X[-1].tolist()) + "]"
    assert last in short  # the last row of X, whole (8 columns fit)
    assert main(["explain", "--n", "40", "--full"]) == 0
    full = capsys.readouterr().out
    assert "corners shown" not in full and len(full.splitlines()) > len(short.splitlines())
    # S is 40×40: each printed row holds SHOWN values and the ⋯ between its halves
    rows = [line for line in short.splitlines() if "⋯" in line]
    assert rows and all(r.count("⋯") == 1 for r in rows)
    assert all(len(re.findall(r"-?\d+\.\d+|-inf", r)) == SHOWN for r in rows)


def test_bench_says_why_a_slope_is_missing():
    from qkv.inspect import bench

    recs = [
        {"method": "tiled", "pass": "forward", "n": 64, "time_s": 1e-3, "peak_mib": 1.0,
         "note": None},
        {"method": "tiled", "pass": "forward", "n": 10**6, "time_s": None, "peak_mib": None,
         "note": "skipped: needs about 15,625 MiB, 8,000 MiB available"},
    ]  # fmt: skip
    text = bench.table(recs)
    assert "nan" not in text
    assert "slope —: fewer than two sizes were measured" in text
    assert "N=1000000: skipped: needs about 15,625 MiB" in text


def test_the_qkv_command_runs_its_entry_point_before_torch():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "qkv"]
    assert ep.value == "_qkv_entry:main"


def test_ctrl_c_while_torch_imports_exits_130_with_one_line():
    script = f"""
{INT_HANDLER}
import os, signal, sys
class SigintAtTorch:  # Ctrl-C the moment the import of torch begins
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, SigintAtTorch())
import _qkv_entry
sys.argv = ["qkv", "explain"]
sys.exit(_qkv_entry.main())
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 130, res.stderr
    assert res.stderr.strip() == "qkv: interrupted" and res.stdout == ""
