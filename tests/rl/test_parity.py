"""Engine/trainer consistency: seeded rollouts of tiny (fp32) in continuous batches of unequal lengths,
then one teacher-forced trainer forward: log-probs within 1e-5, chosen experts identical."""

import copy

import pytest
import torch

from k3.config import K3Config
from k3.engine.generate import Engine
from k3.model import K3ForCausalLM
from k3.rl.policy import check_consistency, forward_logprobs, pack, token_logprobs
from k3.rl.rollout import Trajectory, generate

STOP = 769


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM.from_config(K3Config.from_pretrained("tiny"), seed=3, quantized_experts=False).eval()


def _rollouts(model, temperature=1.0, n=7, record=True, budget=None):
    engine = Engine(copy.deepcopy(model), max_batch=3)  # fewer slots than requests: sequences join and leave
    g = torch.Generator().manual_seed(1)
    trajs = [
        Trajectory(
            group=i // 2, sample=i % 2, prompt=torch.randint(1, 700, (3 + 2 * i,), generator=g).tolist()
        )
        for i in range(n)
    ]
    generate(
        engine, trajs, seed=5, temperature=temperature, stop_id=STOP, max_tokens=12, record_experts=record
    )
    return engine, trajs


def test_trainer_logprobs_and_experts_match_the_engine(model):
    engine, trajs = _rollouts(model)
    assert len({len(t.tokens) for t in trajs}) > 1 or len({len(t.prompt) for t in trajs}) > 1
    c = check_consistency(model, trajs, temperature=1.0, version=0)
    assert c.logprob_diff_max < 1e-5, c
    assert c.expert_flips == 0.0
    # the same figures by hand, one trajectory at a time (no padding)
    for t in trajs:
        ids = torch.tensor([t.prompt + t.tokens[:-1]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids)[0, len(t.prompt) - 1 :].float(), -1)
        mine = logp.gather(-1, torch.tensor(t.tokens)[:, None])[:, 0]
        assert torch.allclose(mine, torch.tensor(t.logprobs), atol=1e-5, rtol=0)


def test_a_planted_expert_change_is_counted(model):
    _, trajs = _rollouts(model, n=3)
    trajs[0].experts = trajs[0].experts.clone()
    trajs[0].experts[1:3, 1] = (trajs[0].experts[1:3, 1] + 1) % 8  # both ids shifted: always another set
    fed = sum(len(t.prompt) + len(t.tokens) - 1 for t in trajs)
    assert check_consistency(model, trajs, 1.0, 0).expert_flips == pytest.approx(2 / fed)


def test_routing_replay_reproduces_the_rollout(model):
    _, trajs = _rollouts(model, temperature=0.7)
    with torch.no_grad():
        replayed = forward_logprobs(model, trajs, 0.7, replay=True)
        own = token_logprobs(model, pack(trajs), 0.7)
    ref = torch.zeros_like(own)
    for b, t in enumerate(trajs):
        ref[b, : len(t.logprobs)] = torch.tensor(t.logprobs)
    assert (replayed - ref).abs().max() < 1e-5
    assert (own - ref).abs().max() < 1e-5


def test_record_experts_off_gives_no_flip_figure(model):
    _, trajs = _rollouts(model, n=2, record=False)
    c = check_consistency(model, trajs, 1.0, 0)
    assert c.logprob_diff_max < 1e-5
    assert c.expert_flips != c.expert_flips  # nan
