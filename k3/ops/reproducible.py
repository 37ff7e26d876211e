"""What k3's CPU results may depend on besides their inputs, and the check `k3 doctor` runs.

* Memory alignment: no. MKL's sgemm takes other code paths for operands that do not start on a 64-byte
  boundary (a tensor read from a memory map at a file offset, an HTTP buffer, a scratch file), and those
  round differently. `import k3` sets MKL_CBWR=AUTO (unless it is already set) before torch's first MKL
  call: MKL's conditional numerical reproducibility, the best code path of this CPU with results that do
  not depend on alignment (no measurable cost: benchmarks in docs/native.md). Set earlier by hand
  (`MKL_CBWR=...`), the user's value is kept; imported after torch already ran an MKL product, it is too late
  for that process (`k3 doctor` says so).
* The thread count: yes, within rounding. For products with few output columns (a router's [N, 16], say)
  MKL splits each K-long sum across threads, so 1 and 2 threads add the same K terms in another order. The
  bound that holds for any order: |a - b| <= 2 gamma_K sum_k |x_k w_k|, gamma_K = K u / (1 - K u), u = 2^-24
  (each result is within gamma_K sum |x_k w_k| of the exact sum). MKL_CBWR's strict mode does not remove
  this on every shape, and its COMPATIBLE mode is the slow SSE2 path, so k3 claims bitwise results at one
  thread count and this bound across thread counts.
* The native kernels (k3/ops/*/_native*): no. They are AVX2 + FMA, and their AVX-512 variants (the
  few-row MXFP4 GEMV, the decode step's rows, the KDA chunk products) run each lane's AVX2 operations in
  the AVX2 order, so they give the AVX2 bits (tests/ops/test_mxfp4.py, tests/model/test_fused_decode.py);
  every output element is reduced inside one thread in a fixed order (parallel over rows, heads or tiles,
  never within a sum): the same bits at any thread count (tests/ops/test_reproducible.py).

To try another CPU's paths here: `ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2` (torch's and
MKL's own switches) makes torch and MKL take their AVX2 code on an AVX-512 machine.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# [N, K] x [M, K]^T shapes that MKL treats differently by alignment or by thread count on the CPUs tried
SHAPES = ((5, 64, 16), (7, 256, 16), (3, 64, 1000), (43, 64, 128), (1, 64, 1))
OFFSETS = range(16)  # operand start, in floats past a 64-byte boundary
UNIT_ROUNDOFF = 2.0**-24


def order_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[N, M]: the most two fp32 sums of x [N, K] times w [M, K]^T in any two orders can differ by."""
    K = x.shape[-1]
    gamma = K * UNIT_ROUNDOFF / (1 - K * UNIT_ROUNDOFF)
    return 2 * gamma * (x.double().abs() @ w.double().abs().t())


def _at(x: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of x starting `offset` floats past a 64-byte boundary (torch's allocator aligns to 64)."""
    buf = torch.empty(x.numel() + 16, dtype=x.dtype)
    out = buf[offset : offset + x.numel()].view(x.shape)
    out.copy_(x)
    return out


def product_checks(threads: tuple[int, ...] = (1, 2)) -> dict:
    """F.linear on SHAPES at every offset and each thread count: whether the bits depend on the alignment
    (at one thread count), whether they depend on the thread count, and whether they stay within
    `order_bound` when they do."""
    before = torch.get_num_threads()
    aligned, same_across, bounded = True, True, True
    try:
        for N, K, M in SHAPES:
            g = torch.Generator().manual_seed(N * K * M)
            x, w = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)
            first = None
            for t in threads:
                torch.set_num_threads(t)
                results = [F.linear(_at(x, o), _at(w, 5 * o % 16)) for o in OFFSETS]  # [N, M] each
                aligned &= all(torch.equal(results[0], r) for r in results[1:])
                if first is None:
                    first = results[0]
                    continue
                same_across &= torch.equal(first, results[0])
                bounded &= bool(((first - results[0]).double().abs() <= order_bound(x, w)).all())
    finally:
        torch.set_num_threads(before)
    return {
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "alignment_independent": aligned,
        "thread_independent": same_across,
        "within_order_bound": bounded,
    }
