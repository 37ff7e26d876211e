"""The PTX term: one optimizer step with `ptx_coef` c moves the weights by exactly c x (the gradient of a
next-token cross-entropy computed here by hand on the same sequences) more than the step without it."""

import copy
import dataclasses

import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.rl.config import RLConfig, RLError
from k3.rl.ptx import PTX_STREAM, PTX_WINDOW, ptx_batch, ptx_text
from k3.rl.rollout import Trajectory
from k3.rl.trainer import _train_on
from k3.tasks.codec import CharCodec
from k3.tasks.registry import make_task
from k3.tasks.task import Problem


def _step(model, rc: RLConfig, task, codec: CharCodec) -> dict[str, torch.Tensor]:
    """Weights after one iteration's update (one SGD step of lr 1, no clipping, no warm-up) minus before:
    two groups of two samples of `12+34=`, one right answer in each."""
    problems = {g: Problem("12+34=", "64") for g in range(2)}
    answers = [["64", "65"], ["11", "64"]]
    groups = [[Trajectory(g, k, codec.encode("12+34="), codec.encode(answers[g][k]) + [codec.eos],
                          [-1.0] * 3, [0] * 3, "stop", 1) for k in range(2)] for g in range(2)]  # fmt: skip
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    row = _train_on(model, optimizer, rc, task, codec, groups, problems, 0, None)  # PTX from the task
    assert row["score"] == "0.500000"
    return {k: v - before[k] for k, v in model.state_dict().items()}


def _hand_ce(model, codec: CharCodec, problems) -> torch.Tensor:
    """Mean of -log softmax(logits)[next id] over answer and EOS positions, sequence by sequence."""
    terms = []
    for p in problems:
        q, a = codec.encode(p.prompt), codec.encode(p.answer) + [codec.eos]
        s = q + a
        logp = torch.log_softmax(model(torch.tensor([s[:-1]]))[0].float(), -1)  # [len - 1, V]
        terms += [-logp[len(q) - 1 + j, tok] for j, tok in enumerate(a)]
    return torch.stack(terms).mean()


def test_ptx_adds_the_weighted_cross_entropy_gradient():
    model = K3ForCausalLM.from_config(
        K3Config.from_pretrained("tiny"), seed=3, quantized_experts=False
    ).train()
    codec, task = CharCodec(model.config.vocab_size), make_task("arithmetic", digits=2)
    rc = RLConfig(lr=1.0, warmup=0, grad_clip=0.0, minibatches=1, samples=2, prompts=2, ptx_batch=3)
    plain = _step(copy.deepcopy(model), rc, task, codec)
    mixed = _step(copy.deepcopy(model), dataclasses.replace(rc, ptx_coef=0.5), task, codec)
    ce_model = copy.deepcopy(model)
    _hand_ce(ce_model, codec, task.problems(rc.seed, PTX_STREAM, 3)).backward()  # the iteration's step 0
    moved = 0
    for name, p in ce_model.named_parameters():
        want = -0.5 * (p.grad if p.grad is not None else torch.zeros_like(p))
        torch.testing.assert_close(mixed[name] - plain[name], want, atol=2e-6, rtol=1e-4, msg=name)
        moved += int(want.abs().max() > 1e-4)
    assert moved > 10  # the PTX gradient reaches most tensors


def test_ptx_text_windows_and_bad_data(tmp_path):
    codec, task = CharCodec(1024), make_task("arithmetic", digits=2)
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 5)
    rc = RLConfig(ptx_data=str(text), ptx_batch=4, seed=1)
    inputs, labels = ptx_batch(rc, task, codec, 7, ptx_text(rc, codec))
    assert inputs.shape == labels.shape == (4, PTX_WINDOW)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])  # next character
    ids = codec.encode(text.read_text())
    row = inputs[0].tolist()
    assert any(ids[i : i + PTX_WINDOW] == row for i in range(len(ids)))  # a window of the file
    assert torch.equal(ptx_batch(rc, task, codec, 7, ptx_text(rc, codec))[0], inputs)  # pure in the step
    for bad in (str(tmp_path / "missing.txt"), "short"):
        (tmp_path / "short").write_text("abc")
        with pytest.raises(RLError, match="--ptx-data"):
            ptx_text(dataclasses.replace(rc, ptx_data=str(tmp_path / bad) if bad == "short" else bad), codec)
