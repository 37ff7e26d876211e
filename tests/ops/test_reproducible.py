"""What k3 claims about bits (k3.ops.reproducible): fp32 products give the same bits at any memory alignment
and stay within the reordering bound across thread counts, also on the AVX2 code paths of torch and MKL
(forced on an AVX-512 machine); the native kernels give the same bits at 1 and 2 threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.ops.kda import chunk_kda
from k3.ops.kda.native import load_native as load_kda
from k3.ops.mxfp4.native import load_native as load_mxfp4
from k3.ops.reproducible import order_bound

ROOT = Path(__file__).resolve().parents[2]
CHECK = "import json, k3; from k3.ops.reproducible import product_checks; print(json.dumps(product_checks()))"
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.parametrize("isa", [{}, AVX2], ids=["this CPU", "forced AVX2"])
def test_products_ignore_alignment_and_stay_within_the_bound_across_threads(isa):
    """A fresh process (MKL reads MKL_CBWR at its first product): `import k3` must set it itself."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | isa | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["mkl_cbwr"] == "AUTO"
    assert report["alignment_independent"] and report["within_order_bound"], report


def test_the_order_bound_is_tight_enough_to_fail():
    """The bound is a few ulps of sum |x w|: a real error (one term dropped) is far beyond it."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=g), torch.randn(16, 64, generator=g)
    exact = x.double() @ w.double().t()
    assert ((x @ w.t()).double() - exact).abs().le(order_bound(x, w) / 2).all()
    dropped = x[:, 1:] @ w[:, 1:].t()
    assert not ((dropped.double() - exact).abs() <= order_bound(x, w)).all()


def at_threads(fn, threads: int):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def native(load):
    module = load()
    if module is None:
        pytest.skip("native kernels not built (`make native`)")
    return module


@pytest.mark.parametrize("m,gemv_max_m", [(5, 8), (300, 0)], ids=["rows path", "tiled path"])
def test_native_mxfp4_matmul_gives_the_same_bits_at_1_and_2_threads(m, gemv_max_m):
    module = native(load_mxfp4)
    g = torch.Generator().manual_seed(m)
    n, k = 200, 4192
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(118, 131, (n, k // 32), dtype=torch.uint8, generator=g)
    x = torch.randn(m, k, generator=g)

    def run():
        return module.matmul(x, packed, scale, gemv_max_m=gemv_max_m, tile_n=32, tile_k=1024)

    assert torch.equal(at_threads(run, 1), at_threads(run, 2))


def test_native_chunked_kda_gives_the_same_bits_at_1_and_2_threads():
    native(load_kda)
    g = torch.Generator().manual_seed(1)
    B, T, H, K = 2, 100, 4, 32
    q, k, v = (torch.randn(B, T, H, K, generator=g) for _ in range(3))
    gate = -torch.rand(B, T, H, K, generator=g)
    beta = torch.rand(B, T, H, generator=g)

    def run():
        return chunk_kda(q, k, v, gate, beta, use_qk_l2norm=True, output_final_state=True)

    (o1, s1), (o2, s2) = at_threads(run, 1), at_threads(run, 2)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
