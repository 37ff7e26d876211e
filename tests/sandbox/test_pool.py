"""`SandboxPool`: sandboxes are started ahead, handed out once, replaced, and all removed on close."""

from __future__ import annotations

import time

from sandbox_testing import leftovers, require

from k3.sandbox import Sandbox
from k3.sandbox.pool import SandboxPool


def test_pool_keeps_warm_sandboxes_and_cleans_up(root):
    require("bwrap")
    pool = SandboxPool(2, "python", backend="bwrap", root=root)
    try:
        end = time.monotonic() + 30
        while pool.ready() < 2 and time.monotonic() < end:
            time.sleep(0.05)
        assert pool.ready() == 2
        t = time.monotonic()
        sbx = pool.acquire()
        assert time.monotonic() - t < 0.5 and isinstance(sbx, Sandbox)  # already started
        assert sbx.commands.run("echo warm", timeout=20).stdout == "warm\n"
        pool.release(sbx)
        assert leftovers(root, sbx.sandbox_id) == []
        while pool.ready() < 2 and time.monotonic() < end:  # refilled
            time.sleep(0.05)
        assert pool.ready() == 2
        waiting = list(pool._ready.queue)
    finally:
        pool.close()
    assert [leftovers(root, s.sandbox_id) for s in waiting] == [[], []]
