"""K3ForCausalLM against the independent slow reference (model_reference.py), on a `tiny` checkpoint."""

from __future__ import annotations

import pytest
import torch
from model_reference import ReferenceK3

from k3.model import K3ForCausalLM


@pytest.mark.parametrize("layers", [None, 4, 1])
def test_logits_match_reference(tiny_checkpoint, layers):
    ids = torch.randint(0, 1024, (2, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = K3ForCausalLM.from_pretrained(tiny_checkpoint, layers=layers)(ids).double()
    reference = ReferenceK3(tiny_checkpoint, layers=layers)
    expected = torch.stack([reference.logits(row.tolist()) for row in ids])
    scale = expected.abs().max()
    assert scale > 1.0
    assert (ours - expected).abs().max() <= 1e-4 * scale
