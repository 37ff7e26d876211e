"""The checkpoint reference's memo: a request it remembers costs no forward and gives the same tables as the
model computes again; past `remember` requests, the least recently used one is computed again."""

from __future__ import annotations

import pytest
import torch

from k3.conform.reference import CheckpointReference
from k3.model import K3ForCausalLM


def ids(seed: int) -> list[int]:
    return torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_last_requests_are_remembered_and_the_least_recent_dropped(checkpoint):
    model = K3ForCausalLM.from_pretrained(checkpoint).eval()
    a, b, c = (ids(seed) for seed in range(3))
    positions = [8, 12]
    reference = CheckpointReference(model, tie_gap=0, remember=2)

    first = reference.expect(a, positions)
    reference.expect(b, positions)
    assert reference.forwards == 2
    again = reference.expect(a, positions)  # a remembered: no forward; a is now the most recent
    assert reference.forwards == 2
    with torch.no_grad():
        rows = model(torch.tensor([a]))[0, [p - 1 for p in positions]].double().log_softmax(-1)
    for row, e, e_again in zip(rows, first, again, strict=True):
        assert torch.equal(e.full, row) and torch.equal(e_again.full, row)

    reference.expect(c, positions)  # over the bound: b, the least recently used, goes
    assert reference.forwards == 3
    reference.expect(a, positions)
    assert reference.forwards == 3
    reference.expect(b, positions)
    assert reference.forwards == 4

    with pytest.raises(ValueError, match="remember"):
        CheckpointReference(model, remember=0)
