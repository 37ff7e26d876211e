"""Snapshots, fork, pause and resume. gVisor's "memory+fs" snapshots carry a running process: a counter
that holds its count and a seeded PRNG only in memory and answers requests through the workspace. The
reference is arithmetic on what was sent (the count must be the sum of the increments) and equality of
state hashes between sandboxes that must be identical."""

from __future__ import annotations

import hashlib
import json
import time

import pytest
from sandbox_testing import require

from k3.sandbox import Sandbox, SandboxError
from k3.sandbox.server import Registry

COUNTER = """
import json, os, random, sys, time
n, rng = 0, random.Random(int(sys.argv[1]))
while True:
    if os.path.exists("req"):
        try:
            k = int(open("req").read())
        except ValueError:
            time.sleep(0.01)
            continue
        os.remove("req")
        n += k
        tmp = "resp.tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps({"n": n, "r": rng.random(), "pid": os.getpid()}))
        os.rename(tmp, "resp")
    time.sleep(0.01)
"""


def ask(sbx: Sandbox, k: int, timeout: float = 20.0) -> dict:
    """Send +k to the counter and wait for its answer (the files API reads the workspace from the host)."""
    sbx.files.write("req", str(k))
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            answer = json.loads(sbx.files.read("resp"))
        except (SandboxError, ValueError):
            time.sleep(0.02)
            continue
        sbx.files.remove("resp")
        return answer
    raise AssertionError(f"the counter in {sbx.sandbox_id} did not answer within {timeout} s")


def files_hash(sbx: Sandbox) -> str:
    h = hashlib.sha256()
    for e in sbx.files.list():
        if e.type == "file" and e.name not in ("req", "resp"):
            h.update(e.name.encode() + b"\0" + sbx.files.read(e.path, format="bytes"))
    return h.hexdigest()


@pytest.fixture
def parent(root):
    """A gVisor sandbox with files, a running counter at n = 7 (in memory only) and a PRNG seeded 1234."""
    require("gvisor")
    with Sandbox.create(backend="gvisor", root=root) as sbx:
        sbx.files.write("counter.py", COUNTER)
        sbx.files.write("notes/a.txt", "parent's file")
        r = sbx.commands.run("nohup python3 counter.py 1234 >/dev/null 2>&1 &", timeout=20)
        assert r.exit_code == 0, r
        assert ask(sbx, 3)["n"] == 3 and ask(sbx, 4)["n"] == 7
        yield sbx


def test_memory_snapshot_keeps_a_running_process_state(parent, root):
    snap = parent.create_snapshot()
    assert snap.kind == "memory+fs" and snap.size_bytes > 0
    with Sandbox.create(snapshot=snap, root=root) as child:
        assert child.files.read("notes/a.txt") == "parent's file"
        assert ask(child, 5)["n"] == 12  # 7 came from memory: no file holds the count
    assert ask(parent, 1)["n"] == 8  # the parent goes on from where it was


def test_fork_children_identical_then_diverge_isolated(parent):
    children = parent.fork(3)
    try:
        assert all(isinstance(c, Sandbox) for c in children), children
        assert len({c.sandbox_id for c in children} | {parent.sandbox_id}) == 4
        at_fork = [(files_hash(c), json.dumps(ask(c, 0), sort_keys=True)) for c in children]
        parent_now = (files_hash(parent), ask(parent, 0))
        assert len(set(at_fork)) == 1  # identical: files, count and the PRNG's next draw
        assert json.loads(at_fork[0][1])["r"] == parent_now[1]["r"] and parent_now[1]["n"] == 7
        answers = [ask(c, 10 * (i + 1)) for i, c in enumerate(children)]
        assert [a["n"] for a in answers] == [17, 27, 37]  # independent inputs, independent counts
        for i, c in enumerate(children):
            c.files.write(f"mine-{i}.txt", str(i))
        for i, c in enumerate(children):
            assert [e.name for e in c.files.list() if e.name.startswith("mine")] == [f"mine-{i}.txt"]
        assert not [e for e in parent.files.list() if e.name.startswith("mine")]
        assert ask(parent, 0)["n"] == 7 and files_hash(parent) == parent_now[0]  # the parent is unchanged
    finally:
        for c in children:
            if isinstance(c, Sandbox):
                c.kill()


