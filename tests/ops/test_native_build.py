"""Native kernels on every install: the cache, its lock, the fallbacks, and a non-editable install.

The lock test runs two processes that ask for the same missing build at the same moment and counts the
builds (a file each build appends to); the install test builds k3's wheel, installs it without `-e` into
a fresh virtualenv and imports both kernels there, compiled from the installed package data.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest
import torch

from k3.ops.extension import NativeExtension, locked_build, native_status
from k3.ops.kda.native import KDA_EXTENSION
from k3.ops.mxfp4 import mxfp4_matmul, quantize_mxfp4
from k3.ops.mxfp4.native import MXFP4_EXTENSION

REPO = Path(__file__).resolve().parents[2]

# A child process: wait for the start signal, then ask for the build; the build sleeps to widen the race.
CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from k3.ops.extension import locked_build
    target, counter, go = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    while not go.exists():
        time.sleep(0.005)
    def build(scratch):
        with open(counter, "a") as f:
            f.write("built\\n")
        time.sleep(0.5)
        (scratch / "module.so").write_text("the module")
        return scratch / "module.so"
    path, built = locked_build(target, build, "compiling (test)")
    print(built, path.read_text())
    """
)


def test_two_processes_asking_at_once_get_one_build(tmp_path):
    target, counter, go = tmp_path / "cache" / "key" / "module.so", tmp_path / "builds", tmp_path / "go"
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(REPO), str(target), str(counter), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    go.touch()
    results = [child.communicate(timeout=60) for child in children]
    assert all(child.returncode == 0 for child in children), results
    assert counter.read_text() == "built\n"  # one build
    assert sorted(out.split()[0] for out, _ in results) == ["False", "True"]  # one built, one waited
    assert all(out.strip().endswith("the module") for out, _ in results)  # both got the module
    assert sum(err.count("compiling (test)") for _, err in results) == 1  # one line on stderr, once
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".build-")] == []


def test_failed_build_leaves_no_module_and_is_retried(tmp_path, capsys):
    target = tmp_path / "key" / "module.so"

    def failing(scratch):
        (scratch / "build.log").write_text("error: no compiler")
        raise RuntimeError("no compiler")

    with pytest.raises(RuntimeError, match="no compiler"):
        locked_build(target, failing, "compiling")
    assert not target.exists()
    assert (target.parent / "build.log").read_text() == "error: no compiler"

    def working(scratch):
        (scratch / "m.so").write_text("ok")
        return scratch / "m.so"

    assert locked_build(target, working, "compiling") == (target, True)
    assert locked_build(target, working, "compiling") == (target, False)  # found: no second build
    assert capsys.readouterr().err.count("compiling") == 2


def test_without_a_compiler_the_torch_path_runs_with_a_warning(tmp_path, monkeypatch):
    def no_compiler(self, folder):
        raise RuntimeError("compiling _native.cpp failed: c++: command not found")

    monkeypatch.setenv("K3_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(NativeExtension, "compile_into", no_compiler)
    with pytest.warns(RuntimeWarning, match="command not found.*pure-torch"):
        status = native_status.__wrapped__(MXFP4_EXTENSION)  # not the cached answer
    assert status.module is None and "command not found" in status.reason
    packed, scale = quantize_mxfp4(torch.randn(8, 64, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr("k3.ops.mxfp4.matmul.load_native", lambda: status.module)
    auto, torch_path = (mxfp4_matmul(x, packed, scale, backend=b) for b in ("auto", "torch"))
    assert torch.equal(auto, torch_path)


def test_k3_native_0_turns_native_kernels_off(monkeypatch):
    monkeypatch.setenv("K3_NATIVE", "0")
    assert native_status.__wrapped__(KDA_EXTENSION).reason == "turned off by K3_NATIVE=0"


def test_cache_key_follows_every_source_file(tmp_path, monkeypatch):
    """A change to the source, a header or a header every source includes gives another cache folder."""
    monkeypatch.setenv("K3_NATIVE_CACHE", str(tmp_path))
    files = [tmp_path / name for name in ("a.cpp", "a.h", "_native_common.h", "_native_pool.h")]
    for f in files:
        f.write_text(f.name)
    monkeypatch.setattr("k3.ops.extension.COMMON_HEADERS", tuple(files[2:]))
    ext = NativeExtension("k3.ops.test._native", files[0], (files[1],))
    keys = {ext.build_key()}
    for f in files:
        f.write_text(f.name + " changed")
        keys.add(ext.build_key())
    assert len(keys) == 5
    assert ext.module_path().parent == tmp_path / ext.build_key()


@pytest.mark.slow
def test_non_editable_wheel_install_in_a_fresh_venv_loads_both_kernels(tmp_path):
    """`pip wheel` + `pip install` (no -e) into a new venv; both kernels compile and load from there.

    About 3 minutes on 2 idle cores (two compiles); the timeouts allow for a machine shared many times over.
    """
    env_dir, wheels, cache = tmp_path / "venv", tmp_path / "wheels", tmp_path / "cache"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True, timeout=600)  # from this machine's wheel cache
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, REPO],
        check=True,
        timeout=300,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("k3-*.whl")
    subprocess.run([*pip, "--no-deps", str(wheel)], check=True, timeout=300)
    probe = textwrap.dedent(
        """
        from concurrent.futures import ThreadPoolExecutor
        import k3
        from k3.ops.extension import native_status
        from k3.ops.kda.native import KDA_EXTENSION
        from k3.ops.mxfp4.native import MXFP4_EXTENSION
        print(k3.__file__)
        with ThreadPoolExecutor(2) as pool:  # first use of both at once: they compile side by side
            statuses = list(pool.map(native_status, (MXFP4_EXTENSION, KDA_EXTENSION)))
        for status in statuses:
            print(status.extension.name, status.in_use, status.path)
        """
    )
    env = {**os.environ, "K3_NATIVE_CACHE": str(cache)}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [str(python), "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=2400
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "site-packages" in lines[0] and not lines[0].startswith(str(REPO))
    for line, name in zip(lines[1:], ("k3.ops.mxfp4._native", "k3.ops.kda._native"), strict=True):
        assert line.startswith(f"{name} True {cache}"), done.stdout + done.stderr
    assert done.stderr.count("k3: compiling native kernels") == 2
