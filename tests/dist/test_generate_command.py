"""`k3 generate --nproc 2` (torchrun, experts sharded over 2 ranks) prints what `k3 generate` prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _k3(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "k3", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )


def test_generate_on_two_processes_prints_what_one_process_prints(tmp_path):
    ckpt = tmp_path / "tiny"
    assert _k3("init", str(ckpt), "--preset", "tiny").returncode == 0
    args = ("generate", str(ckpt), "-p", "Hola mundo", "-n", "12", "--seed", "3")  # sampled, t = 0.7
    one, two = _k3(*args), _k3(*args, "--nproc", "2")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert "on 2 processes" in two.stderr  # it did run expert-parallel
    assert one.stdout.startswith("Hola mundo") and len(one.stdout) > len("Hola mundo\n")
    assert two.stdout == one.stdout