def test_restoring_one_snapshot_twice_is_deterministic(parent, root):
    snap = parent.create_snapshot()
    runs = []
    for _ in range(2):
        with Sandbox.create(snapshot=snap, root=root) as child:
            runs.append([ask(child, k) for k in (1, 2, 3)])
    assert runs[0] == runs[1]
    assert [a["n"] for a in runs[0]] == [8, 10, 13]


def test_a_servers_ttl_reap_during_a_snapshot_leaves_the_sandbox(parent, root, monkeypatch):
    """A server's TTL reaper that asks in the middle of a snapshot, while the gVisor kernel is checkpointed
    and not yet restored, finds the sandbox running and leaves it (it once killed it there, and its
    reaper removed the bundle the restore was reading: "runsc restore failed: ... config.json")."""
    registry = Registry(quota=4)
    registry.sandboxes[parent.sandbox_id] = ("someone", parent)
    checkpoint, seen = parent._backend.checkpoint, []

    def checkpoint_then_reap(image):
        checkpoint(image)
        seen.append(parent._backend.alive())  # the kernel is down here
        registry.reap()

    monkeypatch.setattr(parent._backend, "checkpoint", checkpoint_then_reap)
    snap = parent.create_snapshot()
    assert seen == [False] and parent.sandbox_id in registry.sandboxes
    assert parent.is_running() and ask(parent, 1)["n"] == 8  # restored, its memory intact
    Sandbox.delete_snapshot(snap, root=root)


def test_pause_and_connect_resume_the_process(parent, root):
    sid = parent.pause()
    assert not parent.is_running()
    with Sandbox.connect(sid, root=root) as again:
        assert again.sandbox_id == sid
        assert ask(again, 2)["n"] == 9
    with pytest.raises(SandboxError, match="no snapshot"):
        Sandbox.connect(sid, root=root)  # resumed once: its saved state is gone


def test_fs_snapshot_on_bwrap_restores_files_only(root):
    require("bwrap")
    with Sandbox.create(backend="bwrap", root=root) as sbx:
        sbx.files.write("data/x.txt", "kept")
        sbx.commands.run("echo made-inside > inside.txt", timeout=20)
        snap = sbx.create_snapshot()
        assert snap.kind == "fs"
        children = sbx.fork(2)
        with Sandbox.create(snapshot=snap, root=root) as restored:
            assert restored.files.read("data/x.txt") == "kept"
            assert restored.commands.run("cat inside.txt", timeout=20).stdout == "made-inside\n"
        Sandbox.delete_snapshot(snap, root=root)
        with pytest.raises(SandboxError, match="no snapshot"):
            Sandbox.create(snapshot=snap.id, root=root)
        try:
            children[0].files.write("only-0", "0")
            assert [e.name for e in children[1].files.list()] == ["data", "inside.txt"]
            assert sbx.files.read("inside.txt") == "made-inside\n"
            assert "only-0" not in [e.name for e in sbx.files.list()]
        finally:
            for c in children:
                c.kill()


def test_fork_shares_the_seed_unless_reseeded(root):
    require("bwrap")
    with Sandbox.create(backend="bwrap", root=root) as sbx:
        seeds = lambda kids: [c.commands.run("echo $K3_SEED", timeout=20).stdout for c in kids]  # noqa: E731
        same, fresh = sbx.fork(2), sbx.fork(2, reseed=True)
        try:
            mine = sbx.commands.run("echo $K3_SEED", timeout=20).stdout
            assert seeds(same) == [mine, mine]
            assert len(set(seeds(fresh)) | {mine}) == 3
        finally:
            for c in same + fresh:
                c.kill()


def test_fork_reports_a_failed_child_as_its_exception(root, monkeypatch):
    require("bwrap")
    real = Sandbox.create.__func__
    calls = []

    def flaky(cls, *args, **kwargs):
        calls.append(kwargs.get("snapshot"))
        if len(calls) == 2:
            raise SandboxError("planted failure of the second child")
        return real(cls, *args, **kwargs)

    with Sandbox.create(backend="bwrap", root=root) as sbx:
        monkeypatch.setattr(Sandbox, "create", classmethod(flaky))
        children = sbx.fork(3)
        monkeypatch.undo()
        try:
            assert [type(c).__name__ for c in children] == ["Sandbox", "SandboxError", "Sandbox"]
            assert "planted failure" in str(children[1])
            assert all(
                c.commands.run("true", timeout=20).exit_code == 0 for c in children if isinstance(c, Sandbox)
            )
        finally:
            for c in children:
                if isinstance(c, Sandbox):
                    c.kill()
