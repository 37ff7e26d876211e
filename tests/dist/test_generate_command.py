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
        "--int8-expert-inputs",
        "--bf16-products",
    ]
    result = CliRunner().invoke(app, [*user, "--nproc", "3"])
    assert result.exit_code == 0, result.output
    ((nproc, args),) = launched
    assert nproc == 3 and args[:3] == ["-m", "k3", "generate"] and "--nproc" not in args
    assert "--seed" not in args  # left unset: the ranks get the default, as the user did
    assert args[-2:] == ["--int8-expert-inputs", "--bf16-products"]  # flags: their names alone
    assert (
        CliRunner().invoke(app, args[2:]).exit_code == 0
    )  # each rank's parse (outside torchrun: one process)
    assert CliRunner().invoke(app, user).exit_code == 0  # what the user typed, on one process
    sampling = (5, 0.1, 0, 0.3, 1.0, None)  # max tokens, temperature, top-k, top-p, penalty, seed (unset)
    # then layers, int8 expert inputs, bf16 products, threads (unset), images (none)
    assert ran[0] == ran[1] == ("ckpt dir", "Hola  mundo", *sampling, 2, True, True, None, None)
    assert CliRunner().invoke(app, [*user[:-1], "--nproc", "3"]).exit_code == 0  # the flag off: left out
    assert "--bf16-products" not in launched[1][1] and CliRunner().invoke(app, launched[1][1][2:]).exit_code == 0
    assert ran[2][-4:-2] == (True, False)


def test_generate_from_a_url_on_two_processes_prints_what_one_process_prints(tmp_path):
    """Expert parallel over a URL-loaded model: each rank reads only its home experts, when some rank's
    pairs need them (k3.dist.moe), and forgets the others' (k3.dist.shard); the text is one process's."""
    from k3.checkpoint.serve import RangeServer
    from k3.dist.planner import home_of
    from k3.dist.shard import shard_experts
    from k3.model import K3ForCausalLM
    from k3.model.on_demand import experts_on_demand

    ckpt = tmp_path / "tiny"
    assert CliRunner().invoke(app, ["init", str(ckpt), "--preset", "tiny"]).exit_code == 0
    args = ["-p", "Hola mundo", "-n", "12", "--seed", "3"]
    one = CliRunner().invoke(app, ["generate", str(ckpt), *args])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with RangeServer(ckpt) as server:
        model = shard_experts(K3ForCausalLM.from_pretrained(server.url, mirror_dir=tmp_path), rank=1, world=2)
        missing = experts_on_demand(model).missing
        command = [sys.executable, "-m", "k3", "generate", server.url, *args, "--nproc", "2"]
        two = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    homes = home_of(model.config.num_experts, 2)
    layers = [layer.index for layer in model.model.layers if layer.is_moe]
    assert missing == {(i, e) for i in layers for e in range(len(homes)) if homes[e] == 1}  # rank 1's only
    assert one.exit_code == 0 and two.returncode == 0, two.stderr
    assert "on 2 processes" in two.stderr and two.stdout == one.stdout


def test_many_prompts_from_a_url_on_two_processes_equal_one_process(tmp_path):
    """`python -m k3.dist.generate URL --nproc 2`: the ranks route different prompts, so a rank's experts
    serve pairs its own tokens never chose: the dispatch reads them from the URL first (k3.dist.moe)."""
    from k3.checkpoint.serve import RangeServer

    ckpt = tmp_path / "tiny"
    assert CliRunner().invoke(app, ["init", str(ckpt), "--preset", "tiny"]).exit_code == 0
    args = ["-p", "Hola mundo", "-p", "Érase una vez", "-p", "1 2 3", "-n", "6"]
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def run(source: str, *more: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "k3.dist.generate", source, *args, *more]
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)

    one = run(str(ckpt))
    with RangeServer(ckpt) as server:
        two = run(server.url, "--nproc", "2")
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and len(one.stdout.splitlines()) == 3
