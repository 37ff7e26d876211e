"""MXFP4 (OCP MX v1.0: E2M1 elements, one E8M0 scale per 32) in compressed-tensors' packed layout.

Modules: ``codec`` (quantize / dequantize), ``matmul`` (packed matmul, ``MXFP4Linear``), ``experts`` (one
token's routed experts in one call), ``stats`` (exact value counts), ``native`` + ``_native.cpp`` (AVX2
kernels, compiled on first use; see k3.ops.extension).
"""

from k3.ops.mxfp4.codec import dequantize_mxfp4, quantize_mxfp4
from k3.ops.mxfp4.experts import experts_one_token
from k3.ops.mxfp4.matmul import MXFP4Linear, mxfp4_matmul
from k3.ops.mxfp4.native import native_available
from k3.ops.mxfp4.stats import MXFP4ValueCounts, mxfp4_value_counts

__all__ = [
    "MXFP4Linear",
    "MXFP4ValueCounts",
    "dequantize_mxfp4",
    "experts_one_token",
    "mxfp4_matmul",
    "mxfp4_value_counts",
    "native_available",
    "quantize_mxfp4",
]
