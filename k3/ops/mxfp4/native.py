"""The optional native MXFP4 kernels (``_native.cpp``; compiled on first use into the user cache).

:func:`load_native` returns the compiled module, or None when it cannot be built, is stale or the CPU
lacks AVX2/FMA (see :mod:`k3.ops.extension`); callers then use the pure-torch path.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from k3.ops.extension import NativeExtension, native_status

HERE = Path(__file__).resolve().parent
MXFP4_EXTENSION = NativeExtension(
    "k3.ops.mxfp4._native",
    HERE / "_native.cpp",
    (
        HERE / "_native_rows.h",
        HERE / "_native_rows512.h",
        HERE / "_native_bf16.h",
        HERE / "_native_int8.h",
        HERE.parent / "_native_math.h",
    ),
)


@functools.cache
def load_native() -> ModuleType | None:
    """The native kernel module if it is built, current and usable on this CPU, else None."""
    return native_status(MXFP4_EXTENSION).module


def native_available() -> bool:
    """Whether :func:`k3.ops.mxfp4.mxfp4_matmul` can use the native kernels."""
    return load_native() is not None
