"""k3: Kimi K3, exact and readable, on an ordinary machine."""

import os

# MKL's conditional numerical reproducibility, set before torch's first MKL call: a product's bits then do
# not depend on where its operands start in memory (k3.ops.reproducible; `k3 doctor` checks it).
os.environ.setdefault("MKL_CBWR", "AUTO")

# libgomp's threads (torch's own ops) spin 300,000 pauses after each parallel region before they sleep (7 ms
# on a Zen 3 EPYC): on a machine of few cores they then hold the cores k3's decode threads need
# (k3/ops/_native_pool.h). 10,000 (0.25 ms) still bridges back-to-back regions. libgomp reads it once, when
# torch loads it: import k3 first (docs/native-cpus.md "OpenMP's spin"; tests/ops/test_openmp_spin.py).
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

__version__ = "0.1.0"
