"""The cgroup interface: against this machine's real hierarchy (v1 here), and v2 against a planted
directory tree (the files a v2 kernel exposes, with counters we write)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from sandbox_testing import require

from k3.sandbox.cgroups import Cgroup, CgroupV1, CgroupV2
from k3.sandbox.types import Limits, SandboxError


def test_v2_writes_limits_and_reads_counters(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    assert Cgroup.detect(tmp_path) is CgroupV2
    g = CgroupV2(tmp_path, "k3-sandbox/sbx-1")
    d = tmp_path / "k3-sandbox/sbx-1"
    d.mkdir(parents=True)
    (d / "memory.swap.max").write_text("max\n")
    g.create(Limits(cpus=0.25, memory_mb=300, pids=17))
    assert (d / "memory.max").read_text() == str(300 << 20)
    assert (d / "memory.swap.max").read_text() == "0"
    assert (d / "pids.max").read_text() == "17"
    assert (d / "cpu.max").read_text() == "25000 100000"
    assert (tmp_path / "k3-sandbox/cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\n")
    (d / "pids.events").write_text("max 5\n")
    assert (g.oom_kills(), g.pids_limit_hits()) == (2, 5)
    assert g.procs_files() == [d / "cgroup.procs"]
    # memory: the file pages on the LRU lists are cache; shmem (a gVisor guest's memory) counts as used
    (d / "memory.current").write_text("50000000\n")
    (d / "memory.stat").write_text(
        "anon 30000000\nfile 20000000\nshmem 8000000\nactive_file 7000000\ninactive_file 5000000\n"
    )
    (d / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\n")
    assert g.memory() == (38_000_000, 12_000_000, 300 << 20) and g.cpu_seconds() == 2.5
    (d / "memory.max").write_text("max\n")
    assert g.memory().limit == -1


def test_v2_command_group_nests_under_the_sandboxs(tmp_path):
    """bubblewrap's layout: the sandbox's group (all commands: memory, 2 x pids, CPU) delegates to one
    group per command (its own memory and pids, no CPU quota of its own); the sandbox's pids include them."""
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    sandbox = CgroupV2(tmp_path, "k3-sandbox/sbx-2")
    sandbox.create(Limits(cpus=0.5, memory_mb=100, pids=8), pids=16)
    command = CgroupV2(tmp_path, "k3-sandbox/sbx-2/c1000")
    command.create(Limits(cpus=0.5, memory_mb=100, pids=8), cpu=False)
    s, c = tmp_path / "k3-sandbox/sbx-2", tmp_path / "k3-sandbox/sbx-2/c1000"
    assert (s / "pids.max").read_text() == "16" and (c / "pids.max").read_text() == "8"
    assert (s / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"  # delegated to the command
    assert (s / "cpu.max").read_text() == "50000 100000" and not (c / "cpu.max").exists()
    assert (c / "memory.max").read_text() == str(100 << 20)
    (s / "cgroup.procs").write_text("")
    (c / "cgroup.procs").write_text("424242\n")
    assert sandbox.pids() == {424242} and command.pids() == {424242}


def test_limits_on_this_machines_cgroups():
    """Whichever version this machine mounts (v1 here), on its real hierarchy."""
    require("bwrap")  # root and cgroups
    root = Path("/sys/fs/cgroup")
    kind = Cgroup.detect(root)
    g = kind(root, f"k3-sandbox/test-{os.getpid()}")
    try:
        g.create(Limits(cpus=0.5, memory_mb=64, pids=9))
        if kind is CgroupV1:
            mem, pids, cpu, _ = g.dirs()
            assert (mem / "memory.limit_in_bytes").read_text().strip() == str(64 << 20)
            assert (pids / "pids.max").read_text().strip() == "9"
            assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "50000"
        else:
            (d,) = g.dirs()
            assert (d / "memory.max").read_text().strip() == str(64 << 20)
            assert (d / "pids.max").read_text().strip() == "9"
            assert (d / "cpu.max").read_text().split() == ["50000", "100000"]
        # a real process in the group hits the real pids limit: the counter moves
        script = 'for f in "$@"; do echo $$ > "$f"; done; for i in $(seq 20); do sleep 1 & done; wait'
        proc = subprocess.Popen(
            ["/bin/sh", "-c", script, "sh", *map(str, g.procs_files())], stderr=subprocess.PIPE
        )
        proc.communicate(timeout=20)
        assert g.pids_limit_hits() > 0
        # and its CPU time: a busy loop of ~0.3 s of CPU, read from the group's accounting
        busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
        spin = f'for f in "$@"; do echo $$ > "$f"; done; exec python3 -c "{busy}"'
        subprocess.run(["/bin/sh", "-c", spin, "sh", *map(str, g.procs_files())], timeout=30, check=True)
        assert 0.25 <= g.cpu_seconds() < 5, g.cpu_seconds()
    finally:
        g.remove()
    assert not any(d.exists() for d in g.every_dir())


def test_limits_reject_bad_values():
    for bad in (
        {"cpus": 0},
        {"memory_mb": 1},
        {"pids": 0},
        {"disk_mb": 0.5},
        {"output_mb": -1},
        {"cpu_s": 0},
    ):
        with pytest.raises(SandboxError):
            Limits(**bad)
