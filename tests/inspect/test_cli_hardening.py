"""The CLI never shows a traceback: outputs are checked before the work, sizes and seeds before
an allocation, user text is never markup, Ctrl-C keeps what was measured, `--json -` is JSON
alone, unreadable text is named, and no user string can change how the viewer page parses."""

from __future__ import annotations

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
