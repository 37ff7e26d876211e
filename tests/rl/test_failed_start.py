"""A `k3 rl` that fails before its first iteration (a bad --init, a bad task) leaves no run folder behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--init", "nope"], "--init nope: not a preset"),
        (["--init", "tiny", "--task", "nope"], "nope"),
    ],
)
def test_failed_start_leaves_no_output_folder(tmp_path, args, message):
    out = tmp_path / "runs" / "X"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "k3", "rl", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and message in done.stderr
    assert not out.exists() and not (tmp_path / "runs").exists()
