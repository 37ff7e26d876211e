"""The helpers mounted read-only at /k3 in every sandbox: the seccomp filter (seccomp.bpf), `k3-exec`
(loads that filter, then execs the command: gVisor's way in) and `statx_compat.so` (gVisor 20221219's statx
shim for coreutils). They are compiled once with the host's C compiler into a directory named by the
hash of their sources, so a changed source is rebuilt and a half-written build is never used."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from k3.sandbox.seccomp import deny_filter
from k3.sandbox.types import SandboxError

HERE = Path(__file__).parent
SOURCES = ("k3_exec.c", "statx_compat.c")


def guest_tools(root: Path) -> Path:
    """The directory holding k3-exec, statx_compat.so and seccomp.bpf (built on first use)."""
    digest = hashlib.sha256(deny_filter())
    for name in SOURCES:
        digest.update((HERE / name).read_bytes())
    dest = Path(root) / "guest" / digest.hexdigest()[:16]
    if (dest / "k3-exec").exists():
        return dest
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SandboxError(
            "the sandbox guest helpers need a C compiler (cc); `make sandbox-tools` installs gcc"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent))
    commands = (
        [cc, "-O2", "-static", "-o", str(tmp / "k3-exec"), str(HERE / "k3_exec.c")],
        [cc, "-O2", "-shared", "-fPIC", "-o", str(tmp / "statx_compat.so"), str(HERE / "statx_compat.c")],
    )
    for cmd in commands:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SandboxError(f"building the sandbox guest helpers failed: {done.stderr.strip()[-500:]}")
    (tmp / "seccomp.bpf").write_bytes(deny_filter())
    for f in tmp.iterdir():
        os.chmod(f, 0o755)
    os.chmod(tmp, 0o755)
    try:
        tmp.rename(dest)
    except OSError:  # built by another process meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
