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


def test_launch_passes_every_parsed_option_but_nproc_to_the_ranks(tmp_path, monkeypatch):
    """The torchrun command line is the parsed arguments written back: parsed again, the same values."""
    import k3.dist.commands as commands
    import k3.dist.launch as launch

    launched, ran = [], []
    monkeypatch.setattr(launch, "launch", lambda nproc, args: launched.append((nproc, args)))
    monkeypatch.setattr(commands, "generate_on_one_process", lambda *values: ran.append(values))
    user = [
        "generate",
        "ckpt dir",
        "-p",
        "Hola  mundo",
        "-n",
        "5",
        "-t",
        "0.1",
        "--top-p",
        "0.3",
        "--layers",
        "2",
    ]
    result = CliRunner().invoke(app, [*user, "--nproc", "3"])
    assert result.exit_code == 0, result.output
    ((nproc, args),) = launched
    assert nproc == 3 and args[:3] == ["-m", "k3", "generate"] and "--nproc" not in args
    assert "--seed" not in args  # left unset: the ranks get the default, as the user did
    assert (
        CliRunner().invoke(app, args[2:]).exit_code == 0
    )  # each rank's parse (outside torchrun: one process)
    assert CliRunner().invoke(app, user).exit_code == 0  # what the user typed, on one process
    assert ran[0] == ran[1] == ("ckpt dir", "Hola  mundo", 5, 0.1, 0, 0.3, 1.0, None, 2)
