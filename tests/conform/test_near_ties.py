"""Router near-ties in `k3 conform`: an engine that computes the model to rounding but takes the runner-up
expert where k3's router nearly ties is held against that outcome (and the report says so), while an engine
that parts for any other reason still fails.

The "engine" here is k3 itself with one near-tie flipped (`runner_up_at`), its answers written as an
engine's returned top-k; the reference computes its variants on its own (record_routing + near_ties), and
the flipped forward is checked against `route_with` (a separate mechanism) in tests/model.
"""

from __future__ import annotations

import torch

from k3.conform.reference import CheckpointReference
from k3.conform.report import Returned, ScenarioResult, hold
from k3.model import K3ForCausalLM
from k3.model.routing import near_ties, record_routing, runner_up_at

WIDE_GAP = 0.02  # wide enough that a 48-token prompt of the random `tiny` has near-ties
THRESHOLD = 2e-3


def answers(logits: torch.Tensor, positions: list[int], top: int = 5) -> list[Returned]:
    """What an engine returns at each position p: its greedy token after ids[:p] and its top-5."""
    out = []
    for p in positions:
        row = logits[p - 1].double().log_softmax(-1)
        best = row.topk(top)
        out.append(
            Returned(
                int(best.indices[0]),
                float(best.values[0]),
                dict(zip(best.indices.tolist(), best.values.tolist(), strict=True)),
            )
        )
    return out


def held(reference: CheckpointReference, ids: list[int], positions: list[int], returned: list[Returned]):
    result = ScenarioResult("x")
    hold(result, "request", returned, reference.expect(ids, positions), positions, THRESHOLD, str)
    return result


def setup(checkpoint):
    model = K3ForCausalLM.from_pretrained(checkpoint).eval()
    ids = torch.randint(0, 1000, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad(), record_routing(model) as trace:
        model(torch.tensor([ids]))
    ties = [t for t in near_ties(model, trace, WIDE_GAP) if t.row < 40]
    assert ties, "the prompt has no near-tie to flip at this gap"
    return model, ids, ties[0]


def test_an_engine_taking_the_runner_up_at_a_near_tie_passes_and_is_named(checkpoint):
    model, ids, tie = setup(checkpoint)
    positions = list(range(40, 48))
    with torch.no_grad(), runner_up_at(model, [tie]):
        flipped = model(torch.tensor([ids]))[0]
    returned = answers(flipped, positions)

    blind = held(CheckpointReference(model, tie_gap=0), ids, positions, returned)
    assert not blind.passed and blind.max_dlogprob > THRESHOLD  # the flip does show without tie handling

    aware = held(CheckpointReference(model, tie_gap=WIDE_GAP), ids, positions, returned)
    assert aware.passed, aware.notes
    assert aware.max_dlogprob < 1e-5
    assert len(aware.near_ties) == 1 and f"layer {tie.layer} row {tie.row}" in aware.near_ties[0]


def test_an_engine_parting_otherwise_still_fails(checkpoint):
    model, ids, _ = setup(checkpoint)
    positions = list(range(40, 48))
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]
    logits[44] += 0.05 * torch.randn(logits.shape[-1], generator=torch.Generator().manual_seed(0))
    result = held(CheckpointReference(model, tie_gap=WIDE_GAP), ids, positions, answers(logits, positions))
    assert not result.passed
    assert result.parting is not None and result.parting.position == 45
