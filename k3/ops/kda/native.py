"""The optional native KDA kernels (``_native.cpp`` with ``_native_chunk.h``, ``_native_products.h``,
``_native_products512.h``, ``_native_decode.h``: the fused chunked forward and backward, the inter-chunk
state recurrence with its adjoint, the one-token decode step; compiled on first use into the user cache,
see :mod:`k3.ops.extension`). The chunk products run in 16 lanes where the CPU has AVX-512 F, else in 8:
the same bits (``products_variant()`` says which).

:func:`load_native` returns the compiled module, or None when it cannot be built, is stale or the CPU
lacks AVX2/FMA (see :mod:`k3.ops.extension`); ``chunk_kda`` then runs the same loops in torch.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from k3.ops.extension import NativeExtension, native_status

HERE = Path(__file__).resolve().parent
KDA_EXTENSION = NativeExtension(
    "k3.ops.kda._native",
    HERE / "_native.cpp",
    (
        *(HERE / name for name in ("_native_chunk.h", "_native_products.h", "_native_products512.h")),
        HERE / "_native_decode.h",
        HERE.parent / "_native_math.h",
    ),
)


@functools.cache
def load_native() -> ModuleType | None:
    """The native kernel module if it is built, current and usable on this CPU, else None."""
    return native_status(KDA_EXTENSION).module
