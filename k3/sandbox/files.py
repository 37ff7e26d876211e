"""The files API, seen exactly as the sandbox's commands see it: every operation is a short command run in
the sandbox as its user (uid 1000), so it reaches every path a command reaches (the workspace, /tmp, the
home directory, the read-only template) with the same permissions, and a write into a read-only mount
fails as it would for a command. Symlinks resolve inside the sandbox, like a command's; FIFOs, sockets and
devices are refused (reading one could wait forever). Errors carry the errno's name (`FileError.code`:
"ENOENT", "EACCES", "EROFS", "ENOSPC", "EISDIR", "ENOTDIR", "EEXIST") so a server can map them as E2B's
envd does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath

from k3.sandbox.process import Outcome
from k3.sandbox.templates import WORKSPACE
from k3.sandbox.types import SandboxError

# One helper for every operation: `sh -c SCRIPT k3-files OP PATH [ARG]`. `find -printf` lists entries as
# NUL-terminated records: type, size, mode (octal), owner, group, mtime (s), symlink target, path.
RECORD = r"%y\t%s\t%m\t%u\t%g\t%T@\t%l\t%p\0"
SCRIPT = r"""op=$1; p=$2
case $op in
read) [ -d "$p" ] && { echo "$p: Is a directory" >&2; exit 1; }
  [ -e "$p" ] && [ ! -f "$p" ] && { echo "$p: not a regular file" >&2; exit 1; }; exec cat -- "$p" ;;
write) [ -d "$p" ] && { echo "$p: Is a directory" >&2; exit 1; }
  [ -e "$p" ] && [ ! -f "$p" ] && { echo "$p: not a regular file" >&2; exit 1; }
  d=$(dirname -- "$p"); [ -d "$d" ] || mkdir -p -- "$d" || exit 1; exec cat > "$p" ;;
list) [ -e "$p" ] || { echo "$p: No such file or directory" >&2; exit 1; }
  [ -d "$p" ] || { echo "$p: Not a directory" >&2; exit 1; }
  exec find "$p" -mindepth 1 -maxdepth "$3" -printf "$4" ;;
stat) [ -e "$p" ] || [ -L "$p" ] || { echo "$p: No such file or directory" >&2; exit 1; }
  exec find "$p" -maxdepth 0 -printf "$4" ;;
mkdir) [ -e "$p" ] && { echo "$p: File exists" >&2; exit 17; }; exec mkdir -p -- "$p" ;;
remove) [ -e "$p" ] || [ -L "$p" ] || { echo "$p: No such file or directory" >&2; exit 1; }
  exec rm -rf -- "$p" ;;
rename) [ -e "$p" ] || [ -L "$p" ] || { echo "$p: No such file or directory" >&2; exit 1; }
  d=$(dirname -- "$3"); [ -d "$d" ] || mkdir -p -- "$d" || exit 1; exec mv -T -- "$p" "$3" ;;
esac
echo "unknown files operation $op" >&2; exit 2
"""
ERRNO_TEXT = {  # what coreutils print -> the errno's name
    "No such file or directory": "ENOENT",
    "Permission denied": "EACCES",
    "Operation not permitted": "EACCES",
    "Read-only file system": "EROFS",
    "No space left on device": "ENOSPC",
    "Disk quota exceeded": "ENOSPC",
    "Is a directory": "EISDIR",
    "Not a directory": "ENOTDIR",
    "File exists": "EEXIST",
}
TYPES = {"f": "file", "d": "dir", "l": "symlink"}


class FileError(SandboxError):
    """A files operation failed inside the sandbox; `code` is the errno's name (or "EIO")."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class EntryInfo:
    """One entry of `files.list` / `files.stat`: its name, its absolute sandbox path, "file", "dir",
    "symlink" or "other", its size, mode bits, owner, group, modification time (unix seconds) and, for a
    symlink, its target."""

    name: str
    path: str
    type: str
    size: int
    mode: int = 0
    owner: str = ""
    group: str = ""
    mtime: float = 0.0
    symlink_target: str | None = None


def absolute(path: str) -> str:
    """`path` as the sandbox sees it: relative paths start at the workspace (the user's home)."""
    if not path:
        raise SandboxError("a sandbox path must not be empty")
    if "\0" in path:
        raise SandboxError("a sandbox path must not contain NUL")
    p = PurePosixPath(path)
    return str(p if p.is_absolute() else PurePosixPath(WORKSPACE) / p)


def _parse(records: bytes) -> list[EntryInfo]:
    out = []
    for rec in records.split(b"\0"):
        if not rec:
            continue
        kind, size, mode, owner, group, mtime, target, path = rec.decode(errors="replace").split("\t", 7)
        name = PurePosixPath(path).name
        out.append(
            EntryInfo(
                name,
                path,
                TYPES.get(kind, "other"),
                int(size),
                int(mode, 8),
                owner,
                group,
                float(mtime),
                target or None,
            )  # fmt: skip
        )
    return out


class Files:
    """`sbx.files`: `run(argv_tail, stdin) -> Outcome` runs the helper script in the sandbox."""

    def __init__(self, run: Callable[[list[str], bytes], Outcome]):
        self._run = run

    def _op(self, op: str, path: str, *args: str, data: bytes = b"") -> bytes:
        p = absolute(path)
        out = self._run(["/bin/sh", "-c", SCRIPT, "k3-files", op, p, *args], data)
        if out.stopped_by is not None:
            raise FileError(f"{op} {p}: stopped by the sandbox's {out.stopped_by} limit", "EIO")
        if out.exit_code != 0:
            err = out.stderr.decode(errors="replace").strip()
            code = "EEXIST" if out.exit_code == 17 else next(
                (c for text, c in ERRNO_TEXT.items() if text in err), "EIO"
            )  # fmt: skip
            raise FileError(f"{op} {p}: {err.splitlines()[-1] if err else f'exit {out.exit_code}'}", code)
        return out.stdout

    def write(self, path: str, data: str | bytes) -> None:
        """Write `data` to `path` (creating its parent directories), as a command would."""
        self._op("write", path, data=data.encode() if isinstance(data, str) else bytes(data))

    def read(self, path: str, format: str = "text") -> str | bytes:
        data = self._op("read", path)
        return data if format == "bytes" else data.decode(errors="replace")

    def list(self, path: str = WORKSPACE, depth: int = 1) -> list[EntryInfo]:
        if depth < 1:
            raise SandboxError(f"list depth must be >= 1, got {depth}")
        return sorted(_parse(self._op("list", path, str(depth), RECORD)), key=lambda e: e.path)

    def stat(self, path: str) -> EntryInfo:
        return _parse(self._op("stat", path, "", RECORD))[0]

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except FileError as e:
            if e.code == "ENOENT":
                return False
            raise
        return True

    def make_dir(self, path: str) -> bool:
        """Create `path` and its parents; False if it already exists."""
        try:
            self._op("mkdir", path)
        except FileError as e:
            if e.code == "EEXIST":
                return False
            raise
        return True

    def remove(self, path: str) -> None:
        self._op("remove", path)

    def rename(self, old: str, new: str) -> EntryInfo:
        self._op("rename", old, absolute(new))
        return self.stat(new)
