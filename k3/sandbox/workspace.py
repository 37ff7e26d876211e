"""The writable part of a sandbox, its disk: one tmpfs of `disk_mb` mounted on the host, holding `user/`
(bound at /home/user, the workspace) and `tmp/` (bound at /tmp, sticky and world-writable), so a full disk
gives ENOSPC, /tmp lives as long as the sandbox on both backends, and its files outlive no one. The host
touches it only to mount, copy (snapshots) and unmount it; the files API works inside the sandbox
(files.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from k3.sandbox.types import SandboxError


def unmount(path: Path) -> None:
    if os.path.ismount(path):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


class Disk:
    """The tmpfs at `path` on the host; `uid` (the host uid of the sandbox's user) owns `user/`."""

    def __init__(self, path: Path, uid: int):
        self.path = Path(path)
        self.uid = uid

    def mount(self, size_mb: int) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        opts = f"size={size_mb}m,mode=0755,nosuid,nodev"
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "k3-sandbox", str(self.path)], capture_output=True
        )
        if done.returncode != 0:
            raise SandboxError(
                f"cannot mount the sandbox disk on {self.path} (needs root): {done.stderr.decode()}"
            )
        user, tmp = self.path / "user", self.path / "tmp"
        user.mkdir()
        os.chown(user, self.uid, self.uid)
        tmp.mkdir()
        tmp.chmod(0o1777)

    def copy_to(self, dest: Path) -> int:
        """Copy every file (keeping links as links, owners, modes) into `dest`; return the bytes copied."""
        done = subprocess.run(["cp", "-a", f"{self.path}/.", str(dest)], capture_output=True)
        if done.returncode != 0:
            raise SandboxError(f"copying the sandbox disk failed: {done.stderr.decode().strip()}")
        return tree_bytes(dest)

    def restore_from(self, source: Path) -> None:
        done = subprocess.run(["cp", "-a", f"{source}/.", str(self.path)], capture_output=True)
        if done.returncode != 0:
            raise SandboxError(f"restoring the sandbox disk failed: {done.stderr.decode().strip()}")


def tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total
