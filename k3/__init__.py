"""k3: Kimi K3, exact and readable, on an ordinary machine."""

import os

# MKL's conditional numerical reproducibility, set before torch's first MKL call: a product's bits then do
# not depend on where its operands start in memory (k3.ops.reproducible; `k3 doctor` checks it).
os.environ.setdefault("MKL_CBWR", "AUTO")

__version__ = "0.1.0"
