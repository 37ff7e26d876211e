"""The writable part of a sandbox: a tmpfs of `disk_mb` mounted on the host and bound at /home/user in
the sandbox, so a full workspace gives ENOSPC and its files outlive no one. The files API works on it from
the host side, resolving every path component with O_NOFOLLOW inside the workspace, so a symlink the
sandbox plants cannot lead the host anywhere else."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from k3.sandbox.templates import WORKSPACE
from k3.sandbox.types import SandboxError


@dataclass(frozen=True)
class EntryInfo:
    """One entry of `files.list`: its name, its sandbox path, "file" or "dir" (or "other"), its size."""

    name: str
    path: str
    type: str
    size: int


def mount_tmpfs(path: Path, size_mb: int, uid: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size_mb}m,mode=0755,uid={uid},gid={uid},nosuid,nodev"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "k3-sandbox", str(path)], capture_output=True)
    if done.returncode != 0:
        raise SandboxError(f"cannot mount the workspace tmpfs on {path} (needs root): {done.stderr.decode()}")


def unmount(path: Path) -> None:
    if os.path.ismount(path):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


class Workspace:
    """Host directory `host` (a tmpfs mount) seen as WORKSPACE inside; files are made owned by `uid`."""

    def __init__(self, host: Path, uid: int):
        self.host = Path(host)
        self.uid = uid

    def relative(self, path: str) -> PurePosixPath:
        """`path` (absolute in the sandbox, or relative to the workspace) as a path inside the workspace."""
        p = PurePosixPath(path)
        if p.is_absolute():
            try:
                p = p.relative_to(WORKSPACE)
            except ValueError:
                raise SandboxError(f"{path}: the files API reaches only the workspace {WORKSPACE}") from None
        parts = [part for part in p.parts if part not in ("", ".")]
        if ".." in parts:
            raise SandboxError(f"{path}: '..' is not allowed in sandbox paths")
        return PurePosixPath(*parts) if parts else PurePosixPath()

    def _open_dir(self, parts: tuple[str, ...], create: bool) -> int:
        fd = os.open(self.host, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in parts:
                if create:
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                        os.chown(part, self.uid, self.uid, dir_fd=fd, follow_symlinks=False)
                    except FileExistsError:
                        pass
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = nxt
            return fd
        except OSError:
            os.close(fd)
            raise

    def _call(self, path: str, what: str, fn):
        rel = self.relative(path)
        try:
            return fn(rel)
        except OSError as e:
            if e.errno == errno.ELOOP or (e.errno == errno.ENOTDIR and rel.parts):
                raise SandboxError(f"{path}: a symlink or non-directory on the way; not followed") from e
            raise SandboxError(f"{what} {path}: {e.strerror}") from e

    def write(self, path: str, data: str | bytes) -> None:
        raw = data.encode() if isinstance(data, str) else bytes(data)

        def go(rel: PurePosixPath) -> None:
            if not rel.parts:
                raise SandboxError(f"{path}: is the workspace itself")
            d = self._open_dir(rel.parts[:-1], create=True)
            try:
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                fd = os.open(rel.name, flags, 0o644, dir_fd=d)
                try:
                    os.fchown(fd, self.uid, self.uid)
                    view = memoryview(raw)
                    while view:
                        view = view[os.write(fd, view) :]
                finally:
                    os.close(fd)
            finally:
                os.close(d)

        self._call(path, "cannot write", go)

    def read(self, path: str, format: str = "text") -> str | bytes:
        def go(rel: PurePosixPath) -> bytes:
            d = self._open_dir(rel.parts[:-1], create=False)
            try:
                fd = os.open(rel.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=d)
            finally:
                os.close(d)
            with os.fdopen(fd, "rb") as f:
                return f.read()

        data = self._call(path, "cannot read", go)
        return data if format == "bytes" else data.decode(errors="replace")

    def list(self, path: str = WORKSPACE) -> list[EntryInfo]:
        def go(rel: PurePosixPath) -> list[EntryInfo]:
            d = self._open_dir(rel.parts, create=False)
            try:
                out = []
                for name in sorted(os.listdir(d)):
                    st = os.stat(name, dir_fd=d, follow_symlinks=False)
                    kind = (
                        "dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"
                    )
                    out.append(EntryInfo(name, str(PurePosixPath(WORKSPACE, rel, name)), kind, st.st_size))
                return out
            finally:
                os.close(d)

        return self._call(path, "cannot list", go)

    def remove(self, path: str) -> None:
        def go(rel: PurePosixPath) -> None:
            if not rel.parts:
                raise SandboxError(f"{path}: is the workspace itself")
            d = self._open_dir(rel.parts[:-1], create=False)
            try:
                st = os.stat(rel.name, dir_fd=d, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(rel.name, dir_fd=d)  # rmtree with dir_fd does not follow symlinks
                else:
                    os.unlink(rel.name, dir_fd=d)
            finally:
                os.close(d)

        self._call(path, "cannot remove", go)

    def copy_to(self, dest: Path) -> int:
        """Copy every file (keeping links as links, owners, modes) into `dest`; return the bytes copied."""
        done = subprocess.run(["cp", "-a", f"{self.host}/.", str(dest)], capture_output=True)
        if done.returncode != 0:
            raise SandboxError(f"copying the workspace failed: {done.stderr.decode().strip()}")
        return tree_bytes(dest)


def tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total
