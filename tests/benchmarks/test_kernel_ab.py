"""`python -m benchmarks.kernel_ab`: two source trees' kernels in alternating processes. The
calls themselves are stood in for (they take minutes); the worktree of the base commit, the
alternation, the minima and the table are real."""

from __future__ import annotations

import subprocess

from benchmarks import kernel_ab


def test_trees_alternate_and_the_table_takes_minima(monkeypatch, capsys):
    runs, built, bases = [], [], set()
    times = {"base": iter([10.0, 12.0, 11.0]), "this": iter([9.0, 8.0, 9.5])}

    def fake_run(src, isa):
        name = "base" if "qkv-ab-" in str(src) else "this"
        if name == "base":
            bases.add(src.parent)
        runs.append((name, isa))
        return {"float32 dense N=4096 fwd": next(times[name])}

    monkeypatch.setattr(kernel_ab, "run_tree", fake_run)
    monkeypatch.setattr(kernel_ab, "build", lambda src: built.append(src))
    assert kernel_ab.main(["--base", "HEAD", "--isa", "avx2", "--rounds", "3"]) == 0
    assert [n for n, _ in runs] == ["base", "this", "this", "base", "base", "this"]
    assert {isa for _, isa in runs} == {"avx2"} and len(built) == 2
    row = capsys.readouterr().out.splitlines()[-1]
    assert row == "| avx2 | float32 dense N=4096 fwd | 10.0 | 8.0 | 0.800 | 10.0–12.0 | 8.0–9.5 |"
    worktrees = subprocess.run(
        ["git", "-C", str(kernel_ab.ROOT), "worktree", "list"], capture_output=True, text=True
    ).stdout
    (base,) = bases
    assert str(base) not in worktrees and not base.exists()  # removed afterwards
