"""`Sandbox.usage()` (E2B's metrics) against what a command plants, on both backends: a file of known size
on the disk, a process holding a known amount of memory, a CPU spin of known length against an idle
second, and the limits it reports against those the sandbox was made with."""

from __future__ import annotations

import time

import pytest

from k3.sandbox import Limits, Sandbox, SandboxError
from k3.sandbox.gvisor import BACKSTOP_EXTRA_MB

LIMITS = Limits(cpus=1.0, memory_mb=256, pids=32, disk_mb=32)
MIB = 1 << 20
HOLD = 'python3 -c \'import time; b = b"k" * (96 << 20); print("held", flush=True); time.sleep(60)\''


def test_usage_sees_what_commands_plant(backend, root):
    with Sandbox.create(backend=backend, root=root, limits=LIMITS, timeout=120) as sbx:
        before = sbx.usage()
        assert before.disk_total == LIMITS.disk_mb * MIB and before.cpu_count == LIMITS.cpus
        whole = LIMITS.memory_mb if backend == "bwrap" else 2 * LIMITS.memory_mb + BACKSTOP_EXTRA_MB
        assert before.mem_total == whole * MIB
        assert abs(before.timestamp - time.time()) < 5

        sbx.commands.run("head -c 8388608 /dev/urandom > big.bin", timeout=30)
        grown = sbx.usage().disk_used - before.disk_used
        assert 8 * MIB <= grown < 9 * MIB, grown

        holder = sbx.commands.start(HOLD, timeout=60)
        first = next(holder.follow())  # python has filled its 96 MiB
        assert first == ("stdout", b"held\n"), first
        held = sbx.usage()
        assert 96 * MIB <= held.mem_used - before.mem_used < 96 * MIB + 64 * MIB, held
        assert held.mem_used < held.mem_total
        holder.stop()

        sbx.usage()  # starts the interval
        r = sbx.commands.run("while :; do :; done", timeout=1.5)  # a core's worth for 1.5 s
        spin = sbx.usage()
        assert r.killed_by == "timeout"
        assert 50 <= spin.cpu_used_pct <= 110, spin
        time.sleep(1.0)
        idle = sbx.usage()
        assert idle.cpu_used_pct < 25, idle
    with pytest.raises(SandboxError, match="was killed"):  # no figures of a disk that is gone
        sbx.usage()
