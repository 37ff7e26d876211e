"""The RL loop end to end on tiny: no drift at learning rate 0, partial rollouts at lr 0 give the tokens
of one uninterrupted generation, a SIGKILLed run resumes to identical logs and weights, export."""

import copy
import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from k3.config import K3Config
from k3.engine.generate import Engine
from k3.model import K3ForCausalLM
from k3.rl.plot import plot_rl
from k3.rl.policy_io import load_policy
from k3.rl.rollout import Trajectory, generate, loop_length
from k3.rl.sft import SFTConfig, sft
from k3.rl.trainer import TIMING, RLConfig, RLError, learning_rate, select_batch, train_rl
from k3.train.plot import plot_run
from k3.train.state import list_checkpoints

SMALL = dict(prompts=2, samples=3, minibatches=1, held_out=6, eval_every=2, threads=1, digits=1)


def _rows(run: Path) -> list[dict]:
    with (run / "log.csv").open(newline="") as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


def _weights(run: Path) -> dict:
    return load_file(str(list_checkpoints(run)[-1][1] / "model.safetensors"))


def test_lr_zero_no_drift(tmp_path):
    rc = RLConfig(out=str(tmp_path / "run"), iterations=3, lr=0.0, **SMALL)
    train_rl(rc)
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    for r in rows[1:]:
        assert float(r["logprob_diff_max"]) < 1e-5, r
        assert float(r["expert_flips"]) == 0.0
        assert float(r["kl"]) == 0.0
    start = K3ForCausalLM.from_config(K3Config.from_pretrained("tiny"), quantized_experts=False).state_dict()
    end = _weights(tmp_path / "run")
    assert all(torch.equal(start[k], end[k]) for k in start)


