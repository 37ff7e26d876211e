"""`k3 sandbox run` as a user runs it (a subprocess of `python -m k3.cli`: real exit codes and streams),
`k3 sandbox template build` and a bad argument in-process, and the template builder itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sandbox_testing import require
from typer.testing import CliRunner

from k3.cli import app
from k3.sandbox.templates import build_template, resolve_template

REPO = Path(__file__).resolve().parents[2]


def k3(*args: str, root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "K3_SANDBOX_ROOT": str(root)}
    return subprocess.run(
        [sys.executable, "-m", "k3.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_run_prints_output_and_exits_with_the_code(backend, root):
    r = k3("sandbox", "run", "--backend", backend, "--", "echo out; echo err >&2; exit 7", root=root)
    assert (r.returncode, r.stdout, r.stderr) == (7, "out\n", "err\n")


def test_run_passes_several_arguments_as_an_argv(backend, root):
    """The README's example: joined with spaces, `print(1)` reached /bin/sh unquoted (a syntax error)."""
    r = k3("sandbox", "run", "--backend", backend, "--", "python3", "-c", "print(1); print('a b')", root=root)
    assert (r.returncode, r.stdout) == (0, "1\na b\n"), r.stderr


def test_run_reports_a_timeout(root):
    require("bwrap")
    r = k3("sandbox", "run", "--backend", "bwrap", "--timeout", "1", "--", "sleep 30", root=root)
    assert r.returncode == 137 and "killed by timeout" in r.stderr


def test_bad_backend_is_one_line_error(root, monkeypatch):
    monkeypatch.setenv("K3_SANDBOX_ROOT", str(root))
    r = CliRunner().invoke(app, ["sandbox", "run", "--backend", "firecracker", "--", "true"])
    assert r.exit_code == 1 and "error: unknown backend 'firecracker'" in r.output


def test_template_build_from_a_directory(tmp_path, root, monkeypatch):
    monkeypatch.setenv("K3_SANDBOX_ROOT", str(root))
    src = tmp_path / "src"
    (src / "data").mkdir(parents=True)
    (src / "data/hello.txt").write_text("hi")
    r = CliRunner().invoke(app, ["sandbox", "template", "build", "mine", "--from", str(src)])
    assert r.exit_code == 0 and "template mine" in r.output, r.output
    t = resolve_template(root, "mine")
    assert (t.rootfs / "data/hello.txt").read_text() == "hi" and t.binds == () and not t.host
    assert all((t.rootfs / d).is_dir() for d in ("proc", "dev", "tmp", "home/user", "k3"))  # mount points
    (src / "data/hello.txt").write_text("changed")
    assert (t.rootfs / "data/hello.txt").read_text() == "hi"  # a copy, not a view of the source
    build_template(root, "mine", src)
    assert (resolve_template(root, "mine").rootfs / "data/hello.txt").read_text() == "changed"


def test_host_template_shows_host_python_but_not_host_files(root):
    require("bwrap")
    t = resolve_template(root, "python")
    assert t.binds[0] == "/usr" and (t.rootfs / "etc/passwd").read_text().count("\n") == 3
    assert not (t.rootfs / "etc/shadow").exists()


def test_serve_max_limits_changes_the_ceilings_fields_and_refuses_what_is_not_one():
    from dataclasses import replace

    from k3.sandbox.commands import _ceiling
    from k3.sandbox.server import CEILING

    assert _ceiling(None) == CEILING
    ceiling = _ceiling("cpus=4, memory_mb=8192,cpu_s=60")
    assert (ceiling.cpus, ceiling.memory_mb, ceiling.cpu_s, ceiling.disk_mb) == (
        4.0,
        8192,
        60.0,
        CEILING.disk_mb,
    )
    assert _ceiling("cpus=0.5,cpu_s=none") == replace(CEILING, cpus=0.5, cpu_s=None)
    for bad, says in (
        ("memory_mb=lots", "is not FIELD=NUMBER"),
        ("memroy_mb=1", "no such limit memroy_mb"),
        ("memory_mb=1.5", "Limits.memory_mb must be an integer >= 16, got 1.5"),
        ("pids=none", "Limits.pids must be an integer >= 4, got None"),
    ):
        r = CliRunner().invoke(app, ["sandbox", "serve", "--port", "0", "--max-limits", bad])
        assert r.exit_code == 1 and says in r.output, r.output
