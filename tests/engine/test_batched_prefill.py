"""Waiting prompts of one length prefilled together in one [B, T] forward: the same logits (to rounding),
tokens and log-probs as one forward per sequence, fewer steps, free slots respected, and a sequence that
stops on its first token leaves the batch."""

from __future__ import annotations

import torch

from k3.config import K3Config
from k3.engine.generate import Engine
from k3.engine.sampling import SamplingParams
from k3.model import K3ForCausalLM


def _prompts(lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 768, (n,), generator=g).tolist() for n in lengths]


def test_equal_length_prompts_prefill_together_and_match_full_forward() -> None:
    model = K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=3)
    ps = _prompts([7, 7, 5, 7, 7, 9, 7])  # five of length 7, two others
    params = SamplingParams(temperature=0, max_tokens=5)
    engine = Engine(model, max_batch=4, record_logits=True)
    seqs = [engine.submit(p, params) for p in ps]
    first = engine._prefill_group()
    assert [ps.index(s.prompt) for s in first] == [0, 1, 3, 4]  # same length, max_batch of them
    logits: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(ps))}
    while engine.has_work:
        for event in engine.step():
            logits[seqs.index(event.seq)].append(event.logits)
    for i, seq in enumerate(seqs):
        full = model(torch.tensor([seq.prompt + seq.output[:-1]]))[0]  # [T, V]
        want = full[len(seq.prompt) - 1 :]
        torch.testing.assert_close(torch.stack(logits[i]), want, atol=1e-4, rtol=1e-4)
        assert seq.output == want.argmax(-1).tolist()
        torch.testing.assert_close(
            torch.tensor(seq.logprobs),
            torch.log_softmax(want, -1).gather(1, want.argmax(-1, keepdim=True))[:, 0],
        )
    # one forward per sequence would take 7 prefill steps; together: 4 of length 7, then 5, 9, 7 alone
    one_by_one = Engine(model, max_batch=4)
    one_by_one.prefill_chunk = 2  # a chunk shorter than the prompts: no group can form
    outs = one_by_one.generate(ps, params)
    assert outs == [s.output for s in seqs]
    assert engine.steps < one_by_one.steps


def test_a_row_that_stops_at_once_leaves_the_prefilled_group() -> None:
    model = K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=3)
    ps = _prompts([6, 6, 6])
    greedy = SamplingParams(temperature=0, max_tokens=4)
    alone = [Engine(model).generate([p], greedy)[0] for p in ps]
    stop_first = SamplingParams(temperature=0, max_tokens=4, stop_ids=frozenset({alone[1][0]}))
    engine = Engine(model, max_batch=8)
    seqs = [engine.submit(ps[0], greedy), engine.submit(ps[1], stop_first), engine.submit(ps[2], greedy)]
    engine.step()
    assert seqs[1].finish_reason == "stop" and seqs[1].output == []
    assert engine.running == [seqs[0], seqs[2]] and engine.batch.batch_size == 2
    while engine.has_work:
        engine.step()
    assert [seqs[0].output, seqs[2].output] == [alone[0], alone[2]]
