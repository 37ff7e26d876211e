"""Native CPU kernels: one C++ source per op family, compiled on first use into a user cache directory.

A :class:`NativeExtension` names a C++ source, the headers it includes and the module it compiles to.
:func:`native_status` finds or builds it:

* the build lives in ``~/.cache/k3/native/<key>/`` (``$K3_NATIVE_CACHE`` or ``$XDG_CACHE_HOME/k3/native``
  instead), ``<key>`` the digest of the sources, the shared headers ``_native_common.h`` and
  ``_native_pool.h``, torch's version, the Python ABI and the compiler flags: a new source, torch or Python
  gets a build of its own;
* the first process to need it compiles it (one line on stderr, about a minute; the compiler's output
  goes to ``build.log`` beside it) while holding a file lock, so processes that start together wait for
  that one build instead of compiling it again; the module is moved into place atomically;
* a build that fails (no compiler, no headers), a module compiled from another source (its digest is
  compiled in) or a CPU without AVX2/FMA leaves the module out with a warning naming why, and callers
  take their pure-torch path. ``K3_NATIVE=0`` turns native kernels off.

``python -m k3.ops.build`` (``make native``) warms the cache; ``k3 doctor`` reports what is in use.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

OPS_DIR = Path(__file__).resolve().parent
COMMON_HEADERS = (OPS_DIR / "_native_common.h", OPS_DIR / "_native_pool.h")  # included by every source
COMPILE_FLAGS = ("-O3", "-fopenmp")  # AVX2/FMA are enabled per function in the sources
LINK_FLAGS = ("-fopenmp",)  # resolves to the libgomp torch already loaded


def cache_root() -> Path:
    """Where native builds live: $K3_NATIVE_CACHE, else $XDG_CACHE_HOME/k3/native, else ~/.cache/k3/native."""
    if os.environ.get("K3_NATIVE_CACHE"):
        return Path(os.environ["K3_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "k3" / "native"


@dataclass(frozen=True)
class NativeExtension:
    """A C++ source (``source``, a path inside k3/), the headers it includes from beside it, and the
    importable module it builds (``name``, e.g. ``k3.ops.kda._native``)."""

    name: str
    source: Path
    headers: tuple[Path, ...] = ()

    @property
    def files(self) -> tuple[Path, ...]:
        return (self.source, *self.headers, *COMMON_HEADERS)

    def source_hash(self) -> str:
        """First 16 hex digits of the SHA-256 of the source and its headers (compiled into the module)."""
        digest = hashlib.sha256()
        for path in self.files:
            digest.update(path.read_bytes())
        return digest.hexdigest()[:16]

    def build_key(self) -> str:
        """The cache folder's name: the source digest, torch's version, the Python ABI, the flags."""
        import torch

        parts = [self.name, self.source_hash(), torch.__version__, sys.implementation.cache_tag]
        parts += [sysconfig.get_platform(), *COMPILE_FLAGS, *LINK_FLAGS]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]

    def module_path(self) -> Path:
        """Where the compiled module lives (it may not exist yet)."""
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        return cache_root() / self.build_key() / f"{self.name.rsplit('.', 1)[-1]}{suffix}"

    def compile_into(self, folder: Path) -> Path:
        """Compile into ``folder`` in a child process (output in folder/build.log); the module's path."""
        log = folder / "build.log"
        command = [
            sys.executable,
            str(OPS_DIR / "compile.py"),
            "--name",
            self.name,
            "--source",
            str(self.source),
        ]
        command += ["--include", str(OPS_DIR), "--out", str(folder), "--define"]
        command += [f"K3_NATIVE_SOURCE_HASH={self.source_hash()}"]
        command += [f"--cflag={flag}" for flag in COMPILE_FLAGS] + [f"--ldflag={flag}" for flag in LINK_FLAGS]
        with open(log, "wb") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=folder, check=False)
        built = sorted(folder.glob(f"{self.name.rsplit('.', 1)[-1]}*.so"))
        if done.returncode or not built:
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"compiling {self.source.name} failed: " + " | ".join(tail))
        return built[0]

    def import_module(self, path: Path) -> ModuleType:
        """Import the compiled module at ``path`` under its name."""
        spec = importlib.util.spec_from_file_location(self.name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[self.name] = module
        return module


def locked_build(target: Path, build: Callable[[Path], Path], message: str) -> tuple[Path, bool]:
    """Make ``target`` exist, building it at most once however many processes ask at the same time.

    The first caller takes an exclusive lock on ``<target's folder>/.lock``, prints ``message`` on stderr,
    runs ``build(scratch folder) -> built file`` and moves the file to ``target`` (atomic: the same
    filesystem); the others wait on the lock and then find it. A failed build leaves nothing at
    ``target`` (build.log stays beside it). Returns (target, whether this call built it).
    """
    folder = target.parent
    if target.exists():
        return target, False
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, also if the process dies
        if target.exists():
            return target, False
        print(message, file=sys.stderr, flush=True)
        scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=folder))
        try:
            os.replace(build(scratch), target)
        finally:
            if (scratch / "build.log").exists():
                os.replace(scratch / "build.log", folder / "build.log")
            shutil.rmtree(scratch, ignore_errors=True)
    return target, True


@dataclass(frozen=True)
class NativeStatus:
    """Whether an extension is in use: ``module`` (None: the torch fallback) and why (``reason``)."""

    extension: NativeExtension
    module: ModuleType | None
    reason: str
    path: Path | None = None

    @property
    def in_use(self) -> bool:
        return self.module is not None


def _fallback(extension: NativeExtension, reason: str, path: Path | None = None) -> NativeStatus:
    warnings.warn(f"{extension.name}: {reason}; using the pure-torch path", RuntimeWarning, stacklevel=3)
    return NativeStatus(extension, None, reason, path)


@functools.cache
def native_status(extension: NativeExtension) -> NativeStatus:
    """Find (or compile, once) and import ``extension``; the module, or why the torch path is used."""
    if os.environ.get("K3_NATIVE", "1") == "0":
        return NativeStatus(extension, None, "turned off by K3_NATIVE=0")
    try:
        target = extension.module_path()
        message = f"k3: compiling native kernels {extension.name} into {target.parent} (once, about a minute)"
        path, _ = locked_build(target, extension.compile_into, message)
        module = extension.import_module(path)
    except Exception as error:  # no compiler, no headers, an unreadable cache: the torch path still works
        return _fallback(extension, f"not available ({error})")
    if getattr(module, "source_hash", None) != extension.source_hash():
        return _fallback(extension, f"{path} was built from an older {extension.source.name}", path)
    if not module.cpu_supported():
        return _fallback(extension, "this CPU lacks AVX2/FMA", path)
    return NativeStatus(extension, module, "native", path)
