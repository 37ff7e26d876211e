"""The optional native decode kernels (``_native.cpp`` with ``_native_gemv.h``, ``_native_layout.h``,
``_native_paired.h``, ``_native_weighted.h``, ``_native_mixers.h`` and ``_native_step.h``, which include
k3/ops/kda/_native_decode.h, k3/ops/mxfp4/_native_{rows,rows512,int8,bf16}.h and k3/ops/_native_math.h;
compiled on first use into the user cache, see :mod:`k3.ops.extension`).

:func:`load_native` returns the compiled module, or None when it cannot be built, is stale or the CPU
lacks AVX2/FMA; decode steps then take the model's general path.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from k3.ops.extension import NativeExtension, native_status

HERE = Path(__file__).resolve().parent
OPS = HERE.parent
DECODE_EXTENSION = NativeExtension(
    "k3.ops.decode._native",
    HERE / "_native.cpp",
    (
        HERE / "_native_gemv.h",
        HERE / "_native_layout.h",
        HERE / "_native_paired.h",
        HERE / "_native_weighted.h",
        HERE / "_native_mixers.h",
        HERE / "_native_step.h",
        OPS / "kda" / "_native_decode.h",
        OPS / "mxfp4" / "_native_rows.h",
        OPS / "mxfp4" / "_native_rows512.h",
        OPS / "mxfp4" / "_native_int8.h",
        OPS / "mxfp4" / "_native_bf16.h",
        OPS / "_native_math.h",
    ),
)


@functools.cache
def load_native() -> ModuleType | None:
    """The native kernel module if it is built, current and usable on this CPU, else None."""
    return native_status(DECODE_EXTENSION).module
