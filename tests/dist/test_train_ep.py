"""Training with --expert-parallel 2 equals one process: losses, final weights and routing biases; a
2-process run under torchrun killed with SIGKILL resumes (on 2 ranks, or on 1) to the same losses."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_ranks import assert_ok
from dist_workers import relative_error, train_on_ranks
from safetensors import safe_open

from k3.dist.shard import expert_of
from k3.train.state import CheckpointTensors, list_checkpoints
from k3.train.trainer import TrainConfig, train

TINY = dict(
    preset="tiny",
    batch_size=4,
    seq_len=32,
    warmup=1,
    export=False,
    threads=1,
    progress=False,
    ep_timeout=30.0,
)
REPO = Path(__file__).resolve().parents[2]


def losses(run: Path) -> list[float]:
    with (run / "log.csv").open(newline="") as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


def assert_same_run(got: Path, want: Path, steps: int, weights_rel: float = 1e-5) -> None:
    a, b = losses(got), losses(want)
    assert len(a) == len(b) == steps
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= 1e-5 * abs(y), (a, b)
    final_a = CheckpointTensors(list_checkpoints(got)[-1][1])  # one file, or one shard per rank
    final_b = CheckpointTensors(list_checkpoints(want)[-1][1])
    assert final_a.keys() == final_b.keys()
    for name in final_b:
        assert relative_error(final_a[name], final_b[name]) <= weights_rel, name


def assert_experts_sharded(run: Path, ranks: int, experts: int) -> None:
    """The newest checkpoint has one model and one optimizer shard per rank; rank r's hold the experts
    r E/R .. (r+1) E/R - 1 (their weights and optimizer state) and, but for rank 0, nothing else."""
    checkpoint = list_checkpoints(run)[-1][1]
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    per_rank = experts // ranks
    for rank in range(ranks):
        for stem in ("model", "optimizer"):
            path = checkpoint / f"{stem}-{rank + 1:05d}-of-{ranks:05d}.safetensors"
            with safe_open(str(path), "pt") as f:
                names = list(f.keys())
            held = {expert_of(name) for name in names} - {None}
            assert held == set(range(rank * per_rank, (rank + 1) * per_rank)), (path.name, held)
            if rank:
                assert all(expert_of(name) is not None for name in names), path.name
            if stem == "model":
                assert all(index[name] == path.name for name in names)


@pytest.mark.parametrize(
    "optimizer, policy, more",
    [("adamw", "none", {}), ("muon", "eplb", {}), ("adamw", "moonep", {"balance_refresh": True, "accum": 2})],
    ids=["adamw-none", "muon-eplb", "balance-refresh-accum2"],
)
def test_three_steps_on_two_ranks_equal_one_process(ranks2, tmp_path, optimizer, policy, more):
    # Muon's Newton-Schulz iteration in fp32: in bf16 (torch.optim.Muon) a gradient that differs in its
    # last fp32 bits (summed over ranks, not in one matmul) can round to another bf16 value (k3.train.optim)
    one = dict(TINY, steps=3, optimizer=optimizer, muon_fp32=True, out=str(tmp_path / "one"), **more)
    train(TrainConfig(**one))
    ep = dict(one, out=str(tmp_path / "ep"), expert_parallel=2, ep_policy=policy, ep_replan_every=1)
    ep["ep_threshold"] = False  # tiny's experts are too small to be worth a replica otherwise
    assert_ok(ranks2.run(train_on_ranks, ep))
    if policy != "none":  # replicas were shipped and their gradients came home
        with (tmp_path / "ep" / "expert_parallel.csv").open(newline="") as f:
            assert sum(int(row["replicas"]) for row in csv.DictReader(f)) > 0
    assert_experts_sharded(tmp_path / "ep", 2, 8)
    assert_same_run(tmp_path / "ep", tmp_path / "one", 3)


def test_a_sigkilled_two_process_moonep_run_resumes_to_the_same_losses(ranks2, tmp_path):
    """`nproc=2` launches torchrun; killed after its step-2 checkpoint, the run resumes on 2 ranks (in
    place) and on 1 process (a copy), both to the losses and weights of one uninterrupted process."""
    steps = 4
    one = dict(TINY, steps=steps, checkpoint_every=1, keep_checkpoints=4, out=str(tmp_path / "one"))
    train(TrainConfig(**one))
    run = tmp_path / "killed"
    config = dict(one, out=str(run), nproc=2, expert_parallel=2, ep_policy="moonep", ep_threshold=False)
    launcher = (
        "import json, sys; from k3.train.trainer import TrainConfig, train; "
        "train(TrainConfig(**json.loads(sys.argv[1])))"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher, json.dumps(config)], cwd=REPO, env=env, start_new_session=True
    )
    deadline = time.monotonic() + 240
    while not any(step >= 2 for step, _ in list_checkpoints(run)):  # torchrun + 2 workers, step 2 saved
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher, torchrun and both workers
    proc.wait()
    killed_at = list_checkpoints(run)[-1][0]
    assert killed_at < steps, "killed too late to test a resume"
    one_process = tmp_path / "resumed-on-one"
    shutil.copytree(run, one_process)
    moved = json.loads((one_process / "train.json").read_text())
    (one_process / "train.json").write_text(json.dumps(dict(moved, out=str(one_process))))
    assert_ok(ranks2.run(train_on_ranks, dict(config, nproc=1)))  # the same folder, 2 ranks
    assert_same_run(run, tmp_path / "one", steps)
    with (run / "expert_parallel.csv").open(newline="") as f:  # per step and layer, each exactly once
        rows = list(csv.DictReader(f))
    assert sum(int(row["replicas"]) for row in rows) > 0  # replica weights went out, gradients came home
    seen = sorted((int(row["step"]), int(row["layer"])) for row in rows)
    layers = sorted({layer for _, layer in seen})
    assert layers and seen == [(step, layer) for step in range(1, steps + 1) for layer in layers]
    train(TrainConfig(**dict(config, out=str(one_process), nproc=1, expert_parallel=1)))
    assert_same_run(one_process, tmp_path / "one", steps)


def test_settings_that_cannot_run_are_refused_clearly(tmp_path):
    from k3.train.trainer import TrainError

    with pytest.raises(TrainError, match="--expert-parallel 2: needs --nproc 2"):
        train(TrainConfig(**dict(TINY, steps=1, out=str(tmp_path / "a"), expert_parallel=2)))
    with pytest.raises(TrainError, match="--ep-policy: unknown policy 'hot'"):
        TrainConfig(**dict(TINY, steps=1, ep_policy="hot")).check()
    with pytest.raises(TrainError, match="--expert-parallel: shards the experts over all 4 processes"):
        TrainConfig(**dict(TINY, steps=1, nproc=4, expert_parallel=2)).check()


def test_a_one_process_checkpoint_resumes_on_four_ranks_and_exports_every_rank_s_experts(ranks4, tmp_path):
    """A one-process run stopped after step 2 resumes on 4 ranks (each takes its 2 experts and their
    optimizer state from the single file) to the uninterrupted run; its export, written by rank 0 from
    the 4 shards, equals the export of one model loaded from that final checkpoint."""
    steps = 4
    one = dict(TINY, steps=steps, checkpoint_every=1, out=str(tmp_path / "one"))
    train(TrainConfig(**one))
    run = tmp_path / "resumed"
    train(TrainConfig(**dict(one, out=str(run), stop_after=2)))
    config = dict(one, out=str(run), expert_parallel=4, ep_policy="moonep", ep_threshold=False, export=True)
    assert_ok(ranks4.run(train_on_ranks, config))
    with (run / "expert_parallel.csv").open(newline="") as f:  # only steps 3 and 4 ran on 4 ranks
        assert {int(row["step"]) for row in csv.DictReader(f)} == {3, 4}
    assert_experts_sharded(run, 4, 8)
    assert_same_run(run, tmp_path / "one", steps)

    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.train.export import export_checkpoint
    from k3.train.state import load_model_state

    cfg = K3Config.preset("tiny")
    model = K3ForCausalLM.from_config(cfg, quantized_experts=False)
    load_model_state(list_checkpoints(run)[-1][1], model)
    export_checkpoint(model, cfg, tmp_path / "want")
    got, want = CheckpointTensors(run / "export"), CheckpointTensors(tmp_path / "want")
    assert got.keys() == want.keys() and any(".experts.7." in name for name in got)
    for name in want:
        assert torch.equal(got[name], want[name]), name
