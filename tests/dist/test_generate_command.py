"""`k3 generate --nproc 2` (torchrun, experts sharded over 2 ranks) prints what `k3 generate` prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from k3.cli import app

REPO = Path(__file__).resolve().parents[2]


def test_generate_on_two_processes_prints_what_one_process_prints(tmp_path):
    ckpt = tmp_path / "tiny"
    runner = CliRunner()
    assert runner.invoke(app, ["init", str(ckpt), "--preset", "tiny"]).exit_code == 0
    args = ["generate", str(ckpt), "-p", "Hola mundo", "-n", "12", "--seed", "3"]  # sampled, t = 0.7
    one = runner.invoke(app, args)
    assert one.exit_code == 0, one.output
    env = dict(os.environ, PYTHONPATH=str(REPO))
    two = subprocess.run(
        [sys.executable, "-m", "k3", *args, "--nproc", "2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert two.returncode == 0, two.stderr
    assert "on 2 processes" in two.stderr  # it did run expert-parallel
    assert one.stdout.startswith("Hola mundo") and len(one.stdout) > len("Hola mundo\n")
    assert two.stdout == one.stdout
