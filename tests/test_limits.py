"""Memory guards read the process's real limit (cgroup v2/v1, RLIMIT_AS, MemAvailable) and refuse
every dense O(N²) allocation before making it (`qkv.limits`)."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest
import torch

import qkv
from qkv import limits
from qkv.masks import sliding_window

MiB = 2**20


def _fake_v2(tmp_path, monkeypatch, max_a="1073741824", current_a=str(900 * MiB)):
    """A cgroup v2 tree /a/b: /a limited, /b (the process's) not."""
    root = tmp_path / "cgroup"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "memory.max").write_text(max_a + "\n")
    (root / "a" / "memory.current").write_text(current_a + "\n")
    (root / "a" / "memory.stat").write_text(f"anon 1\ninactive_file {100 * MiB}\n")
    (root / "a" / "b" / "memory.max").write_text("max\n")
    (root / "a" / "b" / "memory.current").write_text(str(10 * MiB))
    proc = tmp_path / "cgroup-of-self"
    proc.write_text("0::/a/b\n")
    monkeypatch.setattr(limits, "CGROUP_ROOT", root)
    monkeypatch.setattr(limits, "PROC_CGROUP", proc)


def test_cgroup_v2_limit_of_an_ancestor_binds(tmp_path, monkeypatch):
    _fake_v2(tmp_path, monkeypatch)
    h = limits.cpu_headroom()
    assert h.bytes == 1024 * MiB - (900 - 100) * MiB  # the page cache counts as free
    assert "cgroup v2" in h.limit and h.limit.endswith("a")


def test_cgroup_v1_limit(tmp_path, monkeypatch):
    root = tmp_path / "cgroup"
    mem = root / "memory" / "docker" / "x"
    mem.mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text(str(512 * MiB))
    (mem / "memory.usage_in_bytes").write_text(str(400 * MiB))
    (mem / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {8 * MiB}\n")
    proc = tmp_path / "cgroup-of-self"
    proc.write_text("12:cpu,cpuacct:/docker/x\n7:memory:/docker/x\n")
    monkeypatch.setattr(limits, "CGROUP_ROOT", root)
    monkeypatch.setattr(limits, "PROC_CGROUP", proc)
    h = limits.cpu_headroom()
    assert h.bytes == (512 - 400 + 8) * MiB and "cgroup v1" in h.limit
    (mem / "memory.limit_in_bytes").write_text("9223372036854771712")  # no limit
    assert "cgroup v1" not in (limits.cpu_headroom() or limits.Headroom(0, "")).limit


def test_reference_refuses_under_a_cgroup_limit_before_allocating(tmp_path, monkeypatch):
    _fake_v2(tmp_path, monkeypatch)  # 224 MiB left; MemAvailable of the host is not asked first
    q = k = v = torch.randn(1, 1, 8192, 8)  # one 8192² float32 score matrix: 256 MiB
    with pytest.raises(limits.MemoryRefusal, match=r"cgroup v2.*backend='tiled'") as err:
        qkv.attention(q, k, v, backend="reference")
    assert isinstance(err.value, MemoryError) and err.value.need > err.value.available


def test_sdpa_refuses_a_dense_mask_that_cannot_fit(tmp_path, monkeypatch):
    _fake_v2(tmp_path, monkeypatch)
    q = k = v = torch.randn(1, 1, 16384, 8)  # the dense sliding-window mask: 256 Mi pairs
    with pytest.raises(limits.MemoryRefusal, match=r"dense .*backend='auto', 'tiled' or 'cpu'"):
        qkv.attention(q, k, v, mask=sliding_window(64), backend="sdpa", finite_inputs=True)


def test_small_problems_read_no_limit(monkeypatch):
    monkeypatch.setattr(limits, "cpu_headroom", lambda: limits.Headroom(0, "nothing left"))
    q = k = v = torch.randn(1, 2, 64, 8)
    qkv.attention(q, k, v, mask=sliding_window(8), backend="sdpa", finite_inputs=True)
    qkv.attention(q, k, v, causal=True, backend="reference")


_UNDER_RLIMIT = """
import sys, torch, qkv
from qkv import limits
q = k = v = torch.randn(1, 1, int(sys.argv[1]), 8)
try:
    if sys.argv[2] == "reference":
        qkv.attention(q, k, v, backend="reference")
    else:
        qkv.attention(q, k, v, mask=qkv.masks.sliding_window(64), backend="sdpa",
                      finite_inputs=True)
except limits.MemoryRefusal as e:
    print("REFUSED", e.limit, "|", e)
"""


def _vm_size_after_import() -> int:
    out = subprocess.run(
        [sys.executable, "-c", "import qkv; print(open('/proc/self/status').read())"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    line = next(x for x in out.splitlines() if x.startswith("VmSize:"))
    return int(line.split()[1]) * 1024


@pytest.mark.slow
@pytest.mark.parametrize(("n", "what"), [(16384, "reference"), (32768, "sdpa")])
def test_an_address_space_limit_is_honoured(n, what):
    """Under `ulimit -v` (RLIMIT_AS) 1 GiB above what `import qkv` maps, a 2-3 GiB step is
    refused by the guard, naming the limit, where the host's MemAvailable would let it try."""
    cap = _vm_size_after_import() + 1024 * MiB

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))

    proc = subprocess.run(
        [sys.executable, "-c", _UNDER_RLIMIT, str(n), what],
        capture_output=True, text=True, preexec_fn=limit, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("REFUSED RLIMIT_AS"), proc.stdout + proc.stderr[-2000:]
    assert "GiB" in proc.stdout
