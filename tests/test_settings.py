"""Every `QKV_*` environment variable is checked at first use: a value qkv cannot honour is an
error or a one-time warning that names the variable."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from qkv import cache as cache_mod
from qkv.kernels.cpu import build, isa


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "-5", "lots", "1e999"])
def test_cache_budget_refuses_what_is_not_a_size(monkeypatch, raw):
    monkeypatch.setenv("QKV_CACHE_MB", raw)
    with pytest.raises(ValueError, match=r"QKV_CACHE_MB must be a number of MiB.*got"):
        cache_mod.budget()


@pytest.mark.parametrize(("raw", "mib"), [("0", 0), ("1.5", 1.5), (" 8 ", 8)])
def test_cache_budget_accepts_sizes(monkeypatch, raw, mib):
    monkeypatch.setenv("QKV_CACHE_MB", raw)
    assert cache_mod.budget() == int(mib * 2**20)


def test_import_names_the_variable():
    env = {**os.environ, "QKV_CACHE_MB": "nan"}
    proc = subprocess.run(
        [sys.executable, "-c", "import qkv"], capture_output=True, text=True, env=env
    )
    assert proc.returncode != 0 and "QKV_CACHE_MB" in proc.stderr.splitlines()[-1]


class _Ops:
    def best_isa(self):
        return "portable"

    def isa_supported(self, name):
        return name == "portable"


@pytest.mark.parametrize("raw", ["avx-512", "amx512"])
def test_a_misspelt_isa_is_warned_about_once(monkeypatch, raw):
    monkeypatch.setattr(isa, "_WARNED", set())
    monkeypatch.setenv("QKV_CPU_ISA", raw)
    with pytest.warns(isa.QkvSettingWarning, match=rf"QKV_CPU_ISA='{raw}' is not one of auto"):
        assert isa.choose(_Ops())[0] is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isa.choose(_Ops())[0] is None  # once


def test_an_isa_this_cpu_lacks_is_warned_about(monkeypatch):
    monkeypatch.setattr(isa, "_WARNED", set())
    monkeypatch.setenv("QKV_CPU_ISA", "AMX")
    with pytest.warns(isa.QkvSettingWarning, match="QKV_CPU_ISA=amx but this CPU lacks"):
        isa.choose(_Ops())
    monkeypatch.setenv("QKV_CPU_ISA", "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isa.choose(_Ops()) == ("portable", None)


def test_a_relative_cache_dir_is_made_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QKV_CACHE_DIR", "kernels")
    root = build.cache_root()
    assert root.is_absolute() and root == tmp_path / "kernels"
    monkeypatch.setenv("QKV_CACHE_DIR", "~/qkv-cache")
    assert build.cache_root().is_absolute() and "~" not in str(build.cache_root())


@pytest.mark.parametrize("env", ["QKV_CPU_SANITIZE", "QKV_CPU_PIN"])
def test_switches_other_than_0_or_1_are_warned_about(monkeypatch, env):
    monkeypatch.setattr(isa, "_WARNED", set())
    monkeypatch.setenv(env, "yes")
    with pytest.warns(isa.QkvSettingWarning, match=rf"{env}='yes' is neither 0 nor 1"):
        build._flag(env, "0")
