"""The compiled kernel's cache in a hostile world: a corrupted, truncated or empty library, a
read-only or unwritable cache, a build killed half-way. Each case leaves `qkv.attention`
working (on the kernel where a good build can be loaded, else on another backend with the
reason), never a crash or a hang. Every case runs in a fresh process against a cache folder of
its own (`QKV_CACHE_DIR`), holding a copy of this machine's good build where the case needs one;
with no compiler (`CXX` pointing nowhere) a rebuild fails at once, so the cases cost seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks.suites.hostile import READ_ONLY_PRELUDE, good_build, kill_a_build_half_way

from qkv.kernels.cpu import build

_PROGRAM = (
    READ_ONLY_PRELUDE
    + """
import torch, qkv
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 300, 8, generator=g) for _ in range(3))
d = qkv.dispatch(q, k, v, return_lse=True)
out, lse = qkv.attention(q, k, v, return_lse=True)
ref = qkv.attention(q, k, v, return_lse=True, backend="reference")[0]
gold = qkv.attention(q.double(), k.double(), v.double(), backend="reference")
print(d.name)
print(d.reasons.get("cpu"))
# the error-ratio rule: within 2x the fp32 reference's error, plus one fp32 rounding of the output
eps = torch.finfo(torch.float32).eps
bound = 2 * (ref.double() - gold).abs().max() + eps * (gold.abs().max() + 0.3)
print(float((out.double() - gold).abs().max() / bound))
"""
)


def _good_build(cache: Path) -> Path:
    if build.status() is not None:
        pytest.skip(f"no compiled kernel here: {build.status()}")
    assert build._verified(build.build_dir()), "the build in use has no manifest"
    return good_build(cache)


def _run(cache: Path, **env: str) -> tuple[str, str, str]:
    """(backend auto picked, why cpu was passed over, stderr) of `_PROGRAM` in a fresh process."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROGRAM],
        env={**os.environ, "QKV_CACHE_DIR": str(cache), "CXX": "/no/such/c++", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    name, reason, err_over_bound = proc.stdout.strip().splitlines()[-3:]
    assert float(err_over_bound) <= 1.0, f"error {err_over_bound} × the error-ratio rule's bound"
    return name, reason, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["corrupted", "truncated", "empty"])
def test_a_damaged_library_is_never_loaded(tmp_path, damage):
    lib = _good_build(tmp_path) / f"{build.NAME}.so"
    data = lib.read_bytes()
    if damage == "corrupted":  # the same size, garbage in the middle
        mid = len(data) // 2
        data = data[:mid] + bytes(4096) + data[mid + 4096 :]
    lib.write_bytes({"corrupted": data, "truncated": data[: len(data) // 2], "empty": b""}[damage])
    name, reason, stderr = _run(tmp_path)
    assert name != "cpu"
    assert "no C++ compiler" in reason  # it was rebuilt (and could not be, here), not loaded
    assert "compiling the CPU attention kernel" in stderr


@pytest.mark.slow
def test_a_read_only_cache_with_a_good_build_runs_the_kernel(tmp_path):
    _good_build(tmp_path)
    name, reason, stderr = _run(tmp_path, READ_ONLY="1")
    assert name == "cpu", reason
    assert "compiling" not in stderr


@pytest.mark.slow
@pytest.mark.parametrize("how", ["read-only", "not a folder"])
def test_a_cache_that_cannot_be_written_is_a_reason(tmp_path, how):
    if how == "read-only":
        name, reason, _ = _run(tmp_path, READ_ONLY="1")
    else:
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        name, reason, _ = _run(blocker / "cache")
    assert name != "cpu"
    assert "cannot be written" in reason and "QKV_CACHE_DIR" in reason


@pytest.mark.slow
def test_leftovers_of_a_killed_build_are_cleared(tmp_path):
    """What a killed build leaves (its own build folder, half-written files) is removed by the
    next build, which does not wait for them."""
    folder = _good_build(tmp_path)
    (folder / f"{build.NAME}.so").write_bytes(b"")  # the killed build's library, never finished
    (folder / f"{build.BUILDING}dead").mkdir()
    (folder / f"{build.BUILDING}dead" / "lock").write_text("")  # torch's own build lock
    (folder / f".{build.NAME}.so.1.part").write_text("half")
    _, reason, _ = _run(tmp_path)
    assert "no C++ compiler" in reason
    assert not list(folder.glob(f"{build.BUILDING}*")) and not list(folder.glob("*.part"))


@pytest.mark.slow
def test_a_failed_build_is_retried_by_qkv_build(tmp_path):
    """A recorded failure stops later processes from retrying, but not `qkv build`."""
    env = {**os.environ, "QKV_CACHE_DIR": str(tmp_path), "CXX": "/no/such/c++"}
    folder = build.build_dir().name
    (tmp_path / "cpu-kernel" / folder).mkdir(parents=True)
    (tmp_path / "cpu-kernel" / folder / build.FAILED).write_text("building it failed: long ago\n")
    _, reason, _ = _run(tmp_path)
    assert "long ago" in reason
    proc = subprocess.run(
        [sys.executable, "-m", "qkv", "build", "--no-tune"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "no C++ compiler" in proc.stderr and "long ago" not in proc.stderr


_BUILD = (
    "from qkv.kernels.cpu import build; build.load(); print(build._verified(build.build_dir()))"
)


@pytest.mark.slow
def test_a_build_killed_half_way_does_not_stop_the_next(tmp_path):
    """SIGKILL of the process group compiling the kernel (an OOM kill, a closed terminal, a CI
    timeout), then a new process: it builds (it does not wait for the dead one) and loads."""
    if build.status() is not None:
        pytest.skip(f"no compiled kernel here: {build.status()}")
    env = {**os.environ, "QKV_CACHE_DIR": str(tmp_path)}
    kill_a_build_half_way(tmp_path)
    folder = tmp_path / "cpu-kernel" / build.build_dir().name
    second = subprocess.run(
        [sys.executable, "-c", _BUILD], env=env, capture_output=True, text=True, timeout=600
    )
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout.strip().splitlines()[-1] == "True"
    assert not list(folder.glob(f"{build.BUILDING}*"))


def test_the_sanitizer_build_has_a_folder_of_its_own(monkeypatch):
    """`QKV_CPU_SANITIZE=1` (CI's sanitizer job) never loads or overwrites the normal build."""
    monkeypatch.delenv(build.SANITIZE_ENV, raising=False)
    normal = build.build_dir()
    monkeypatch.setenv(build.SANITIZE_ENV, "1")
    assert build.sanitized() and build.build_dir() != normal
    assert build.build_dir().name.endswith("-sanitized")
    assert all(flag in build._cflags() for flag in build.SANITIZE_FLAGS)
