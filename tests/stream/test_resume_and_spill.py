"""A run killed by SIGKILL continues from its last finished layer and ends with the same bytes as an
uninterrupted run; state spilled beyond the memory budget (to the scratch files) changes nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from stream_testing import prompts_for

from k3.stream.api import stream_logits, stream_to_dir
from k3.stream.runner import StreamOptions

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = dict(all_positions=True, max_new_tokens=3, dump_hidden=(1, 6))

# a child process that SIGKILLs itself when it reaches stage `argv[3]` of pass `argv[4]`
CHILD = """
import json, os, signal, sys
from pathlib import Path
from k3.stream.api import stream_to_dir
from k3.stream.runner import StreamOptions
stage, pass_index = sys.argv[3], int(sys.argv[4])
def report(s):
    if s.stage == stage and s.pass_index == pass_index:
        os.kill(os.getpid(), signal.SIGKILL)
options = StreamOptions(**json.loads(sys.argv[6]))
stream_to_dir(sys.argv[1], json.loads(sys.argv[5]), Path(sys.argv[2]), options, report=report)
"""


def run_child(ckpt: Path, out: Path, stage: str, pass_index: int, prompts: list[list[int]]) -> int:
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    options = json.dumps({**OPTIONS, "dump_hidden": list(OPTIONS["dump_hidden"])})
    args = [
        sys.executable,
        "-c",
        CHILD,
        str(ckpt),
        str(out),
        stage,
        str(pass_index),
        json.dumps(prompts),
        options,
    ]
    return subprocess.run(args, env=env, cwd=ROOT, timeout=300).returncode


@pytest.mark.parametrize("stage,pass_index", [("layer 4 ffn", 0), ("layer 2 expert 3", 1)])
def test_killed_run_resumes_to_the_same_bytes(checkpoints, tmp_path, stage, pass_index):
    ckpt = checkpoints("k3ish")
    prompts = prompts_for(1024, lengths=(6, 11, 2))
    options = StreamOptions(**OPTIONS)
    whole = stream_to_dir(ckpt, prompts, tmp_path / "whole", options)
    assert run_child(ckpt, tmp_path / "killed", stage, pass_index, prompts) == -signal.SIGKILL
    scratch = tmp_path / "killed" / "scratch"
    assert (scratch / "state.safetensors").is_file() and not (
        tmp_path / "killed" / "logits.safetensors"
    ).exists()
    resumed = stream_to_dir(ckpt, prompts, tmp_path / "killed", options)
    assert resumed.summary["bytes_dense"] < whole.summary["bytes_dense"]  # it did not start again
    assert not scratch.exists()  # deleted at the end
    a, b = (
        load_file(tmp_path / "whole" / "logits.safetensors"),
        load_file(tmp_path / "killed" / "logits.safetensors"),
    )
    assert sorted(a) == sorted(b) and {"generated", "hidden.1", "hidden.6", "logits"} <= set(a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_scratch_folder_of_another_job_is_not_resumed(checkpoints, tmp_path):
    ckpt = checkpoints("k3ish")
    prompts = prompts_for(1024, lengths=(6, 11, 2))
    assert run_child(ckpt, tmp_path / "out", "layer 5 mixer", 1, prompts) == -signal.SIGKILL
    other = [p[::-1] for p in prompts]
    fresh = stream_to_dir(ckpt, other, tmp_path / "out", StreamOptions(**OPTIONS))
    want = stream_logits(ckpt, other, StreamOptions(**OPTIONS))
    assert torch.equal(fresh.outputs["logits"], want.outputs["logits"])
    assert sum(fresh.summary["dense_bytes_per_pass"]) == fresh.summary["bytes_dense"]


def test_state_beyond_the_budget_lives_in_scratch_files(checkpoints, tmp_path):
    ckpt = checkpoints("k3ish")
    prompts = prompts_for(1024, lengths=(30, 12, 5))
    in_ram = stream_logits(ckpt, prompts, StreamOptions(**OPTIONS), scratch_dir=tmp_path / "a")
    spilled = stream_logits(
        ckpt, prompts, StreamOptions(**OPTIONS, memory_budget=0), scratch_dir=tmp_path / "b"
    )
    for key, value in in_ram.outputs.items():
        assert torch.equal(value, spilled.outputs[key]), key
    # every layer of every pass wrote its state once: streams and (generating) the layer's caches
    assert spilled.summary["scratch_bytes_written"] > 0
    layers = 8
    assert spilled.summary["state_spills"] == 2 * layers * 3 and in_ram.summary["state_spills"] == 0
