"""Start N processes on this machine through torch.distributed.run (torchrun), for users who do not
want to write the torchrun command themselves:

    launch(2, ["-m", "k3.train.trainer", "runs/x/train.json"])
    # = python -m torch.distributed.run --standalone --nproc-per-node 2 -m k3.train.trainer runs/x/train.json
"""

from __future__ import annotations

import subprocess
import sys

from k3.dist.group import DistError


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    if nproc < 1:
        raise DistError(f"--nproc must be at least 1, got {nproc}")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def launch(nproc: int, args: list[str]) -> None:
    """Run `args` (a module or script and its arguments) on `nproc` local processes; raises DistError
    when any of them fails (torchrun stops the others and prints the failing rank's error)."""
    code = subprocess.run(torchrun_command(nproc, args), check=False).returncode
    if code:
        raise DistError(
            f"{nproc} processes under torchrun: exit status {code} (the failing rank's error is above)"
        )
