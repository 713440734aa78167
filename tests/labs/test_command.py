"""`qkv lab NAME`: bad arguments are one-line errors with exit code 2 (before any work), and a
run prints its answer, writes its figure and its JSON (alone on stdout with `--json -`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qkv.cli import main


@pytest.mark.parametrize(
    "argv,message",
    [
        (["lab", "lstm"], "invalid choice: 'lstm'"),
        (["lab", "rnn", "--quick", "--full"], "not allowed with argument --quick"),
        (["lab", "scale", "--lang", "fr"], "invalid choice: 'fr'"),
        (["lab", "routing", "--seed", "-1"], "the seed must be in 0..2**32-1, got -1"),
        (["lab", "rnn", "--seed", str(2**32)], f"the seed must be in 0..2**32-1, got {2**32}"),
        (["lab", "routing", "--seed", "x"], "expected an integer seed, got 'x'"),
        (["lab", "rnn", "--json", "/nonexistent-qkv/r.json"], "does not exist"),
    ],
)
def test_bad_arguments_are_one_line_errors_with_exit_code_2(argv, message):
    res = subprocess.run(
        [sys.executable, "-m", "qkv", *argv], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert message in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("qkv lab: error: ")


@pytest.mark.parametrize(
    "lang,message",
    [
        (
            "en",
            "qkv lab: error: qkv lab needs a lab's name: rnn, scale, routing or sparse (e.g. qkv "
            "lab rnn)",
        ),
        (
            "zh",
            "qkv lab: 错误：qkv lab 需要实验的名字：rnn、scale、routing 或 sparse"
            "（例如 qkv lab rnn）",
        ),
    ],
)
def test_a_lab_without_a_name_lists_the_labs(lang, message):
    res = subprocess.run(
        [sys.executable, "-m", "qkv", "lab", "--lang", lang],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == message
    assert "arguments are required" not in res.stderr and "缺少必需的参数" not in res.stderr


def test_outputs_are_checked_before_the_lab_runs(monkeypatch, tmp_path, capsys):
    import qkv.labs.rnn as rnn

    def ran(*_, **__):
        raise AssertionError("the lab ran before its outputs were checked")

    monkeypatch.setattr(rnn, "run", ran)
    taken = tmp_path / "taken"
    taken.write_text("x")
    assert main(["lab", "rnn", "--out", str(taken)]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["lab", "rnn", "--json", str(tmp_path), "--no-files"]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_a_run_writes_its_figure_and_the_json_alone_on_stdout(monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from qkv.labs import routing

    tiny = routing.Preset(
        length=10, width=8, layers=(1,), trials=1, route_length=8, steps=5, examples=3, samples=8
    )
    monkeypatch.setattr(routing, "QUICK", tiny)
    argv = ["lab", "routing", "--json", "-", "--out", str(tmp_path), "--lang", "zh"]
    assert main([*argv, "--no-progress"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["lab"] == "routing" and doc["preset"]["length"] == 10
    assert "软路由" in err and "图：" in err and "figure:" not in err
    assert (tmp_path / "routing.png").stat().st_size > 0


def test_the_labs_and_the_command_import_no_heavy_package():
    code = (
        "import sys, qkv, qkv.cli, qkv.labs.rnn, qkv.labs.scale, qkv.labs.routing, "
        "qkv.inspect.rollout; "
        "heavy = [m for m in ('matplotlib', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
