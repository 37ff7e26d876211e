"""Templates: the read-only root a sandbox runs on. A host template ("python", "coreutils") is a small
skeleton (mount points, a generated /etc with a `user` account) plus the host's own /usr bound read-only,
so the sandbox sees the host's Python and coreutils and nothing else of the host. A directory template is
a copy of a directory (`k3 sandbox template build NAME --from DIR`), used as the root as it is."""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from k3.sandbox.types import SandboxError

HOST_TEMPLATES = ("python", "coreutils")
WORKSPACE = "/home/user"
GUEST_TOOLS = "/k3"  # where the compiled guest helpers (guest.py) are mounted read-only
GUEST_UID = 1000
MOUNT_POINTS = ("proc", "dev", "tmp", "home/user", GUEST_TOOLS.strip("/"), "etc")
PASSWD = "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n"
PASSWD += "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
GROUP = "root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n"


@dataclass(frozen=True)
class Template:
    """`rootfs`: the directory mounted read-only as /; `binds`: host directories mounted read-only at the
    same path on top of it; `host`: whether it is built from this host's files (then gVisor preloads
    the guest's statx shim, see guest.py)."""

    name: str
    rootfs: Path
    binds: tuple[str, ...] = ()
    host: bool = False


def _host_skeleton(dest: Path) -> tuple[str, ...]:
    """Write the skeleton of a host template into `dest`; return the host directories to bind on it."""
    for d in MOUNT_POINTS + ("usr",):
        (dest / d).mkdir(parents=True, exist_ok=True)
    binds = ["/usr"]
    for top in ("bin", "sbin", "lib", "lib64", "lib32", "libx32"):
        host = Path("/") / top
        if host.is_symlink():  # merged /usr (Debian 12): the same relative link
            (dest / top).symlink_to(os.readlink(host))
        elif host.is_dir():
            (dest / top).mkdir()
            binds.append(str(host))
    etc = dest / "etc"
    (etc / "passwd").write_text(PASSWD)
    (etc / "group").write_text(GROUP)
    (etc / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")
    (etc / "hostname").write_text("sandbox\n")
    (etc / "nsswitch.conf").write_text("passwd: files\ngroup: files\nhosts: files\n")
    # gVisor 20221219 needs the statx shim for coreutils (guest/statx_compat.c); harmless under bwrap
    (etc / "ld.so.preload").write_text(f"{GUEST_TOOLS}/statx_compat.so\n")
    if Path("/etc/ld.so.cache").exists():
        shutil.copy2("/etc/ld.so.cache", etc / "ld.so.cache")
    if Path("/etc/alternatives").is_dir():  # links into /usr (awk, editors)
        shutil.copytree("/etc/alternatives", etc / "alternatives", symlinks=True)
    return tuple(binds)


def _write_template(dest: Path, name: str, source: Path | None) -> Template:
    """Build into a temporary sibling, then rename: a half-built template is never used."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=dest.parent))
    tmp.chmod(0o755)  # the sandbox's unprivileged user must reach the root inside
    rootfs = tmp / "rootfs"
    if source is None:
        rootfs.mkdir(parents=True)
        binds = _host_skeleton(rootfs)
    else:
        if not source.is_dir():
            raise SandboxError(f"template source {source} is not a directory")
        shutil.copytree(source, rootfs, symlinks=True)
        for d in MOUNT_POINTS:
            if not (rootfs / d).is_dir():
                (rootfs / d).mkdir(parents=True)
        binds = ()
    meta = {"name": name, "binds": list(binds), "host": source is None}
    (tmp / "template.json").write_text(json.dumps(meta))
    old = dest.with_name(f".{name}.old{os.getpid()}.{secrets.token_hex(4)}")
    if dest.exists():
        dest.rename(old)
    try:
        tmp.rename(dest)
    except OSError:  # another process built it at the same moment: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return Template(name, dest / "rootfs", binds, source is None)


def build_template(root: Path, name: str, source: Path | None = None) -> Template:
    """Build template `name` under `root`/templates: from `source` (a directory, copied) or, without one,
    from the host's own files. Rebuilding replaces it."""
    if not name or "/" in name or name.startswith("."):
        raise SandboxError(f"bad template name {name!r}: use letters, digits, - and _")
    return _write_template(Path(root) / "templates" / name, name, source)


def resolve_template(root: Path, name: str) -> Template:
    """The template called `name` (building a host template on first use), or a directory path used as
    a root directly."""
    dest = Path(root) / "templates" / name
    meta = dest / "template.json"
    if meta.exists():
        m = json.loads(meta.read_text())
        return Template(m["name"], dest / "rootfs", tuple(m["binds"]), m["host"])
    if name in HOST_TEMPLATES:  # built once, however many sandboxes (threads, processes) start at once
        meta.parent.parent.mkdir(parents=True, exist_ok=True)
        with open(meta.parent.parent / ".build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if meta.exists():
                return resolve_template(root, name)
            return build_template(root, name)
    if os.path.isabs(name) and Path(name).is_dir():
        return Template(name, Path(name))
    known = sorted({*HOST_TEMPLATES, *(p.name for p in (Path(root) / "templates").glob("*") if p.is_dir())})
    raise SandboxError(f"unknown template {name!r}: known are {', '.join(known)}, or an absolute directory")
