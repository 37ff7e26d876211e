"""`python -m k3 ...` runs the `k3` command (so `torchrun -m k3 train ...` works too)."""

from k3.cli import app

app(prog_name="k3")
