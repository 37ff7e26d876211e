"""Multi-turn rollouts: a tool's output inserted as token ids between the model's turns, loss mask 0.

The engine's log-probs of the model's own tokens (each turn conditioned on the tool's tokens before it)
equal the trainer's teacher-forced forward; the logits that predict tool tokens get exactly zero
gradient from the loss; the calculator task in the loop (its chat format: tests/rl/test_tool_chat.py)."""

import copy

import torch

from k3.config import K3Config
from k3.engine.generate import Engine
from k3.model import K3ForCausalLM
from k3.rl.losses import k2_loss
from k3.rl.policy import check_consistency, pack, token_logprobs
from k3.rl.rollout import Trajectory, generate
from k3.rl.trainer import RLConfig, train_rl
from k3.tasks.task import Tool

REPLY = [50, 51, 52]
T = 0.05  # nearly greedy: every sample's first token is the call id chosen below


def _rollouts():
    model = K3ForCausalLM.from_config(K3Config.from_pretrained("tiny"), seed=1, quantized_experts=False)
    prompts = [[40 + i, 41, 42 + 2 * i] for i in range(3)]
    first = Engine(copy.deepcopy(model)).generate([prompts[0]], _greedy())[0][0]
    seen: list[list[int]] = []

    def respond(turn: list[int]) -> list[int]:
        seen.append(turn)
        return REPLY

    trajs = [Trajectory(group=i, sample=s, prompt=p) for i, p in enumerate(prompts) for s in range(2)]
    tool = Tool(respond=respond)  # every turn ends on `first` (the stop id), the first one is answered
    generate(
        Engine(copy.deepcopy(model)), trajs, seed=0, temperature=T, stop_id=first, max_tokens=10, tool=tool
    )
    return model, trajs, first, seen


def _greedy():
    from k3.engine.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=1)


def test_tool_tokens_sit_between_turns_and_logprobs_match_the_trainer():
    model, trajs, call, seen = _rollouts()
    called = [t for t in trajs if t.tool_calls]
    assert called, "no sample called the tool"
    for t in called:
        j = t.tokens.index(call)
        assert t.tokens[j + 1 : j + 4] == REPLY and t.env[j + 1 : j + 4] == [True] * 3
        assert t.versions[j + 1 : j + 4] == [-1] * 3 and sum(t.env) == 3  # one call at most
        assert len(t.tokens) > j + 4  # the model's next turn followed
        assert len(t.env) == len(t.tokens) == len(t.logprobs) == len(t.versions)
    assert sorted(map(tuple, seen)) == sorted(tuple(t.tokens[: t.tokens.index(call) + 1]) for t in called)
    check = check_consistency(model, trajs, T, version=0)
    # the model's own tokens, after the tool's, as the engine saw them: 1e-5 on the logits' scale (a
    # log-prob at temperature T moves by up to 2 |d logit| / T)
    assert check.logprob_diff_max < 1e-5 / T and check.logprob_diff_mean < 1e-5
    packed = pack(trajs)
    for b, t in enumerate(trajs):
        want = [0.0 if e else 1.0 for e in t.env] if t.env else [1.0] * len(t.tokens)
        assert packed.mask[b, : len(t.tokens)].tolist() == want


def test_tool_tokens_get_zero_gradient():
    model, trajs, _, _ = _rollouts()
    packed = pack(trajs)
    kept: dict = {}

    def keep(_module, _inputs, out):
        out.retain_grad()
        kept["logits"] = out

    handle = model.lm_head.register_forward_hook(keep)
    try:
        logp = token_logprobs(model, packed, T)
    finally:
        handle.remove()
    rewards = torch.tensor([1.0, 0.0] * 3)
    k2_loss(logp, logp.detach() - 0.1, packed.mask, rewards, 2, tau=0.1).backward()
    grad = kept["logits"].grad  # [N, L, V]
    env_rows = model_rows = 0
    for b, t in enumerate(trajs):
        for j in range(len(t.tokens)):
            g = grad[b, packed.positions[b, j]]
            if t.env and t.env[j]:
                assert torch.count_nonzero(g) == 0  # the position that predicts a tool token
                env_rows += 1
            elif g.abs().max() > 0:
                model_rows += 1
    assert env_rows >= 3 and model_rows > 0


def test_calculator_task_in_the_loop(tmp_path):
    rc = RLConfig(task="calculator", digits=1, out=str(tmp_path / "run"), iterations=1, prompts=2, samples=2,
                  minibatches=1, held_out=1, eval_every=1, threads=1, lr=0.0)  # fmt: skip
    rows = (train_rl(rc) / "log.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[2].startswith("1,")
