"""`--lang zh`: the command's help and errors in Chinese, the values they quote kept."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from qkv import cli_zh
from qkv.cli import _parser, language, main

CJK = re.compile(r"[\u4e00-\u9fff]")


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_help_line_is_chinese_under_lang_zh():
    english = []
    for p in _parsers(_parser("zh")):
        lines = [p.description] + [a.help for a in p._actions if a.help]
        for sub in p._actions:
            if isinstance(sub, argparse._SubParsersAction):
                lines += [c.help for c in sub._choices_actions]
        english += [line for line in lines if line and not CJK.search(line)]
    assert english == []


def test_help_of_a_command_reads_in_chinese(capsys):
    with pytest.raises(SystemExit) as e:
        main(["explain", "--lang", "zh", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("用法：qkv explain")
    assert "词元数 N（默认 4）" in out and "显示此帮助并退出" in out


def test_bare_qkv_in_chinese_lists_the_commands(capsys):
    assert main(["--lang", "zh"]) == 0
    out = capsys.readouterr().out
    assert "命令" in out and "用真实的数字逐步演示教科书里的公式" in out


def test_the_language_is_found_anywhere_on_the_line():
    assert language(["explain", "--lang", "zh"]) == "zh"
    assert language(["--lang=zh", "lab", "rnn"]) == "zh"
    assert language(["explain"]) == "en"
    assert language(["explain", "--lang", "fr"]) == "en"  # argparse refuses it, in English
    assert language(["explain", "--lang"]) == "en"


def test_a_language_before_the_command_applies_to_its_answer(capsys):
    assert main(["--lang", "zh", "explain"]) == 0
    assert capsys.readouterr().out.startswith("缩放点积自注意力")


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def _quoted(message: str) -> list[str]:
    """The values a message quotes ('x', a path, a number after 'got'): kept in translation."""
    return re.findall(r"'[^']*'", message) + re.findall(r"got (-?\d+)", message)


BAD = [
    ["explain", "--n", "x"],
    ["explain", "--n", "0"],
    ["explain", "--seed", "-1"],
    ["explain", "--n", "3000000"],
    ["explain", "--html", "/no/such/folder/x.html"],
    ["explain", "--quick"],
    ["explain", "--n", "40", "--html", "f.html"],
    ["explain", "--dk", "5", "--html", "f.html"],
    ["frob"],
    ["lab"],
    ["lab", "foo"],
    ["lab", "rnn", "--quick", "--full"],
    ["lab", "rnn", "--seed", "x"],
    ["bench", "--methods", "naive,fast"],
    ["bench", "--sizes", "512,x"],
    ["bench", "--png", "cost.nosuchformat"],
    ["bench", "--sizes"],
    ["attend", "--head", "1", "--no-files"],
    ["tokens"],
    ["tokens", "--image", "nosuch.png"],
    ["tokens", "--image", "big"],
    ["tokens", "--image", "10x10", "--max-pixels", "x"],
]


@pytest.mark.parametrize("argv", BAD, ids=" ".join)
def test_errors_in_chinese_keep_the_code_and_the_values(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code_en, en = _run(argv, capsys)
    code_zh, zh = _run([*argv, "--lang", "zh"], capsys)
    assert code_zh == code_en == 2
    assert re.match(r"qkv( \w+)?: error: ", en), en
    assert re.match(r"qkv( \w+)?: 错误：", zh), zh
    said = zh.split("：", 1)[1]
    assert CJK.search(said) and said != en.split("error: ", 1)[1], zh
    for value in _quoted(en.split("error: ", 1)[1]):
        assert value in zh, (value, zh)


def test_an_existing_file_given_as_a_folder(capsys, tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    code, zh = _run(["demo", "--out", str(f), "--lang", "zh"], capsys)
    assert code == 2 and zh == f"qkv demo: 错误：--out {str(f)!r} 是一个已有的文件；请给出文件夹"


def test_a_word_not_in_the_text_in_chinese(minilm, capsys):
    code, zh = _run(["attend", "--token", "dog", "--no-files", "--lang", "zh"], capsys)
    assert code == 2 and zh.startswith("qkv attend: 错误：文本中没有词 'dog'；文本中的词有：")
    code, zh = _run(["attend", "--layer", "6", "--no-files", "--lang", "zh"], capsys)
    assert code == 2 and zh == "qkv attend: 错误：层 6 超出范围；模型的层编号为 0..5"
    code, zh = _run(
        ["attend", "--layer", "0", "--head", "12", "--no-files", "--lang", "zh"], capsys
    )
    assert code == 2 and zh == "qkv attend: 错误：头 12 超出范围；每层的头编号为 0..11"


def test_a_missing_package_is_named_in_chinese(monkeypatch, capsys):
    import importlib.util

    from qkv.inspect import demo

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    with pytest.raises(ImportError) as e:
        demo.check_requirements()
    zh = cli_zh.error(str(e.value))
    assert zh.startswith("qkv demo 需要 matplotlib；安装命令：pip install")


def test_a_message_no_pattern_knows_stays_english():
    assert cli_zh.error("something nobody wrote down") == "something nobody wrote down"


def test_ctrl_c_in_chinese_says_so_in_one_line():
    script = """
import signal, os, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
class SigintAtTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, SigintAtTorch())
import _qkv_entry
sys.argv = ["qkv", "explain", "--lang", "zh"]
sys.exit(_qkv_entry.main())
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 130 and res.stderr.strip() == "qkv: 已中断"
