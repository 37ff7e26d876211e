"""Loading the optional native kernels (``_native.cpp``, built by ``python -m k3.ops.mxfp4.build``).

:func:`load_native` returns the compiled module, or None when it is not built, was built from an older
``_native.cpp`` (a stale build is ignored with a warning), or the CPU lacks AVX2/FMA. Callers then use
the pure-torch path.
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).resolve().parent / "_native.cpp"


def source_hash() -> str:
    """First 16 hex digits of the SHA-256 of ``_native.cpp`` (compiled into the module by the build)."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


@functools.cache
def load_native() -> ModuleType | None:
    """The native kernel module if it is built, current and usable on this CPU, else None."""
    try:
        from k3.ops.mxfp4 import _native
    except ImportError:
        return None
    if SOURCE.exists() and _native.source_hash != source_hash():
        warnings.warn(
            "k3.ops.mxfp4: the native kernels were built from an older _native.cpp and are ignored; "
            "rebuild with `python -m k3.ops.mxfp4.build`",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    if not _native.cpu_supported():
        return None
    return _native


def native_available() -> bool:
    """Whether :func:`k3.ops.mxfp4.mxfp4_matmul` can use the native kernels."""
    return load_native() is not None