def test_partial_rollouts_at_lr_zero_match_one_generation():
    model = K3ForCausalLM.from_config(K3Config.from_pretrained("tiny"), seed=1, quantized_experts=False)
    prompts = [[40 + i, 41, 42 + 2 * i] for i in range(4)]

    def fresh():
        return [Trajectory(group=i, sample=0, prompt=p) for i, p in enumerate(prompts)]

    whole, engine = fresh(), Engine(copy.deepcopy(model), max_batch=3)
    generate(engine, whole, seed=0, temperature=0.0, stop_id=769, max_tokens=9)
    parts, engine = fresh(), Engine(copy.deepcopy(model), max_batch=3)
    for version in range(1, 20):
        if all(t.finished for t in parts):
            break
        generate(engine, parts, seed=0, temperature=0.0, stop_id=769, max_tokens=9, budget=2)
        engine.load_weights(model.state_dict(), version)  # lr 0: the same weights, a new version
    for a, b in zip(whole, parts, strict=True):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
        assert b.segments == -(-len(b.tokens) // 2)  # ceil: two tokens per iteration
        assert b.versions == [j // 2 for j in range(len(b.tokens))]


def test_sampled_partial_rollouts_at_lr_zero_match_one_generation():
    """T = 1: position-keyed draws make a trajectory continued over segments of 2 tokens (prompt + tokens
    so far re-prefilled each time) draw exactly the tokens of one uninterrupted sampled generation."""
    model = K3ForCausalLM.from_config(K3Config.from_pretrained("tiny"), seed=1, quantized_experts=False)
    prompts = [[40 + i, 41, 42 + 2 * i] for i in range(4)]

    def fresh():
        return [Trajectory(group=i, sample=s, prompt=p) for i, p in enumerate(prompts) for s in range(2)]

    whole = fresh()
    generate(
        Engine(copy.deepcopy(model), max_batch=3), whole, seed=5, temperature=1.0, stop_id=769, max_tokens=9
    )
    parts, engine = fresh(), Engine(copy.deepcopy(model), max_batch=3)
    for version in range(1, 20):
        if all(t.finished for t in parts):
            break
        generate(engine, parts, seed=5, temperature=1.0, stop_id=769, max_tokens=9, budget=2)
        engine.load_weights(model.state_dict(), version)
    assert len({tuple(t.tokens) for t in whole}) == len(whole)  # sampled: the samples differ
    for a, b in zip(whole, parts, strict=True):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
        assert b.segments > 1 or len(b.tokens) <= 2


def test_loop_detection():
    assert loop_length([1, 2, 3, 3, 3, 3], repeats=4) == 4
    assert loop_length([5, 1, 2, 1, 2, 1, 2], repeats=3) == 6
    assert loop_length([1, 2, 3, 4], repeats=2) == 0
    assert loop_length([7, 7, 7], repeats=0) == 0


def test_partial_cap_defers_groups():
    def group(g, partial):
        return [Trajectory(g, k, [1], [2], [0.0], [0], "stop", 2 if partial else 1) for k in range(2)]

    pool = group(0, True) + group(1, False) + group(2, True) + group(3, False)
    unfinished = Trajectory(4, 0, [1], [2], [0.0], [0], None, 1)
    chosen, kept = select_batch(pool + [unfinished, *group(4, False)[1:]], max_partial=3)
    assert [g[0].group for g in chosen] == [0, 1, 3]  # group 2 would make 4 partial samples
    assert {t.group for t in kept} == {2, 4}
    only_partial = group(5, True)
    assert select_batch(only_partial, max_partial=0)[0] == [only_partial]  # never stuck


def test_bad_options():
    with pytest.raises(RLError, match="--samples"):
        RLConfig(samples=1).check()
    with pytest.raises(RLError, match="--minibatches"):
        RLConfig(prompts=3, minibatches=2).check()


def test_warmup_learning_rate():
    rc = RLConfig(lr=1e-3, warmup=4)
    assert [learning_rate(rc, s) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert learning_rate(RLConfig(lr=1e-3, warmup=0), 0) == 1e-3
    with pytest.raises(RLError, match="--warmup"):
        RLConfig(warmup=-1).check()


def _cli(run: Path, *extra: str) -> list[str]:
    args = ["--out", str(run), "--iterations", "4", "--prompts", "2", "--samples", "3", "--minibatches", "1"]
    args += [
        "--held-out",
        "6",
        "--eval-every",
        "2",
        "--threads",
        "1",
        "--digits",
        "1",
        "--lr",
        "0.01",
        "--quiet",
    ]
    return [sys.executable, "-m", "k3", "rl", *args, *extra]


def test_sigkill_resume_gives_identical_logs_and_weights(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(_cli(whole, "--partial-budget", "2"), check=True, timeout=600)
    proc = subprocess.Popen(_cli(killed, "--partial-budget", "2"))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if [s for s, _ in list_checkpoints(killed)] and len(_rows(killed)) >= 3:  # step 0, 1 (+2) written
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(_rows(killed)) < 5, "the run finished before it was killed"
    subprocess.run(_cli(killed, "--partial-budget", "2"), check=True, timeout=600)
    assert _rows(killed) == _rows(whole)
    a, b = _weights(whole), _weights(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(float(r["partial_share"] or 0) > 0 for r in _rows(whole))  # partial rollouts did happen
    out = tmp_path / "export"
    subprocess.run(
        [sys.executable, "-m", "k3", "rl", "export", str(whole), str(out)], check=True, timeout=300
    )
    exported = K3ForCausalLM.from_pretrained(out)
    assert exported.config.vocab_size == 1024 and (out / "tiktoken.model").is_file()
    assert [p.name for p in plot_run(whole)] == ["loss.png"]  # k3 train plot reads the RL log
    assert plot_rl(whole)[0].is_file()


def test_code_task_in_the_loop(tmp_path):
    rc = RLConfig(out=str(tmp_path / "code"), task="code", iterations=1, prompts=1, samples=2, minibatches=1)
    rc.held_out, rc.threads = 2, 1
    train_rl(rc)
    rows = _rows(tmp_path / "code")
    assert rows[0]["eval_acc"] == "0.000000" and rows[1]["score"] == "0.000000"  # random weights, no crash


def test_sft_writes_a_policy_that_loads(tmp_path):
    run = sft(
        SFTConfig(task="sort", out=str(tmp_path / "sft"), steps=2, batch_size=4, held_out=3, eval_every=2)
    )
    model = load_policy(str(run / "policy"))
    saved = load_file(str(run / "policy-000002" / "policy.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert [r["step"] for r in csv.DictReader((run / "log.csv").open())] == ["1", "2"]
